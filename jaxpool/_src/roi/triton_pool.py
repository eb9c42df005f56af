"""roi_pool's GPU kernels (Pallas Triton): each bin's argmax and the gradient to it.

``roi_pool`` on the kernels (``kernels.py``) is the XLA path's (``xla.roi_pool``) with two of
its parts replaced: each bin's argmax and maximum, and the feature gradient. The maxima
differentiate as the gather ``x[argmax]`` (a linear map of the features, an XLA gather, which
runs only for a tangent: forward mode and ``vmap`` compose as on the XLA path), whose transpose
is the gradient kernel.

**Argmax** (:func:`argmax`): one program per (box ``k``, bin row ``i``, block of channels), the
bin row's ``pw`` bins as a ``(cols, lanes)`` tile. It walks the bin row's pixel rows
``hstart[i] .. hend[i] - 1`` and, in each, the columns ``wstart[j] + t`` for ``t`` up to the
widest bin of the box (a column past its bin's end is masked), keeping per channel the first
pixel whose value (in float32) is ``>`` the best so far, from torchvision's start
(``-FLT_MAX``): so the first maximum in row-major order, NaN never wins, and -1 where nothing
beat the start. The XLA path visits the same pixels in the same order with the same test: the
same indices, bit for bit. A box that is not usable (an image index out of range, a
non-finite coordinate) visits nothing (its rows are masked to -1 outside, as on the XLA path).

**Gradient** (:func:`pick_transpose`): ``dx[p, c]`` is the sum of the cotangents
``ct[k, i, j, c]`` whose argmax is pixel ``p``. The programs and box lists are ROI align's
feature gradient's (``triton.Tile``): one program per tile of pixels of one image x a block of
channels, owning its tile; each walks its cell's boxes ascending, in each the bin rows
``i`` ascending whose rows meet the tile, the bins ``j`` ascending whose columns meet it, and
adds ``where(argmax == pixel, ct, 0)`` per pixel and channel, in float32 from 0. No atomics,
the same bits on every run; equal to the XLA path's sorted sum to float32 rounding (the same
terms in another order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpool._src.pallas.calls import out_struct
from jaxpool._src.pallas.triton.tile import load
from jaxpool._src.roi.plan import POOL_FLOOR, Level
from jaxpool._src.roi.triton import (FWD_LANES, FWD_TILE, Tile, _call_kwargs, _Lanes, _pow2,
                                     bin_row_program, schedule)
from jaxpool._src.roi.triton_levels import extents

F32 = jnp.float32
I32 = jnp.int32
# The gradient's tile: GRAD_ROWS x GRAD_COLS pixels x at most GRAD_LANES channels (powers of
# two) in programs of GRAD_WARPS warps, its box lists per cell of at least CELL pixels
# (benchmarks/roi_pool_gpu.py --tiles times the choices).
GRAD_ROWS = 2
GRAD_COLS = 4
GRAD_LANES = 64
GRAD_WARPS = 1
CELL = (4, 32)


def _argmax_kernel(hs_ref, he_ref, ws_ref, we_ref, base_ref, span_ref, x_ref, o_ref, v_ref, *,
                   ph, pw, width, lanes, block_cols, block_lanes, interpret):
  k, i, lane, j, col_mask = bin_row_program(ph, pw, lanes, block_cols, block_lanes, interpret)
  w0 = load(ws_ref, (k * pw + j,))
  w1 = load(we_ref, (k * pw + j,))
  base = base_ref[k]

  def row(h, carry):
    def col(t, carry):
      best, arg = carry
      w = w0 + t
      rows = base + h * width + jnp.minimum(w, width - 1)
      v = load(x_ref, lane.tile(rows)).astype(F32)
      better = (w < w1)[:, None] & (v > best)
      return jnp.where(better, v, best), jnp.where(better, rows[:, None], arg)

    return lax.fori_loop(0, span_ref[k], col, carry)

  init = (jnp.full((block_cols, block_lanes), POOL_FLOOR, F32),
          jnp.full((block_cols, block_lanes), -1, I32))
  best, arg = lax.fori_loop(hs_ref[k * ph + i], he_ref[k * ph + i], row, init)
  lane.store(o_ref, (k * ph + i) * pw + j, arg, col_mask)
  lane.store(v_ref, (k * ph + i) * pw + j, best.astype(v_ref.dtype), col_mask)


def argmax(table, bins, base, ok, *, width: int,
           interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Per element ``(K, ph, pw, C)``: the table row of the bin's first maximum under ``>``
  from ``-FLT_MAX``, or -1 (``xla._pool_argmax``'s result, bit for bit), and that maximum in
  the table's dtype (exact: the element's own value; where the row is -1, the start's, cast:
  unused). ``bins``:
  ``((hstart, hend), (wstart, wend))`` of ``plan.pool_bins``; ``base``: each box's image's
  first row; ``ok``: usable boxes (the others visit nothing)."""
  (hs, he), (ws, we) = bins
  K, ph = hs.shape
  pw = ws.shape[1]
  C = table.shape[1]
  if K == 0:
    return jnp.zeros((0, ph, pw, C), I32), jnp.zeros((0, ph, pw, C), table.dtype)
  he = jnp.where(ok[:, None], he, hs)  # (an unusable box: no rows)
  span = jnp.maximum(jnp.max(we - ws, axis=1), 0)
  block_cols = _pow2(pw)
  block_lanes = min(_pow2(C), FWD_LANES, max(16, FWD_TILE // block_cols))
  kernel = functools.partial(_argmax_kernel, ph=ph, pw=pw, width=width, lanes=C,
                             block_cols=block_cols, block_lanes=block_lanes,
                             interpret=interpret)
  rows, values = pl.pallas_call(
      kernel, out_shape=(out_struct((K * ph * pw, C), I32, table),
                         out_struct((K * ph * pw, C), table.dtype, table)),
      grid=(K * ph * pl.cdiv(C, block_lanes),), interpret=interpret,
      name="jaxpool_roi_pool_argmax", **_call_kwargs(interpret))(
          *(a.reshape(-1).astype(I32) for a in (hs, he, ws, we)), base.astype(I32),
          span.astype(I32), table)
  return rows.reshape(K, ph, pw, C), values.reshape(K, ph, pw, C)


def _grad_kernel(count_ref, list_ref, ext_ref, rext_ref, cext_ref, arg_ref, ct_ref, o_ref, *,
                 planes, band_rows, band_cols, n_boxes, ph, pw, lanes, block_rows, block_cols,
                 block_lanes, interpret):
  tile = Tile(planes, pl.cdiv(lanes, block_lanes), block_rows, block_cols, band_rows,
              band_cols)
  lane = _Lanes(block_lanes, lanes, tile.lb, interpret)
  pixel = (tile.n * tile.height + tile.r) * tile.width + tile.c  # (the table's rows)

  def add(kk, acc):
    j_first, j_last = tile.bin_columns(cext_ref, kk, pw)

    def bin_row(i, acc):
      def one(j, acc):
        at = (kk * ph + i) * pw + j
        hit = load(arg_ref, lane.tile(at))[None, :] == pixel[:, None]
        ct = load(ct_ref, lane.tile(at)).astype(F32)
        return acc + jnp.where(hit, ct[None, :], 0.0)

      return lax.fori_loop(j_first, j_last + 1, one, acc)

    return tile.bin_rows(rext_ref, kk, ph, bin_row, acc)

  acc = jnp.zeros((block_rows * block_cols, block_lanes), F32)
  tile.store((o_ref,), lane, tile.walk(count_ref, list_ref, ext_ref, n_boxes, add, acc))


def _bin_extents(start, end):
  """Per bin ``(K, n, 2)``: its first and last pixel along an axis (-1, -1 if empty)."""
  full = end > start
  return jnp.stack([jnp.where(full, start, -1), jnp.where(full, end - 1, -1)], axis=-1)


def pick_transpose(arg, bins, base, ok, ct, *, level: Level, interpret: bool) -> jax.Array:
  """``dx`` ``(N * H * W, C)`` in ``ct``'s dtype: ``dx[p, c] = sum of ct[k, i, j, c]`` where
  ``arg[k, i, j, c] == p`` (``arg``: :func:`argmax`'s rows, -1 where none), written once per
  pixel by the program owning it. ``bins``, ``base``, ``ok``: as :func:`argmax`'s (each box's
  bins; its image's first row; whether it is usable: the others select nothing)."""
  (hs, he), (ws, we) = bins
  K, ph, pw, C = arg.shape
  shape = (level.images * level.height * level.width, C)
  if K == 0:
    return jnp.zeros(shape, ct.dtype)
  rext, cext = _bin_extents(hs, he), _bin_extents(ws, we)  # (K, ph, 2), (K, pw, 2)
  ext = jnp.concatenate([extents(rext, 2), extents(cext, 2)], axis=1).astype(I32)
  ext = jnp.where(ok[:, None], ext, jnp.array([2**30, -1, 2**30, -1], I32))
  one = (dataclasses.replace(level, offset=0),)  # (the only table)
  params, count, lists, grid = schedule(base, ext, one, 1, K, K * ph * pw * C,
                                        GRAD_ROWS, min(GRAD_COLS, _pow2(level.width)), C, (0,),
                                        GRAD_LANES, CELL)
  kernel = functools.partial(_grad_kernel, n_boxes=K, ph=ph, pw=pw, lanes=C,
                             interpret=interpret, **params)
  return pl.pallas_call(
      kernel, out_shape=out_struct(shape, ct.dtype, ct), grid=grid, interpret=interpret,
      name="jaxpool_roi_pool_bwd", **_call_kwargs(interpret, GRAD_WARPS))(
          count, lists, ext.reshape(-1), rext.reshape(-1).astype(I32),
          cext.reshape(-1).astype(I32), arg.reshape(K * ph * pw, C).astype(I32),
          ct.reshape(K * ph * pw, C))

