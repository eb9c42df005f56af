"""Pallas kernels for GPUs (the Triton backend): 1-D, 2-D and 3-D pooling, both layouts.

Every kernel sees the spatial dims as ``(D, H, W)`` (1-D and 2-D pools get unit ``D`` and
``H``). A program covers one output row (``b, d, h``), a block of ``bw`` columns and a block of
``bl`` *lanes*: the channels in ``channels_last`` (the operand viewed as ``(B, D, H, W, C)``,
channels contiguous) or the planes in ``channels_first`` (viewed as ``(P, D, H, W)`` with
``P = batch * C``, columns contiguous). Each tap's load is a tile with the contiguous dim last:
``(bw, bl)`` in channels_last, ``(bl, bw)`` in channels_first (Triton spreads a warp's threads
along the last dim, so that is what keeps the loads coalesced).

The kernels never read or write out of bounds, compiled or in interpret mode. At the edges
every index is clamped into the array: a max kernel's tap outside the input reads a copy of the
nearest real tap of its own window (which cannot change the maximum; the winner is mapped back
to the real tap), an average kernel masks such taps out of the sum, and stores are masked to the
real columns and lanes (the block's overhang past ``W`` or the lanes). Programs whose windows all
lie inside the array (most of them) take a second code path, chosen at run time, without clamps.

Forward kernels gather over the window's taps (max with the argmax, or a sum for average
pooling). Backward kernels are gathers too: each input element visits the taps of the windows
that can hold it, in a fixed order, and sums the cotangents of those that chose it (max) or
their share (average): no atomics, the same bits on every run.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as _plgpu
  plgpu: ModuleType | None = _plgpu
except ImportError:  # pragma: no cover - jaxlib without the Triton backend
  plgpu = None

from jaxpool._src.pallas.calls import out_struct
from jaxpool._src.windows import Geometry, phase_taps, real_taps, taps_dtype, window_count
from jaxpool._src.autodiff import apply_activation
from jaxpool._src.pallas import tuning
from jaxpool._src.platforms import platform
from jaxpool._src.dtypes import accumulator_dtype, beats, lowest

# Older Pallas had ``load``/``store`` at the top level; newer jax (and its type hints) has not.
_pl_legacy: ModuleType = pl

Launch = tuning.Launch  # (bw, bl, num_warps)


def _next_pow2(n: int) -> int:
  return 1 << (max(int(n), 1) - 1).bit_length()


def _least_waste(width: int, most: int, least: int = 1) -> int:
  """The power-of-two block in ``[least, most]`` (``least`` no more than ``width`` needs) that
  pads ``width`` least; the largest on ties."""
  least = min(least, _next_pow2(width), most)
  best = min((-(-width // bw) * bw, -bw) for bw in (1 << e for e in range(8))
             if least <= bw <= most)
  return -best[1]


def launch_config(width: int, lanes: int, itemsize: int, channels_last: bool) -> Launch:
  """``(bw, bl, num_warps)`` for a kernel over ``width`` columns and ``lanes`` lanes.

  channels_last: whole channel rows up to 512 bytes; columns that pad ``width`` least, from 8
  to 16 (more for narrow channel rows, up to 1024 elements a tile). channels_first: up to 64
  contiguous columns, planes up to 1024 elements a tile. Warps: one thread per 8 bytes of the
  tile, 1 to 8. ``benchmarks/probes/sweep_gpu.py`` measured the alternatives (NOTES.md): small
  per-thread tiles keep the most loads in flight.
  """
  if channels_last:
    bl = min(_next_pow2(lanes), max(512 // itemsize, 1))
    bw = _least_waste(width, min(max(8192 // bl, 1), max(16, 1024 // bl)), least=8)
  else:
    bw = min(_next_pow2(width), 64)
    bl = min(_next_pow2(lanes), max(1024 // bw, 1))
  warps = min(max(bw * bl * itemsize // 256, 1), 8)
  return bw, bl, _pow2_at_most(warps)


def _pow2_at_most(n: int) -> int:
  return 1 << (max(int(n), 1).bit_length() - 1)


class _Tile:
  """Lane coordinates of one program's tile and the layout's indexer.

  ``lane`` is clamped, so lanes past the end duplicate the last real one: they compute the same
  value and, in interpret mode (where stores go unmasked, since the interpreter's masked scatter
  would let a masked lane restore an old value), write it again.
  """

  def __init__(self, bw: int, lanes: int, bl: int, interpret: bool, channels_last: bool):
    raw = pl.program_id(2) * bl + jnp.arange(bl, dtype=jnp.int32)
    exact = lanes % bl == 0
    self.channels_last = channels_last
    self.shape = (bw, bl) if channels_last else (bl, bw)
    self.lane: Any  # a pl.Slice (compiled, contiguous channels) or an index array
    if channels_last and exact and not interpret:
      # Compiled: a plain slice keeps the channel dim provably contiguous (vector loads).
      self.lane = pl.ds(pl.program_id(2) * bl, bl)
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


def _load(ref, idx, mask=None, other=None):
  if plgpu is not None and hasattr(plgpu, "load"):
    return plgpu.load(ref.at[idx], mask=mask, other=other)
  return _pl_legacy.load(ref, idx, mask=mask, other=other)  # pragma: no cover - older Pallas


def _split(pid, sizes):
  """``pid`` -> (its quotient by ``prod(sizes)``, *its row-major coordinates over ``sizes``)."""
  coords = []
  for n in reversed(sizes):
    coords.append(pid % n)
    pid = pid // n
  return (pid, *reversed(coords))


def _both_paths(interior, body: Callable[[bool], None]) -> None:
  """Runs ``body(edge=False)`` where ``interior`` holds (no masks), else ``body(edge=True)``."""
  pl.when(interior)(lambda: body(False))
  pl.when(jnp.logical_not(interior))(lambda: body(True))


def _interleaves(stride: int) -> bool:
  """Whether :func:`_interleave` handles ``stride`` phases (Triton stacks two at a time)."""
  return stride & (stride - 1) == 0


def _interleave(parts):
  """``(bl, n * bw)`` from ``n`` (a power of two) ``(bl, bw)`` tiles: column ``m * n + r`` is
  ``parts[r][:, m]``. Pairs are stacked on a new minor dim and flattened, recursively."""
  if len(parts) == 1:
    return parts[0]
  evens, odds = _interleave(parts[0::2]), _interleave(parts[1::2])
  return jnp.stack([evens, odds], axis=-1).reshape(evens.shape[0], 2 * evens.shape[1])


def _compiler_params(num_warps: int):
  if plgpu is None:
    return None
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _call_kwargs(interpret: bool, num_warps: int):
  return {} if interpret else {"compiler_params": _compiler_params(num_warps)}


def _view_shape(shape, spatial, channels_last: bool) -> tuple[int, ...]:
  """``(B, D, H, W, C)`` (channels_last) or ``(P, D, H, W)`` (channels_first) for ``shape``."""
  rest = math.prod(shape) // (math.prod(spatial) * (shape[-1] if channels_last else 1))
  return (rest, *spatial, shape[-1]) if channels_last else (rest, *spatial)


def _view(x: jax.Array, spatial, channels_last: bool) -> jax.Array:
  return x.reshape(_view_shape(x.shape, spatial, channels_last))


def _lanes_and_batch(x4: jax.Array, channels_last: bool) -> tuple[int, int]:
  return (x4.shape[-1], x4.shape[0]) if channels_last else (x4.shape[0], 1)


def _window_count(g: Geometry, wins, include_pad: bool, bw: int):
  """Each window's taps inside the counted region (the input, or the input and its user
  padding with ``include_pad``), a product of one factor per dim: ``(bw,)`` int32."""
  cnt = jnp.ones((bw,), jnp.int32)
  for dim, o in enumerate(wins):
    cnt = cnt * window_count(g, dim, o, include_pad, jnp).astype(jnp.int32)
  return cnt


# ----------------------------------------------------------------------------- forward


def _window_kernel(x_ref, *out_refs, g: Geometry, bw: int, bl: int, lanes: int, mode: str,
                   include_pad: bool, divisor: int | None, interpret: bool,
                   activation: str | None = None):
  """One output row: max (``mode='max'``), max with argmax (``'argmax'``) or average (``'avg'``)."""
  Do, Ho, Wo = g.out_spatial
  b, do, ho = _split(pl.program_id(0), (Do, Ho))
  tile = _Tile(bw, lanes, bl, interpret, g.channels_last)
  w0 = pl.program_id(1) * bw
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
  dtype = x_ref.dtype
  acc_t = accumulator_dtype(dtype)
  idx_t = out_refs[1].dtype if mode == "argmax" else np.dtype(np.int8)
  # 16-bit floats are compared in float32 (exact): Triton would convert them for every op.
  cmp_t = np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 \
      else np.dtype(dtype)
  low = lowest(dtype)

  # Max kernels scan the taps in order with a running maximum that ranks NaN above every number
  # and +0.0 above -0.0 (_nan_max), and take a tap where that maximum's bits change: of equal
  # values the first keeps it, +0.0 replaces -0.0 and the first NaN wins (dtypes.beats' order).
  # On an NVIDIA GPU one instruction a tap for the maximum, two more for the taps; a window
  # holding NaN gives the canonical NaN there (a NaN, as XLA's maximum gives one).
  form = _max_form(cmp_t, interpret)
  outs = (do, ho, wo)

  def tap_at(dim: int, k):
    """The input position along ``dim`` of tap ``k`` of the tile's windows."""
    return outs[dim] * g.strides[dim] + k * g.dilation[dim] - g.pad_lo[dim]

  def load_tap(tap, edge: bool, fill):
    """Tap ``(a, i, j)`` of the tile's windows (average pooling), and where it is real (None:
    everywhere): edges masked, the masked taps read ``fill``."""
    pos = [tap_at(dim, k) for dim, k in enumerate(tap)]
    ok = None
    if edge:
      inside = [(p >= 0) & (p < n) for p, n in zip(pos, g.in_spatial)]
      ok = tile.cols_of(inside[0] & inside[1] & inside[2])
      pos = [jnp.clip(p, 0, n - 1) for p, n in zip(pos, g.in_spatial)]
    return _load(x_ref, tile.index(b, *pos), ok, None if ok is None else fill), ok

  def load_max_tap(tap, real):
    """Tap ``tap`` of the tile's windows (max pooling). At the edges (``real``: each dim's
    first and last real tap, per window) a tap outside the input reads the nearest real tap
    of its window, dim by dim: a copy, which cannot change a maximum. Of the taps holding the
    first maximum, the first is then a copy of the first real one, or that one, and
    :func:`_real_tap` maps it back: the first tap reading a real tap ``m`` has, in each dim, 0
    where ``m`` is that dim's first real tap and ``m``'s own index elsewhere, an order on the
    real taps that is row-major's."""
    pos = []
    for dim, k in enumerate(tap):
      if real is not None and g.window[dim] > 1:
        k = jnp.clip(k, *real[dim])
      p = tap_at(dim, k)
      if real is not None:  # (a window with no real tap reads anywhere inside; see empty)
        p = jnp.clip(p, 0, g.in_spatial[dim] - 1)
      pos.append(p)
    return _load(x_ref, tile.index(b, *pos))

  def body(edge: bool):
    best: Any = None
    acc: Any = None
    idx: Any = None
    real = [real_taps(g, dim, o, xp=jnp) for dim, o in enumerate(outs)] if edge else None
    taps = list(enumerate(g.taps()))
    for t, tap in taps:
      if mode == "avg":
        xt, _ = load_tap(tap, edge, np.array(0, dtype))
        xt = xt.astype(acc_t)
        acc = xt if acc is None else acc + xt
        continue
      xt = load_max_tap(tap, real).astype(cmp_t)
      if best is None:
        best = _nan_max(xt, xt, form)  # (NaN made canonical, as the scan's maxima are)
        if mode == "argmax":
          idx = jnp.full(tile.shape, t, idx_t)
        continue
      new = _nan_max(best, xt, form)
      if mode == "argmax":
        idx = jnp.where(_bits(new) != _bits(best), np.array(t, idx_t), idx)
      best = new
    out_at = tile.index(b, do, ho, wo)
    if mode == "avg":
      if divisor is not None or not edge:  # an interior window counts all its taps
        div = np.array(divisor if divisor is not None else g.num_taps, acc_t)
      else:
        cnt = _window_count(g, (do, ho, wo), include_pad, bw)
        div = tile.cols_of(jnp.where(cnt == 0, 1, cnt).astype(acc_t))
      tile.store(out_refs[0], out_at, (acc / div).astype(dtype), col_mask)
      return
    if real is not None:
      # Windows with no real tap: the lowest value, no tap.
      empty = None
      for dim, (first, last) in enumerate(real):
        if g.window[dim] > 1 or g.pad_lo[dim] or g.pad_hi[dim] or g.extra[dim]:
          e = tile.cols_of(first > last)
          empty = e if empty is None else empty | e
      if empty is not None:
        best = jnp.where(empty, np.array(low, cmp_t), best)
      if mode == "argmax":
        idx = _real_tap(g, idx, [[tile.cols_of(v) for v in r] for r in real])
        if empty is not None:
          idx = jnp.where(empty, np.array(-1, idx_t), idx)
    best, idx = apply_activation(best, idx, activation)  # (fused: no pass of its own)
    tile.store(out_refs[0], out_at, best.astype(dtype), col_mask)
    if mode == "argmax":
      tile.store(out_refs[1], out_at, idx, col_mask)

  _both_paths(interior, body)


