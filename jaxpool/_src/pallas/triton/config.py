"""The Triton kernels' launch space, in one place: the launch type and its bounds, the heuristic
launch (:func:`launch_config`), the candidates the tuner times beside it (:func:`candidates`,
the 16-byte and least-waste tiles, the warps, the blocks of rows of
:func:`row_block_candidates` and :func:`backward_block_candidates`), and the form of the max
kernel's running maximum that decides which blocks give the one-row kernel's bits (the
``nan_max`` setting, ``jaxpool/_src/settings.py``).

The tuner (``tuning/``) chooses among these and stores its choices; the calls
(``triton/ops.py``) launch what it chooses. The ``nan_max`` setting and ``platform`` are read
here when a kernel is traced (tests set them with ``settings.override`` and ``monkeypatch``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxpool._src import settings
from jaxpool._src.pallas.triton.backward import interleaves, phase_rows
from jaxpool._src.pallas.triton.max import compare_dtype
from jaxpool._src.pallas.triton.rows import shares_planes
from jaxpool._src.pallas.triton.tile import loop_dim, plgpu
from jaxpool._src.platforms import platform
from jaxpool._src.windows import Geometry, phase_offsets, window_counts_1d

@dataclasses.dataclass(frozen=True, eq=False)
class Launch:
  """One launch of a Triton kernel: a program's tile and warps, and its block of rows.

  ``block_cols`` x ``block_lanes``: the tile (output columns,
  and channels in channels_last or planes in channels_first); ``num_warps``: Triton's warps.
  ``block_depth`` x ``block_height``, or None (the one-row kernels): a program's block of rows,
  in a forward (max with or without its taps, or average; ``triton/rows.py``) output rows,
  ``block_depth = 0`` for ``block_height`` rows of every output plane, looped over; in a
  backward (``triton/backward.py``) blocks of input rows, each block one row per stride phase.

  On disk (the cache's entries, the shipped tables) a launch is its tuple form, a list of three
  or five ints in this order: ``Launch(8, 64, 4)`` is ``[8, 64, 4]``, ``Launch(8, 64, 4, 1, 2)``
  ``[8, 64, 4, 1, 2]``. A launch iterates, indexes, hashes and compares as that tuple, so that
  tuples spelled by hand (tests, benchmarks) name the same launch.
  """

  block_cols: int
  block_lanes: int
  num_warps: int
  block_depth: int | None = None
  block_height: int | None = None

  def __post_init__(self):
    if (self.block_depth is None) != (self.block_height is None):
      raise ValueError(f"a launch's block of rows has a depth and a height or neither, got "
                       f"{self.block_depth!r} x {self.block_height!r}")

  @classmethod
  def of(cls, launch: Launch | Sequence[int]) -> Launch:
    """``launch`` itself, or the launch whose tuple form ``launch`` is (3 or 5 ints)."""
    return launch if isinstance(launch, Launch) else cls(*launch)

  @property
  def rows(self) -> tuple[int, int] | None:
    """``(block_depth, block_height)``, or None for the one-row kernels."""
    if self.block_depth is None or self.block_height is None:
      return None
    return self.block_depth, self.block_height

  def astuple(self) -> tuple[int, ...]:
    """The tuple form (three or five ints), as the JSON on disk lists it."""
    tile = (self.block_cols, self.block_lanes, self.num_warps)
    return tile if self.rows is None else (*tile, *self.rows)

  def __iter__(self) -> Iterator[int]:
    return iter(self.astuple())

  def __len__(self) -> int:
    return len(self.astuple())

  def __getitem__(self, index: Any) -> Any:
    return self.astuple()[index]

  def __eq__(self, other: object) -> bool:
    if isinstance(other, (Launch, tuple)):
      return self.astuple() == tuple(other)
    return NotImplemented

  def __hash__(self) -> int:
    return hash(self.astuple())


def _launches(launches: Iterable[Any]) -> list[Launch]:
  return [Launch.of(v) for v in launches]


MAX_TILE = 8192  # elements: the largest tile a candidate (or the heuristic) has
MAX_WARPS = 32  # Triton's limit
MAX_ROWS = 4  # rows (block_depth x block_height, rd x rh or bd x bh) a program at most


def pow2_ceil(n: int) -> int:
  return 1 << (max(int(n), 1) - 1).bit_length()



# ----------------------------------------------------------------------------- heuristic

def launch_config(width: int, lanes: int, itemsize: int, channels_last: bool) -> Launch:
  """``(bw, bl, num_warps)`` for a kernel over ``width`` columns and ``lanes`` lanes.

  channels_last: whole channel rows up to 512 bytes; columns that pad ``width`` least, from 8
  to 16 (more for narrow channel rows, up to 1024 elements a tile). channels_first: up to 64
  contiguous columns, planes up to 1024 elements a tile. Warps: one thread per 8 bytes of the
  tile, 1 to 8. Sweeps of the alternatives chose it (docs/design/launches.md): small per-thread
  tiles keep the most loads in flight.
  """
  if channels_last:
    bl = min(pow2_ceil(lanes), max(512 // itemsize, 1))
    bw = least_waste(width, min(max(8192 // bl, 1), max(16, 1024 // bl)), least=8)
  else:
    bw = min(pow2_ceil(width), 64)
    bl = min(pow2_ceil(lanes), max(1024 // bw, 1))
  return Launch(bw, bl, warps_for(bw, bl, itemsize, 8))



# ----------------------------------------------------------------------------- kernel forms

def _ptx(interpret: bool) -> bool:
  """Whether the kernels are compiled for an NVIDIA GPU (inline PTX serves), read when they are
  traced."""
  return not interpret and plgpu is not None and platform() == "cuda"


def _max_form(cmp_t, interpret: bool) -> str:
  """The form of ``max.nan_max`` that the max kernel uses (the ``nan_max`` setting: "auto"
  resolved), read when the kernel is traced.

  "auto": PTX's ``max.NaN.f32`` for compiled kernels on an NVIDIA GPU whose floats are
  compared in float32; "beats" for the rest (and for integers in every form); "beats" or
  "canonical" (``beats`` with PTX's NaN results: how interpret-mode tests check the compiled
  kernels' taps of windows holding NaN on a CPU) as set."""
  nan_max = settings.get("nan_max")
  if not jnp.issubdtype(cmp_t, jnp.floating):
    return "beats"
  if nan_max != "auto":
    return nan_max
  return "ptx" if np.dtype(cmp_t) == np.float32 and _ptx(interpret) else "beats"



# ----------------------------------------------------------------------------- candidates

def candidates(heuristic: Launch, cols: int, lanes: int, itemsize: int, channels_last: bool,
               limit: int, extra: Sequence[Launch] = ()) -> list[Launch]:
  """Up to ``limit`` configurations around ``heuristic``, ``heuristic`` first, then
  :func:`sixteen_byte_tiles` (its tile and the tile of half its columns with 16 bytes per
  thread), in channels_last :func:`least_waste_tile`, then the others by how far they are
  from it (fewest changed factors, then smallest changes); then ``extra`` (the forwards'
  blocks of rows, ``triton.row_block_candidates``, or the backwards',
  ``triton.backward_block_candidates``), beyond ``limit``.

  Columns ``bw`` from half to four times the heuristic's (at most the columns rounded up to
  a power of two), lanes ``bl`` from half to twice (at most the lanes so rounded, and 1024
  bytes a channel row in channels_last), warps from half to twice (1 to 8; the 16-byte tiles'
  may be fewer), tiles of at most 8192 elements: all powers of two, as Triton's blocks must be.
  """
  heuristic = Launch.of(heuristic)
  bw0, bl0, w0 = heuristic.block_cols, heuristic.block_lanes, heuristic.num_warps
  top_w, top_l = pow2_ceil(cols), pow2_ceil(lanes)
  if channels_last:
    top_l = min(top_l, max(1024 // itemsize, 1))
  found = []
  for bw in (bw0 // 2, bw0, bw0 * 2, bw0 * 4):
    for bl in (bl0 // 2, bl0, bl0 * 2):
      for warps in (w0 // 2, w0, w0 * 2):
        if not (1 <= bw <= max(top_w, bw0) and 1 <= bl <= max(top_l, bl0) and 1 <= warps <= 8):
          continue
        if bw * bl > MAX_TILE and (bw, bl) != (bw0, bl0):
          continue
        cand = (bw, bl, warps)
        steps = [abs(math.log2(a / b)) for a, b in zip(cand, heuristic, strict=True)]
        found.append(((sum(s > 0 for s in steps), sum(steps), cand), cand))
  found.sort()
  exact = least_waste_tile(cols, bw0, bl0, itemsize) if channels_last else []
  ordered = [tuple(heuristic), *sixteen_byte_tiles(bw0, bl0, itemsize), *exact,
             *(c for _, c in found)]
  return _launches([*list(dict.fromkeys(ordered))[:max(int(limit), 1)], *extra])


def warps_for(bw: int, bl: int, itemsize: int, thread_bytes: int) -> int:
  """The warps (a power of two, 1 to 8) that give each thread about ``thread_bytes`` bytes of a
  ``bw x bl`` tile of ``itemsize``-byte elements (at least that many where 8 warps cap it)."""
  warps = max(bw * bl * itemsize // (thread_bytes * 32), 1)
  return min(1 << (warps.bit_length() - 1), 8)


def sixteen_byte_tiles(bw: int, bl: int, itemsize: int) -> list[Launch]:
  """The tile ``bw x bl`` and the tile of half its columns, each with the warps that give a
  thread 16 bytes of it: one 16-byte load or store a thread and tile, the widest a thread
  issues. (The heuristic gives each thread 8 bytes where 8 warps do not cap it; on an H200 the
  3-D and bfloat16 backwards ran fastest in such smaller programs with 16 bytes per thread:
  ``docs/tuning.md``.)"""
  return _launches((w, bl, warps_for(w, bl, itemsize, 16)) for w in (bw, bw // 2) if w)


def least_waste(width: int, most: int, least: int = 1) -> int:
  """The power-of-two block in ``[least, most]`` (``least`` no more than ``width`` needs), at
  most 128, that pads ``width`` least; the largest on ties."""
  least = min(least, pow2_ceil(width), most)
  best = min((_padded(width, bw), -bw) for bw in (1 << e for e in range(8))
             if least <= bw <= most)
  return -best[1]


def _padded(width: int, block: int) -> int:
  """``width`` rounded up to a multiple of ``block``."""
  return -(-width // block) * block


def least_waste_tile(cols: int, bw: int, bl: int, itemsize: int) -> list[Launch]:
  """Where tiles of ``bw`` columns pad the kernel's ``cols`` (the forwards' output columns,
  the backwards' phase columns), the tile of the columns from ``bw / 4`` (or fewer, as few as
  ``cols`` needs) to ``bw / 2`` that pads them least, if it pads less, with about 16 bytes per
  thread (fewer where one warp is the floor); else none. (28 columns in tiles of 16 or 8 leave
  an eighth of the lanes idle on average, in tiles of 4 none: on an H200 the 3-D forwards over
  28 output columns ran 1-4% faster so, docs/tuning.md.)"""
  w = least_waste(cols, max(bw // 2, 1), max(bw // 4, 1))
  if _padded(cols, w) >= _padded(cols, bw):
    return []
  return [Launch(w, bl, warps_for(w, bl, itemsize, 16))]



def separable(g: Geometry) -> bool:
  """Whether the max forward of ``g`` (lifted to 3-D) may run in blocks of output rows
  (``triton/rows.py``): dilation 1 and every window holding a real tap in each dim, where a
  tap clamped into the input reads a tap of its own window."""
  return all(d == 1 for d in g.dilation) and all(
      bool((window_counts_1d(g, dim, False) > 0).all()) for dim in range(3))


def avg_blocks(g: Geometry) -> bool:
  """Whether the average forward of ``g`` (lifted to 3-D) may run in blocks of output rows:
  dilation 1 (each block reads whole rows; the sums' order is the one-row kernel's)."""
  return all(d == 1 for d in g.dilation)


def _blocks_exact(g: Geometry, dtype, interpret: bool) -> bool:
  """Whether blocks of output rows give the one-row kernel's bits for the max forward of
  ``g`` in ``dtype``: :func:`separable`, and compiled a maximum whose bits do not depend on
  the order: PTX's ``max.NaN.f32`` (NaN results canonical, ``+0.0`` above ``-0.0``) or an
  integer maximum. (Interpret mode, for tests, runs any block; a NaN's payload may differ.)"""
  if not separable(g):
    return False
  cmp_t = compare_dtype(dtype)
  return (interpret or bool(jnp.issubdtype(cmp_t, jnp.integer))
          or _max_form(cmp_t, interpret) == "ptx")


def row_block_candidates(heuristic: Launch, g: Geometry, dtype, op: str = "max_fwd"
                         ) -> list[Launch]:
  """The forward's launches over blocks of output rows that the tuner tries beside the
  one-row ones, where windows share input rows.

  The max forward (with or without the taps, ``op`` "max_fwd" or "argmax_fwd"), where every
  block gives the one-row kernel's bits compiled (:func:`_blocks_exact`): ``1 x 2`` rows with
  the heuristic's tile and with half its lanes, and ``2 x 2`` (output planes that share input
  planes) or ``1 x 4`` with half its columns and lanes (each row of a block keeps a tile of
  maxima, and of taps). The average forward ("avg_fwd", :func:`avg_blocks`): ``1 x 2`` rows
  with the heuristic's tile. Both, where output planes share input planes: ``2`` rows of every
  output plane, looped over (``rd = 0``: each input plane read once), with the heuristic's tile,
  with half its columns and warps and, in channels_last, with the columns of
  :func:`least_waste_tile` and its lanes or half of them, about 16 bytes a thread (with
  the taps, the first two also with half their lanes, and one row of every output plane with
  the heuristic's tile: each row holds a tile of taps beside its maxima)."""
  Do, Ho, _ = g.out_spatial
  shared = g.window[0] > g.strides[0] or g.window[1] > g.strides[1]  # rows read twice
  fits = avg_blocks(g) if op == "avg_fwd" else _blocks_exact(g, dtype, False)
  if not fits or Ho < 2 or not shared or loop_dim(g) is not None:
    return []  # (a dim of many taps: the one-row kernel's loop, whose code does not grow)
  heuristic = Launch.of(heuristic)
  bw, bl, warps = heuristic.block_cols, heuristic.block_lanes, heuristic.num_warps
  half_bw, half_bl = max(bw // 2, 1), max(bl // 2, 1)
  planes = Do > 1 and shares_planes(g)  # (output planes sharing input planes)
  exact = [(*tile, 0, 2) for lanes in (bl, half_bl)
           for tile in least_waste_tile(g.out_spatial[2], bw, lanes,
                                               np.dtype(dtype).itemsize)] if g.channels_last else []
  loops = [(bw, bl, warps, 0, 2), (half_bw, bl, max(warps // 2, 1), 0, 2),
           *exact] if planes else []
  if planes and op == "argmax_fwd":  # (a tile of taps beside the maxima: half the lanes too,
    # and one row of every plane)
    loops += [(bw, half_bl, warps, 0, 2), (half_bw, half_bl, max(warps // 2, 1), 0, 2),
              (bw, bl, warps, 0, 1)]
  if op == "avg_fwd":
    return _launches(dict.fromkeys([(bw, bl, warps, 1, 2), *loops]))
  four = (half_bw, half_bl, warps, 2, 2) if planes else (half_bw, half_bl, warps, 1, 4)
  return _launches(dict.fromkeys([(bw, bl, warps, 1, 2), (bw, half_bl, warps, 1, 2), four,
                                  *loops]))


def backward_block_candidates(heuristic: Launch, g: Geometry, itemsize: int) -> list[Launch]:
  """The backward's launches over blocks of rows that the tuner tries beside the one-block
  ones, where neighbouring blocks read the same cotangent rows (windows that overlap in height)
  and a block reads at most :data:`BLOCK_TILES` tiles: ``1 x 2`` blocks with the heuristic's
  tile and with half its lanes, ``2 x 2`` (windows that overlap in depth too) or ``1 x 4``
  with half its lanes, and ``1 x 2`` blocks of the heuristic's tile and of half its columns
  with 16 bytes per thread (:func:`sixteen_byte_tiles`; ``itemsize``: the cotangents').
  Every block gives the same bits (each element's sum is the same, in the same order)."""
  depth, height = phase_rows(g)
  if height < 2 or len(phase_offsets(g, 1)) < 2 or _block_tiles(g) > BLOCK_TILES:
    return []
  heuristic = Launch.of(heuristic)
  bw, bl, warps = heuristic.block_cols, heuristic.block_lanes, heuristic.num_warps
  half_bl = max(bl // 2, 1)
  planes = depth > 1 and len(phase_offsets(g, 0)) > 1
  four = (bw, half_bl, warps, 2, 2) if planes else (bw, half_bl, warps, 1, 4)
  sixteen = [(*tile, 1, 2) for tile in sixteen_byte_tiles(bw, bl, itemsize)]
  return _launches(dict.fromkeys([(bw, bl, warps, 1, 2), (bw, half_bl, warps, 1, 2), four,
                                  *sixteen]))


# The most tiles (of cotangents, and of taps) one block of the backward's rows may read for the
# tuner to offer blocks: a 3x3/s2 pool reads 4, a 3x3x3/s2 one 8, where every block ran slower
# than one block a program on an H100 and an H200 (a program of 2 x 2 such blocks sums 32
# phases) and took seconds more to compile (docs/design/max-backward.md).
BLOCK_TILES = 4


def _block_tiles(g: Geometry) -> int:
  """The tiles one block of the backward's rows reads (each column tap's own, in channels_first
  with a stride that does not interleave)."""
  cols = (len(phase_offsets(g, 2)) if g.channels_last or interleaves(g.strides[2])
          else g.window[2])
  return len(phase_offsets(g, 0)) * len(phase_offsets(g, 1)) * cols


