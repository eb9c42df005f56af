"""What every GPU kernel (Pallas Triton) shares: the tile of one program, loads and stores
that stay in bounds, and the choice between the interior and the edge code paths.

A program's tile is a block of ``block_cols`` columns and ``block_lanes`` *lanes*: the channels in
``channels_last`` (the operand viewed as ``(B, D, H, W, C)``) or the planes in
``channels_first`` (viewed as ``(P, D, H, W)``). :class:`Tile` holds the lane coordinates and
builds the indexers; ``triton/ops.py`` explains the layout and calls the kernels.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as _plgpu
  plgpu: ModuleType | None = _plgpu
except ImportError:  # pragma: no cover - jaxlib without the Triton backend
  plgpu = None

from jaxpool._src.windows import Geometry, window_count


@functools.cache
def _register_triton_lowering() -> None:
  """Imports Pallas' Triton lowering for ``pallas_call`` before the first kernel is lowered.

  Pallas registers that lowering when its module is first imported, and a ``pallas_call``
  lowered for a GPU before then first tries Mosaic GPU's with jax 0.10 (importing it: 0.2-0.5 s
  of a first call, for kernels that never use it; jax 0.11 tries Triton's first). Importing it
  here lets the lowering find the Triton rule of the kernels' ``CompilerParams`` at once. A jax
  whose module is elsewhere loses only that time."""
  try:
    import jax._src.pallas.triton.pallas_call_registration  # noqa: F401
  except ImportError:  # pragma: no cover - another jax's layout
    pass
  _name_the_triton_dialect_module()


# A module path under which MLIR's Python bindings find the Python module of Triton's dialect.
TRITON_DIALECT_PREFIX = "jaxpool._src.pallas.triton.mlir_dialects"


def _name_the_triton_dialect_module() -> None:
  """Lets MLIR's Python bindings find the Python module of Triton's dialect ("tt") once.

  The bindings look up a Python module for the dialect of each op they build, by the dialect's
  name under their search prefixes (``jaxlib.mlir.dialects``, ...), and, while none is found,
  look again for the next op. Triton's module is ``jaxlib.triton.dialect``, under none of them,
  so every op that Pallas' Triton lowering built tried the prefixes' imports again: thousands of
  failed imports a first call, a sixth of the kernels' lowering time in Python (measured on a
  CPU, jax 0.10; the same program). Naming the module under a prefix of jaxpool's own ends the
  lookups after the first. Where jaxlib has another layout nothing changes but that time."""
  try:
    from jaxlib.mlir._mlir_libs import _mlir
    from jaxlib.triton import dialect
  except ImportError:  # pragma: no cover - jaxlib without the Triton bindings
    return
  sys.modules.setdefault(f"{TRITON_DIALECT_PREFIX}.tt", dialect)
  globals_ = getattr(_mlir, "globals", None)
  if (globals_ is not None and hasattr(globals_, "append_dialect_search_prefix")
      and TRITON_DIALECT_PREFIX not in getattr(globals_, "dialect_search_modules", ())):
    globals_.append_dialect_search_prefix(TRITON_DIALECT_PREFIX)


def compiler_params(num_warps: int) -> dict:
  """The ``pallas_call`` keyword arguments of a compiled Triton kernel: ``num_warps`` warps,
  one pipelining stage (no kernel has a loop that software pipelining would help)."""
  if plgpu is None:  # pragma: no cover - jaxlib without the Triton backend
    return {}
  _register_triton_lowering()
  return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=1)}

# Older Pallas had ``load``/``store`` at the top level; newer jax (and its type hints) has not.
_pl_legacy: ModuleType = pl


class Tile:
  """Lane coordinates of one program's tile and the layout's indexer.

  ``lane`` is clamped, so lanes past the end duplicate the last real one: they compute the same
  value and, in interpret mode (where stores go unmasked, since the interpreter's masked scatter
  would let a masked lane restore an old value), write it again.
  """

  def __init__(self, block_cols: int, lanes: int, block_lanes: int, interpret: bool,
               channels_last: bool, lane_block):
    raw = lane_block * block_lanes + jnp.arange(block_lanes, dtype=jnp.int32)
    exact = lanes % block_lanes == 0
    self.channels_last = channels_last
    self.shape = (block_cols, block_lanes) if channels_last else (block_lanes, block_cols)
    self.lane: Any  # a pl.Slice (compiled, contiguous channels) or an index array
    if channels_last and exact and not interpret:
      # Compiled: a plain slice keeps the channel dim provably contiguous (vector loads).
      self.lane = pl.ds(lane_block * block_lanes, block_lanes)
    else:
      self.lane = jnp.minimum(raw, lanes - 1)
    self.lane_mask = None if exact else self.lanes_of(raw < lanes)
    self.interpret = interpret

  def cols_of(self, vector):
    """A per-column ``(block_cols,)`` vector (or a scalar) laid along the tile's column dim."""
    if jnp.ndim(vector) == 0:
      return vector
    return vector[:, None] if self.channels_last else vector[None, :]

  def lanes_of(self, vector):
    """A per-lane ``(block_lanes,)`` vector laid along the tile's lane dim."""
    return vector[None, :] if self.channels_last else vector[:, None]

  def index(self, batch, depth, height, cols):
    """Indexer for the elements ``(batch, depth, height, cols, lanes)`` of the operand ->
    ``self.shape``."""
    if not self.channels_last:
      assert not isinstance(self.lane, pl.Slice)
      return (self.lane[:, None], depth, height, cols[None, :])
    if isinstance(self.lane, pl.Slice):
      return (batch, depth, height, cols, self.lane)
    return (batch, depth, height, cols[:, None], self.lane[None, :])

  def store(self, ref, where, value, col_mask=None):
    """Stores ``value``; compiled, masked to the real columns (``col_mask``) and lanes."""
    if self.interpret:
      ref[where] = value
      return
    mask = None if col_mask is None else self.cols_of(col_mask)
    if self.lane_mask is not None:
      mask = self.lane_mask if mask is None else (mask & self.lane_mask)
    if plgpu is not None and hasattr(plgpu, "store"):
      plgpu.store(ref.at[where], value, mask=mask)
    else:  # pragma: no cover - older Pallas
      _pl_legacy.store(ref, where, value, mask=mask)


