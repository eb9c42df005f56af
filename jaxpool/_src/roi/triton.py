"""ROI align's GPU kernels (Pallas Triton): the averaged sampled sum and its feature gradient.

(The box gradient's kernel, the derivatives with respect to the corner weights, is in
``triton_boxes.py``, with its summation order; it shares this module's helpers, and roi_pool's
gradient kernel, ``triton_pool.py``, the feature gradient's schedule: :class:`Tile`,
:func:`schedule`.)

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
``form._forward``. Compiled, a box whose corners are all live (a flag per box, computed
outside the kernel) takes the same terms without the selects, each corner after the first a
fused multiply-add (in interpret mode the XLA path's operations and bits).

**Feature gradient** (:func:`feature_grad`): one program per tile of ``GRAD_ROWS`` pixel rows x
``GRAD_COLS`` columns of one image of one level x a block of channels; the program owns its
tile, writes it once into its level's output (one output per level), and nothing else writes
it. Outside the kernel, each cell of
``GRAD_BAND`` rows x ``GRAD_CBAND`` columns of an image (level) gets the list of the boxes
whose live corner rows and columns meet it, ascending (a mask, a running count and a write at
unique places: no sort). A program walks its cell's list, skipping a box whose live corner
columns or rows miss its tile (scalar tests on the box's extents); for a box, it finds once
the bins ``j`` whose live corner columns meet its columns, then visits the bin rows ``i``
whose live corner rows meet its rows (per-bin extents, computed outside the kernel) and, in
each, those bins. Average
ROI align is separable per box: the contribution of box ``k`` to pixel ``(r, c)`` is
``sum_{i, j} A[i, r] B[j, c] ct[k, i, j]`` with ``A[i, r] = sum of wy[k, i, sy, a] where
iy[k, i, sy, a] == r`` (``sy`` then ``a`` ascending; ``B`` likewise), A and B computed per
pixel of the tile. Per pixel, in float32 from 0: the boxes in ascending order, in each box the
bin rows ``i`` ascending, the bins ``j`` ascending, each term ``where(hit, (A * B) * ct, 0)``
(``hit``: a live corner of the bin lies on the pixel, so a NaN cotangent reaches exactly the
pixels the XLA path's does; for a box whose cotangents and corner weights are all finite, a
flag computed outside the kernel, the form ``(A * B) * ct`` with no ``hit``: where no live
corner lies on a pixel its weight ``A`` or ``B`` is +0, so its term is an exact zero;
compiled, each term one fused multiply-add, one rounding, in interpret mode the product then
the sum); a visited bin that misses a pixel adds an exact 0 there (the sum is never -0), so
neither the tile nor the cells change the bits. A box's first and last bin meeting the tile,
along each axis, come from two vector loads of its bins' extents; the bin rows between them
are visited (one that misses the tile adds zeros). The cotangent row is loaded as a ``(1,
lanes)`` row of the tile's layout (a 1-D load took a trip through shared memory a bin). The
coarsest level's programs come first (they run longest); the next box's index and the next
bin's cotangent are loaded ahead. The same bits on every run; equal to the XLA path's sorted
sum to float32 rounding (a different order of the same terms). The tile (small: a bin's
footprint covers most of it, so few of its terms are zeros) and the cells are the fastest at
7x7 of those ``benchmarks/roi_tiles_gpu.py`` timed on Mask R-CNN's shapes on an H200 (within 3%
at 14x14).
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
from jaxpool._src.roi.triton_levels import (box_lists, cells, extents, finite_boxes, live_boxes,
                                            meeting, on_level, planes)

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

  def row(self, ref, row):
    """``ref[row, lanes]`` as a ``(1, block)`` row (lanes past the channels: a clamped
    copy)."""
    if isinstance(self.index, pl.Slice):
      return load(ref, (pl.ds(row, 1), self.index))
    return load(ref, self.tile(row))[None, :]

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


def bin_row_program(ph, pw, lanes, block_cols, block_lanes, interpret):
  """A program of one box ``k``, bin row ``i`` and block of channels (the lanes fastest in
  ``pl.program_id``), its bins as the ``block_cols`` rows of a tile: ``(k, i, lane, j,
  col_mask)``, ``j`` the bins (clamped), ``col_mask`` the real ones (None: all are)."""
  n_lb = pl.cdiv(lanes, block_lanes)
  pid = pl.program_id(0)
  ki = pid // n_lb
  lane = _Lanes(block_lanes, lanes, pid % n_lb, interpret)
  cols = jnp.arange(block_cols, dtype=I32)
  col_mask = None if pw == block_cols else cols < pw
  return ki // ph, ki % ph, lane, jnp.minimum(cols, pw - 1), col_mask


def sample_values(refs, k, i, j, lane, *, starts, ph, pw, sy_n, sx_n, step, init, alive=None,
                  all_live=False, interpret=True):
  """Bin row ``i`` of box ``k`` (its bins ``j``, a block of channels ``lane``): ``carry =
  step(s, v, carry)`` from ``init`` for each sample ``s = sy * sx_n + sx`` in row-major order,
  ``v`` its bilinear value ``(cols, lanes)`` in float32 (the four corners gathered as channel
  vectors and added in torchvision's order, each ``where(live, (wy * wx) * x, 0)``), read from
  the box's level's table. ``refs``: ``(base, stride, iy, ix, wy, wx)`` refs and the levels'
  tables. A loop over more than ``UNROLL`` samples skips those ``alive`` (a pair of
  predicates on ``sy`` and ``sx``) calls dead; by default the dead samples (all corners -1),
  whose ``v`` is +0. ``all_live``: the caller knows every corner of the box is live, so
  compiled (``interpret`` False) the terms need no select, and each corner after the first is
  one multiply-add (:func:`multiply_add`); in interpret mode it changes nothing (the XLA
  path's operations, whose selects keep XLA from contracting them: its bits)."""
  base_ref, stride_ref, iy_ref, ix_ref, wy_ref, wx_ref, x_refs = refs
  stride = stride_ref[k]
  if alive is None:
    alive = (lambda sy: iy_ref[((k * ph + i) * sy_n + sy) * 2] >= 0,
             lambda sx: jnp.max(load(ix_ref, (((k * pw + j) * sx_n + sx) * 2,))) >= 0)

  def level_sum(level, base):  # (the box's level's table, its first row there)
    x_ref = x_refs[level]

    def row_sample(sy, carry):
      at_y = [((k * ph + i) * sy_n + sy) * 2 + a for a in (0, 1)]
      r = [iy_ref[at] for at in at_y]
      u = [wy_ref[at] for at in at_y]

      def col_sample(sx, carry):
        at_x = [((k * pw + j) * sx_n + sx) * 2 + b for b in (0, 1)]
        c = [load(ix_ref, (at,)) for at in at_x]
        t = [load(wx_ref, (at,)) for at in at_x]
        v = None
        for a in (0, 1):
          for b in (0, 1):
            rows = base + jnp.maximum(r[a], 0) * stride + jnp.maximum(c[b], 0)
            g = load(x_ref, lane.tile(rows)).astype(F32)
            if all_live and not interpret:
              w = (u[a] * t[b])[:, None]
              v = w * g if v is None else multiply_add(w, g, v, interpret)
              continue
            live = (r[a] >= 0) & (c[b] >= 0)
            term = jnp.where(live[:, None], (u[a] * t[b])[:, None] * g, 0.0)
            v = term if v is None else v + term
        return step(sy * sx_n + sx, v, carry)

      return _over(sx_n, col_sample, carry, alive[1])

    return _over(sy_n, row_sample, init, alive[0])

  return on_level(base_ref[k], starts, level_sum)


def _forward_kernel(base_ref, stride_ref, iy_ref, ix_ref, wy_ref, wx_ref, live_ref, *refs,
                    starts, ph, pw, sy_n, sx_n, lanes, block_cols, block_lanes, interpret):
  *x_refs, o_ref = refs  # (the levels' tables, then the output)
  k, i, lane, j, col_mask = bin_row_program(ph, pw, lanes, block_cols, block_lanes, interpret)
  values = functools.partial(
      sample_values, (base_ref, stride_ref, iy_ref, ix_ref, wy_ref, wx_ref, x_refs), k, i, j,
      lane, starts=starts, ph=ph, pw=pw, sy_n=sy_n, sx_n=sx_n, step=lambda s, v, acc: acc + v,
      init=jnp.zeros((block_cols, block_lanes), F32), interpret=interpret)
  # (Compiled, a box whose samples all lie on the map, the common case, takes the form without
  # selects: ``triton_levels.live_boxes``; interpreted, the two forms are one.)
  acc = values() if interpret else lax.cond(live_ref[k] != 0, lambda: values(all_live=True),
                                            values)
  lane.store(o_ref, (k * ph + i) * pw + j, acc.astype(o_ref.dtype), col_mask)


def forward(base, stride, iy, ix, wy, wx, x, *, dtype, interpret: bool) -> jax.Array:
  """The form's ``wrt="ct"`` of the average: ``(K, ph, pw, C)``, the float32 sums rounded
  once to ``dtype``. ``x``: the levels' tables ``(P_l, C)`` (a tuple, or one table), ``base``
  a row of their concatenation (``triton_levels``); the rest as ``plan.align_plan``'s."""
  return bin_row_call(_forward_kernel, base, stride, iy, ix, wy, wx, x, (live_boxes(iy, ix),),
                      dtype=dtype,
                      name="jaxpool_roi_align_fwd", interpret=interpret)


def bin_row_call(body, base, stride, iy, ix, wy, wx, x, extra, *, dtype, name, interpret,
                 **static):
  """A kernel of one program per box, bin row and block of channels (:func:`bin_row_program`)
  over the plan and the levels' tables ``x``: ``body(base, stride, iy, ix, wy, wx, *extra,
  *x, out, **static, starts=, ph=, ...)`` writing ``(K, ph, pw, C)`` in ``dtype``."""
  x = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  K, ph, sy_n, _ = iy.shape
  pw, sx_n = ix.shape[1:3]
  C = x[0].shape[1]
  if K == 0:
    return jnp.zeros((0, ph, pw, C), dtype)
  block_cols = _pow2(pw)
  block_lanes = min(_pow2(C), FWD_LANES, max(16, FWD_TILE // block_cols))
  kernel = functools.partial(body, starts=form.starts(tuple(a.shape[0] for a in x)),
                             ph=ph, pw=pw, sy_n=sy_n, sx_n=sx_n, lanes=C,
                             block_cols=block_cols, block_lanes=block_lanes,
                             interpret=interpret, **static)
  n_out = K * ph * pw * C
  out = pl.pallas_call(
      kernel, out_shape=out_struct((K * ph * pw, C), dtype, x[0]),
      grid=(K * ph * pl.cdiv(C, block_lanes),), interpret=interpret, name=name,
      cost_estimate=pl.CostEstimate(flops=8 * n_out * sy_n * sx_n, transcendentals=0,
                                    bytes_accessed=4 * n_out * (1 + 4 * sy_n * sx_n)),
      **_call_kwargs(interpret))(
          base.astype(I32), stride.astype(I32), iy.reshape(-1).astype(I32),
          ix.reshape(-1).astype(I32), wy.reshape(-1).astype(F32), wx.reshape(-1).astype(F32),
          *extra, *x)
  return out.reshape(K, ph, pw, C)


# ----------------------------------------------------------------------------- feature gradient


def multiply_add(w, v, acc, interpret: bool):
  """``acc + w * v`` (``w`` and ``v`` broadcast to ``acc``'s shape, float32): compiled, one fused
  multiply-add an element (one rounding); in interpret mode the product, then the sum."""
  if interpret:
    return acc + w * v
  assert plgpu is not None
  w, v = jnp.broadcast_to(w, acc.shape), jnp.broadcast_to(v, acc.shape)
  return plgpu.elementwise_inline_asm(
      "fma.rn.f32 $0, $1, $2, $3;", args=[w, v, acc], constraints="=r,r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, acc.dtype)])[0]


class Tile:
  """A feature-gradient program's tile (its index from ``pl.program_id``; ``planes``: the
  schedule of ``triton_levels.planes``): ``block_rows`` x ``block_cols`` pixels of one image of
  one level, row-major (``r``, ``c``, clamped into the map: a clamped pixel computes its
  clamp's value again and is stored masked or with the same bits), a lane block ``lb``, and
  the cell whose box list it walks. Shared by ROI align's and roi_pool's gradient kernels."""

  def __init__(self, planes, n_lb, block_rows, block_cols, band_rows, band_cols):
    pid = pl.program_id(0)
    first, height, width, offset, first_cell, bands, cbands, groups, blocks, out = (
        jnp.int32(v) for v in planes[0])
    for p in planes[1:]:  # this program's level (static: a few levels)
      later = pid >= p[0]
      first, height, width, offset, first_cell, bands, cbands, groups, blocks, out = (
          jnp.where(later, jnp.int32(new), old) for new, old in
          zip(p, (first, height, width, offset, first_cell, bands, cbands, groups, blocks,
                  out)))
    local = pid - first  # (row group of an image, column block, lane block), the lanes fastest
    self.lb = local % n_lb
    cb = (local // n_lb) % blocks
    group = local // (n_lb * blocks)
    self.n, self.row0 = group // groups, (group % groups) * block_rows
    self.col0 = cb * block_cols
    self.cell = (first_cell + (self.n * bands + self.row0 // band_rows) * cbands
                 + self.col0 // band_cols)
    self.row_last = jnp.minimum(self.row0 + block_rows, height) - 1
    self.col_last = jnp.minimum(self.col0 + block_cols, width) - 1
    at = jnp.arange(block_rows * block_cols, dtype=I32)
    self.raw_r, self.raw_c = self.row0 + at // block_cols, self.col0 + at % block_cols
    self.r = jnp.minimum(self.raw_r, height - 1)
    self.c = jnp.minimum(self.raw_c, width - 1)
    self.height, self.width, self.offset, self.out = height, width, offset, out

  def walk(self, count_ref, list_ref, ext_ref, n_boxes, visit, acc):
    """``acc = visit(kk, acc)`` for the boxes ``kk`` of the cell's list, ascending, whose
    extents (``ext_ref``: per box, the live rows' then columns' lowest and highest) meet the
    tile (the next box's index loaded ahead)."""
    count = count_ref[self.cell]

    def box(t, carry):
      acc, kk = carry
      # The next box's index, issued before this box's work (the last step loads its own).
      kk_next = list_ref[self.cell * n_boxes + jnp.minimum(t + 1, count - 1)]
      hit = ((ext_ref[4 * kk] <= self.row_last) & (ext_ref[4 * kk + 1] >= self.row0)
             & (ext_ref[4 * kk + 2] <= self.col_last) & (ext_ref[4 * kk + 3] >= self.col0))
      return lax.cond(hit, functools.partial(visit, kk), lambda acc: acc, acc), kk_next

    return lax.fori_loop(0, count, box, (acc, list_ref[self.cell * n_boxes]))[0]

  def bin_columns(self, cext_ref, kk, pw):
    """The first and last bin ``j`` of box ``kk`` whose live columns (``cext_ref``: per bin,
    lowest and highest) meet the tile's (``pw`` and -1: none)."""
    return meeting(cext_ref, kk, pw, self.col0, self.col_last)

  def bin_rows(self, rext_ref, kk, ph, fn, acc):
    """``acc = fn(i, acc)`` for the bin rows ``i`` of box ``kk``, ascending, from the first to
    the last whose live rows meet the tile's (a row between them that misses the tile, if
    any, adds exact zeros)."""
    first, last = meeting(rext_ref, kk, ph, self.row0, self.row_last)
    return lax.fori_loop(first, last + 1, fn, acc)

  def store(self, o_refs, lane, acc):
    """The tile's sums into its level's output (one output per level, or the one)."""
    def store(o_ref):
      lane.store(o_ref, self.offset + (self.n * self.height + self.r) * self.width + self.c,
                 acc.astype(o_ref.dtype),
                 (self.raw_r < self.height) & (self.raw_c < self.width))

    if len(o_refs) == 1:
      store(o_refs[0])
    for index, o_ref in enumerate(o_refs if len(o_refs) > 1 else ()):
      pl.when(self.out == index)(functools.partial(store, o_ref))


def schedule(base, ext, levels, copies: int, K: int, entries: int, block_rows: int,
             block_cols: int, lanes: int, want: tuple[int, ...], max_lanes: int = GRAD_LANES,
             cell: tuple[int, int] = (GRAD_BAND, GRAD_CBAND)):
  """A gradient kernel's launch: the cells (``triton_levels.cells``, lists of at most about
  ``entries`` / 4 entries), their box lists, the programs' plan (``planes``), the lane block
  and the grid (lane blocks of at most ``max_lanes``; cells of at least ``cell`` pixels).
  ``ext``: ``(K, 4)`` per box, the live rows' and columns' extents."""
  band, cband = cells(levels, copies, K, max(2**20, entries // 4),
                      max(cell[0], block_rows), max(cell[1], block_cols))
  count, lists = box_lists(base, ext, levels, copies, band, cband)
  block_lanes = min(_pow2(lanes), max_lanes)
  n_lb = pl.cdiv(lanes, block_lanes)
  plan = planes(levels, copies, band, cband, block_rows, block_cols, n_lb, want)
  grid = (copies * sum(levels[p].images * -(-levels[p].height // block_rows)
                       * -(-levels[p].width // block_cols) for p in want) * n_lb,)
  return dict(band_rows=band, band_cols=cband, planes=plan, block_lanes=block_lanes,
              block_rows=block_rows, block_cols=block_cols), count, lists, grid


def _grad_kernel(count_ref, list_ref, ext_ref, rext_ref, cext_ref, iy_ref, ix_ref, wy_ref,
                 wx_ref, finite_ref, ct_ref, *o_refs, planes, band_rows, band_cols, n_boxes,
                 ph, pw, sy_n, sx_n, lanes, block_rows, block_cols, block_lanes, interpret):
  n_lb = pl.cdiv(lanes, block_lanes)
  tile = Tile(planes, n_lb, block_rows, block_cols, band_rows, band_cols)
  lane = _Lanes(block_lanes, lanes, tile.lb, interpret)
  # (The pixels as a column of the tile: their weights broadcast along the lanes in the
  # tile's own layout.)
  r, c = tile.r[:, None], tile.c[:, None]

  def axis_weights(pixel, index_ref, weight_ref, first, n, with_hit):
    """One bin's samples ``first .. first + n - 1`` along one axis: the summed weight of
    their two corners on each pixel's row (or column) ``pixel``, and with ``with_hit``
    whether any lands there (the samples in order, each corner 0 then 1; dead samples
    skipped). A pixel where none lands has weight +0."""
    def sample(s, carry):
      weight, hit = carry
      for corner in (0, 1):
        at = (first + s) * 2 + corner
        on = pixel == index_ref[at]
        weight = weight + jnp.where(on, weight_ref[at], 0.0)
        hit = (hit | on) if with_hit else hit
      return weight, hit

    zeros = (jnp.zeros(pixel.shape, F32), jnp.zeros(pixel.shape, jnp.bool_) if with_hit else None)
    return _over(n, sample, zeros, lambda s: index_ref[(first + s) * 2] >= 0)

  def bin_row(kk, j_first, j_last, finite, i, acc):
    """Bin row ``i`` of box ``kk``: its weight on each pixel's row and its bins' terms
    (``finite``: static, whether the box's cotangents are all finite)."""
    A, hit_a = axis_weights(r, iy_ref, wy_ref, (kk * ph + i) * sy_n, sy_n, not finite)

    def fetch(j):  # bin j's cotangent (j clamped into the range: loaded, maybe unused)
      j = jnp.clip(jnp.minimum(j, j_last), 0, pw - 1)
      return lane.row(ct_ref, (kk * ph + i) * pw + j).astype(F32)

    def one(j, carry):
      acc, ct = carry
      ct_next = fetch(j + 1)  # (issued before this bin's work: its latency overlaps it)
      B, hit_b = axis_weights(c, ix_ref, wx_ref, (kk * pw + j) * sx_n, sx_n, not finite)
      if finite:
        # (A pixel that no live corner of the bin lies on has weight +0 along an axis, so
        # with finite weights and cotangent its term is an exact zero: no change, the sum
        # never being -0. The bits do not depend on the visited bins.)
        acc = multiply_add(A * B, ct, acc, interpret)
      else:  # (a NaN or infinite cotangent reaches only the pixels a live corner lies on)
        acc = acc + jnp.where(hit_a & hit_b, (A * B) * ct, 0.0)
      return acc, ct_next

    return lax.fori_loop(j_first, j_last + 1, one, (acc, fetch(j_first)))[0]

  def add(kk, acc):
    j_first, j_last = tile.bin_columns(cext_ref, kk, pw)

    def rows(finite, acc):
      return tile.bin_rows(rext_ref, kk, ph,
                           functools.partial(bin_row, kk, j_first, j_last, finite), acc)

    return lax.cond(finite_ref[kk] != 0, functools.partial(rows, True),
                    functools.partial(rows, False), acc)

  acc = jnp.zeros((block_rows * block_cols, block_lanes), F32)
  tile.store(o_refs, lane, tile.walk(count_ref, list_ref, ext_ref, n_boxes, add, acc))


def feature_grad(base, iy, ix, wy, wx, ct, *, levels, dtype, interpret: bool, copies: int = 1,
                 want: tuple[int, ...] | None = None, taps=None,
                 taps_kernel=None) -> list[jax.Array]:
  """The form's ``wrt="x"``: the feature gradient of each level in ``want`` (default: all),
  ``(copies * N_l * H_l * W_l, C)`` each in ``dtype``, written by the kernel's programs of that
  level (one call). ``levels`` (``plan.Level``) and ``copies``: the tables ``base`` addresses
  (``copies`` copies of each level one after the other, level by level: ``triton_levels``).
  ``taps``: the max mode's selected samples, with ``taps_kernel`` its kernel
  (``triton_max.grad_kernel``); None: the average."""
  K, ph, sy_n, _ = iy.shape
  pw, sx_n = ix.shape[1:3]
  C = ct.shape[-1]
  want = tuple(range(len(levels))) if want is None else tuple(want)
  shapes = [(copies * levels[p].images * levels[p].height * levels[p].width, C) for p in want]
  if K == 0:
    return [jnp.zeros(s, dtype) for s in shapes]
  rext, cext = extents(iy, 2), extents(ix, 2)  # (K, ph, 2), (K, pw, 2)
  ext_y, ext_x = extents(iy, 3), extents(ix, 3)  # (K, 2)
  ext = jnp.concatenate([ext_y, ext_x], axis=1).astype(I32)  # (K, 4)
  params, count, lists, grid = schedule(
      base, ext, levels, copies, K, K * ph * pw * C, GRAD_ROWS,
      min(GRAD_COLS, _pow2(max(lv.width for lv in levels))), C, want)
  if taps is None:
    body = _grad_kernel
    # Per box: whether its cotangents and weights are all finite (the shorter form's terms).
    per_box = finite_boxes(ct.reshape(K, -1), wy, wx)
  else:
    body = taps_kernel
    per_box = taps.reshape(K * ph * pw, C).astype(I32)
  kernel = functools.partial(body, n_boxes=K, ph=ph, pw=pw, sy_n=sy_n, sx_n=sx_n,
                             lanes=C, interpret=interpret, **params)
  n_ct = math.prod(ct.shape)
  rows = sum(s[0] for s in shapes)
  return list(pl.pallas_call(
      kernel, out_shape=tuple(out_struct(s, dtype, ct) for s in shapes), grid=grid,
      interpret=interpret, name="jaxpool_roi_align_bwd",
      cost_estimate=pl.CostEstimate(flops=4 * n_ct * sy_n * sx_n, transcendentals=0,
                                    bytes_accessed=4 * (n_ct * 2 * sy_n + rows * C)),
      **_call_kwargs(interpret, GRAD_WARPS))(
          count, lists, ext.reshape(-1), rext.reshape(-1).astype(I32),
          cext.reshape(-1).astype(I32),
          iy.reshape(-1).astype(I32), ix.reshape(-1).astype(I32), wy.reshape(-1).astype(F32),
          wx.reshape(-1).astype(F32), per_box, ct.reshape(K * ph * pw, C)))
