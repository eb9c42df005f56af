"""The max-pool forward over a block of output rows a program (Pallas Triton): the maximum,
and with the taps each window's winning tap.

A window's maximum is separable: the maximum over its planes of the maxima over their rows of
the maxima over each row's column taps. A program of this kernel covers ``rd x rh`` output rows
(and a tile of columns and lanes, as ``triton_tile.py``'s programs), reduces each input row it
reads over its column taps once, then the rows of each plane, then the planes, so the output
rows whose windows share an input row (3x3/s2 windows share one row in three) load and reduce
it once, and fewer bytes pass through the L2 cache (which bounds the 3-D forward on an H200:
``docs/tuning.md``).

The maximum does not depend on the order of its operands when each maximum is PTX's
``max.NaN.f32`` (NaN results canonical, ``+0.0`` above ``-0.0``) or an integer maximum, so
there these programs are bit-identical to ``triton_max.max_kernel``'s: the tuner offers blocks
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

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpool._src.autodiff import apply_activation
from jaxpool._src.pallas.triton_max import bits, compare_dtype, nan_max
from jaxpool._src.pallas.triton_tile import Tile, load, program, split
from jaxpool._src.windows import Geometry


def row_blocks(g: Geometry, block: tuple[int, int]) -> int:
  """The programs' row blocks of ``block = (rd, rh)`` over the output rows (a batch's)."""
  Do, Ho, _ = g.out_spatial
  return -(-Do // block[0]) * -(-Ho // block[1])


def rows_kernel(x_ref, *out_refs, g: Geometry, bw: int, bl: int, lanes: int, nb: int,
                block: tuple[int, int], form: str, interpret: bool, with_taps: bool = False,
                activation: str | None = None):
  """The maxima (then ``activation``) of a block of ``rd x rh`` output rows, ``bw`` columns
  and ``bl`` lanes, and with ``with_taps`` each window's winning tap (row-major). ``nb``: the
  batches (1 in channels_first); ``form``: ``nan_max``'s."""
  (D, H, W), (Do, Ho, Wo) = g.in_spatial, g.out_spatial
  rd, rh = block
  k, s, p = g.window, g.strides, g.pad_lo
  blocks, cb, lb = program(nb * row_blocks(g, block), pl.cdiv(Wo, bw), pl.cdiv(lanes, bl),
                           g.channels_last)
  b, dblk, hblk = split(blocks, (-(-Do // rd), -(-Ho // rh)))
  tile = Tile(bw, lanes, bl, interpret, g.channels_last, lb)
  raw = cb * bw + jnp.arange(bw, dtype=jnp.int32)
  # Columns past the last: clamped copies of it (their stores are masked).
  wo = jnp.minimum(raw, Wo - 1)
  cols = [jnp.clip(wo * s[2] - p[2] + j, 0, W - 1) for j in range(k[2])]
  d0, h0 = dblk * rd * s[0] - p[0], hblk * rh * s[1] - p[1]
  cmp_t = compare_dtype(x_ref.dtype)

  def take(best, at, v, v_at):
    """The running maximum ``best`` (and the position ``at`` of its winner) after ``v``
    (at ``v_at``), which comes later in the window's row-major order: where the maximum's
    bits change, ``v`` wins (of equal values the first keeps it)."""
    if best is None:
      return v, v_at
    new = nan_max(best, v, form)
    if with_taps:
      at = jnp.where(bits(new) != bits(best), v_at, at)
    return new, at

  # Each output row's maximum and, with the taps, its winner's position in the window: the
  # plane's and the row's tap (``h - the window's first row``) as ``(dt * k[1] + ht) * k[2]``
  # plus the input column (the window's first column is taken off at the end).
  acc: list[list[Any]] = [[None] * rh for _ in range(rd)]
  acc_at: list[list[Any]] = [[None] * rh for _ in range(rd)]
  for a in range((rd - 1) * s[0] + k[0]):  # the block's input planes
    if not any(0 <= a - q * s[0] < k[0] for q in range(rd)):
      continue  # (between windows: a stride past the window)
    d = jnp.clip(d0 + a, 0, D - 1)
    hm: list[Any] = [None] * rh  # each output row's maximum over this plane's rows
    hm_at: list[Any] = [None] * rh
    for t in range((rh - 1) * s[1] + k[1]):  # the block's input rows
      if not any(0 <= t - r * s[1] < k[1] for r in range(rh)):
        continue
      h = jnp.clip(h0 + t, 0, H - 1)
      wm: Any = None  # this input row's maximum over each window's column taps
      wm_at: Any = None  # (its input column)
      for c in cols:
        v = load(x_ref, tile.index(b, d, h, c)).astype(cmp_t)
        c_at = jnp.broadcast_to(tile.cols_of(c), tile.shape) if with_taps else None
        wm, wm_at = take(wm, wm_at, nan_max(v, v, form) if wm is None else v, c_at)
      for r in range(rh):
        if 0 <= t - r * s[1] < k[1]:
          ht = h - ((hblk * rh + r) * s[1] - p[1])
          hm[r], hm_at[r] = take(hm[r], hm_at[r], wm,
                                 ht * k[2] + wm_at if with_taps else None)
    for q in range(rd):
      if 0 <= a - q * s[0] < k[0]:
        dt = d - ((dblk * rd + q) * s[0] - p[0])
        for r in range(rh):
          acc[q][r], acc_at[q][r] = take(acc[q][r], acc_at[q][r], hm[r],
                                         dt * (k[1] * k[2]) + hm_at[r] if with_taps else None)
  first_col = tile.cols_of(wo * s[2] - p[2])
  for q in range(rd):
    for r in range(rh):
      do, ho = dblk * rd + q, hblk * rh + r
      tap = None
      if with_taps:
        tap = (acc_at[q][r] - first_col).astype(out_refs[1].dtype)
      val, tap = apply_activation(acc[q][r], tap, activation)
      real = (do < Do) & (ho < Ho)  # (the block's rows past the end are not stored)
      at = tile.index(b, jnp.minimum(do, Do - 1), jnp.minimum(ho, Ho - 1), wo)
      outs = [(out_refs[0], val.astype(out_refs[0].dtype))]
      if with_taps:
        outs.append((out_refs[1], tap))
      if interpret:  # (stores unmasked: the columns past the end rewrite the last one's value)

        def store(at=at, outs=outs):
          for ref, v in outs:
            tile.store(ref, at, v)

        pl.when(real)(store)
      else:
        for ref, v in outs:
          tile.store(ref, at, v, (raw < Wo) & real)
