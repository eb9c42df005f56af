"""Pallas kernels for GPUs (the Triton backend), 2-D pooling in channels_last.

Every kernel sees its operands as ``(B, H, W, C)`` (the leading batch dims flattened; a 1-D
pool is ``H = 1``). One program covers one row of its output (``b, h``), a block of ``bw``
columns and a block of ``bc`` channels; channels are the contiguous dim, so each tap's load is a
coalesced ``(bw, bc)`` tile. Windows that overlap the edges are masked explicitly: every index is
clamped into the array and the lanes that fall outside (padding, the ceil-mode overhang, the
block's overhang past ``W`` or ``C``) are masked out of the result, so the kernels never read or
write out of bounds, compiled or in interpret mode.

Forward kernels gather over the window's taps (max with the argmax, or a sum for average
pooling). Backward kernels are gathers too: each input element visits the taps of the windows
that can hold it, in a fixed order, and sums the cotangents of those that chose it (max) or
their share (average): no atomics, the same bits on every run.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as _plgpu
  plgpu: ModuleType | None = _plgpu
except ImportError:  # pragma: no cover - jaxlib without the Triton backend
  plgpu = None

from jaxpool._src.windows import Geometry, argmax_dtype
from jaxpool._src.xla import accumulator_dtype, lowest

# Older Pallas had ``load``/``store`` at the top level; newer jax (and its type hints) has not.
_pl_legacy: ModuleType = pl


@dataclasses.dataclass(frozen=True)
class Geom2:
  """A 2-D channels_last pooling geometry in the kernels' terms (1-D pools get ``H = 1``)."""

  H: int
  W: int
  Ho: int
  Wo: int
  kh: int
  kw: int
  sh: int
  sw: int
  dh: int
  dw: int
  ph: int  # low padding (the high side only shows through Ho/Wo)
  pw: int
  phh: int  # high user padding (counted by count_include_pad; the ceil overhang is not)
  pwh: int

  @property
  def taps(self) -> int:
    return self.kh * self.kw

  @staticmethod
  def from_geometry(geom: Geometry) -> Geom2:
    if geom.nspatial == 1:
      (w,), (k,), (s,), (d,) = geom.in_spatial, geom.window, geom.strides, geom.dilation
      ((lo, hi),), (o,) = geom.padding, geom.out_spatial
      return Geom2(1, w, 1, o, 1, k, 1, s, 1, d, 0, lo, 0, hi)
    (h, w), (kh, kw), (sh, sw), (dh, dw) = (geom.in_spatial, geom.window, geom.strides,
                                            geom.dilation)
    ((ph, phh), (pw, pwh)), (ho, wo) = geom.padding, geom.out_spatial
    return Geom2(h, w, ho, wo, kh, kw, sh, sw, dh, dw, ph, pw, phh, pwh)


def _pow2_at_most(n: int) -> int:
  return 1 << (max(int(n), 1).bit_length() - 1)


def _next_pow2(n: int) -> int:
  return 1 << (max(int(n), 1) - 1).bit_length()


