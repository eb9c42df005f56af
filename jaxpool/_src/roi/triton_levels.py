"""The feature maps' levels in ROI align's GPU kernels: each level is its own array.

The kernels take the levels' tables (each map ``(N, H, W, C)`` reshaped to ``(N * H * W, C)``,
a free reshape) as separate operands; a box's ``base`` is its first row in their concatenation
(level-major: under ``vmap``, each level's copies one after the other, ``primitive.py``), which
is never formed. A forward or box-gradient program finds its box's level from ``base`` and the
levels' first rows (static) and reads that level's array (:func:`on_level`); the feature
gradient's programs each own a tile of one image of one level and write it into that level's
output (``_planes``), so each level's gradient comes out of the kernel as its own array.

Here also the feature gradient's schedule (``triton.py``): its tiles' programs per level
(:func:`planes`), its cells and their box lists (:func:`cells`, :func:`box_lists`), the
boxes' extents (:func:`extents`, read by :func:`meeting`), and the flags per box that pick a
shorter form of the kernels' terms (:func:`live_boxes`, :func:`finite_boxes`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.pallas.triton.tile import load

I32 = jnp.int32


def on_level(base, starts: tuple[int, ...], fn):
  """``fn(l, base - starts[l])`` for the level ``l`` whose rows hold row ``base`` (the last
  whose first row ``starts[l]`` is at most ``base``): with several levels, a switch over them
  (static: a few), each branch reading its own level's array; the program runs one branch."""
  if len(starts) == 1:
    return fn(0, base)
  level = sum((base >= s).astype(I32) for s in starts[1:])

  def branch(index, b):
    return fn(index, b - starts[index])

  return lax.switch(level, [functools.partial(branch, n) for n in range(len(starts))], base)


