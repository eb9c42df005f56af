"""How the GPU kernels number their programs (``triton_tile.program``): every tile once, and
consecutive programs on neighbouring memory (channels_last: the lane blocks of a column block,
then the column blocks of a row, then the rows; channels_first: the column blocks, then the
rows, then the plane blocks). Interpret mode on a CPU; the kernels' own tests check the
values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxpool._src.pallas.triton import tile as triton_tile


def _numbering(rows, col_blocks, lane_blocks, channels_last):
  """``out[pid] = (row, column block, lane block)`` of program ``pid``, run in interpret mode."""

  def kernel(o_ref):
    row, cb, lb = triton_tile.program(rows, col_blocks, lane_blocks, channels_last)
    pid = pl.program_id(0)
    o_ref[pid, 0], o_ref[pid, 1], o_ref[pid, 2] = row, cb, lb

  n = rows * col_blocks * lane_blocks
  grid = triton_tile.grid(rows, col_blocks, lane_blocks)
  assert grid == (n,)
  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n, 3), jnp.int32), grid=grid,
                        interpret=True)
  return np.asarray(jax.jit(call)())


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("rows,col_blocks,lane_blocks", [(5, 3, 2), (1, 1, 1), (7, 1, 4),
                                                         (2, 6, 1)])
def test_programs_cover_every_tile_once_in_memory_order(rows, col_blocks, lane_blocks,
                                                        channels_last):
  got = _numbering(rows, col_blocks, lane_blocks, channels_last)
  # The order of memory: (row, column, lane) in channels_last, (plane, row, column) otherwise.
  want = [(r, c, b) for r in range(rows) for c in range(col_blocks) for b in range(lane_blocks)]
  if not channels_last:
    want = [(r, c, b) for b in range(lane_blocks) for r in range(rows)
            for c in range(col_blocks)]
  np.testing.assert_array_equal(got, np.array(want, np.int32).reshape(-1, 3))