def _real_tap(g: Geometry, idx, real):
  """The real taps that the copies in ``idx`` (window taps, row-major) read: each dim's tap
  clamped to ``real``'s ``(first, last)``."""
  t, parts = idx.astype(jnp.int32), []
  for k in reversed(g.window):
    parts.append(t % k)
    t = t // k
  out: Any = None
  for dim, part in enumerate(reversed(parts)):
    if g.window[dim] > 1:
      part = jnp.clip(part, *real[dim])
    out = part if out is None else out * g.window[dim] + part
  return out.astype(idx.dtype)


# How the max kernels take their running maximum (see _nan_max): "auto" (PTX's instruction where
# it serves, else "beats"), "beats" or "canonical" ("beats" with PTX's NaN results: how
# interpret-mode tests check the compiled kernels' taps of windows holding NaN on a CPU).
NAN_MAX = "auto"
_NAN_MAX_FORMS = ("auto", "beats", "canonical")


def _max_form(cmp_t, interpret: bool) -> str:
  """The form of :func:`_nan_max` that the max kernels use (``NAN_MAX``, "auto" resolved).

  "auto": PTX's ``max.NaN.f32`` for compiled kernels on an NVIDIA GPU whose floats are
  compared in float32; "beats" for the rest (and for integers in every form)."""
  if NAN_MAX not in _NAN_MAX_FORMS:
    raise ValueError(f"NAN_MAX must be one of {_NAN_MAX_FORMS}, got {NAN_MAX!r}")
  if not jnp.issubdtype(cmp_t, jnp.floating):
    return "beats"
  if NAN_MAX != "auto":
    return NAN_MAX
  ptx = (not interpret and plgpu is not None and np.dtype(cmp_t) == np.float32
         and platform() == "cuda")
  return "ptx" if ptx else "beats"


