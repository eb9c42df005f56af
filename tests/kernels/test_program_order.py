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


def test_the_earlier_order_still_numbers_every_tile(monkeypatch):
  """``ORDER = "rows"``: a 3-D grid (what comparator_gpu.py times against)."""
  monkeypatch.setattr(triton_tile, "ORDER", "rows")
  assert triton_tile.grid(5, 3, 2) == (5, 3, 2)

  def kernel(o_ref):
    row, cb, lb = triton_tile.program(5, 3, 2, True)
    o_ref[row, cb, lb] = row * 100 + cb * 10 + lb

  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((5, 3, 2), jnp.int32),
                       grid=(5, 3, 2), interpret=True)()
  r, c, b = np.meshgrid(range(5), range(3), range(2), indexing="ij")
  np.testing.assert_array_equal(np.asarray(out), r * 100 + c * 10 + b)



@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_kernels_give_the_same_bits_in_either_order(monkeypatch, data_format):
  """The forward with taps, the average forward and both backwards, numbered either way
  (interpret mode, launch configurations that leave partial column and lane blocks)."""
  from jaxpool._src import windows
  from jaxpool._src.pallas.triton import ops as triton

  shape = (2, 9, 11, 6) if data_format == "channels_last" else (2, 6, 9, 11)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1, data_format=data_format)
  x = jnp.asarray(np.random.default_rng(0).integers(-3, 3, shape), jnp.float32)
  outs = {}
  for order in ("memory", "rows"):
    monkeypatch.setattr(triton_tile, "ORDER", order)
    launch = (4, 4, 1)
    y, taps = triton._window_call(x, geom, "argmax", True, launch=launch)
    avg = triton._window_call(x, geom, "avg", True, True, None, launch=launch)[0]
    dy = y * 2 + 1
    dmax = triton._backward_call((taps, dy), shape, geom, "max", True, launch=launch)
    davg = triton._backward_call((dy,), shape, geom, "avg", True, True, None, launch=launch)
    outs[order] = [np.asarray(v) for v in (y, taps, avg, dmax, davg)]
  for a, b in zip(outs["memory"], outs["rows"], strict=True):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