def planes(levels, copies: int, band: int, cband: int, group: int, cols: int,
           programs_per_tile: int, want: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
  """Per copy of each level in ``want``, in the order of their programs: (first program,
  height, width, first row in the level's output, first cell, bands per image, column bands,
  row groups per image, column blocks, the output's index in ``want``); a row group is
  ``group`` pixel rows of one image, a column block ``cols`` columns, a cell ``band`` rows (a
  multiple of ``group``) x ``cband`` columns (a multiple of ``cols``) of one image, numbered
  row band by row band, level by level (:func:`box_lists`); each tile (group x block) has
  ``programs_per_tile`` programs (lane blocks). The coarsest level's programs come first: a
  coarse level's boxes cover more of it, so its programs run longest, and the GPU starts them
  while the finer levels' many short ones fill in around them."""
  entries: list[tuple[int, int, int, tuple[int, ...]]] = []
  first_cell = 0
  for index, lv in enumerate(levels):
    bands, cbands = -(-lv.height // band), -(-lv.width // cband)
    groups, blocks = -(-lv.height // group), -(-lv.width // cols)
    for copy in range(copies):
      if index in want:
        entries.append((lv.height * lv.width, len(entries), lv.images * groups * blocks,
                        (lv.height, lv.width, copy * lv.images * lv.height * lv.width,
                         first_cell, bands, cbands, groups, blocks, want.index(index))))
      first_cell += lv.images * bands * cbands
  out, first_program = [], 0
  for _, _, tiles, entry in sorted(entries):
    out.append((first_program, *entry))
    first_program += tiles * programs_per_tile
  return tuple(out)


def extents(idx, axes: int) -> jax.Array:
  """The lowest and highest live corner index along an axis, over the last ``axes`` axes of
  ``idx`` ``(..., 2)`` (an empty range, ``(2**30, -1)``, where none is live)."""
  flat = idx.reshape(*idx.shape[:idx.ndim - axes], -1)
  live = flat >= 0
  lo = jnp.min(jnp.where(live, flat, 2**30), axis=-1, initial=2**30)
  hi = jnp.max(jnp.where(live, flat, -1), axis=-1, initial=-1)
  return jnp.stack([lo, hi], axis=-1)


def cells(levels, copies: int, K: int, budget: int, band: int,
          cband: int) -> tuple[int, int]:
  """The box lists' cells, ``(rows, columns)`` (powers of two, from ``band`` x ``cband``): the
  smallest whose lists, ``cells x K`` entries, fit ``budget``, the rows grown first (or one
  cell per image)."""
  tallest, widest = max(lv.height for lv in levels), max(lv.width for lv in levels)
  while band < tallest or cband < widest:
    count = copies * sum(lv.images * -(-lv.height // band) * -(-lv.width // cband)
                         for lv in levels)
    if count * K <= budget:
      break
    if band < tallest:
      band *= 2
    else:
      cband *= 2
  return band, cband


def box_lists(base, ext, levels, copies: int, band: int, cband: int):
  """Per cell (``band`` rows x ``cband`` columns of one image of one copy of a level;
  :func:`planes`' numbering): how many boxes meet it and their indices, ascending,
  ``(cells,)`` and ``(cells * K,)``: a box meets a cell when it samples that image (level) and
  its live corner rows and columns meet the cell's. ``ext``: ``(K, 4)``, the rows' then the
  columns' extents."""
  firsts, plane, lo, hi, clo, chi = [], [], [], [], [], []
  for lv in levels:  # (the tables' rows in order: level-major, then copies, then images)
    for copy in range(copies):
      for n in range(lv.images):
        firsts.append(copies * lv.offset + (copy * lv.images + n) * lv.height * lv.width)
        for q in range(-(-lv.height // band)):
          for u in range(-(-lv.width // cband)):
            plane.append(len(firsts) - 1)
            lo.append(q * band)
            hi.append(min(lv.height, (q + 1) * band) - 1)
            clo.append(u * cband)
            chi.append(min(lv.width, (u + 1) * cband) - 1)
  # A box's image (level): the last whose first table row is at most its own (as the rows
  # of its samples lie there). (A count of comparisons, not ``searchsorted``, whose default
  # method is a while loop: on a GPU, a round trip to the host per step.)
  starts = jnp.asarray(np.asarray(firsts, np.int32))
  box_plane = jnp.sum(starts[None, :] <= base[:, None], axis=1, dtype=I32) - 1
  col = lambda v: jnp.asarray(np.asarray(v, np.int32))[:, None]  # noqa: E731
  meets = ((box_plane[None, :] == col(plane))
           & (ext[None, :, 0] <= col(hi)) & (ext[None, :, 1] >= col(lo))
           & (ext[None, :, 2] <= col(chi)) & (ext[None, :, 3] >= col(clo)))
  # Each cell's boxes in ascending order: a running count gives each its place, and a write
  # at those places (unique: no two boxes share one) fills the lists; no sort.
  K = ext.shape[0]
  # (A box that misses the cell goes to a place past the list, its own, and is dropped.)
  place = jnp.where(meets, jnp.cumsum(meets, axis=1, dtype=I32) - 1,
                    K + jnp.arange(K, dtype=I32)[None, :])
  n_cells = len(plane)
  rows = jnp.broadcast_to(jnp.arange(n_cells, dtype=I32)[:, None], (n_cells, K))
  boxes = jnp.broadcast_to(jnp.arange(K, dtype=I32)[None, :], (n_cells, K))
  lists = jnp.zeros((n_cells, K), I32).at[rows, place].set(boxes, mode="drop",
                                                            unique_indices=True)
  return jnp.sum(meets, axis=1, dtype=I32), lists.reshape(-1)


def live_boxes(iy, ix) -> jax.Array:
  """Per box, 1 where every corner of every sample is live (no -1 in ``iy`` or ``ix``), else 0
  (``int32``, ``(K,)``)."""
  flat = lambda a: a.reshape(a.shape[0], math.prod(a.shape[1:]))
  return ((jnp.min(flat(iy), axis=1, initial=0) >= 0)
          & (jnp.min(flat(ix), axis=1, initial=0) >= 0)).astype(I32)


def finite_boxes(ct, wy, wx) -> jax.Array:
  """Per box, 1 where its cotangents (``ct`` ``(K, n)``) and its samples' corner weights (``wy``,
  ``wx``, ``K`` first) are all finite, else 0 (``int32``): the boxes whose feature gradient
  may drop the mask of its terms (``triton.py``)."""
  def finite(a):
    return jnp.all(jnp.isfinite(a.reshape(a.shape[0], math.prod(a.shape[1:]))), axis=1)

  return (finite(ct) & finite(wy) & finite(wx)).astype(I32)


def meeting(ext_ref, kk, n, low, high):
  """The first and last of box ``kk``'s ``n`` bins along an axis whose live extent
  (``ext_ref``: per bin, lowest and highest) meets ``[low, high]`` (``n`` and -1: none), read
  in two vector loads of the box's extents (the lowest, the highest)."""
  at = jnp.arange(1 << max(0, (n - 1).bit_length()), dtype=I32)
  bins = jnp.minimum(at, n - 1)
  lo = load(ext_ref, (2 * (kk * n + bins),))
  hi = load(ext_ref, (2 * (kk * n + bins) + 1,))
  on = (lo <= high) & (hi >= low) & (at < n)
  return jnp.min(jnp.where(on, at, n)), jnp.max(jnp.where(on, at, -1))
