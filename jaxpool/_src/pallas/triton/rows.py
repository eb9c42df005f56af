"""The forwards over a block of output rows a program (Pallas Triton): the maximum, with the
taps each window's winning tap, or the average.

A window's maximum (or sum) is separable: the maximum over its planes of the maxima over their
rows of the maxima over each row's column taps. A program of this kernel covers ``rd x rh``
output rows (and a tile of columns and lanes, as ``triton/tile.py``'s programs), reduces each
input row it reads over its column taps once, then the rows of each plane, then the planes, so
the output rows whose windows share an input row (3x3/s2 windows share one row in three) load
and reduce it once, and fewer bytes pass through the L2 cache (which bounds the 3-D forward on
an H200: ``docs/tuning.md``). With ``rd = 0`` a program covers ``rh`` output rows of every
output plane and loops over the planes, carrying the reductions of the input planes that the
next window shares, so each input plane is read once.

The average sums in that order in every launch, one row a program included
(``avg.avg_kernel``), with the taps outside the input masked to zero and the divisor's
reciprocal computed per window (the same number as the one-row kernel's constant inside the
input): every launch gives the same bits.

The maximum does not depend on the order of its operands when each maximum is PTX's
``max.NaN.f32`` (NaN results canonical, ``+0.0`` above ``-0.0``) or an integer maximum, so
there these programs are bit-identical to ``max.max_kernel``'s: the tuner offers blocks
only where that holds (``triton.row_block_candidates``), and a compiled call with another
maximum refuses them. The tap follows ``max_kernel``'s rule (the first tap in row-major order
where the running maximum's bits change), which composes: each stage (a row's columns, a
plane's rows, the planes) runs in the window's order and keeps the first of equal maxima, so
the winner is the first tap, row-major, of the window's maximum. At the edges every index is
clamped into the input: with dilation 1, and every window holding a real tap in each dim, a
clamped tap reads a tap of its own window, which cannot change the maximum; the winner is
counted by its input position, so a copy counts as the real tap it reads (which comes first
among equal values, as ``max_kernel``'s mapping of copies gives).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxpool._src.autodiff import apply_activation
from jaxpool._src.dtypes import accumulator_dtype
from jaxpool._src.pallas.triton.avg import count_reciprocal, reciprocal
from jaxpool._src.pallas.triton.max import bits, compare_dtype, nan_max
from jaxpool._src.pallas.triton.tile import Tile, counted_taps, load, program, split
from jaxpool._src.windows import Geometry


def row_blocks(g: Geometry, block: tuple[int, int]) -> int:
  """The programs' row blocks of ``block = (rd, rh)`` over the output rows (a batch's; ``rd =
  0``: every output plane in one block, looped over)."""
  Do, Ho, _ = g.out_spatial
  return (-(-Do // block[0]) if block[0] else 1) * -(-Ho // block[1])


def shares_planes(g: Geometry) -> bool:
  """Whether consecutive windows of ``g`` share input planes: where a program may loop over
  the output planes (``rd = 0``), carrying them."""
  return g.window[0] > g.strides[0]


def rows_kernel(x_ref, *out_refs, g: Geometry, bw: int, bl: int, lanes: int, nb: int,
                block: tuple[int, int], form: str, interpret: bool, with_taps: bool = False,
                activation: str | None = None, mode: str = "max", include_pad: bool = False,
                divisor: int | None = None, ptx: bool = False):
  """A block of ``rd x rh`` output rows, ``bw`` columns and ``bl`` lanes: ``mode`` "max", the
  maxima (then ``activation``) and with ``with_taps`` each window's winning tap (row-major;
  ``form``: ``nan_max``'s); "avg", the averages (``avg.avg_kernel``'s divisor, sum
  order and ``ptx``). ``nb``: the batches (1 in channels_first).

  ``rd = 0``: the program covers ``rh`` output rows of every output plane and loops over the
  planes, carrying the reductions of the input planes that the next window shares (each input
  plane is read once; with static blocks of ``rd`` planes, once a block)."""
  (D, H, W), (Do, Ho, Wo) = g.in_spatial, g.out_spatial
  rd, rh = block
  k, s, p = g.window, g.strides, g.pad_lo
  blocks, cb, lb = program(nb * row_blocks(g, block), pl.cdiv(Wo, bw), pl.cdiv(lanes, bl),
                           g.channels_last)
  b, dblk, hblk = split(blocks, (-(-Do // rd) if rd else 1, -(-Ho // rh)))
  tile = Tile(bw, lanes, bl, interpret, g.channels_last, lb)
  raw = cb * bw + jnp.arange(bw, dtype=jnp.int32)
  # Columns past the last: clamped copies of it (their stores are masked).
  wo = jnp.minimum(raw, Wo - 1)
  # Each column tap's input columns: clamped into the input, and (the sum's mask) inside it.
  cols = [wo * s[2] - p[2] + j for j in range(k[2])]
  cols_in = [jnp.clip(c, 0, W - 1) for c in cols]
  cols_ok = [tile.cols_of((c >= 0) & (c < W)) for c in cols]
  h0 = hblk * rh * s[1] - p[1]
  avg = mode == "avg"
  acc_t = accumulator_dtype(x_ref.dtype) if avg else compare_dtype(x_ref.dtype)

  def take(best, at, v, v_at):
    """The running reduction ``best`` after ``v``, the next in the window's row-major order:
    a sum; or the maximum and the position ``at`` of its winner, where the maximum's bits
    change ``v`` (at ``v_at``) wins (of equal values the first keeps it)."""
    if best is None:
      return v, v_at
    if avg:
      return best + v, None
    new = nan_max(best, v, form)
    if with_taps:
      at = jnp.where(bits(new) != bits(best), v_at, at)
    return new, at

  def tap(d, h, j):
    """The tile of input plane ``d``, row ``h``, column tap ``j``: for the maximum clamped into
    the input (a tap of the window's own, which cannot change it), for the sum masked (zero)."""
    where = tile.index(b, jnp.clip(d, 0, D - 1), jnp.clip(h, 0, H - 1), cols_in[j])
    if not avg:
      v = load(x_ref, where).astype(acc_t)
      return nan_max(v, v, form) if j == 0 else v  # (a row's first: its NaN made canonical)
    ok = cols_ok[j] & ((d >= 0) & (d < D) & (h >= 0) & (h < H))
    return load(x_ref, where, ok, np.array(0, x_ref.dtype)).astype(acc_t)

  def plane(d):
    """Input plane ``d`` reduced for each of the block's output rows: ``[(the reduction over
    the window's rows of each row's column taps, the maximum's winner or None)]``, the winner
    as ``ht * k[2] + column`` (``ht``: the row's tap; the input column, from which the
    window's first column is taken off at the end)."""
    hm: list[Any] = [None] * rh
    hm_at: list[Any] = [None] * rh
    for t in range((rh - 1) * s[1] + k[1]):  # the block's input rows
      if not any(0 <= t - r * s[1] < k[1] for r in range(rh)):
        continue  # (between windows: a stride past the window)
      h = h0 + t
      wm: Any = None  # this input row's reduction over each window's column taps
      wm_at: Any = None  # (the maximum's input column)
      for j in range(k[2]):
        c_at = jnp.broadcast_to(tile.cols_of(cols_in[j]), tile.shape) if with_taps else None
        wm, wm_at = take(wm, wm_at, tap(d, h, j), c_at)
      for r in range(rh):
        if 0 <= t - r * s[1] < k[1]:
          ht = jnp.clip(h, 0, H - 1) - ((hblk * rh + r) * s[1] - p[1])
          hm[r], hm_at[r] = take(hm[r], hm_at[r], wm,
                                 ht * k[2] + wm_at if with_taps else None)
    return list(zip(hm, hm_at))

  def add_plane(acc, do, d, reduced):
    """``acc`` (each output row's running reduction of output plane ``do``) after input plane
    ``d`` (``reduced``: :func:`plane`'s), the window's next plane."""
    dt = jnp.clip(d, 0, D - 1) - (do * s[0] - p[0])
    return [take(*acc[r], m, dt * (k[1] * k[2]) + m_at if with_taps else None)
            for r, (m, m_at) in enumerate(reduced)]

  first_col = tile.cols_of(wo * s[2] - p[2])

  def store(do, r, m, m_at):
    """Output row ``(do, hblk * rh + r)``: its maxima and taps, or its averages, where it
    exists."""
    ho = hblk * rh + r
    if avg:
      if divisor is not None:
        scale: Any = reciprocal(divisor, acc_t)
      else:
        cnt = counted_taps(g, (do, ho, wo), include_pad, bw)
        scale = tile.cols_of(count_reciprocal(cnt, acc_t, ptx))
      outs = [(out_refs[0], (m * scale).astype(out_refs[0].dtype))]
    else:
      taps = (m_at - first_col).astype(out_refs[1].dtype) if with_taps else None
      val, taps = apply_activation(m, taps, activation)
      outs = [(out_refs[0], val.astype(out_refs[0].dtype))]
      if with_taps:
        outs.append((out_refs[1], taps))
    real = (do < Do) & (ho < Ho)  # (the block's rows past the end are not stored)
    at = tile.index(b, jnp.minimum(do, Do - 1), jnp.minimum(ho, Ho - 1), wo)
    if interpret:  # (stores unmasked: the columns past the end rewrite the last one's value)

      def store_all(at=at, outs=outs):
        for ref, v in outs:
          tile.store(ref, at, v)

      pl.when(real)(store_all)
    else:
      for ref, v in outs:
        tile.store(ref, at, v, (raw < Wo) & real)

  if rd == 0:
    _plane_loop(g, plane, add_plane, store, rh)
    return
  d0 = dblk * rd * s[0] - p[0]
  acc: list[list[Any]] = [[(None, None)] * rh for _ in range(rd)]
  for a in range((rd - 1) * s[0] + k[0]):  # the block's input planes
    if not any(0 <= a - q * s[0] < k[0] for q in range(rd)):
      continue  # (between windows: a stride past the window)
    reduced = plane(d0 + a)
    for q in range(rd):
      if 0 <= a - q * s[0] < k[0]:
        acc[q] = add_plane(acc[q], dblk * rd + q, d0 + a, reduced)
  for q in range(rd):
    for r in range(rh):
      store(dblk * rd + q, r, *acc[q][r])


def _plane_loop(g: Geometry, plane, add_plane, store, rh: int) -> None:
  """Every output plane of a block of ``rh`` rows, one after the other (``rows_kernel`` with
  ``rd = 0``): the window's planes in order, the last ``k - s`` of them (the next window's
  first) carried to the next step."""
  k, s, p = g.window[0], g.strides[0], g.pad_lo[0]
  keep = k - s
  if not shares_planes(g):  # (nothing to carry)
    raise ValueError(f"a loop over the output planes needs windows that share input planes "
                     f"(window > stride along depth), not window {k}, stride {s}")

  def step(do, carried):
    planes = list(carried) + [(do * s - p + a, plane(do * s - p + a)) for a in range(keep, k)]
    acc = [(None, None)] * rh
    for d, reduced in planes:
      acc = add_plane(acc, do, d, reduced)
    for r in range(rh):
      store(do, r, *acc[r])
    return planes[s:]

  first = [jnp.int32(a - p) for a in range(keep)]
  jax.lax.fori_loop(0, g.out_spatial[0], step, [(d, plane(d)) for d in first])