def block_sizes(width: int, channels: int, itemsize: int) -> tuple[int, int]:
  """``(bw, bc)``, powers of two: whole channels up to 512 bytes a row; columns, little waste."""
  bc = min(_next_pow2(channels), max(512 // itemsize, 1))
  budget = max(8192 // bc, 1)  # at most 8192 elements a tile
  best: tuple[tuple[int, int], int] | None = None
  for bw in (1, 2, 4, 8, 16, 32, 64, 128):
    if bw > budget:
      break
    padded = -(-width // bw) * bw
    key = (padded, -bw)
    if best is None or key < best[0]:
      best = (key, bw)
  if best is None:  # unreachable: budget >= 1, so bw = 1 always qualifies
    raise ValueError(f"no column block for width {width}, {channels} channels.")
  return best[1], bc


class _Tile:
  """Column and channel coordinates of one program's tile, clamped into range.

  ``cols`` and ``chans`` are clamped, so lanes past the end duplicate the last real column or
  channel: they compute the same value and, in interpret mode (where stores go unmasked, since
  the interpreter's masked scatter would let a masked lane restore an old value), write it again.
  """

  def __init__(self, n_cols: int, channels: int, bw: int, bc: int, interpret: bool):
    raw_w = pl.program_id(1) * bw + jnp.arange(bw, dtype=jnp.int32)
    raw_c = pl.program_id(2) * bc + jnp.arange(bc, dtype=jnp.int32)
    self.cols = jnp.minimum(raw_w, n_cols - 1)
    self.in_cols = raw_w < n_cols
    exact_c = channels % bc == 0
    self.chan_index: slice | pl.Slice | jax.Array
    self.chan_mask: jax.Array | None
    if exact_c and not interpret:
      # Compiled: a plain slice keeps the channel dim provably contiguous (vector loads).
      self.chan_index = pl.ds(pl.program_id(2) * bc, bc)
      self.chan_mask = None
    else:
      self.chan_index = jnp.minimum(raw_c, channels - 1)[None, :]
      self.chan_mask = None if exact_c else (raw_c < channels)[None, :]
    self.interpret = interpret

  def index(self, b, row, cols):
    """Indexer for ``ref[b, row, cols, chans]`` -> ``(bw, bc)``."""
    if isinstance(self.chan_index, pl.Slice):
      return (b, row, cols, self.chan_index)
    return (b, row, cols[:, None], self.chan_index)

  def store_mask(self):
    m = self.in_cols[:, None]
    return m if self.chan_mask is None else (m & self.chan_mask)


def _load(ref, idx, mask, other):
  if plgpu is not None and hasattr(plgpu, "load"):
    return plgpu.load(ref.at[idx], mask=mask, other=other)
  return _pl_legacy.load(ref, idx, mask=mask, other=other)  # pragma: no cover - older Pallas


def _store(ref, idx, val, tile: _Tile):
  if tile.interpret:
    ref[idx] = val
    return
  mask = tile.store_mask()
  if plgpu is not None and hasattr(plgpu, "store"):
    plgpu.store(ref.at[idx], val, mask=mask)
  else:  # pragma: no cover - older Pallas
    _pl_legacy.store(ref, idx, val, mask=mask)


def _compiler_params(num_warps: int = 4):
  if plgpu is None:
    return None
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _grid_spec_kwargs(interpret: bool):
  return {} if interpret else {"compiler_params": _compiler_params()}


# ----------------------------------------------------------------------------- forward


def _window_kernel(x_ref, *out_refs, g: Geom2, bw: int, bc: int, channels: int, mode: str,
                   include_pad: bool, divisor: int | None, interpret: bool):
  """One output row: max (``mode='max'``), max with argmax (``'argmax'``) or average (``'avg'``)."""
  pid = pl.program_id(0)
  b, ho = pid // g.Ho, pid % g.Ho
  tile = _Tile(g.Wo, channels, bw, bc, interpret)
  wo = tile.cols
  dtype = x_ref.dtype
  if mode == "avg":
    acc_t = accumulator_dtype(dtype)
    acc = jnp.zeros((bw, bc), acc_t)
    cnt_h = jnp.zeros((), jnp.int32)
    cnt_w = jnp.zeros((bw,), jnp.int32)
  else:
    best = jnp.full((bw, bc), lowest(dtype), dtype)
    idx = jnp.full((bw, bc), -1, jnp.int32)
  lo_h, hi_h = (-g.ph, g.H + g.phh) if include_pad else (0, g.H)
  lo_w, hi_w = (-g.pw, g.W + g.pwh) if include_pad else (0, g.W)
  for i in range(g.kh):
    h = ho * g.sh + i * g.dh - g.ph
    h_ok = (h >= 0) & (h < g.H)
    hc = jnp.clip(h, 0, g.H - 1)
    if mode == "avg":
      cnt_h = cnt_h + ((h >= lo_h) & (h < hi_h)).astype(jnp.int32)
    for j in range(g.kw):
      w = wo * g.sw + j * g.dw - g.pw
      # Lanes past the block's end are clamped copies of real ones: never masked here.
      ok = (h_ok & (w >= 0) & (w < g.W))[:, None]
      wc = jnp.clip(w, 0, g.W - 1)
      if mode == "avg":
        if i == 0:
          cnt_w = cnt_w + ((w >= lo_w) & (w < hi_w)).astype(jnp.int32)
        xt = _load(x_ref, tile.index(b, hc, wc), ok, np.array(0, dtype))
        acc = acc + jnp.where(ok, xt.astype(acc_t), 0)
        continue
      xt = _load(x_ref, tile.index(b, hc, wc), ok, lowest(dtype))
      if mode == "argmax":
        better = (idx < 0) | (xt > best)
      else:
        better = xt > best
      if jnp.issubdtype(dtype, jnp.floating):
        better = better | (jnp.isnan(xt) & ~jnp.isnan(best))
      better = better & ok
      best = jnp.where(better, xt, best)
      if mode == "argmax":
        idx = jnp.where(better, i * g.kw + j, idx)
  out_idx = tile.index(b, ho, wo)
  if mode == "avg":
    if divisor is not None:
      div = jnp.full((bw, 1), divisor, acc_t)
    else:
      cnt = cnt_h * cnt_w
      div = jnp.where(cnt == 0, 1, cnt).astype(acc_t)[:, None]
    _store(out_refs[0], out_idx, (acc / div).astype(dtype), tile)
    return
  _store(out_refs[0], out_idx, best, tile)
  if mode == "argmax":
    _store(out_refs[1], out_idx, idx.astype(out_refs[1].dtype), tile)


def _as4(x: jax.Array, g: Geom2, spatial: tuple[int, int]) -> jax.Array:
  c = x.shape[-1]
  return x.reshape(-1, spatial[0], spatial[1], c)


def _window_call(x: jax.Array, geom: Geometry, mode: str, interpret: bool,
                 include_pad: bool = False, divisor: int | None = None):
  g = Geom2.from_geometry(geom)
  out_shape = geom.output_shape(x.shape)
  c = x.shape[-1]
  x4 = _as4(x, g, (g.H, g.W))
  nb = x4.shape[0]
  bw, bc = block_sizes(g.Wo, c, x.dtype.itemsize)
  grid = (nb * g.Ho, pl.cdiv(g.Wo, bw), pl.cdiv(c, bc))
  shape4 = (nb, g.Ho, g.Wo, c)
  outs = [jax.ShapeDtypeStruct(shape4, x.dtype)]
  if mode == "argmax":
    outs.append(jax.ShapeDtypeStruct(shape4, argmax_dtype(g.taps)))
  kernel = functools.partial(_window_kernel, g=g, bw=bw, bc=bc, channels=c, mode=mode,
                             include_pad=include_pad, divisor=divisor, interpret=interpret)
  n_in, n_out = x.size * x.dtype.itemsize, sum(
      int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize for o in outs)
  res = pl.pallas_call(
      kernel, out_shape=tuple(outs), grid=grid, interpret=interpret,
      name=f"jaxpool_{mode}_pool_fwd",
      cost_estimate=pl.CostEstimate(flops=int(np.prod(shape4)) * g.taps,
                                    transcendentals=0, bytes_accessed=n_in + n_out),
      **_grid_spec_kwargs(interpret))(x4)
  return tuple(r.reshape(out_shape) for r in res)


def max_forward(x: jax.Array, geom: Geometry, *, interpret: bool) -> jax.Array:
  """Max pooling without the argmax. ``x: (*batch, *spatial, C)`` -> ``(*batch, *out, C)``."""
  return _window_call(x, geom, "max", interpret)[0]


def max_forward_argmax(x: jax.Array, geom: Geometry, *, interpret: bool):
  """Max pooling and the argmax as a row-major tap offset (``argmax_dtype``; -1: no element)."""
  return _window_call(x, geom, "argmax", interpret)


def avg_forward(x: jax.Array, geom: Geometry, *, interpret: bool, count_include_pad: bool,
                divisor_override: int | None) -> jax.Array:
  """Average pooling; sums in float32 for 16-bit inputs."""
  return _window_call(x, geom, "avg", interpret, count_include_pad, divisor_override)[0]


# ----------------------------------------------------------------------------- backward


def _backward_kernel(*refs, g: Geom2, bw: int, bc: int, channels: int, mode: str,
                     include_pad: bool, divisor: int | None, interpret: bool):
  """``dx`` for ``sh`` input rows and ``sw * bw`` columns, one stride phase at a time.

  The input element ``(h, w) = (hm * sh + rh, m * sw + rw)`` lies at tap ``(i, j)`` of window
  ``(hm + qh, m + qw)`` exactly when ``rh + ph - i * dh = qh * sh`` and ``rw + pw - j * dw =
  qw * sw``: for a fixed phase ``(rh, rw)`` the taps that can hold it and the offsets ``qh, qw``
  are static, and each tap's window coordinates are a contiguous run over ``m``. So each phase
  loads only the taps that matter, as whole tiles, and sums them in descending tap order: the
  order in which JAX's transpose of the XLA path's tap gather adds them (the skipped taps add
  exact zeros there), so max-pool gradients have the same bits on both paths.
  """
  if mode == "max":
    idx_ref, dy_ref, dx_ref = refs
  else:
    dy_ref, dx_ref = refs
  hm_count = -(-g.H // g.sh)
  pid = pl.program_id(0)
  b, hm = pid // hm_count, pid % hm_count
  m = pl.program_id(1) * bw + jnp.arange(bw, dtype=jnp.int32)
  raw_c = pl.program_id(2) * bc + jnp.arange(bc, dtype=jnp.int32)
  exact_c = channels % bc == 0
  chans: slice | pl.Slice | jax.Array
  if exact_c and not interpret:
    chans = pl.ds(pl.program_id(2) * bc, bc)
  else:
    chans = jnp.minimum(raw_c, channels - 1)[None, :]

  def at(row, cols):
    if isinstance(chans, pl.Slice):
      return (b, row, cols, chans)
    return (b, row, cols[:, None], chans)

  dtype = dy_ref.dtype
  acc_t = accumulator_dtype(dtype)
  lo_h, hi_h = (-g.ph, g.H + g.phh) if include_pad else (0, g.H)
  lo_w, hi_w = (-g.pw, g.W + g.pwh) if include_pad else (0, g.W)
  zero = jnp.zeros((bw, bc), acc_t)
  for rh in range(g.sh):
    h = hm * g.sh + rh
    for rw in range(g.sw):
      w = m * g.sw + rw
      acc = None
      for t in reversed(range(g.taps)):
        i, j = divmod(t, g.kw)
        qh, remh = divmod(rh + g.ph - i * g.dh, g.sh)
        qw, remw = divmod(rw + g.pw - j * g.dw, g.sw)
        if remh or remw:
          continue
        ho, wo = hm + qh, m + qw
        ok = ((ho >= 0) & (ho < g.Ho) & (wo >= 0) & (wo < g.Wo))[:, None]
        where = at(jnp.clip(ho, 0, g.Ho - 1), jnp.clip(wo, 0, g.Wo - 1))
        dyt = _load(dy_ref, where, ok, np.array(0, dtype))
        if mode == "max":
          sel = ok & (_load(idx_ref, where, ok, np.array(-1, idx_ref.dtype)) == t)
          c = jnp.where(sel, dyt, np.array(0, dtype)).astype(acc_t)
          if acc is None:
            acc = c if t == g.taps - 1 else (zero + c).astype(dtype).astype(acc_t)
          else:
            # Round after every add, as the XLA path does when it adds 16-bit cotangents.
            acc = (acc + c).astype(dtype).astype(acc_t)
        else:
          if divisor is not None:
            div = jnp.full((bw,), divisor, acc_t)
          else:
            # The divisor of window (ho, wo): its taps inside the counted region.
            hoc, woc = jnp.clip(ho, 0, g.Ho - 1), jnp.clip(wo, 0, g.Wo - 1)
            ch = jnp.zeros((), jnp.int32)
            for ii in range(g.kh):
              hh = hoc * g.sh + ii * g.dh - g.ph
              ch = ch + ((hh >= lo_h) & (hh < hi_h)).astype(jnp.int32)
            cw = jnp.zeros((bw,), jnp.int32)
            for jj in range(g.kw):
              ww = woc * g.sw + jj * g.dw - g.pw
              cw = cw + ((ww >= lo_w) & (ww < hi_w)).astype(jnp.int32)
            cnt = ch * cw
            div = jnp.where(cnt == 0, 1, cnt).astype(acc_t)
          c = jnp.where(ok, dyt.astype(acc_t) / div[:, None], 0)
          acc = c if acc is None else acc + c
      if acc is None:
        acc = zero
      # Rows and columns past the end: masked when compiled; in interpret mode the store's
      # scatter drops out-of-bounds indices (and clamped channels rewrite their own value).
      if interpret:
        dx_ref[at(h, w)] = acc.astype(dtype)
      else:
        mask = ((w < g.W) & (h < g.H))[:, None]
        if not exact_c:
          mask = mask & (raw_c < channels)[None, :]
        if plgpu is None:  # pragma: no cover - compiled kernels need the Triton backend
          raise RuntimeError("compiled Pallas GPU kernels need jax.experimental.pallas.triton.")
        plgpu.store(dx_ref.at[at(h, w)], acc.astype(dtype), mask=mask)


def _backward_call(operands, in_shape, geom: Geometry, mode: str, interpret: bool,
                   include_pad: bool = False, divisor: int | None = None) -> jax.Array:
  g = Geom2.from_geometry(geom)
  dy = operands[-1]
  c = dy.shape[-1]
  ops4 = [_as4(o, g, (g.Ho, g.Wo)) for o in operands]
  nb = ops4[0].shape[0]
  bw, bc = block_sizes(-(-g.W // g.sw), c, dy.dtype.itemsize)
  grid = (nb * -(-g.H // g.sh), pl.cdiv(-(-g.W // g.sw), bw), pl.cdiv(c, bc))
  kernel = functools.partial(_backward_kernel, g=g, bw=bw, bc=bc, channels=c, mode=mode,
                             include_pad=include_pad, divisor=divisor, interpret=interpret)
  shape4 = (nb, g.H, g.W, c)
  nbytes = sum(o.size * o.dtype.itemsize for o in operands) + int(np.prod(shape4)) * \
      dy.dtype.itemsize
  dx = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(shape4, dy.dtype), grid=grid, interpret=interpret,
      name=f"jaxpool_{mode}_pool_bwd",
      cost_estimate=pl.CostEstimate(flops=int(np.prod(shape4)) * g.taps, transcendentals=0,
                                    bytes_accessed=nbytes),
      **_grid_spec_kwargs(interpret))(*ops4)
  return dx.reshape(in_shape)


def max_backward(idx: jax.Array, dy: jax.Array, in_shape, geom: Geometry, *,
                 interpret: bool) -> jax.Array:
  """``dx``: each input element sums, in descending tap order, the ``dy`` of windows choosing it.

  Args:
    idx: ``(*batch, *out, C)`` argmax tap offsets from :func:`max_forward_argmax`.
    dy: ``(*batch, *out, C)`` cotangent.
    in_shape: the forward input's shape ``(*batch, *spatial, C)``.
  """
  return _backward_call((idx, dy), in_shape, geom, "max", interpret)


def avg_backward(dy: jax.Array, in_shape, geom: Geometry, *, interpret: bool,
                 count_include_pad: bool, divisor_override: int | None) -> jax.Array:
  """``dx``: each input element sums ``dy / divisor`` of the windows that hold it."""
  return _backward_call((dy,), in_shape, geom, "avg", interpret, count_include_pad,
                        divisor_override)