def _nan_max(best, x, form: str):
  """The running maximum ``best`` of a window scanned in tap order, after tap ``x``, in
  :func:`dtypes.beats`' order: NaN above every number, ``+0.0`` above ``-0.0``.

  "ptx": PTX's ``max.NaN.f32``, one instruction, whose NaN results are the canonical NaN.
  "beats": ``dtypes.beats`` itself, the XLA path's rule, so that interpret mode decides as the
  XLA path does on the same backend (XLA's CPU comparisons treat subnormals as zeros); the
  first NaN is kept. "canonical": "beats" with PTX's NaN results.
  """
  if form == "ptx":
    assert plgpu is not None  # (_max_form gives "ptx" only with the Triton backend)
    return plgpu.elementwise_inline_asm(
        "max.NaN.f32 $0, $1, $2;", args=[best, x], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]
  new = jnp.where(beats(x, best), x, best)
  if form == "canonical":
    canonical = np.array(np.uint32(0x7FFFFFFF)).view(np.float32).astype(x.dtype)
    new = jnp.where(new != new, canonical, new)
  return new


def _bits(v):
  """``v``'s bits as unsigned integers (floats), or ``v``."""
  if not jnp.issubdtype(v.dtype, jnp.floating):
    return v
  unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[v.dtype.itemsize]
  return lax.bitcast_convert_type(v, unsigned)


