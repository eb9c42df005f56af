"""ROI align's max mode on the GPU (Pallas Triton): each bin's selected sample and its value.

The max mode (``mode="max"``) keeps, per bin and channel, the first sample holding the bin's
maximum (a NaN beats every number, the first NaN wins; -1 where the bin has no sample), the
taps; the output is that sample's bilinear value, the form of ``form.py`` with ``sel`` the
taps. Two kernels, each the forward's program (``triton.sample_values``: one program per box,
bin row and block of channels, each sample's value computed as the average's forward does):

- :func:`taps`: keeps the running maximum and its sample over the real samples (those within
  the box's count, dead ones included: their value is 0), in row-major order, with the XLA
  path's test (``xla._align_taps``): the same taps, bit for bit;
- :func:`at_taps`: the form's ``wrt="ct"`` with taps: each channel's value at its tap (the same
  float32 terms in the same order as the XLA path's form: its bits in interpret mode).

The gradients with taps: the feature gradient (:func:`grad_kernel`, the average's schedule,
``triton.feature_grad``) and the corner weights' (``triton_boxes.corner_grad``, each channel's
product kept where its tap is the sample).

**Feature gradient** with taps: the average's tiles, cells and walk (``triton.Tile``); per bin
of a box meeting the tile, each sample's two y corners' weights on the tile's rows and x
corners' on its columns, and per channel the terms of its tap's sample:
``where(hit & (tap == s), (A_s * B_s) * ct, 0)``, the samples ``sy`` then ``sx`` ascending
within the bin. Grids of at most ``MAX_GRAD_SAMPLES`` samples a bin (their loops are unrolled;
larger ones take the XLA path's form).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpool._src.pallas.triton.tile import load
from jaxpool._src.roi.triton import (Tile, _Lanes, bin_row_call, bin_row_program,
                                     sample_values)

F32 = jnp.float32
I32 = jnp.int32
MAX_GRAD_SAMPLES = 16  # (samples a bin for the feature gradient's kernel: Sy x Sx, unrolled)


def _kernel(base_ref, stride_ref, iy_ref, ix_ref, wy_ref, wx_ref, a_ref, b_ref, *refs, find,
            starts, ph, pw, sy_n, sx_n, lanes, block_cols, block_lanes, interpret):
  """``find``: the taps (``a_ref``, ``b_ref``: the boxes' sample counts along y and x), else
  the values at the taps (``a_ref``: the taps; ``b_ref`` unused)."""
  *x_refs, o_ref = refs
  k, i, lane, j, col_mask = bin_row_program(ph, pw, lanes, block_cols, block_lanes, interpret)
  refs6 = (base_ref, stride_ref, iy_ref, ix_ref, wy_ref, wx_ref, x_refs)
  kw = dict(starts=starts, ph=ph, pw=pw, sy_n=sy_n, sx_n=sx_n)
  zeros = jnp.zeros((block_cols, block_lanes), F32)
  out_at = (k * ph + i) * pw + j
  if find:
    gy, gx = a_ref[k], b_ref[k]

    def keep(s, v, carry):
      best, arg = carry
      real = (s // sx_n < gy) & (s % sx_n < gx)
      better = real & ((arg < 0) | (v > best) | (jnp.isnan(v) & ~jnp.isnan(best)))
      return jnp.where(better, v, best), jnp.where(better, s, arg)

    _, arg = sample_values(refs6, k, i, j, lane, step=keep,
                           init=(zeros, jnp.full((block_cols, block_lanes), -1, I32)),
                           alive=(lambda sy: sy < gy, lambda sx: sx < gx), **kw)
    lane.store(o_ref, out_at, arg, col_mask)
    return
  tap = load(a_ref, lane.tile(out_at))  # (cols, lanes)
  value = sample_values(refs6, k, i, j, lane, step=lambda s, v, acc: jnp.where(tap == s, v, acc),
                        init=zeros, **kw)
  lane.store(o_ref, out_at, value.astype(o_ref.dtype), col_mask)


def _call(base, stride, iy, ix, wy, wx, x, a, b, *, find, dtype, interpret):
  return bin_row_call(_kernel, base, stride, iy, ix, wy, wx, x, (a, b), dtype=dtype,
                      name="jaxpool_roi_align_max_taps" if find else "jaxpool_roi_align_max_fwd",
                      interpret=interpret, find=find)


def taps(base, stride, iy, ix, wy, wx, x, gy, gx, *, interpret: bool) -> jax.Array:
  """Each bin's and channel's first sample holding the maximum of its real samples (``gy`` x
  ``gx`` of the box's, the ``(K,)`` counts), -1 where it has none: ``(K, ph, pw, C)`` int32,
  ``xla._align_taps``'s. ``x``: the levels' tables; the rest as ``plan.align_plan``'s."""
  return _call(base, stride, iy, ix, wy, wx, x, gy.astype(I32), gx.astype(I32), find=True,
               dtype=I32, interpret=interpret)


def at_taps(base, stride, iy, ix, wy, wx, taps, x, *, dtype, interpret: bool) -> jax.Array:
  """The form's ``wrt="ct"`` with ``taps``: each element's value at its tap (0 at -1),
  ``(K, ph, pw, C)`` in ``dtype``."""
  C = taps.shape[-1]
  return _call(base, stride, iy, ix, wy, wx, x, taps.reshape(-1, C).astype(I32),
               jnp.zeros((1,), I32), find=False, dtype=dtype, interpret=interpret)


def grad_kernel(count_ref, list_ref, ext_ref, rext_ref, cext_ref, iy_ref, ix_ref, wy_ref,
                wx_ref, taps_ref, ct_ref, *o_refs, planes, band_rows, band_cols, n_boxes, ph, pw,
                sy_n, sx_n, lanes, block_rows, block_cols, block_lanes, interpret):
  """The feature gradient's kernel with taps (``triton.feature_grad(..., taps=)``)."""
  tile = Tile(planes, pl.cdiv(lanes, block_lanes), block_rows, block_cols, band_rows,
              band_cols)
  lane = _Lanes(block_lanes, lanes, tile.lb, interpret)

  def weights(pixel, index_ref, weight_ref, sample):
    """One sample's two corners along an axis: their summed weight on each pixel's row (or
    column) and whether one lies there (a dead corner, -1, lies nowhere)."""
    weight, hit = jnp.zeros(pixel.shape, F32), jnp.zeros(pixel.shape, jnp.bool_)
    for corner in (0, 1):
      at = sample * 2 + corner
      on = pixel == index_ref[at]
      weight, hit = weight + jnp.where(on, weight_ref[at], 0.0), hit | on
    return weight, hit

  def add(kk, acc):
    j_first, j_last = tile.bin_columns(cext_ref, kk, pw)

    def bin_row(i, acc):
      rows = [weights(tile.r, iy_ref, wy_ref, (kk * ph + i) * sy_n + sy) for sy in range(sy_n)]

      def one(j, acc):
        at = (kk * ph + i) * pw + j
        tap = load(taps_ref, lane.tile(at))
        ct = load(ct_ref, lane.tile(at)).astype(F32)
        cols = [weights(tile.c, ix_ref, wx_ref, (kk * pw + j) * sx_n + sx) for sx in range(sx_n)]
        for sy, (a, hit_a) in enumerate(rows):
          for sx, (b, hit_b) in enumerate(cols):
            on = (hit_a & hit_b)[:, None] & (tap == sy * sx_n + sx)[None, :]
            acc = acc + jnp.where(on, (a * b)[:, None] * ct[None, :], 0.0)
        return acc

      return lax.fori_loop(j_first, j_last + 1, one, acc)

    return tile.bin_rows(rext_ref, kk, ph, bin_row, acc)

  acc = jnp.zeros((block_rows * block_cols, block_lanes), F32)
  tile.store(o_refs, lane, tile.walk(count_ref, list_ref, ext_ref, n_boxes, add, acc))
