"""ROI align's GPU kernels (Pallas Triton): the averaged sampled sum and its feature gradient.

(The box gradient's kernel, the derivatives with respect to the corner weights, is in
``triton_boxes.py``, with its summation order; it shares this module's helpers.)

Both kernels take the plan of ``plan.py`` (per box and axis: the corner indices ``iy``, ``ix``
``(K, n_out, S, 2)``, -1 for a dead sample, and the corner weights ``wy``, ``wx``), flattened,
and the levels' feature tables ``(P_l, C)`` (channels last: a pixel's channels are contiguous;
each level its own array, ``triton_levels.py``), so they compute exactly the form of
``form.py`` (its ``wrt="ct"`` and ``wrt="x"``), in float32, without atomics. Every load and
store stays in bounds: corner indices and channels are clamped, and the values at clamped
columns and channels are computed again and stored masked (compiled) or stored again with the
same bits (interpret mode, where a masked store could restore an old value).

**Forward** (:func:`forward`): one program per (box ``k``, bin row ``i``, block of
``block_lanes`` channels), the bin row's ``pw`` bins as a ``(cols, lanes)`` tile, read from the
box's level's table (a switch over the levels, ``triton_levels.on_level``). For each
sample in row-major order ``(sy, sx)``, the four corners are gathered as channel vectors and
added in torchvision's order ``(0, 0), (0, 1), (1, 0), (1, 1)``, each ``where(live, (wy * wx) *
x, 0)``; the sample's value is added to the running sum: the order of the XLA path's
``form._forward``.

**Feature gradient** (:func:`feature_grad`): one program per tile of ``GRAD_ROWS`` pixel rows x
``GRAD_COLS`` columns of one image of one level x a block of channels; the program owns its
tile, writes it once into its level's output (one output per level), and nothing else writes
it. Outside the kernel, each cell of
``GRAD_BAND`` rows x ``GRAD_CBAND`` columns of an image (level) gets the list of the boxes
whose live corner rows and columns meet it, ascending (a mask, a running count and a write at
unique places: no sort). A program walks its cell's list, skipping a box whose live corner
columns or rows miss its tile (scalar tests on the box's extents); for a box, it finds once
the bins ``j`` whose live corner columns meet its columns, then visits the bin rows ``i``
whose live corner rows meet its rows (per-bin extents, computed outside the kernel). Average
ROI align is separable per box: the contribution of box ``k`` to pixel ``(r, c)`` is
``sum_{i, j} A[i, r] B[j, c] ct[k, i, j]`` with ``A[i, r] = sum of wy[k, i, sy, a] where
iy[k, i, sy, a] == r`` (``sy`` then ``a`` ascending; ``B`` likewise), A and B computed per
pixel of the tile. Per pixel, in float32 from 0: the boxes in ascending order, in each box the
bin rows ``i`` ascending, the bins ``j`` ascending, each term ``where(hit, (A * B) * ct, 0)``
(``hit``: a live corner of the bin lies on the pixel, so a NaN cotangent reaches exactly the
pixels the XLA path's does; for a box whose cotangents are all finite, a flag computed outside
the kernel, the form ``where(hit, A * B, 0) * ct``, fewer operations a term: the same bits in
interpret mode, and compiled the same terms, which Triton may fuse into multiply-adds); a
visited bin that misses a pixel adds an exact 0 there (the sum is never -0), so neither the
tile nor the cells change the bits. The coarsest level's programs come first (they run
longest); the next box's index and the next bin's cotangent are loaded ahead. The same
bits on every run; equal to the XLA path's sorted sum to float32 rounding (a different order
of the same terms). The tile (small: a bin's footprint covers most of it, so few of its terms
are zeros) and the cells are the fastest at 7x7 of those ``benchmarks/roi_tiles_gpu.py``
timed on Mask R-CNN's shapes on an H200 (within 3% at 14x14).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpool._src.pallas.calls import out_struct
from jaxpool._src.pallas.triton.tile import compiler_params, load, plgpu
from jaxpool._src.roi import form
from jaxpool._src.roi.triton_levels import box_lists, cells, extents, on_level, planes

F32 = jnp.float32
I32 = jnp.int32
NUM_WARPS = 4
# A forward tile is (bins of a row, rounded up to a power of two) x lanes elements, at most
# this many; the gradient's tile is GRAD_ROWS rows x GRAD_COLS columns (powers of two) x at
# most GRAD_LANES lanes, in programs of GRAD_WARPS warps, and its box lists are per cell of
# GRAD_BAND rows x GRAD_CBAND columns at least (powers of two; benchmarks/roi_tiles_gpu.py
# times the choices).
FWD_TILE = 4096
FWD_LANES = 256
GRAD_ROWS = 2
GRAD_COLS = 4
GRAD_LANES = 128
GRAD_WARPS = 1
GRAD_BAND = 4
GRAD_CBAND = 32


def _pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


class _Lanes:
  """A program's block of channels: an index (a ``pl.ds`` slice when compiled and whole, else
  clamped indices) and the mask of the real ones (None: all are)."""

  def __init__(self, block: int, lanes: int, lane_block, interpret: bool):
    raw = lane_block * block + jnp.arange(block, dtype=I32)
    exact = lanes % block == 0
    self.index: Any = (pl.ds(lane_block * block, block) if exact and not interpret
                       else jnp.minimum(raw, lanes - 1))
    self.mask = None if exact else raw < lanes
    self.interpret = interpret

  def tile(self, rows):
    """The indexer of ``rows`` ``(n,)`` (or a scalar row) x these lanes."""
    if jnp.ndim(rows) == 0 or isinstance(self.index, pl.Slice):
      return (rows, self.index)
    return (rows[:, None], self.index[None, :])

  def store(self, ref, rows, value, row_mask=None):
    where = self.tile(rows)
    if self.interpret:
      ref[where] = value
      return
    mask = None if row_mask is None else row_mask[:, None]
    if self.mask is not None:
      mask = self.mask[None, :] if mask is None else mask & self.mask[None, :]
    assert plgpu is not None
    plgpu.store(ref.at[where], value, mask=mask)


def _call_kwargs(interpret: bool, warps: int = NUM_WARPS) -> dict:
  return {} if interpret else compiler_params(warps)


# A sample loop of at most this many steps is unrolled; a longer one (the adaptive count's
# ``max_samples`` grid) is a loop that skips dead samples (padding past a box's count, outside
# the map) without loading. A dead sample adds exact zeros, and a sum that starts at +0 is
# never -0, so skipping it keeps the bits.
UNROLL = 4


def _over(n: int, body, carry, alive):
  """``body(s, carry)`` for ``s`` in ``range(n)``: unrolled, or a loop skipping the steps
  where ``alive(s)`` is false."""
  if n <= UNROLL:
    for s in range(n):
      carry = body(s, carry)
    return carry

  def step(s, carry):
    return lax.cond(alive(s), functools.partial(body, s), lambda c: c, carry)

  return lax.fori_loop(0, n, step, carry)


# ----------------------------------------------------------------------------- forward


def _forward_kernel(base_ref, stride_ref, iy_ref, ix_ref, wy_ref, wx_ref, *refs, starts, ph,
                    pw, sy_n, sx_n, lanes, block_cols, block_lanes, interpret):
  *x_refs, o_ref = refs  # (the levels' tables, then the output)
  n_lb = pl.cdiv(lanes, block_lanes)
  pid = pl.program_id(0)
  lb = pid % n_lb
  ki = pid // n_lb
  k, i = ki // ph, ki % ph
  lane = _Lanes(block_lanes, lanes, lb, interpret)
  cols = jnp.arange(block_cols, dtype=I32)
  col_mask = None if pw == block_cols else cols < pw
  j = jnp.minimum(cols, pw - 1)
  stride = stride_ref[k]

  def level_sum(level, base):  # (the box's level's table, its first row there)
    x_ref = x_refs[level]

    def row_sample(sy, acc):
      at_y = [((k * ph + i) * sy_n + sy) * 2 + a for a in (0, 1)]
      r = [iy_ref[at] for at in at_y]
      u = [wy_ref[at] for at in at_y]

      def col_sample(sx, acc):
        at_x = [((k * pw + j) * sx_n + sx) * 2 + b for b in (0, 1)]
        c = [load(ix_ref, (at,)) for at in at_x]
        t = [load(wx_ref, (at,)) for at in at_x]
        v = None
        for a in (0, 1):
          for b in (0, 1):
            rows = base + jnp.maximum(r[a], 0) * stride + jnp.maximum(c[b], 0)
            g = load(x_ref, lane.tile(rows)).astype(F32)
            live = (r[a] >= 0) & (c[b] >= 0)
            term = jnp.where(live[:, None], (u[a] * t[b])[:, None] * g, 0.0)
            v = term if v is None else v + term
        return acc + v

      def col_alive(sx):
        return jnp.max(load(ix_ref, (((k * pw + j) * sx_n + sx) * 2,))) >= 0

      return _over(sx_n, col_sample, acc, col_alive)

    def row_alive(sy):
      return iy_ref[((k * ph + i) * sy_n + sy) * 2] >= 0

    return _over(sy_n, row_sample, jnp.zeros((block_cols, block_lanes), F32), row_alive)

  acc = on_level(base_ref[k], starts, level_sum)
  lane.store(o_ref, (k * ph + i) * pw + j, acc.astype(o_ref.dtype), col_mask)


def forward(base, stride, iy, ix, wy, wx, x, *, dtype, interpret: bool) -> jax.Array:
  """The form's ``wrt="ct"`` of the average: ``(K, ph, pw, C)``, the float32 sums rounded
  once to ``dtype``. ``x``: the levels' tables ``(P_l, C)`` (a tuple, or one table), ``base``
  a row of their concatenation (``triton_levels``); the rest as ``plan.align_plan``'s."""
  x = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  K, ph, sy_n, _ = iy.shape
  pw, sx_n = ix.shape[1:3]
  C = x[0].shape[1]
  if K == 0:
    return jnp.zeros((0, ph, pw, C), dtype)
  block_cols = _pow2(pw)
  block_lanes = min(_pow2(C), FWD_LANES, max(16, FWD_TILE // block_cols))
  kernel = functools.partial(_forward_kernel, starts=form.starts(tuple(a.shape[0] for a in x)),
                             ph=ph, pw=pw, sy_n=sy_n, sx_n=sx_n, lanes=C,
                             block_cols=block_cols, block_lanes=block_lanes,
                             interpret=interpret)
  grid = (K * ph * pl.cdiv(C, block_lanes),)
  n_out = K * ph * pw * C
  out = pl.pallas_call(
      kernel, out_shape=out_struct((K * ph * pw, C), dtype, x[0]), grid=grid,
      interpret=interpret,
      name="jaxpool_roi_align_fwd",
      cost_estimate=pl.CostEstimate(flops=8 * n_out * sy_n * sx_n, transcendentals=0,
                                    bytes_accessed=4 * n_out * (1 + 4 * sy_n * sx_n)),
      **_call_kwargs(interpret))(
          base.astype(I32), stride.astype(I32), iy.reshape(-1).astype(I32),
          ix.reshape(-1).astype(I32), wy.reshape(-1).astype(F32), wx.reshape(-1).astype(F32),
          *x)
  return out.reshape(K, ph, pw, C)


# ----------------------------------------------------------------------------- feature gradient


def _grad_kernel(count_ref, list_ref, ext_ref, rext_ref, cext_ref, iy_ref, ix_ref, wy_ref,
                 wx_ref, finite_ref, ct_ref, *o_refs, planes, band_rows, band_cols, n_boxes,
                 ph, pw, sy_n, sx_n, lanes, block_rows, block_cols, block_lanes, interpret):
  n_lb = pl.cdiv(lanes, block_lanes)
  pid = pl.program_id(0)
  first, height, width, offset, first_cell, bands, cbands, groups, blocks, out = (
      jnp.int32(v) for v in planes[0])
  for p in planes[1:]:  # this program's level (static: a few levels)
    later = pid >= p[0]
    first, height, width, offset, first_cell, bands, cbands, groups, blocks, out = (
        jnp.where(later, jnp.int32(new), old) for new, old in
        zip(p, (first, height, width, offset, first_cell, bands, cbands, groups, blocks, out)))
  local = pid - first  # (row group of an image, column block, lane block), the lanes fastest
  lb = local % n_lb
  cb = (local // n_lb) % blocks
  group = local // (n_lb * blocks)
  n, row0 = group // groups, (group % groups) * block_rows
  col0 = cb * block_cols
  cell = first_cell + (n * bands + row0 // band_rows) * cbands + col0 // band_cols
  row_last = jnp.minimum(row0 + block_rows, height) - 1
  col_last = jnp.minimum(col0 + block_cols, width) - 1
  lane = _Lanes(block_lanes, lanes, lb, interpret)
  # The tile's pixels, row-major: (rows x cols) of them, clamped into the map (a clamped
  # pixel computes its clamp's value again and is stored masked or with the same bits).
  at = jnp.arange(block_rows * block_cols, dtype=I32)
  raw_r, raw_c = row0 + at // block_cols, col0 + at % block_cols
  r, c = jnp.minimum(raw_r, height - 1), jnp.minimum(raw_c, width - 1)

  def axis_weights(pixel, index_ref, weight_ref, first, n):
    """One bin's samples ``first .. first + n - 1`` along one axis: the summed weight of
    their two corners on each pixel's row (or column) ``pixel``, and whether any lands there
    (the samples in order, each corner 0 then 1; dead samples skipped)."""
    def sample(s, carry):
      weight, hit = carry
      for corner in (0, 1):
        at = (first + s) * 2 + corner
        on = pixel == index_ref[at]
        weight = weight + jnp.where(on, weight_ref[at], 0.0)
        hit = hit | on
      return weight, hit

    zeros = (jnp.zeros(pixel.shape, F32), jnp.zeros(pixel.shape, jnp.bool_))
    return _over(n, sample, zeros, lambda s: index_ref[(first + s) * 2] >= 0)

  def bin_row(kk, j_first, j_last, finite, i, acc):
    """Bin row ``i`` of box ``kk``: its weight on each pixel's row and its bins' terms
    (``finite``: static, whether the box's cotangents are all finite)."""
    A, hit_a = axis_weights(r, iy_ref, wy_ref, (kk * ph + i) * sy_n, sy_n)

    def fetch(j):  # bin j's cotangent (j clamped into the range: loaded, maybe unused)
      j = jnp.clip(jnp.minimum(j, j_last), 0, pw - 1)
      return load(ct_ref, lane.tile((kk * ph + i) * pw + j)).astype(F32)

    def one(j, carry):
      acc, ct = carry
      ct_next = fetch(j + 1)  # (issued before this bin's work: its latency overlaps it)

      B, hit_b = axis_weights(c, ix_ref, wx_ref, (kk * pw + j) * sx_n, sx_n)
      # (A pixel that no live corner of the bin lies on adds an exact zero: no change, the
      # sum never being -0. With finite cotangents the product of a zero weight is that zero,
      # so the pixels' weights are masked, not the tile's terms: fewer operations a term.)
      hit = hit_a & hit_b
      if finite:
        acc = acc + jnp.where(hit, A * B, 0.0)[:, None] * ct[None, :]
      else:
        acc = acc + jnp.where(hit[:, None], (A * B)[:, None] * ct[None, :], 0.0)
      return acc, ct_next

    return lax.fori_loop(j_first, j_last + 1, one, (acc, fetch(j_first)))[0]

  count = count_ref[cell]

  def box(t, carry):
    acc, kk = carry
    # The next box's index, issued before this box's work (the last step loads its own).
    kk_next = list_ref[cell * n_boxes + jnp.minimum(t + 1, count - 1)]
    hit = ((ext_ref[4 * kk] <= row_last) & (ext_ref[4 * kk + 1] >= row0)
           & (ext_ref[4 * kk + 2] <= col_last) & (ext_ref[4 * kk + 3] >= col0))

    def add(acc):
      def col_range(j, carry):  # the bins whose live corner columns meet the tile's
        lo, hi = carry
        on = ((cext_ref[2 * (kk * pw + j)] <= col_last)
              & (cext_ref[2 * (kk * pw + j) + 1] >= col0))
        return jnp.where(on, jnp.minimum(lo, j), lo), jnp.where(on, j, hi)

      j_first, j_last = lax.fori_loop(0, pw, col_range, (jnp.int32(pw), jnp.int32(-1)))

      def rows(finite, acc):
        def row(i, acc):  # a bin row whose live corner rows meet the tile's
          on = ((rext_ref[2 * (kk * ph + i)] <= row_last)
                & (rext_ref[2 * (kk * ph + i) + 1] >= row0))
          return lax.cond(on, functools.partial(bin_row, kk, j_first, j_last, finite, i),
                          lambda acc: acc, acc)

        return lax.fori_loop(0, ph, row, acc)

      return lax.cond(finite_ref[kk] != 0, functools.partial(rows, True),
                      functools.partial(rows, False), acc)

    return lax.cond(hit, add, lambda acc: acc, acc), kk_next

  acc = jnp.zeros((block_rows * block_cols, block_lanes), F32)
  acc = lax.fori_loop(0, count, box, (acc, list_ref[cell * n_boxes]))[0]
  def store(o_ref):  # (into the program's level's output)
    lane.store(o_ref, offset + (n * height + r) * width + c, acc.astype(o_ref.dtype),
               (raw_r < height) & (raw_c < width))

  if len(o_refs) == 1:
    store(o_refs[0])
  for index, o_ref in enumerate(o_refs if len(o_refs) > 1 else ()):
    pl.when(out == index)(functools.partial(store, o_ref))


def feature_grad(base, iy, ix, wy, wx, ct, *, levels, dtype, interpret: bool, copies: int = 1,
                 want: tuple[int, ...] | None = None) -> list[jax.Array]:
  """The form's ``wrt="x"`` of the average: the feature gradient of each level in ``want``
  (default: all), ``(copies * N_l * H_l * W_l, C)`` each in ``dtype``, written by the kernel's
  programs of that level (one call). ``levels`` (``plan.Level``) and ``copies``: the tables
  ``base`` addresses (``copies`` copies of each level one after the other, level by level:
  ``triton_levels``)."""
  K, ph, sy_n, _ = iy.shape
  pw, sx_n = ix.shape[1:3]
  C = ct.shape[-1]
  want = tuple(range(len(levels))) if want is None else tuple(want)
  shapes = [(copies * levels[p].images * levels[p].height * levels[p].width, C) for p in want]
  if K == 0:
    return [jnp.zeros(s, dtype) for s in shapes]
  block_rows = GRAD_ROWS
  block_cols = min(GRAD_COLS, _pow2(max(lv.width for lv in levels)))
  band, cband = cells(levels, copies, K, max(2**20, K * ph * pw * C // 4),
                      max(GRAD_BAND, block_rows), max(GRAD_CBAND, block_cols))
  rext, cext = extents(iy, 2), extents(ix, 2)  # (K, ph, 2), (K, pw, 2)
  ext_y, ext_x = extents(iy, 3), extents(ix, 3)  # (K, 2)
  ext = jnp.concatenate([ext_y, ext_x], axis=1).astype(I32)  # (K, 4)
  count, lists = box_lists(base, ext, levels, copies, band, cband)
  ext = ext.reshape(-1)
  block_lanes = min(_pow2(C), GRAD_LANES)
  n_lb = pl.cdiv(C, block_lanes)
  schedule = planes(levels, copies, band, cband, block_rows, block_cols, n_lb, want)
  kernel = functools.partial(_grad_kernel, planes=schedule, band_rows=band, band_cols=cband,
                             n_boxes=K, ph=ph,
                             pw=pw, sy_n=sy_n, sx_n=sx_n, lanes=C, block_rows=block_rows,
                             block_cols=block_cols, block_lanes=block_lanes,
                             interpret=interpret)
  grid = (copies * sum(levels[p].images * -(-levels[p].height // block_rows)
                       * -(-levels[p].width // block_cols) for p in want) * n_lb,)
  n_ct = math.prod(ct.shape)
  # Per box: whether its cotangents are all finite (its terms then take the shorter form).
  finite = jnp.all(jnp.isfinite(ct.reshape(K, -1)), axis=1).astype(I32)
  rows = sum(s[0] for s in shapes)
  return list(pl.pallas_call(
      kernel, out_shape=tuple(out_struct(s, dtype, ct) for s in shapes), grid=grid,
      interpret=interpret, name="jaxpool_roi_align_bwd",
      cost_estimate=pl.CostEstimate(flops=4 * n_ct * sy_n * sx_n, transcendentals=0,
                                    bytes_accessed=4 * (n_ct * 2 * sy_n + rows * C)),
      **_call_kwargs(interpret, GRAD_WARPS))(
          count, lists, ext, rext.reshape(-1).astype(I32), cext.reshape(-1).astype(I32),
          iy.reshape(-1).astype(I32), ix.reshape(-1).astype(I32), wy.reshape(-1).astype(F32),
          wx.reshape(-1).astype(F32), finite, ct.reshape(K * ph * pw, C)))