def _window_call(x: jax.Array, geom: Geometry, mode: str, interpret: bool,
                 include_pad: bool = False, divisor: int | None = None,
                 launch: Launch | None = None, activation: str | None = None):
  g = geom.lift(3)
  out_shape = geom.output_shape(x.shape)
  x4 = _view(x, g.in_spatial, g.channels_last)
  lanes, nb = _lanes_and_batch(x4, g.channels_last)
  (Do, Ho, Wo) = g.out_spatial
  bw, bl, warps = launch or launch_for(f"{mode}_fwd", x.shape, x.dtype, geom,
                                       interpret=interpret, include_pad=include_pad,
                                       divisor=divisor, activation=activation)
  grid = (nb * Do * Ho, pl.cdiv(Wo, bw), pl.cdiv(lanes, bl))
  shape4 = _view_shape(out_shape, g.out_spatial, g.channels_last)
  outs = [out_struct(shape4, x.dtype, x)]
  if mode == "argmax":
    outs.append(out_struct(shape4, taps_dtype(g.num_taps), x))
  kernel = functools.partial(_window_kernel, g=g, bw=bw, bl=bl, lanes=lanes, mode=mode,
                             include_pad=include_pad, divisor=divisor, interpret=interpret,
                             activation=activation)
  n_in, n_out = x.size * x.dtype.itemsize, sum(
      math.prod(o.shape) * np.dtype(o.dtype).itemsize for o in outs)
  res = pl.pallas_call(
      kernel, out_shape=tuple(outs), grid=grid, interpret=interpret,
      name=f"jaxpool_{mode}_pool_fwd",
      cost_estimate=pl.CostEstimate(flops=math.prod(shape4) * g.num_taps,
                                    transcendentals=0, bytes_accessed=n_in + n_out),
      **_call_kwargs(interpret, warps))(x4)
  return tuple(r.reshape(out_shape) for r in res)


