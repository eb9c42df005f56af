"""The backward kernel for GPUs (Pallas Triton): max- and average-pool gradients as gathers.

Each input element visits, in a fixed order, the taps of the windows that can hold it, and sums
the cotangents of those that chose it (max pooling, from the forward's winning taps) or their
share ``dy / divisor`` (average pooling): no atomics, the same bits on every run. The program
layout and the tile are ``triton/tile.py``'s; ``triton/ops.py`` launches the kernel.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxpool._src.dtypes import accumulator_dtype
from jaxpool._src.pallas.triton.tile import (
    Tile,
    both_paths,
    counted_taps,
    fold,
    interior_of,
    load,
    loop_dim,
    plgpu,
    program,
    split,
)
from jaxpool._src.pallas.types import PoolKind
from jaxpool._src.windows import Geometry, phase_offsets, phase_taps


def backward_kernel(*refs, geom: Geometry, block_cols: int, block_lanes: int, lanes: int,
                    rows: int, n_cols: int, mode: PoolKind, include_pad: bool,
                    divisor: int | None, interpret: bool, block: tuple[int, int] = (1, 1),
                    packed: bool = False):
  """``dx`` for a block of ``s_d x s_h`` input rows and ``s_w * block_cols`` (channels_last) or
  ``block_cols`` (channels_first) columns, phase by phase; with ``block = (block_depth,
  block_height)``, for ``block_depth x block_height`` such blocks of rows.

  The input element ``(m_d s_d + r_d, m_h s_h + r_h, m s_w + r_w)`` lies at tap ``(a, i, j)`` of
  window ``(m_d + q_d, m_h + q_h, m + q_w)`` exactly when ``r + lo - tap * d = q * s`` in every
  dim: for a fixed phase ``r`` the taps that can hold it and the offsets ``q`` are static, and
  each tap's windows are a contiguous run over ``m``. (``rows`` and ``n_cols``: the launch's
  blocks of rows, ``batch x ceil(ceil(D / s_d) / block_depth) x ceil(ceil(H / s_h) /
  block_height)``, and its columns,
  over which :func:`tile.program` numbers the programs.) So each phase reads only the
  taps that matter, as whole tiles (each loaded once for all the phases of the program's blocks
  that read it: neighbouring blocks of rows share the windows' rows where windows overlap), and
  sums them in descending tap order: the order in which JAX's transpose of the XLA path's tap
  gather adds them (the skipped taps add exact zeros there), so max-pool gradients have the
  same bits on both paths. In channels_first the columns are the
  contiguous dim, so a block is a run of input columns (stored whole) and the column phase is
  per lane: every column tap is visited, masked to the lanes it can hold.

  A max pool's dim of more than ``tile.LOOP_TAPS`` taps at stride 1 (one phase, one block) visits
  its taps in a loop (``tile.fold``), in the same order.

  ``packed`` (max pooling of 16-bit floats, compiled for an NVIDIA GPU, each thread holding an
  even number of a tile's elements): each tap's select runs on pairs of lanes (:func:`pick16`)
  instead of one lane at a time; the same bits.

  Average pooling divides each cotangent by its window's divisor, computed on both code paths
  alike. (A multiply by the reciprocal, as the forward does, would let the compilers contract
  it with the sum's add into a fused multiply-add where the edge path's select does not come
  between them: a division keeps both paths' bits equal.)
  """
  if mode == "max":
    idx_ref, dy_ref, dx_ref = refs
  else:
    dy_ref, dx_ref = refs
  (depth, height, width), (out_depth, out_height, out_width) = geom.in_spatial, geom.out_spatial
  phase_counts = [-(-size // stride)
                  for size, stride in zip(geom.in_spatial, geom.strides, strict=True)]
  block_depth, block_height = block
  row, col_block, lane_block = program(rows, pl.cdiv(n_cols, block_cols),
                                       pl.cdiv(lanes, block_lanes), geom.channels_last)
  batch, m_depth, m_height = split(row, block_rows(geom, block))
  # The first block's phase rows (blocks past the end: masked).
  m_depth, m_height = m_depth * block_depth, m_height * block_height
  tile = Tile(block_cols, lanes, block_lanes, interpret, geom.channels_last, lane_block)
  first_col = col_block * block_cols
  raw_cols = first_col + jnp.arange(block_cols, dtype=jnp.int32)
  stride_w = geom.strides[2]
  interleaved = not geom.channels_last and interleaves(stride_w)

  def col_span(xp, first):
    """The window-phase columns ``m`` (first, last) of the block of columns from ``first``
    (``xp``: ``jnp`` for this program's, NumPy for every program's: :func:`tile.interior_of`)."""
    if geom.channels_last or interleaved:
      return first, xp.minimum(first + block_cols, phase_counts[2]) - 1
    return first // stride_w, (xp.minimum(first + block_cols, width) - 1) // stride_w

  # (store columns, window-phase columns m, [(column tap, offset q, lane mask or None)])
  groups: list[tuple[Any, Any, list[tuple[int, Any, Any]]]]
  if geom.channels_last or interleaved:
    # Columns by phase: the block is ``block_cols`` values of ``m``, each phase ``r_w`` one
    # group. (channels_first with a power-of-two stride: the phases' results are interleaved
    # into whole lines of ``stride_w * block_cols`` columns before they are stored.)
    # Lanes past the end: clamped copies, stores masked.
    phase_cols = jnp.minimum(raw_cols, phase_counts[2] - 1)
    col_mask = None if phase_counts[2] % block_cols == 0 else raw_cols < phase_counts[2]
    m_span = col_span(jnp, first_col)
    groups = [(phase_cols * stride_w + col_phase, phase_cols,
               [(col_tap, offset, None) for col_tap, offset in phase_taps(geom, 2, col_phase)])
              for col_phase in range(stride_w)]
  else:
    # channels_first, other strides: the block is ``block_cols`` contiguous input columns
    # (whole-line stores), each lane with its own phase, so the column taps are masked per lane.
    in_cols = jnp.minimum(raw_cols, width - 1)
    col_mask = None if width % block_cols == 0 else raw_cols < width
    phase_cols, col_phase = in_cols // stride_w, in_cols % stride_w
    m_span = col_span(jnp, first_col)
    col_taps = []
    for col_tap in range(geom.window[2]):
      # (keeps the numerator >= 0 for C-style // and %)
      shift = -(-(col_tap * geom.dilation[2]) // stride_w) + 1
      numerator = col_phase + geom.pad_lo[2] - col_tap * geom.dilation[2] + shift * stride_w
      col_taps.append((col_tap, numerator // stride_w - shift, numerator % stride_w == 0))
    groups = [(in_cols, phase_cols, col_taps)]
  # Interior: every phase's rows exist and every window the (real) tile visits is real; the
  # columns past W are masked on both paths.
  def inside(dim):
    offsets = phase_offsets(geom, dim)

    def holds(xp, first_m, last_m):
      real = (first_m + min(offsets) >= 0) & (last_m + max(offsets) < geom.out_spatial[dim])
      if dim < 2:
        real &= (last_m + 1) * geom.strides[dim] <= geom.in_spatial[dim]
      return real
    return holds

  def every_block(dim, size):  # (first, last) of every program's block of rows along ``dim``
    first = np.arange(-(-phase_counts[dim] // size)) * size
    return first, first + size - 1

  interior = interior_of([
      (inside(0), every_block(0, block_depth), (m_depth, m_depth + block_depth - 1)),
      (inside(1), every_block(1, block_height), (m_height, m_height + block_height - 1)),
      (inside(2), col_span(np, np.arange(-(-n_cols // block_cols)) * block_cols), m_span)])
  dtype = dy_ref.dtype
  # Max pooling sums in the cotangents' dtype, rounding after every add as the XLA path does
  # (a 16-bit sum taken in float32 and rounded is the same bits: float32's 24 digits are at
  # least 2p + 2 for a 16-bit float's p, so rounding twice gives the correctly rounded sum);
  # average pooling in float32.
  acc_t = dtype if mode == "max" else accumulator_dtype(dtype)
  zero = jnp.zeros(tile.shape, acc_t)

  def divisor_of(windows):
    """The average divisor of the windows ``(out_plane, out_row, out_cols)``: the same formula
    on both code paths (unlike the forward, no path has a constant count)."""
    if divisor is not None:
      return np.array(divisor, acc_t)
    counts = counted_taps(geom, windows, include_pad, block_cols)
    return tile.cols_of(jnp.where(counts == 0, 1, counts).astype(acc_t))

  def store(in_plane, in_row, in_cols, acc, edge):
    # Rows and columns past the end: masked when compiled; in interpret mode the store's
    # scatter drops out-of-bounds indices (and clamped lanes rewrite their own value).
    mask = col_mask if in_cols.shape == (block_cols,) else None
    if width % stride_w or interleaved:
      past = in_cols < width  # (an interleaved line's overhang past the last m is past W too)
      mask = past if mask is None else (mask & past)
    if edge:
      real_rows = jnp.broadcast_to((in_plane < depth) & (in_row < height), in_cols.shape)
      mask = real_rows if mask is None else (mask & real_rows)
    tile.store(dx_ref, tile.index(batch, in_plane, in_row, in_cols), acc.astype(dtype), mask)

  # Every phase (a block ``block_d, block_h``, its ``phase_d, phase_h`` and a column group)
  # sums its taps in descending tap order. A tap's windows are a tile at a static offset
  # ``(block_d + offset_d, block_h + offset_h, offset_w)`` from the program's first block
  # (``-col_tap``, not ``offset_w``, where each lane has its own column phase), and phases
  # share offsets (a 3x3/s2 block's four phases read four tiles, for nine
  # taps; two blocks in height, six): so the tiles are loaded once each, in ascending offset
  # order, which is every phase's descending tap order, and added into every phase that reads
  # them.
  row_phases = [(block_d, block_h, phase_d, phase_h)
                for block_d, block_h in itertools.product(range(block_depth), range(block_height))
                for phase_d, phase_h in itertools.product(range(geom.strides[0]),
                                                          range(geom.strides[1]))]
  phases = [(*row_phase, group) for row_phase in row_phases for group in range(len(groups))]
  uses: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # offset -> [(phase, tap)]
  lane_oks: dict[tuple[int, int, int], Any] = {}
  cols: dict[tuple[int, int, int], Any] = {}
  every_tap = []  # whether each phase visits every tap of the window
  for phase, (block_d, block_h, phase_d, phase_h, group) in enumerate(phases):
    _, phase_cols, col_taps = groups[group]
    n_taps = 0
    for plane_tap, offset_d in phase_taps(geom, 0, phase_d):
      for row_tap, offset_h in phase_taps(geom, 1, phase_h):
        for col_tap, offset_w, lane_ok in col_taps:
          key = (block_d + offset_d, block_h + offset_h,
                 offset_w if lane_ok is None else -col_tap)
          tap = (plane_tap * geom.window[1] + row_tap) * geom.window[2] + col_tap
          uses.setdefault(key, []).append((phase, tap))
          lane_oks[key], cols[key] = lane_ok, phase_cols + offset_w
          n_taps += 1
    every_tap.append(n_taps == geom.num_taps)

  # One dim of many taps at stride 1 (max pooling, one block): a single phase, whose taps, in
  # descending order, are the keys in ascending order along that dim; visited in a loop
  # (``tile.fold``), so the code does not grow with the window.
  loop = loop_dim(geom)
  if loop is not None:
    size, lo, dil = geom.window[loop], geom.padding[loop][0], geom.dilation[loop]

    def loop_key(tap):
      """The offsets of the windows holding an element at ``tap`` along ``loop``."""
      return tuple(lo - tap * dil if dim == loop else 0 for dim in range(3))

    one_phase = {loop_key(tap): [(0, tap)] for tap in range(size)}
    if mode != "max" or uses != one_phase or any(ok is not None for ok in lane_oks.values()):
      loop = None  # (the plan above, unrolled)

  def body(edge: bool):
    accs: list[Any] = [None] * len(phases)
    missed: list[Any] = [None] * len(phases)  # (edge path) the windows past the edge it skipped

    def visit(key, taps_of, valid, out_cols):
      """Adds the windows at ``key`` (offsets from the first block) to each phase of
      ``taps_of``, ``[(phase, tap)]``."""
      out_plane, out_row = m_depth + key[0], m_height + key[1]
      if edge:
        real = ((out_plane >= 0) & (out_plane < out_depth) & (out_row >= 0)
                & (out_row < out_height) & (out_cols >= 0) & (out_cols < out_width))
        valid = real if valid is None else valid & real
        out_plane, out_row, out_cols = (jnp.clip(out_plane, 0, out_depth - 1),
                                        jnp.clip(out_row, 0, out_height - 1),
                                        jnp.clip(out_cols, 0, out_width - 1))
      if valid is not None:
        valid = tile.cols_of(valid)
      where = tile.index(batch, out_plane, out_row, out_cols)
      dy_tile = load(dy_ref, where, valid, None if valid is None else np.array(0, dtype))
      if mode == "max":
        no_tap = None if valid is None else np.array(-1, idx_ref.dtype)
        taps_tile = load(idx_ref, where, valid, no_tap)
        if packed:
          taps_tile = taps_tile.astype(jnp.int16)
        for phase, tap in taps_of:
          # The XLA path adds a zero for each tap this phase skips, so its sums are never
          # -0.0: -0.0 + 0.0 is +0.0. So the first term of such a phase maps -0.0 to +0.0.
          # (A select: XLA:CPU would simplify zero + c to c.)
          first_zero = accs[phase] is None and not every_tap[phase]
          if packed:
            term = pick16(dy_tile, taps_tile, tap, first_zero)
          else:
            if not isinstance(tap, int):
              tap = lax.convert_element_type(tap, taps_tile.dtype)
            term = jnp.where(taps_tile == tap, dy_tile, np.array(0, dtype))
            if first_zero:
              term = jnp.where(term == 0, zero, term)
          accs[phase] = term if accs[phase] is None else accs[phase] + term
      else:
        term = dy_tile.astype(acc_t) / divisor_of((out_plane, out_row, out_cols))
        if valid is not None:
          term = jnp.where(valid, term, 0)
        for phase, _ in taps_of:
          accs[phase] = term if accs[phase] is None else accs[phase] + term
          if valid is not None:
            missed[phase] = ~valid if missed[phase] is None else missed[phase] | ~valid

    if loop is None:
      for key in sorted(uses):
        visit(key, uses[key], lane_oks[key], cols[key])
    else:
      # Taps k - 1, ..., 0 at offsets ``pad_lo - tap * d`` (ascending) along ``loop``.
      phase_cols = groups[0][1]

      def step(i, acc):
        tap = size - 1 - i
        key = loop_key(tap)
        accs[0] = acc
        visit(key, [(0, tap)], None, phase_cols + key[2])
        return accs[0]

      step(0, None)  # (the first term starts the sum)
      accs[0] = fold(1, size - 1, step, accs[0])
    if mode != "max":
      # The XLA path's gradient sums a term for every tap, +0.0 from the padding where a tap
      # holds no real window (JAX transposes the tap slices into pads), so it is -0.0 only
      # where every tap sends -0.0. The kernel adds only the taps that matter: a sum that
      # skipped a tap (a phase that visits fewer than all, or a window past the edge) takes
      # +0.0 for a zero. (A select: XLA:CPU, which runs interpret mode, would fold a constant
      # masked +0.0 out of the sum.)
      for phase, acc in enumerate(accs):
        if acc is None:
          continue
        skipped = missed[phase] if every_tap[phase] else True
        if skipped is not None:
          accs[phase] = jnp.where((acc == 0) & skipped, zero, acc)
    accs = [zero if acc is None else acc for acc in accs]
    n_groups = len(groups)
    for index, (block_d, block_h, phase_d, phase_h) in enumerate(row_phases):
      in_plane = (m_depth + block_d) * geom.strides[0] + phase_d
      in_row = (m_height + block_h) * geom.strides[1] + phase_h
      mine = accs[index * n_groups:(index + 1) * n_groups]
      if interleaved:
        # Whole lines of ``stride_w * block_cols`` columns: column ``m * stride_w + r`` from
        # phase ``r``.
        line = first_col * stride_w + jnp.arange(block_cols * stride_w, dtype=jnp.int32)
        store(in_plane, in_row, line, interleave(mine), edge)
      else:
        for (in_cols, _, _), acc in zip(groups, mine, strict=True):
          store(in_plane, in_row, in_cols, acc, edge)

  both_paths(interior, body, interpret)


PICK16_TAPS = 0x7C00  # (taps below it are finite half floats' bits)


def pick16(dy, taps, tap, plus_zero: bool):
  """``where(taps == tap, dy, +0.0)`` for 16-bit floats ``dy`` and int16 ``taps`` (``-1`` or a
  tap), two lanes an instruction (inline PTX on pairs packed in 32-bit registers); with
  ``plus_zero`` a ``-0.0`` in ``dy`` gives ``+0.0`` too. ``tap``: a Python int (an immediate
  of the instruction) or, in a loop over the taps, a traced int32 below ``PICK16_TAPS`` (a
  third operand, packed as the taps are).

  The taps' bits are compared as half floats (``set.eq.u32.f16x2``: ``0xFFFF`` where equal):
  a tap ``0 <= t < 0x7C00`` is a finite half float (a subnormal below ``2**10``: no flush to
  zero), equal only to itself, and ``-1`` is a NaN, equal to nothing. The mask is ANDed with
  ``dy``'s bits. ``dy``'s zeros of either sign are half-float zeros in both formats (bits
  ``0x0000`` and ``0x8000``), so the same compare against ``0`` finds them, and a three-input
  logic op (``lop3``, ``dy & mask & ~zero``) clears them."""
  assert plgpu is not None
  args = [dy, taps]
  if isinstance(tap, int):
    assert 0 <= tap < PICK16_TAPS
    tap_pair = f"mov.b32 jp_k, {tap * 0x10001};"
  else:  # (each 32-bit register of the third operand holds the tap twice)
    args.append(lax.broadcast(lax.convert_element_type(tap, taps.dtype), taps.shape))
    tap_pair = "mov.b32 jp_k, $3;"
  if plus_zero:
    body = ("mov.b32 jp_z, 0; set.eq.u32.f16x2 jp_n, $1, jp_z; "
            "lop3.b32 $0, $1, jp_m, jp_n, 0x40;")  # (a & b & ~c)
  else:
    body = "and.b32 $0, $1, jp_m;"
  asm = ("{ .reg .b32 jp_k, jp_m, jp_z, jp_n; "
         f"{tap_pair} set.eq.u32.f16x2 jp_m, $2, jp_k; {body} }}")
  return plgpu.elementwise_inline_asm(
      asm, args=args, constraints="=r" + ",r" * len(args), pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(dy.shape, dy.dtype)])[0]


def phase_rows(geom: Geometry) -> tuple[int, int]:
  """The backward's blocks of ``s_d x s_h`` input rows in depth and height (``geom`` lifted to
  3-D): ``ceil(D / s_d)`` and ``ceil(H / s_h)``."""
  return -(-geom.in_spatial[0] // geom.strides[0]), -(-geom.in_spatial[1] // geom.strides[1])


def block_rows(geom: Geometry, block: tuple[int, int]) -> tuple[int, int]:
  """The programs' rows of ``block = (block_depth, block_height)`` blocks in depth and height
  (a batch's)."""
  depth, height = phase_rows(geom)
  return -(-depth // block[0]), -(-height // block[1])


def interleaves(stride: int) -> bool:
  """Whether :func:`interleave` handles ``stride`` phases (Triton stacks two at a time)."""
  return stride & (stride - 1) == 0


def interleave(parts):
  """``(block_lanes, n * block_cols)`` from ``n`` (a power of two) ``(block_lanes,
  block_cols)`` tiles: column ``m * n + r`` is
  ``parts[r][:, m]``. Pairs are stacked on a new minor dim and flattened, recursively."""
  if len(parts) == 1:
    return parts[0]
  evens, odds = interleave(parts[0::2]), interleave(parts[1::2])
  return jnp.stack([evens, odds], axis=-1).reshape(evens.shape[0], 2 * evens.shape[1])