def load(ref, where, mask=None, other=None):
  if plgpu is not None and hasattr(plgpu, "load"):
    return plgpu.load(ref.at[where], mask=mask, other=other)
  return _pl_legacy.load(ref, where, mask=mask, other=other)  # pragma: no cover - older Pallas


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


def both_paths(interior, body: Callable[[bool], None], interpret: bool) -> None:
  """Runs ``body(edge=False)`` where ``interior`` holds (no masks), else ``body(edge=True)``;
  ``interior`` None (every program is interior: :func:`interior_of`): only ``body(False)``.

  (Interpreted, that body still runs inside a ``cond``, of a constant predicate: a kernel body
  outside any ``cond`` failed JAX's check of varying manual axes when interpreted inside a
  ``shard_map`` with ``check_vma=True``, "Primitive gather requires varying manual axes to
  match"; inside one, as the kernels with both paths always run, it passes.)"""
  if interior is None:
    if interpret:
      pl.when(np.bool_(True))(lambda: body(False))
    else:
      body(False)
    return
  pl.when(interior)(lambda: body(False))
  pl.when(jnp.logical_not(interior))(lambda: body(True))


def interior_of(dims) -> Any:
  """Whether a program is interior: the conjunction over ``dims``, each ``(inside, every,
  mine)``, of ``inside(xp, first, last)`` on this program's ``mine = (first, last)`` (traced).
  ``every``: every ``(first, last)`` that a program of the launch can have along the dim, as
  NumPy arrays (the other coordinates of a program, such as its batch and lanes, do not enter
  the test); a dim whose ``inside`` holds on all of them is left out, and where every dim is,
  the result is None (no
  program takes the edge path, whose code is then not built: a valid pool's forward, for one,
  lowers and compiles about half the code)."""
  interior = None
  for inside, every, mine in dims:
    if np.all(inside(np, *every)):
      continue
    holds = inside(jnp, *mine)
    interior = holds if interior is None else interior & holds
  return interior


# A window dim of more taps than this is visited in a loop (:func:`fold`), so a kernel's code
# and its compile time stay the same from there on, whatever the window: a 31-tap stage
# compiles like a 16-tap one. Up to here the taps are straight-line code, which the small
# windows' speed was measured with. (A window of at most ``MAX_TAPS``, 32, taps has at most one
# such dim, all its others of one tap: the large windows' 1-D stages, and 1-D pools.)
LOOP_TAPS = 16
TAPS_PER_TRIP = 8  # taps per trip of such a loop (straight-line code inside a trip)


