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
from jax.experimental import pallas as pl

from jaxpool._src.dtypes import accumulator_dtype
from jaxpool._src.pallas.triton.tile import (
    Tile,
    both_paths,
    counted_taps,
    load,
    plgpu,
    program,
    split,
)
from jaxpool._src.windows import Geometry, phase_offsets, phase_taps


def backward_kernel(*refs, g: Geometry, bw: int, bl: int, lanes: int, rows: int,
                    n_cols: int, mode: str, include_pad: bool, divisor: int | None,
                    interpret: bool, block: tuple[int, int] = (1, 1), packed: bool = False):
  """``dx`` for a block of ``s_d x s_h`` input rows and ``s_w * bw`` (channels_last) or ``bw``
  (channels_first) columns, phase by phase; with ``block = (bd, bh)``, for ``bd x bh`` such
  blocks of rows (``bd`` of them in depth, ``bh`` in height).

  The input element ``(m_d s_d + r_d, m_h s_h + r_h, m s_w + r_w)`` lies at tap ``(a, i, j)`` of
  window ``(m_d + q_d, m_h + q_h, m + q_w)`` exactly when ``r + lo - tap * d = q * s`` in every
  dim: for a fixed phase ``r`` the taps that can hold it and the offsets ``q`` are static, and
  each tap's windows are a contiguous run over ``m``. (``rows`` and ``n_cols``: the launch's
  blocks of rows, ``b x ceil(ceil(D / s_d) / bd) x ceil(ceil(H / s_h) / bh)``, and its columns,
  over which :func:`tile.program` numbers the programs.) So each phase reads only the
  taps that matter, as whole tiles (each loaded once for all the phases of the program's blocks
  that read it: neighbouring blocks of rows share the windows' rows where windows overlap), and
  sums them in descending tap order: the order in which JAX's transpose of the XLA path's tap
  gather adds them (the skipped taps add exact zeros there), so max-pool gradients have the
  same bits on both paths. In channels_first the columns are the
  contiguous dim, so a block is a run of input columns (stored whole) and the column phase is
  per lane: every column tap is visited, masked to the lanes it can hold.

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
  (D, H, W), (Do, Ho, Wo) = g.in_spatial, g.out_spatial
  mcount = [-(-n // s) for n, s in zip(g.in_spatial, g.strides)]
  bd, bh = block
  row, cb, lb = program(rows, pl.cdiv(n_cols, bw), pl.cdiv(lanes, bl), g.channels_last)
  b, md, mh = split(row, block_rows(g, block))
  md, mh = md * bd, mh * bh  # the first block's phase rows (blocks past the end: masked)
  tile = Tile(bw, lanes, bl, interpret, g.channels_last, lb)
  c0 = cb * bw
  raw = c0 + jnp.arange(bw, dtype=jnp.int32)
  sw = g.strides[2]
  interleaved = not g.channels_last and interleaves(sw)
  # (store columns, window-phase columns m, [(column tap j, offset q, lane mask or None)])
  groups: list[tuple[Any, Any, list[tuple[int, Any, Any]]]]
  if g.channels_last or interleaved:
    # Columns by phase: the block is ``bw`` values of ``m``, each phase ``r_w`` one group.
    # (channels_first with a power-of-two stride: the phases' results are interleaved into
    # whole lines of ``sw * bw`` columns before they are stored.)
    m = jnp.minimum(raw, mcount[2] - 1)  # lanes past the end: clamped copies, stores masked
    col_mask = None if mcount[2] % bw == 0 else raw < mcount[2]
    m_span = (c0, jnp.minimum(c0 + bw, mcount[2]) - 1)
    groups = [(m * sw + rw, m, [(j, q, None) for j, q in phase_taps(g, 2, rw)])
              for rw in range(sw)]
  else:
    # channels_first, other strides: the block is ``bw`` contiguous input columns (whole-line
    # stores), each lane with its own phase, so the column taps are masked per lane.
    w = jnp.minimum(raw, W - 1)
    col_mask = None if W % bw == 0 else raw < W
    m, rw = w // sw, w % sw
    m_span = (c0 // sw, (jnp.minimum(c0 + bw, W) - 1) // sw)
    jtaps = []
    for j in range(g.window[2]):
      shift = -(-(j * g.dilation[2]) // sw) + 1  # keeps the numerator >= 0 for C-style // and %
      num = rw + g.pad_lo[2] - j * g.dilation[2] + shift * sw
      jtaps.append((j, num // sw - shift, num % sw == 0))
    groups = [(w, m, jtaps)]
  # Interior: every phase's rows exist and every window the (real) tile visits is real; the
  # columns past W are masked on both paths.
  interior = None
  for dim, first_m, last_m in ((0, md, md + bd - 1), (1, mh, mh + bh - 1), (2, *m_span)):
    qs = phase_offsets(g, dim)
    inside = (first_m + min(qs) >= 0) & (last_m + max(qs) < g.out_spatial[dim])
    if dim < 2:
      inside &= (last_m + 1) * g.strides[dim] <= g.in_spatial[dim]
    interior = inside if interior is None else interior & inside
  dtype = dy_ref.dtype
  # Max pooling sums in the cotangents' dtype, rounding after every add as the XLA path does
  # (a 16-bit sum taken in float32 and rounded is the same bits: float32's 24 digits are at
  # least 2p + 2 for a 16-bit float's p, so rounding twice gives the correctly rounded sum);
  # average pooling in float32.
  acc_t = dtype if mode == "max" else accumulator_dtype(dtype)
  zero = jnp.zeros(tile.shape, acc_t)

  def divisor_of(wins):
    """The average divisor of the windows ``wins = (od, oh, ow)``: the same formula on both
    code paths (unlike the forward, no path has a constant count)."""
    if divisor is not None:
      return np.array(divisor, acc_t)
    cnt = counted_taps(g, wins, include_pad, bw)
    return tile.cols_of(jnp.where(cnt == 0, 1, cnt).astype(acc_t))

  def store(d, h, w, acc, edge):
    # Rows and columns past the end: masked when compiled; in interpret mode the store's
    # scatter drops out-of-bounds indices (and clamped lanes rewrite their own value).
    mask = col_mask if w.shape == (bw,) else None
    if W % sw or interleaved:
      past = w < W  # (an interleaved line's overhang past the last m is past W too)
      mask = past if mask is None else (mask & past)
    if edge:
      rows = jnp.broadcast_to((d < D) & (h < H), w.shape)
      mask = rows if mask is None else (mask & rows)
    tile.store(dx_ref, tile.index(b, d, h, w), acc.astype(dtype), mask)

  # Every phase (a block ``kd, kh``, its ``rd, rh`` and a column group) sums its taps in
  # descending tap order. A tap's windows are a tile at a static offset ``(kd + qd, kh + qh,
  # qw)`` from the program's first block (``j``, not ``qw``, where each lane has its own column
  # phase), and phases share offsets (a 3x3/s2 block's four phases read four tiles, for nine
  # taps; two blocks in height, six): so the tiles are loaded once each, in ascending offset
  # order, which is every phase's descending tap order, and added into every phase that reads
  # them.
  row_phases = [(kd, kh, rd, rh) for kd, kh in itertools.product(range(bd), range(bh))
                for rd, rh in itertools.product(range(g.strides[0]), range(g.strides[1]))]
  phases = [(*rp, gi) for rp in row_phases for gi in range(len(groups))]
  uses: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # offset -> [(phase, tap)]
  lane_oks: dict[tuple[int, int, int], Any] = {}
  cols: dict[tuple[int, int, int], Any] = {}
  every_tap = []  # whether each phase visits every tap of the window
  for p, (kd, kh, rd, rh, gi) in enumerate(phases):
    _, m, jtaps = groups[gi]
    n = 0
    for a, qd in phase_taps(g, 0, rd):
      for i, qh in phase_taps(g, 1, rh):
        for j, qw, lane_ok in jtaps:
          key = (kd + qd, kh + qh, qw if lane_ok is None else -j)
          uses.setdefault(key, []).append((p, (a * g.window[1] + i) * g.window[2] + j))
          lane_oks[key], cols[key] = lane_ok, m + qw
          n += 1
    every_tap.append(n == g.num_taps)

  def body(edge: bool):
    accs: list[Any] = [None] * len(phases)
    missed: list[Any] = [None] * len(phases)  # (edge path) the windows past the edge it skipped
    for key in sorted(uses):
      od, oh, ow = md + key[0], mh + key[1], cols[key]
      ok = lane_oks[key]
      if edge:
        real = (od >= 0) & (od < Do) & (oh >= 0) & (oh < Ho) & (ow >= 0) & (ow < Wo)
        ok = real if ok is None else ok & real
        od, oh, ow = (jnp.clip(od, 0, Do - 1), jnp.clip(oh, 0, Ho - 1),
                      jnp.clip(ow, 0, Wo - 1))
      if ok is not None:
        ok = tile.cols_of(ok)
      where = tile.index(b, od, oh, ow)
      dyt = load(dy_ref, where, ok, None if ok is None else np.array(0, dtype))
      if mode == "max":
        it = load(idx_ref, where, ok, None if ok is None else np.array(-1, idx_ref.dtype))
        if packed:
          it = it.astype(jnp.int16)
        for p, t in uses[key]:
          # The XLA path adds a zero for each tap this phase skips, so its sums are never
          # -0.0: -0.0 + 0.0 is +0.0. So the first term of such a phase maps -0.0 to +0.0.
          # (A select: XLA:CPU would simplify zero + c to c.)
          first_zero = accs[p] is None and not every_tap[p]
          if packed:
            c = pick16(dyt, it, t, first_zero)
          else:
            c = jnp.where(it == t, dyt, np.array(0, dtype))
            if first_zero:
              c = jnp.where(c == 0, zero, c)
          accs[p] = c if accs[p] is None else accs[p] + c
      else:
        c = dyt.astype(acc_t) / divisor_of((od, oh, ow))
        if ok is not None:
          c = jnp.where(ok, c, 0)
        for p, _ in uses[key]:
          accs[p] = c if accs[p] is None else accs[p] + c
          if ok is not None:
            missed[p] = ~ok if missed[p] is None else missed[p] | ~ok
    if mode != "max":
      # The XLA path's gradient sums a term for every tap, +0.0 from the padding where a tap
      # holds no real window (JAX transposes the tap slices into pads), so it is -0.0 only
      # where every tap sends -0.0. The kernel adds only the taps that matter: a sum that
      # skipped a tap (a phase that visits fewer than all, or a window past the edge) takes
      # +0.0 for a zero. (A select: XLA:CPU, which runs interpret mode, would fold a constant
      # masked +0.0 out of the sum.)
      for p, acc in enumerate(accs):
        if acc is None:
          continue
        skipped = missed[p] if every_tap[p] else True
        if skipped is not None:
          accs[p] = jnp.where((acc == 0) & skipped, zero, acc)
    accs = [zero if acc is None else acc for acc in accs]
    ng = len(groups)
    for n, (kd, kh, rd, rh) in enumerate(row_phases):
      d, h = (md + kd) * g.strides[0] + rd, (mh + kh) * g.strides[1] + rh
      mine = accs[n * ng:(n + 1) * ng]
      if interleaved:
        # Whole lines of ``sw * bw`` columns: column ``m * sw + r`` from phase ``r``.
        store(d, h, c0 * sw + jnp.arange(bw * sw, dtype=jnp.int32), interleave(mine), edge)
      else:
        for (w, _, _), acc in zip(groups, mine):
          store(d, h, w, acc, edge)

  both_paths(interior, body)


PICK16_TAPS = 0x7C00  # (taps below it are finite half floats' bits)


def pick16(dy, taps, tap: int, plus_zero: bool):
  """``where(taps == tap, dy, +0.0)`` for 16-bit floats ``dy`` and int16 ``taps`` (``-1`` or a
  tap), two lanes an instruction (inline PTX on pairs packed in 32-bit registers); with
  ``plus_zero`` a ``-0.0`` in ``dy`` gives ``+0.0`` too.

  The taps' bits are compared as half floats (``set.eq.u32.f16x2``: ``0xFFFF`` where equal):
  a tap ``0 <= t < 0x7C00`` is a finite half float (a subnormal below ``2**10``: no flush to
  zero), equal only to itself, and ``-1`` is a NaN, equal to nothing. The mask is ANDed with
  ``dy``'s bits. ``dy``'s zeros of either sign are half-float zeros in both formats (bits
  ``0x0000`` and ``0x8000``), so the same compare against ``0`` finds them, and a three-input
  logic op (``lop3``, ``dy & mask & ~zero``) clears them."""
  assert plgpu is not None and 0 <= tap < PICK16_TAPS
  pair = tap * 0x10001
  if plus_zero:
    body = ("mov.b32 jp_z, 0; set.eq.u32.f16x2 jp_n, $1, jp_z; "
            "lop3.b32 $0, $1, jp_m, jp_n, 0x40;")  # (a & b & ~c)
  else:
    body = "and.b32 $0, $1, jp_m;"
  asm = ("{ .reg .b32 jp_k, jp_m, jp_z, jp_n; "
         f"mov.b32 jp_k, {pair}; set.eq.u32.f16x2 jp_m, $2, jp_k; {body} }}")
  return plgpu.elementwise_inline_asm(
      asm, args=[dy, taps], constraints="=r,r,r", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(dy.shape, dy.dtype)])[0]


def phase_rows(g: Geometry) -> tuple[int, int]:
  """The backward's blocks of ``s_d x s_h`` input rows in depth and height (``g`` lifted to
  3-D): ``ceil(D / s_d)`` and ``ceil(H / s_h)``."""
  return -(-g.in_spatial[0] // g.strides[0]), -(-g.in_spatial[1] // g.strides[1])


def block_rows(g: Geometry, block: tuple[int, int]) -> tuple[int, int]:
  """The programs' rows of ``block = (bd, bh)`` blocks in depth and height (a batch's)."""
  depth, height = phase_rows(g)
  return -(-depth // block[0]), -(-height // block[1])


def interleaves(stride: int) -> bool:
  """Whether :func:`interleave` handles ``stride`` phases (Triton stacks two at a time)."""
  return stride & (stride - 1) == 0


def interleave(parts):
  """``(bl, n * bw)`` from ``n`` (a power of two) ``(bl, bw)`` tiles: column ``m * n + r`` is
  ``parts[r][:, m]``. Pairs are stacked on a new minor dim and flattened, recursively."""
  if len(parts) == 1:
    return parts[0]
  evens, odds = interleave(parts[0::2]), interleave(parts[1::2])
  return jnp.stack([evens, odds], axis=-1).reshape(evens.shape[0], 2 * evens.shape[1])