def max_forward(x: jax.Array, geom: Geometry, *, interpret: bool,
                activation: str | None = None) -> jax.Array:
  """Max pooling without the taps (then the activation): ``x`` in either layout, 1-3 spatial
  dims."""
  return _window_call(x, geom, "max", interpret, activation=activation)[0]


def max_forward_taps(x: jax.Array, geom: Geometry, *, interpret: bool,
                     activation: str | None = None):
  """Max pooling and each window's winning tap, row-major (``taps_dtype``; -1: none)."""
  return _window_call(x, geom, "argmax", interpret, activation=activation)


def avg_forward(x: jax.Array, geom: Geometry, *, interpret: bool, count_include_pad: bool,
                divisor_override: int | None) -> jax.Array:
  """Average pooling; sums in float32 for 16-bit inputs."""
  return _window_call(x, geom, "avg", interpret, count_include_pad, divisor_override)[0]


# ----------------------------------------------------------------------------- backward


def _backward_kernel(*refs, g: Geometry, bw: int, bl: int, lanes: int, mode: str,
                     include_pad: bool, divisor: int | None, interpret: bool):
  """``dx`` for a block of ``s_d x s_h`` input rows and ``s_w * bw`` (channels_last) or ``bw``
  (channels_first) columns, phase by phase.

  The input element ``(m_d s_d + r_d, m_h s_h + r_h, m s_w + r_w)`` lies at tap ``(a, i, j)`` of
  window ``(m_d + q_d, m_h + q_h, m + q_w)`` exactly when ``r + lo - tap * d = q * s`` in every
  dim: for a fixed phase ``r`` the taps that can hold it and the offsets ``q`` are static, and
  each tap's windows are a contiguous run over ``m``. So each phase reads only the taps that
  matter, as whole tiles (each loaded once for all the block's phases that read it), and sums
  them in descending tap order: the order in which JAX's transpose of the XLA path's tap
  gather adds them (the skipped taps add exact zeros there), so max-pool gradients have the
  same bits on both paths. In channels_first the columns are the
  contiguous dim, so a block is a run of input columns (stored whole) and the column phase is
  per lane: every column tap is visited, masked to the lanes it can hold.
  """
  if mode == "max":
    idx_ref, dy_ref, dx_ref = refs
  else:
    dy_ref, dx_ref = refs
  (D, H, W), (Do, Ho, Wo) = g.in_spatial, g.out_spatial
  mcount = [-(-n // s) for n, s in zip(g.in_spatial, g.strides)]
  b, md, mh = _split(pl.program_id(0), mcount[:2])
  tile = _Tile(bw, lanes, bl, interpret, g.channels_last)
  c0 = pl.program_id(1) * bw
  raw = c0 + jnp.arange(bw, dtype=jnp.int32)
  sw = g.strides[2]
  interleave = not g.channels_last and _interleaves(sw)
  # (store columns, window-phase columns m, [(column tap j, offset q, lane mask or None)])
  groups: list[tuple[Any, Any, list[tuple[int, Any, Any]]]]
  if g.channels_last or interleave:
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
  for dim, first_m, last_m in ((0, md, md), (1, mh, mh), (2, *m_span)):
    qs = [q for r in range(g.strides[dim]) for _, q in phase_taps(g, dim, r)]
    inside = (first_m + min(qs) >= 0) & (last_m + max(qs) < g.out_spatial[dim])
    if dim < 2:
      inside &= (first_m + 1) * g.strides[dim] <= g.in_spatial[dim]
    interior = inside if interior is None else interior & inside
  dtype = dy_ref.dtype
  # Max pooling sums in the cotangents' dtype, rounding after every add as the XLA path does
  # (a 16-bit sum taken in float32 and rounded is the same bits: float32's 24 digits are at
  # least 2p + 2 for a 16-bit float's p, so rounding twice gives the correctly rounded sum);
  # average pooling in float32.
  acc_t = dtype if mode == "max" else accumulator_dtype(dtype)
  zero = jnp.zeros(tile.shape, acc_t)

  def divisor_of(wins):
    """The average divisor of the windows ``wins = (od, oh, ow)``."""
    if divisor is not None:
      return np.array(divisor, acc_t)
    cnt = _window_count(g, wins, include_pad, bw)
    return tile.cols_of(jnp.where(cnt == 0, 1, cnt).astype(acc_t))

  def store(d, h, w, acc, edge):
    # Rows and columns past the end: masked when compiled; in interpret mode the store's
    # scatter drops out-of-bounds indices (and clamped lanes rewrite their own value).
    mask = col_mask if w.shape == (bw,) else None
    if W % sw or interleave:
      past = w < W  # (an interleaved line's overhang past the last m is past W too)
      mask = past if mask is None else (mask & past)
    if edge:
      rows = jnp.broadcast_to((d < D) & (h < H), w.shape)
      mask = rows if mask is None else (mask & rows)
    tile.store(dx_ref, tile.index(b, d, h, w), acc.astype(dtype), mask)

  # Every phase (``rd, rh`` and a column group) sums its taps in descending tap order. A tap's
  # windows are a tile at a static offset ``(qd, qh, qw)`` from the block (``j``, not ``qw``,
  # where each lane has its own column phase), and phases share offsets (a 3x3/s2 block's four
  # phases read four tiles, for nine taps): so the tiles are loaded once each, in ascending
  # offset order, which is every phase's descending tap order, and added into every phase
  # that reads them.
  phases = [(rd, rh, gi) for rd, rh in itertools.product(range(g.strides[0]), range(g.strides[1]))
            for gi in range(len(groups))]
  uses: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # offset -> [(phase, tap)]
  lane_oks: dict[tuple[int, int, int], Any] = {}
  cols: dict[tuple[int, int, int], Any] = {}
  every_tap = []  # whether each phase visits every tap of the window
  for p, (rd, rh, gi) in enumerate(phases):
    _, m, jtaps = groups[gi]
    n = 0
    for a, qd in phase_taps(g, 0, rd):
      for i, qh in phase_taps(g, 1, rh):
        for j, qw, lane_ok in jtaps:
          key = (qd, qh, qw if lane_ok is None else -j)
          uses.setdefault(key, []).append((p, (a * g.window[1] + i) * g.window[2] + j))
          lane_oks[key], cols[key] = lane_ok, m + qw
          n += 1
    every_tap.append(n == g.num_taps)

  def body(edge: bool):
    accs: list[Any] = [None] * len(phases)
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
      dyt = _load(dy_ref, where, ok, None if ok is None else np.array(0, dtype))
      if mode == "max":
        it = _load(idx_ref, where, ok, None if ok is None else np.array(-1, idx_ref.dtype))
        for p, t in uses[key]:
          c = jnp.where(it == t, dyt, np.array(0, dtype))
          if accs[p] is None and not every_tap[p]:
            # The XLA path adds a zero for each tap this phase skips, so its sums are never
            # -0.0: -0.0 + 0.0 is +0.0. (A select: XLA:CPU would simplify zero + c to c.)
            accs[p] = jnp.where(c == 0, zero, c)
          else:
            accs[p] = c if accs[p] is None else accs[p] + c
      else:
        c = dyt.astype(acc_t) / divisor_of((od, oh, ow))
        if ok is not None:
          c = jnp.where(ok, c, 0)
        for p, _ in uses[key]:
          accs[p] = c if accs[p] is None else accs[p] + c
    accs = [zero if acc is None else acc for acc in accs]
    ng = len(groups)
    for n, (rd, rh) in enumerate(itertools.product(range(g.strides[0]), range(g.strides[1]))):
      d, h = md * g.strides[0] + rd, mh * g.strides[1] + rh
      mine = accs[n * ng:(n + 1) * ng]
      if interleave:
        # Whole lines of ``sw * bw`` columns: column ``m * sw + r`` from phase ``r``.
        store(d, h, c0 * sw + jnp.arange(bw * sw, dtype=jnp.int32), _interleave(mine), edge)
      else:
        for (w, _, _), acc in zip(groups, mine):
          store(d, h, w, acc, edge)

  _both_paths(interior, body)


def _backward_cols(g: Geometry) -> int:
  """The backward's columns (``g`` lifted to 3-D): phase columns ``m``, or, channels_first
  with a stride that does not interleave, input columns."""
  if g.channels_last or _interleaves(g.strides[2]):
    return -(-g.in_spatial[2] // g.strides[2])
  return g.in_spatial[2]


def _backward_call(operands, in_shape, geom: Geometry, mode: str, interpret: bool,
                   include_pad: bool = False, divisor: int | None = None,
                   launch: Launch | None = None) -> jax.Array:
  g = geom.lift(3)
  dy = operands[-1]
  ops4 = [_view(o, g.out_spatial, g.channels_last) for o in operands]
  lanes, nb = _lanes_and_batch(ops4[0], g.channels_last)
  mcount = [-(-n // s) for n, s in zip(g.in_spatial, g.strides)]
  # The column block counts phase columns ``m`` (or, channels_first with a stride that does not
  # interleave, input columns).
  cols = _backward_cols(g)
  bw, bl, warps = launch or launch_for(f"{mode}_bwd", in_shape, dy.dtype, geom,
                                       interpret=interpret, include_pad=include_pad,
                                       divisor=divisor)
  grid = (nb * mcount[0] * mcount[1], pl.cdiv(cols, bw), pl.cdiv(lanes, bl))
  kernel = functools.partial(_backward_kernel, g=g, bw=bw, bl=bl, lanes=lanes, mode=mode,
                             include_pad=include_pad, divisor=divisor, interpret=interpret)
  shape4 = _view_shape(in_shape, g.in_spatial, g.channels_last)
  nbytes = sum(o.size * o.dtype.itemsize for o in operands) + math.prod(shape4) * \
      dy.dtype.itemsize
  dx = pl.pallas_call(
      kernel, out_shape=out_struct(shape4, dy.dtype, dy), grid=grid, interpret=interpret,
      name=f"jaxpool_{mode}_pool_bwd",
      cost_estimate=pl.CostEstimate(flops=math.prod(shape4) * g.num_taps, transcendentals=0,
                                    bytes_accessed=nbytes),
      **_call_kwargs(interpret, warps))(*ops4)
  return dx.reshape(in_shape)


def max_backward(taps: jax.Array, dy: jax.Array, in_shape, geom: Geometry, *,
                 interpret: bool) -> jax.Array:
  """``dx``: each input element sums, in descending tap order, the ``dy`` of windows choosing it.

  Args:
    taps: winning tap offsets from :func:`max_forward_taps` (the forward output's shape);
      ``-1`` sends nothing.
    dy: cotangent, the forward output's shape.
    in_shape: the forward input's shape.
  """
  return _backward_call((taps, dy), in_shape, geom, "max", interpret)


def avg_backward(dy: jax.Array, in_shape, geom: Geometry, *, interpret: bool,
                 count_include_pad: bool, divisor_override: int | None) -> jax.Array:
  """``dx``: each input element sums ``dy / divisor`` of the windows that hold it."""
  return _backward_call((dy,), in_shape, geom, "avg", interpret, count_include_pad,
                        divisor_override)


# ----------------------------------------------------------------------------- launch


OPS = ("max_fwd", "argmax_fwd", "avg_fwd", "max_bwd", "avg_bwd")


def launch_for(op: str, in_shape, dtype, geom: Geometry, *, interpret: bool,
               include_pad: bool = False, divisor: int | None = None,
               activation: str | None = None) -> Launch:
  """The launch configuration of kernel ``op`` (:data:`OPS`) on an input of ``in_shape``.

  Interpret mode, platforms other than CUDA and ``JAXPOOL_TUNE=off``: :func:`launch_config`
  (the heuristic constants). Otherwise the tuner's choice (``tuning.py``): from memory, the
  disk cache or the shipped table, else tuned now among :func:`tuning.candidates` (unless
  ``JAXPOOL_TUNE=cached``). Every configuration computes the same bits.
  """
  if op not in OPS:
    raise ValueError(f"op must be one of {OPS}, got {op!r}")
  g = geom.lift(3)
  dtype = np.dtype(dtype)
  in_shape = tuple(int(n) for n in in_shape)
  forward = op.endswith("_fwd")
  kind = op[:-4]
  out_shape = geom.output_shape(in_shape)
  spatial = g.out_spatial if forward else g.in_spatial
  view = _view_shape(out_shape if forward else in_shape, spatial, g.channels_last)
  lanes = view[-1] if g.channels_last else view[0]
  cols = g.out_spatial[2] if forward else _backward_cols(g)
  heuristic = launch_config(cols, lanes, dtype.itemsize, g.channels_last)
  if interpret or tuning.mode() == "off" or platform() != "cuda":
    return heuristic
  key = tuning.Key(op, dtype.name, "channels_last" if g.channels_last else "channels_first",
                   tuning.geometry_class(g.window, g.strides, g.dilation, cols, lanes,
                                         math.prod(view)))
  cands = tuning.candidates(heuristic, cols, lanes, dtype.itemsize, g.channels_last,
                            tuning.max_candidates())

  def call(launch: Launch, *ops):
    if forward:
      return _window_call(ops[0], geom, kind, False, include_pad, divisor, launch, activation)
    return _backward_call(ops, in_shape, geom, kind, False, include_pad, divisor, launch)

  n_taps = g.num_taps
  operand_types = ([jax.ShapeDtypeStruct(in_shape, dtype)] if forward else
                   ([jax.ShapeDtypeStruct(out_shape, taps_dtype(n_taps))] if kind == "max" else [])
                   + [jax.ShapeDtypeStruct(out_shape, dtype)])

  def compile_launch(launch: Launch):
    return jax.jit(functools.partial(call, launch)).lower(*operand_types).compile()

  def args():
    with jax.ensure_compile_time_eval():  # (concrete arrays, even inside a trace)
      k1, k2 = jax.random.split(jax.random.key(0))
      data = jax.random.normal(k1, operand_types[-1].shape, jnp.float32).astype(dtype)
      if forward or kind == "avg":
        return (data,)
      taps = jax.random.randint(k2, out_shape, -1, n_taps, jnp.int32).astype(taps_dtype(n_taps))
      return (taps, data)

  return tuning.default_tuner().choose(key, heuristic, cands,
                                       tuning.Trial(compile_launch, args),
                                       tune=tuning.mode() == "auto")
