"""What every GPU kernel (Pallas Triton) shares: the tile of one program, loads and stores
that stay in bounds, and the choice between the interior and the edge code paths.

A program's tile is a block of ``bw`` columns and ``bl`` *lanes*: the channels in
``channels_last`` (the operand viewed as ``(B, D, H, W, C)``) or the planes in
``channels_first`` (viewed as ``(P, D, H, W)``). :class:`Tile` holds the lane coordinates and
builds the indexers; ``triton/ops.py`` explains the layout and calls the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as _plgpu
  plgpu: ModuleType | None = _plgpu
except ImportError:  # pragma: no cover - jaxlib without the Triton backend
  plgpu = None

from jaxpool._src.windows import Geometry, window_count

# Older Pallas had ``load``/``store`` at the top level; newer jax (and its type hints) has not.
_pl_legacy: ModuleType = pl


class Tile:
  """Lane coordinates of one program's tile and the layout's indexer.

  ``lane`` is clamped, so lanes past the end duplicate the last real one: they compute the same
  value and, in interpret mode (where stores go unmasked, since the interpreter's masked scatter
  would let a masked lane restore an old value), write it again.
  """

  def __init__(self, bw: int, lanes: int, bl: int, interpret: bool, channels_last: bool,
               lane_block):
    raw = lane_block * bl + jnp.arange(bl, dtype=jnp.int32)
    exact = lanes % bl == 0
    self.channels_last = channels_last
    self.shape = (bw, bl) if channels_last else (bl, bw)
    self.lane: Any  # a pl.Slice (compiled, contiguous channels) or an index array
    if channels_last and exact and not interpret:
      # Compiled: a plain slice keeps the channel dim provably contiguous (vector loads).
      self.lane = pl.ds(lane_block * bl, bl)
    else:
      self.lane = jnp.minimum(raw, lanes - 1)
    self.lane_mask = None if exact else self.lanes_of(raw < lanes)
    self.interpret = interpret

  def cols_of(self, v):
    """A per-column ``(bw,)`` vector (or a scalar) laid along the tile's column dim."""
    if jnp.ndim(v) == 0:
      return v
    return v[:, None] if self.channels_last else v[None, :]

  def lanes_of(self, v):
    """A per-lane ``(bl,)`` vector laid along the tile's lane dim."""
    return v[None, :] if self.channels_last else v[:, None]

  def index(self, b, d, h, cols):
    """Indexer for the elements ``(b, d, h, cols, lanes)`` of the operand -> ``self.shape``."""
    if not self.channels_last:
      assert not isinstance(self.lane, pl.Slice)
      return (self.lane[:, None], d, h, cols[None, :])
    if isinstance(self.lane, pl.Slice):
      return (b, d, h, cols, self.lane)
    return (b, d, h, cols[:, None], self.lane[None, :])

  def store(self, ref, idx, val, col_mask=None):
    """Stores ``val``; compiled, masked to the real columns (``col_mask``) and lanes."""
    if self.interpret:
      ref[idx] = val
      return
    mask = None if col_mask is None else self.cols_of(col_mask)
    if self.lane_mask is not None:
      mask = self.lane_mask if mask is None else (mask & self.lane_mask)
    if plgpu is not None and hasattr(plgpu, "store"):
      plgpu.store(ref.at[idx], val, mask=mask)
    else:  # pragma: no cover - older Pallas
      _pl_legacy.store(ref, idx, val, mask=mask)


def load(ref, idx, mask=None, other=None):
  if plgpu is not None and hasattr(plgpu, "load"):
    return plgpu.load(ref.at[idx], mask=mask, other=other)
  return _pl_legacy.load(ref, idx, mask=mask, other=other)  # pragma: no cover - older Pallas


def grid(rows: int, col_blocks: int, lane_blocks: int) -> tuple[int, ...]:
  """The launch grid of a kernel over ``rows`` rows (``b, d, h``), ``col_blocks`` blocks of
  columns and ``lane_blocks`` blocks of lanes: one program a tile, numbered by :func:`program`."""
  return (rows * col_blocks * lane_blocks,)