def loop_dim(geom: Geometry) -> int | None:
  """The dim whose taps the kernels visit in a loop: the window's only dim of more than one tap,
  where it has more than :data:`LOOP_TAPS`; else None (a window with another dim of more than
  one tap has more than ``MAX_TAPS`` taps, which no kernel call takes)."""
  for dim, size in enumerate(geom.window):
    if size > LOOP_TAPS:
      return dim if geom.num_taps == size else None
  return None


def fold(first: int, count: int, step: Callable[[Any, Any], Any], carry: Any) -> Any:
  """``carry = step(t, carry)`` for ``t = first, first + 1, ..., first + count - 1`` in that
  order (``t`` traced): a loop of trips of :data:`TAPS_PER_TRIP` steps, then a loop of one
  step a trip for the rest; the same code for every ``count``."""
  full, rest = divmod(count, TAPS_PER_TRIP)

  def trips(start: int, per_trip: int):
    def trip(i, c):
      for u in range(per_trip):
        c = step(start + i * per_trip + u, c)
      return c
    return trip

  carry = lax.fori_loop(0, full, trips(first, TAPS_PER_TRIP), carry)
  return lax.fori_loop(0, rest, trips(first + full * TAPS_PER_TRIP, 1), carry)


def counted_taps(geom: Geometry, windows, include_pad: bool, block_cols: int):
  """Each window's taps inside the counted region (the input, or the input and its user
  padding with ``include_pad``), a product of one factor per dim: ``(block_cols,)`` int32."""
  count = jnp.ones((block_cols,), jnp.int32)
  for dim, position in enumerate(windows):
    count = count * window_count(geom, dim, position, include_pad, jnp).astype(jnp.int32)
  return count


class OutputRow(NamedTuple):
  """Where a forward program works: its tile, batch (or plane) ``batch``, the output positions
  ``outs = (out_plane, out_row, out_cols)`` of its windows (``out_cols``: ``(block_cols,)``, the
  columns past the last clamped to it), the mask of its real columns (None: all are) and
  whether every tap of every real window lies inside the input (``interior``, a traced
  bool; None where that holds in every program: :func:`interior_of`)."""

  tile: Tile
  batch: Any
  outs: tuple[Any, Any, Any]
  col_mask: Any
  interior: Any


def output_row(geom: Geometry, block_cols: int, block_lanes: int, lanes: int, rows: int,
               interpret: bool) -> OutputRow:
  """The :class:`OutputRow` of this program: one output row (``batch, out_plane, out_row``) of
  ``rows``, ``block_cols`` columns."""
  out_depth, out_height, out_width = geom.out_spatial
  row, col_block, lane_block = program(rows, pl.cdiv(out_width, block_cols),
                                       pl.cdiv(lanes, block_lanes), geom.channels_last)
  batch, out_plane, out_row = split(row, (out_depth, out_height))
  tile = Tile(block_cols, lanes, block_lanes, interpret, geom.channels_last, lane_block)
  first_col = col_block * block_cols
  raw_cols = first_col + jnp.arange(block_cols, dtype=jnp.int32)
  # Lanes past the last column are clamped copies of it (their stores are masked).
  out_cols = jnp.minimum(raw_cols, out_width - 1)
  col_mask = None if out_width % block_cols == 0 else raw_cols < out_width
  # Interior: every tap of every (real) window of the tile lies inside the input.
  def inside(dim):
    def holds(xp, first_window, last_window):
      first = first_window * geom.strides[dim] - geom.pad_lo[dim]
      last = (last_window * geom.strides[dim] + (geom.window[dim] - 1) * geom.dilation[dim]
              - geom.pad_lo[dim])
      return (first >= 0) & (last < geom.in_spatial[dim])
    return holds

  def col_span(xp, first):  # (the block's first and last real output columns)
    return first, xp.minimum(first + block_cols, out_width) - 1

  dims = [(inside(0), (np.arange(out_depth),) * 2, (out_plane, out_plane)),
          (inside(1), (np.arange(out_height),) * 2, (out_row, out_row)),
          (inside(2), col_span(np, np.arange(-(-out_width // block_cols)) * block_cols),
           col_span(jnp, first_col))]
  return OutputRow(tile, batch, (out_plane, out_row, out_cols), col_mask, interior_of(dims))
