"""The max-pool forward without the taps over a block of output rows a program (Pallas Triton).

A window's maximum is separable: the maximum over its planes of the maxima over their rows of
the maxima over each row's column taps. A program of this kernel covers ``rd x rh`` output rows
(and a tile of columns and lanes, as ``triton_tile.py``'s programs), reduces each input row it
reads over its column taps once, then the rows of each plane, then the planes, so the output
rows whose windows share an input row (3x3/s2 windows share one row in three) load and reduce
it once, and fewer bytes pass through the L2 cache (which bounds the 3-D forward on an H200:
``docs/tuning.md``).

The maximum without the taps does not depend on the order of its operands when each maximum
is PTX's ``max.NaN.f32`` (NaN results canonical, ``+0.0`` above ``-0.0``) or an integer
maximum, so there these programs are bit-identical to ``triton_max.max_kernel``'s: the tuner
offers blocks only where that holds (``triton.row_block_candidates``), and a compiled call
with another maximum refuses them. At the edges every index is clamped into the input: with
dilation 1, and every window holding a real tap in each dim, a clamped tap reads a tap of its
own window, which cannot change the maximum.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpool._src.autodiff import apply_activation
from jaxpool._src.pallas.triton_max import compare_dtype, nan_max
from jaxpool._src.pallas.triton_tile import Tile, load, program, split
from jaxpool._src.windows import Geometry


def row_blocks(g: Geometry, block: tuple[int, int]) -> int:
  """The programs' row blocks of ``block = (rd, rh)`` over the output rows (a batch's)."""
  Do, Ho, _ = g.out_spatial
  return -(-Do // block[0]) * -(-Ho // block[1])


def rows_kernel(x_ref, o_ref, *, g: Geometry, bw: int, bl: int, lanes: int, nb: int,
                block: tuple[int, int], form: str, interpret: bool,
                activation: str | None = None):
  """The maxima (then ``activation``) of a block of ``rd x rh`` output rows, ``bw`` columns
  and ``bl`` lanes. ``nb``: the batches (1 in channels_first); ``form``: ``nan_max``'s."""
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
  acc: list[list[Any]] = [[None] * rh for _ in range(rd)]
  for a in range((rd - 1) * s[0] + k[0]):  # the block's input planes
    if not any(0 <= a - q * s[0] < k[0] for q in range(rd)):
      continue  # (between windows: a stride past the window)
    d = jnp.clip(d0 + a, 0, D - 1)
    hm: list[Any] = [None] * rh  # each output row's maximum over this plane's rows
    for t in range((rh - 1) * s[1] + k[1]):  # the block's input rows
      if not any(0 <= t - r * s[1] < k[1] for r in range(rh)):
        continue
      h = jnp.clip(h0 + t, 0, H - 1)
      wm: Any = None  # this input row's maximum over each window's column taps
      for c in cols:
        v = load(x_ref, tile.index(b, d, h, c)).astype(cmp_t)
        wm = nan_max(v, v, form) if wm is None else nan_max(wm, v, form)
      for r in range(rh):
        if 0 <= t - r * s[1] < k[1]:
          hm[r] = wm if hm[r] is None else nan_max(hm[r], wm, form)
    for q in range(rd):
      if 0 <= a - q * s[0] < k[0]:
        for r in range(rh):
          acc[q][r] = hm[r] if acc[q][r] is None else nan_max(acc[q][r], hm[r], form)
  for q in range(rd):
    for r in range(rh):
      do, ho = dblk * rd + q, hblk * rh + r
      val, _ = apply_activation(acc[q][r], None, activation)
      val = val.astype(o_ref.dtype)
      real = (do < Do) & (ho < Ho)  # (the block's rows past the end are not stored)
      at = tile.index(b, jnp.minimum(do, Do - 1), jnp.minimum(ho, Ho - 1), wo)
      if interpret:  # (stores unmasked: the columns past the end rewrite the last one's value)

        def store(at=at, val=val):
          tile.store(o_ref, at, val)

        pl.when(real)(store)
      else:
        tile.store(o_ref, at, val, (raw < Wo) & real)