def program(rows: int, col_blocks: int, lane_blocks: int, channels_last: bool):
  """This program's ``(row, column block, lane block)``.

  Programs run roughly in the order of their number, so consecutive numbers go to neighbours
  in memory: in channels_last (``(B, D, H, W, C)``) the lane blocks of a column block, then the
  column blocks of a row, then the rows; in channels_first (``(P, D, H, W)``) the column blocks
  of a row, then the rows of a plane block, then the plane (lane) blocks. Consecutive programs
  then read and write consecutive stretches of memory. (With the rows running fastest, the
  3x3/s2 channels_last kernels took 6-8% longer on an H100: ``docs/tuning.md``.)"""
  pid = pl.program_id(0)
  if channels_last:
    row, cb, lb = split(pid, (col_blocks, lane_blocks))
  else:
    lb, row, cb = split(pid, (rows, col_blocks))
  return row, cb, lb


def split(pid, sizes):
  """``pid`` -> (its quotient by ``prod(sizes)``, *its row-major coordinates over ``sizes``)."""
  coords = []
  for n in reversed(sizes):
    coords.append(pid % n)
    pid = pid // n
  return (pid, *reversed(coords))


def both_paths(interior, body: Callable[[bool], None]) -> None:
  """Runs ``body(edge=False)`` where ``interior`` holds (no masks), else ``body(edge=True)``."""
  pl.when(interior)(lambda: body(False))
  pl.when(jnp.logical_not(interior))(lambda: body(True))


def counted_taps(g: Geometry, wins, include_pad: bool, bw: int):
  """Each window's taps inside the counted region (the input, or the input and its user
  padding with ``include_pad``), a product of one factor per dim: ``(bw,)`` int32."""
  cnt = jnp.ones((bw,), jnp.int32)
  for dim, o in enumerate(wins):
    cnt = cnt * window_count(g, dim, o, include_pad, jnp).astype(jnp.int32)
  return cnt


class OutputRow(NamedTuple):
  """Where a forward program works: its tile, batch (or plane) ``b``, the output positions
  ``outs = (do, ho, wo)`` of its windows (``wo``: ``(bw,)``, the columns past the last clamped
  to it), the mask of its real columns (None: all are) and whether every tap of every real
  window lies inside the input (``interior``, a traced bool)."""

  tile: Tile
  b: Any
  outs: tuple[Any, Any, Any]
  col_mask: Any
  interior: Any


def output_row(g: Geometry, bw: int, bl: int, lanes: int, rows: int,
               interpret: bool) -> OutputRow:
  """The :class:`OutputRow` of this program: one output row (``b, do, ho``) of ``rows``,
  ``bw`` columns."""
  Do, Ho, Wo = g.out_spatial
  row, cb, lb = program(rows, pl.cdiv(Wo, bw), pl.cdiv(lanes, bl), g.channels_last)
  b, do, ho = split(row, (Do, Ho))
  tile = Tile(bw, lanes, bl, interpret, g.channels_last, lb)
  w0 = cb * bw
  raw_wo = w0 + jnp.arange(bw, dtype=jnp.int32)
  # Lanes past the last column are clamped copies of it (their stores are masked).
  wo = jnp.minimum(raw_wo, Wo - 1)
  col_mask = None if Wo % bw == 0 else raw_wo < Wo
  # Interior: every tap of every (real) window of the tile lies inside the input.
  interior = None
  for dim, first_win, last_win in ((0, do, do), (1, ho, ho), (2, w0, jnp.minimum(w0 + bw, Wo) - 1)):
    first = first_win * g.strides[dim] - g.pad_lo[dim]
    last = last_win * g.strides[dim] + (g.window[dim] - 1) * g.dilation[dim] - g.pad_lo[dim]
    inside = (first >= 0) & (last < g.in_spatial[dim])
    interior = inside if interior is None else interior & inside
  return OutputRow(tile, b, (do, ho, wo), col_mask, interior)
