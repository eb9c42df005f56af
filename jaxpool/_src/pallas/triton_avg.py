"""The average-pool forward kernel for GPUs (Pallas Triton): each window's sum over its divisor.

A program covers one output row and a tile of columns and lanes (``triton_tile.py``). It sums
the window's taps in tap order, in float32 for 16-bit inputs; at the edges a tap outside the
input is masked out of the sum (its load reads zero). The divisor is ``divisor_override``, else
the window's counted taps (with ``count_include_pad`` the padding counts too).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpool._src.dtypes import accumulator_dtype
from jaxpool._src.pallas.triton_tile import both_paths, counted_taps, load, output_row
from jaxpool._src.windows import Geometry


def avg_kernel(x_ref, o_ref, *, g: Geometry, bw: int, bl: int, lanes: int, include_pad: bool,
               divisor: int | None, interpret: bool):
  """One output row's averages."""
  row = output_row(g, bw, bl, lanes, interpret)
  tile, b, outs = row.tile, row.b, row.outs
  dtype = x_ref.dtype
  acc_t = accumulator_dtype(dtype)

  def load_tap(tap, edge: bool):
    """Tap ``(a, i, j)`` of the tile's windows; at the edges (``edge``) the taps outside the
    input are masked and read zero."""
    pos = [outs[dim] * g.strides[dim] + k * g.dilation[dim] - g.pad_lo[dim]
           for dim, k in enumerate(tap)]
    ok = None
    if edge:
      inside = [(p >= 0) & (p < n) for p, n in zip(pos, g.in_spatial)]
      ok = tile.cols_of(inside[0] & inside[1] & inside[2])
      pos = [jnp.clip(p, 0, n - 1) for p, n in zip(pos, g.in_spatial)]
    return load(x_ref, tile.index(b, *pos), ok, None if ok is None else np.array(0, dtype))

  def body(edge: bool):
    acc: Any = None
    for tap in g.taps():
      xt = load_tap(tap, edge).astype(acc_t)
      acc = xt if acc is None else acc + xt
    if divisor is not None or not edge:  # an interior window counts all its taps
      div = np.array(divisor if divisor is not None else g.num_taps, acc_t)
    else:
      cnt = counted_taps(g, outs, include_pad, bw)
      div = tile.cols_of(jnp.where(cnt == 0, 1, cnt).astype(acc_t))
    tile.store(o_ref, tile.index(b, *outs), (acc / div).astype(dtype), row.col_mask)

  both_paths(row.interior, body)
