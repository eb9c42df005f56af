"""The forwards over a block of output rows a program (Pallas Triton): the maximum, with the
taps each window's winning tap, or the average.

A window's maximum (or sum) is separable: the maximum over its planes of the maxima over their
rows of the maxima over each row's column taps. A program of this kernel covers ``block_depth
x block_height`` output rows (and a tile of columns and lanes, as ``triton/tile.py``'s
programs), reduces each input row it reads over its column taps once, then the rows of each
plane, then the planes, so the output rows whose windows share an input row (3x3/s2 windows
share one row in three) load and reduce it once, and fewer bytes pass through the L2 cache
(which bounds the 3-D forward on an H200: ``docs/tuning.md``). With ``block_depth = 0`` a
program covers ``block_height`` output rows of every output plane and loops over the planes,
carrying the reductions of the input planes that the next window shares, so each input plane
is read once.

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

from jaxpool._src.api_args import Activation
from jaxpool._src.autodiff import apply_activation
from jaxpool._src.dtypes import accumulator_dtype
from jaxpool._src.pallas.triton.avg import count_reciprocal, reciprocal
from jaxpool._src.pallas.triton.max import bits, compare_dtype, nan_max
from jaxpool._src.pallas.triton.tile import Tile, counted_taps, load, program, split
from jaxpool._src.pallas.types import MaxForm, PoolKind
from jaxpool._src.windows import Geometry


def row_blocks(geom: Geometry, block: tuple[int, int]) -> int:
  """The programs' row blocks of ``block = (block_depth, block_height)`` over the output rows
  (a batch's; ``block_depth = 0``: every output plane in one block, looped over)."""
  out_depth, out_height, _ = geom.out_spatial
  return (-(-out_depth // block[0]) if block[0] else 1) * -(-out_height // block[1])


def shares_planes(geom: Geometry) -> bool:
  """Whether consecutive windows of ``geom`` share input planes: where a program may loop over
  the output planes (``block_depth = 0``), carrying them."""
  return geom.window[0] > geom.strides[0]


def rows_kernel(x_ref, *out_refs, geom: Geometry, block_cols: int, block_lanes: int, lanes: int,
                n_batch: int, block: tuple[int, int], form: MaxForm, interpret: bool,
                with_taps: bool = False, activation: Activation = None, mode: PoolKind = "max",
                include_pad: bool = False, divisor: int | None = None, ptx: bool = False):
  """A block of ``block_depth x block_height`` output rows (``block``), ``block_cols`` columns
  and ``block_lanes`` lanes: ``mode`` "max", the maxima (then ``activation``) and with
  ``with_taps`` each window's winning tap (row-major; ``form``: ``nan_max``'s); "avg", the
  averages (``avg.avg_kernel``'s divisor, sum order and ``ptx``). ``n_batch``: the batches (1
  in channels_first).

  ``block_depth = 0``: the program covers ``block_height`` output rows of every output plane
  and loops over the planes, carrying the reductions of the input planes that the next window
  shares (each input plane is read once; with static blocks of ``block_depth`` planes, once a
  block)."""
  (depth, height, width), (out_depth, out_height, out_width) = geom.in_spatial, geom.out_spatial
  block_depth, block_height = block
  window, strides, pad_lo = geom.window, geom.strides, geom.pad_lo
  blocks, col_block, lane_block = program(n_batch * row_blocks(geom, block),
                                          pl.cdiv(out_width, block_cols),
                                          pl.cdiv(lanes, block_lanes), geom.channels_last)
  depth_blocks = -(-out_depth // block_depth) if block_depth else 1
  batch, depth_block, height_block = split(blocks, (depth_blocks, -(-out_height // block_height)))
  tile = Tile(block_cols, lanes, block_lanes, interpret, geom.channels_last, lane_block)
  raw_cols = col_block * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
  # Columns past the last: clamped copies of it (their stores are masked).
  out_cols = jnp.minimum(raw_cols, out_width - 1)
  # Each column tap's input columns: clamped into the input, and (the sum's mask) inside it.
  cols = [out_cols * strides[2] - pad_lo[2] + col_tap for col_tap in range(window[2])]
  cols_in = [jnp.clip(col, 0, width - 1) for col in cols]
  cols_ok = [tile.cols_of((col >= 0) & (col < width)) for col in cols]
  first_row = height_block * block_height * strides[1] - pad_lo[1]
  avg = mode == "avg"
  acc_t = accumulator_dtype(x_ref.dtype) if avg else compare_dtype(x_ref.dtype)

  def take(best, best_at, value, value_at):
    """The running reduction ``best`` after ``value``, the next in the window's row-major
    order: a sum; or the maximum and the position ``best_at`` of its winner, where the
    maximum's bits change ``value`` (at ``value_at``) wins (of equal values the first keeps
    it)."""
    if best is None:
      return value, value_at
    if avg:
      return best + value, None
    new = nan_max(best, value, form)
    if with_taps:
      best_at = jnp.where(bits(new) != bits(best), value_at, best_at)
    return new, best_at

  def tap(in_plane, in_row, col_tap):
    """The tile of input plane ``in_plane``, row ``in_row``, column tap ``col_tap``: for the
    maximum clamped into the input (a tap of the window's own, which cannot change it), for the
    sum masked (zero)."""
    where = tile.index(batch, jnp.clip(in_plane, 0, depth - 1), jnp.clip(in_row, 0, height - 1),
                       cols_in[col_tap])
    if not avg:
      value = load(x_ref, where).astype(acc_t)
      # (a row's first: its NaN made canonical)
      return nan_max(value, value, form) if col_tap == 0 else value
    valid = cols_ok[col_tap] & ((in_plane >= 0) & (in_plane < depth) & (in_row >= 0)
                                & (in_row < height))
    return load(x_ref, where, valid, np.array(0, x_ref.dtype)).astype(acc_t)

  def plane(in_plane):
    """Input plane ``in_plane`` reduced for each of the block's output rows: ``[(the reduction
    over the window's rows of each row's column taps, the maximum's winner or None)]``, the
    winner as ``row_tap * window[2] + column`` (``row_tap``: the row's tap; the input column,
    from which the window's first column is taken off at the end)."""
    by_row: list[Any] = [None] * block_height
    by_row_at: list[Any] = [None] * block_height
    for row_offset in range((block_height - 1) * strides[1] + window[1]):  # the input rows
      if not any(0 <= row_offset - block_row * strides[1] < window[1]
                 for block_row in range(block_height)):
        continue  # (between windows: a stride past the window)
      in_row = first_row + row_offset
      row_red: Any = None  # this input row's reduction over each window's column taps
      row_red_at: Any = None  # (the maximum's input column)
      for col_tap in range(window[2]):
        col_at = (jnp.broadcast_to(tile.cols_of(cols_in[col_tap]), tile.shape) if with_taps
                  else None)
        row_red, row_red_at = take(row_red, row_red_at, tap(in_plane, in_row, col_tap), col_at)
      for block_row in range(block_height):
        if 0 <= row_offset - block_row * strides[1] < window[1]:
          out_row = height_block * block_height + block_row
          row_tap = jnp.clip(in_row, 0, height - 1) - (out_row * strides[1] - pad_lo[1])
          by_row[block_row], by_row_at[block_row] = take(
              by_row[block_row], by_row_at[block_row], row_red,
              row_tap * window[2] + row_red_at if with_taps else None)
    return list(zip(by_row, by_row_at, strict=True))

  def add_plane(acc, out_plane, in_plane, reduced):
    """``acc`` (each output row's running reduction of output plane ``out_plane``) after input
    plane ``in_plane`` (``reduced``: :func:`plane`'s), the window's next plane."""
    plane_tap = jnp.clip(in_plane, 0, depth - 1) - (out_plane * strides[0] - pad_lo[0])
    return [take(*acc[block_row], reduction,
                 plane_tap * (window[1] * window[2]) + reduction_at if with_taps else None)
            for block_row, (reduction, reduction_at) in enumerate(reduced)]

  first_col = tile.cols_of(out_cols * strides[2] - pad_lo[2])

  def store(out_plane, block_row, reduction, reduction_at):
    """Output row ``(out_plane, height_block * block_height + block_row)``: its maxima and
    taps, or its averages, where it exists."""
    out_row = height_block * block_height + block_row
    if avg:
      if divisor is not None:
        scale: Any = reciprocal(divisor, acc_t)
      else:
        counts = counted_taps(geom, (out_plane, out_row, out_cols), include_pad, block_cols)
        scale = tile.cols_of(count_reciprocal(counts, acc_t, ptx))
      outs = [(out_refs[0], (reduction * scale).astype(out_refs[0].dtype))]
    else:
      taps = (reduction_at - first_col).astype(out_refs[1].dtype) if with_taps else None
      maxima, taps = apply_activation(reduction, taps, activation)
      outs = [(out_refs[0], maxima.astype(out_refs[0].dtype))]
      if with_taps:
        outs.append((out_refs[1], taps))
    real = (out_plane < out_depth) & (out_row < out_height)  # (rows past the end: not stored)
    out_at = tile.index(batch, jnp.minimum(out_plane, out_depth - 1),
                        jnp.minimum(out_row, out_height - 1), out_cols)
    if interpret:  # (stores unmasked: the columns past the end rewrite the last one's value)

      def store_all(out_at=out_at, outs=outs):
        for ref, value in outs:
          tile.store(ref, out_at, value)

      pl.when(real)(store_all)
    else:
      for ref, value in outs:
        tile.store(ref, out_at, value, (raw_cols < out_width) & real)

  if block_depth == 0:
    _plane_loop(geom, plane, add_plane, store, block_height)
    return
  first_plane = depth_block * block_depth * strides[0] - pad_lo[0]
  acc: list[list[Any]] = [[(None, None)] * block_height for _ in range(block_depth)]
  for plane_offset in range((block_depth - 1) * strides[0] + window[0]):  # the input planes
    if not any(0 <= plane_offset - block_plane * strides[0] < window[0]
               for block_plane in range(block_depth)):
      continue  # (between windows: a stride past the window)
    reduced = plane(first_plane + plane_offset)
    for block_plane in range(block_depth):
      if 0 <= plane_offset - block_plane * strides[0] < window[0]:
        acc[block_plane] = add_plane(acc[block_plane], depth_block * block_depth + block_plane,
                                     first_plane + plane_offset, reduced)
  for block_plane in range(block_depth):
    for block_row in range(block_height):
      store(depth_block * block_depth + block_plane, block_row, *acc[block_plane][block_row])


def _plane_loop(geom: Geometry, plane, add_plane, store, block_height: int) -> None:
  """Every output plane of a block of ``block_height`` rows, one after the other
  (``rows_kernel`` with ``block_depth = 0``): the window's planes in order, the last
  ``depth_window - depth_stride`` of them (the next window's first) carried to the next
  step."""
  depth_window, depth_stride, depth_pad = geom.window[0], geom.strides[0], geom.pad_lo[0]
  carry = depth_window - depth_stride
  if not shares_planes(geom):  # (nothing to carry)
    raise ValueError(f"a loop over the output planes needs windows that share input planes "
                     f"(window > stride along depth), not window {depth_window}, "
                     f"stride {depth_stride}")

  def step(out_plane, carried):
    planes = list(carried) + [(out_plane * depth_stride - depth_pad + offset,
                               plane(out_plane * depth_stride - depth_pad + offset))
                              for offset in range(carry, depth_window)]
    acc = [(None, None)] * block_height
    for in_plane, reduced in planes:
      acc = add_plane(acc, out_plane, in_plane, reduced)
    for block_row in range(block_height):
      store(out_plane, block_row, *acc[block_row])
    return planes[depth_stride:]

  first = [jnp.int32(offset - depth_pad) for offset in range(carry)]
  jax.lax.fori_loop(0, geom.out_spatial[0], step,
                    [(in_plane, plane(in_plane)) for in_plane in first])
