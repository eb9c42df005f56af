"""The average-pool forward kernel for GPUs (Pallas Triton): each window's sum over its divisor.

A program covers one output row and a tile of columns and lanes (``triton/tile.py``). It sums
each row's column taps, then the rows of each plane, then the planes, each in the window's
order, in float32 for 16-bit inputs: the order of ``triton/rows.py``'s blocks of rows, which
share the rows' and planes' sums between windows, so that every launch gives the same bits.
At the edges a tap outside the input is masked out of the sum (its load reads zero). The
divisor is ``divisor_override``, else the window's counted taps (with ``count_include_pad``
the padding counts too).

The sum is multiplied by the divisor's reciprocal, correctly rounded, on both code paths: an
interior program's reciprocal is a constant (:func:`reciprocal`), an edge program's is computed
per column (:func:`count_reciprocal`), and the two are the same number, so a window's average
has the same bits whichever program computes it (a launch configuration or a split over
devices moves windows between the two paths). A division would not: XLA's CPU backend (where
interpret mode runs) divides by a constant as a multiply by its reciprocal and by a computed
count as a true division, and Triton's float32 division is approximate. (The backward kernel
has no constant-count path: it divides on both.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src.dtypes import accumulator_dtype
from jaxpool._src.pallas.triton.tile import both_paths, counted_taps, load, output_row, plgpu
from jaxpool._src.windows import Geometry


def reciprocal(count: int, acc_t) -> np.ndarray:
  """``1 / count`` in ``acc_t``, correctly rounded (computed now, a constant of the kernel)."""
  return np.array(1, acc_t) / np.array(count, acc_t)


def count_reciprocal(counts, acc_t, ptx: bool):
  """``1 / counts`` in ``acc_t`` for the window counts ``counts`` (int32; a zero count, an
  empty window's, reads one), correctly rounded as :func:`reciprocal`'s: an IEEE division, or
  where the kernel is compiled for an NVIDIA GPU (``ptx``) PTX's ``rcp.rn.f32`` for float32
  (Triton divides float32 approximately; it divides float64 exactly)."""
  denominator = jnp.where(counts == 0, 1, counts).astype(acc_t)
  if ptx and np.dtype(acc_t) == np.float32:
    assert plgpu is not None  # (triton/ops.py sets ptx only with the Triton backend)
    return plgpu.elementwise_inline_asm(
        "rcp.rn.f32 $0, $1;", args=[denominator], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(denominator.shape, denominator.dtype)])[0]
  return np.array(1, acc_t) / denominator


def avg_kernel(x_ref, o_ref, *, geom: Geometry, block_cols: int, block_lanes: int, lanes: int,
               rows: int, include_pad: bool, divisor: int | None, interpret: bool, ptx: bool):
  """One output row's averages (``ptx``: compiled for an NVIDIA GPU, see
  :func:`count_reciprocal`)."""
  row = output_row(geom, block_cols, block_lanes, lanes, rows, interpret)
  tile, batch, outs = row.tile, row.batch, row.outs
  dtype = x_ref.dtype
  acc_t = accumulator_dtype(dtype)

  def load_tap(tap, edge: bool):
    """Tap ``(plane_tap, row_tap, col_tap)`` of the tile's windows; at the edges (``edge``)
    the taps outside the input are masked and read zero."""
    positions = [outs[dim] * geom.strides[dim] + offset * geom.dilation[dim] - geom.pad_lo[dim]
                 for dim, offset in enumerate(tap)]
    valid = None
    if edge:
      sizes = geom.in_spatial
      inside = [(position >= 0) & (position < size)
                for position, size in zip(positions, sizes, strict=True)]
      valid = tile.cols_of(inside[0] & inside[1] & inside[2])
      positions = [jnp.clip(position, 0, size - 1)
                   for position, size in zip(positions, sizes, strict=True)]
    zero = None if valid is None else np.array(0, dtype)
    return load(x_ref, tile.index(batch, *positions), valid, zero)

  def body(edge: bool):
    acc: Any = None  # the planes' sums of the rows' sums of each row's taps, each in order
    for plane_tap in range(geom.window[0]):
      plane: Any = None
      for row_tap in range(geom.window[1]):
        line: Any = None
        for col_tap in range(geom.window[2]):
          value = load_tap((plane_tap, row_tap, col_tap), edge).astype(acc_t)
          line = value if line is None else line + value
        plane = line if plane is None else plane + line
      acc = plane if acc is None else acc + plane
    if divisor is not None or not edge:  # an interior window counts all its taps
      scale: Any = reciprocal(divisor if divisor is not None else geom.num_taps, acc_t)
    else:
      counts = counted_taps(geom, outs, include_pad, block_cols)
      scale = tile.cols_of(count_reciprocal(counts, acc_t, ptx))
    tile.store(o_ref, tile.index(batch, *outs), (acc * scale).astype(dtype), row.col_mask)

  both_paths(row.interior, body, interpret)
