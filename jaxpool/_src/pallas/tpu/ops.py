"""Pallas kernels for TPUs (the Mosaic TPU backend), 2-D pooling in channels_last.

Every kernel sees its operands as ``(B, H, W, C)`` (the leading batch dims flattened; a 1-D pool
is ``H = 1``). One grid step covers one image and one block of ``cb`` channels: its input block
``(H, W, cb)`` sits in VMEM, channels on the 128 lanes and columns on the sublanes. Nothing is
gathered: the kernel copies its block (in float32) into a VMEM scratch padded on every side with
the fill value (``-inf`` for max, ``0`` for average), then walks the output rows in a loop; for
output row ``ho`` and tap ``(i, j)`` it reads the padded row ``ho * sh + i * dh`` at columns
``j * dw + wo * sw`` as one sublane-strided load (``pl.ds(start, Wo, stride=sw)``, static start
and stride), a ``(Wo, cb)`` tile. Padding never reaches the result of a max: a tap's rows are real
for one scalar test of ``ho`` and its columns for a static range of ``wo`` (a 2-D iota mask).

Backward kernels are gathers, as on the GPU: input row ``h = hm * sh + rh`` and the columns of
phase ``rw`` (``w = m * sw + rw``) receive, in descending tap order, the cotangents of the windows
``(hm + qh, m + qw)`` that can hold them; ``qh``, ``qw`` and the taps that matter are static per
phase, so each tap's window columns are one contiguous run of a ``dy`` (and argmax) scratch
padded with zeros (and ``-1``). Each phase's sum goes to the row's float32 scratch with one
sublane-strided store; the row is then cast and stored whole. No atomics, a fixed order, and for
max pooling the same bits as JAX's transpose of the XLA path's tap gather.

Strided loads and stores only touch 32-bit scratch (``tpu.strided_load``/``strided_store``), so
16-bit inputs are upcast once per block; the max is exact in float32, and 16-bit gradient sums
round to the input dtype after every add, as the XLA path does.

No TPU was reachable when these were written: they are tested in the TPU interpreter
(``pltpu.InterpretParams``) on a CPU and checked to lower to Mosaic
(``lowering_platforms=("tpu",)``); see docs/pallas.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpool._src.pallas.calls import out_struct
from jaxpool._src.windows import Geometry, phase_taps, taps_dtype
from jaxpool._src.autodiff import apply_activation
from jaxpool._src.dtypes import accumulator_dtype, beats, lowest

@dataclasses.dataclass(frozen=True)
class Geom2:
  """The Geometry lifted to 2-D (``Geometry.lift``; 1-D pools get ``H = 1``), its numbers
  under the short names the kernels' index arithmetic reads best with. No arithmetic of its
  own."""

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
  geom: Geometry  # the lifted geometry itself

  @property
  def taps(self) -> int:
    return self.kh * self.kw

  @staticmethod
  def from_geometry(geom: Geometry) -> Geom2:
    g = geom.lift(2)
    (h, w), (ho, wo), (kh, kw) = g.in_spatial, g.out_spatial, g.window
    (sh, sw), (dh, dw), (ph, pw), (phh, pwh) = g.strides, g.dilation, g.pad_lo, g.pad_hi
    return Geom2(h, w, ho, wo, kh, kw, sh, sw, dh, dw, ph, pw, phh, pwh, g)


VMEM_BUDGET = 48 * 2**20  # bytes of VMEM one grid step may use (v5e/v6e have 128 MiB, v7x 64)
_F32 = jnp.float32


def _interpret_arg(interpret: bool | str):
  """``pallas_call``'s ``interpret``: False (compile for a TPU), True (Pallas' generic
  interpreter) or ``"tpu"`` (the TPU interpreter, ``pltpu.InterpretParams``: out-of-bounds reads
  raise, uninitialized VMEM reads NaN).

  ``ops.py`` uses True: the TPU interpreter's ordered callbacks are not threaded through the
  transpose of ``linear_call`` (JAX 0.10.2 fails to lower it), so the tests run the kernels
  through the TPU interpreter directly and through the generic one under ``grad``/``vmap``.
  """
  if interpret == "tpu":
    params = getattr(pltpu, "InterpretParams", None)
    return params() if params is not None else True
  return bool(interpret)


def _round_up(n: int, m: int) -> int:
  return -(-int(n) // m) * m


def _tile_bytes(rows: int, cols: int, chans: int, itemsize: int) -> int:
  """VMEM bytes of a ``(rows, cols, chans)`` buffer in Mosaic's tiled layout."""
  sublanes = 8 * max(4 // itemsize, 1)  # packed dtypes tile (16, 128) / (32, 128)
  return rows * _round_up(cols, sublanes) * _round_up(chans, 128) * itemsize


def _pad_dims(g: Geom2) -> tuple[int, int]:
  """Rows and columns of the padded input scratch: the input after ``ph``/``pw`` and every tap."""
  hp = max(g.ph + g.H, (g.Ho - 1) * g.sh + (g.kh - 1) * g.dh + 1)
  wp = max(g.pw + g.W, (g.Wo - 1) * g.sw + (g.kw - 1) * g.dw + 1)
  return hp, wp


def _taps_inside(g: Geom2, dim: int, o, include_pad: bool):
  """Taps of window ``o`` (traced) along ``dim`` inside the counted region, tap by tap: Mosaic
  lowers the closed form of ``windows.window_count`` (integer division) only for a known TPU."""
  k, s, d = g.geom.window[dim], g.geom.strides[dim], g.geom.dilation[dim]
  (pad_lo, pad_hi), size = g.geom.padding[dim], g.geom.in_spatial[dim]
  lo, hi = (-pad_lo, size + pad_hi) if include_pad else (0, size)
  cnt = jnp.zeros(jnp.shape(o), jnp.int32)
  for t in range(k):
    pos = o * s + t * d - pad_lo
    cnt = cnt + ((pos >= lo) & (pos < hi)).astype(jnp.int32)
  return cnt


def _bwd_plan(g: Geom2):
  """Static plan of the backward gather.

  Returns ``(wm, taps, mlo, width)``: ``wm[rw]`` columns in phase ``rw``; ``taps[(rh, rw)]`` the
  ``(t, qh, qw)`` that can hold an element of that phase (``windows.phase_taps`` per dim), in
  descending ``t``; and the ``dy`` scratch's column margin ``mlo`` and width so that every run
  ``mlo + qw + [0, wm[rw])`` is in it.
  """
  wm = [-(-(g.W - rw) // g.sw) for rw in range(g.sw)]
  taps, lo, hi = {}, 0, g.Wo
  for rh in range(g.sh):
    for rw in range(g.sw):
      found = [] if wm[rw] == 0 else sorted(
          ((i * g.kw + j, qh, qw) for i, qh in phase_taps(g.geom, 0, rh)
           for j, qw in phase_taps(g.geom, 1, rw)), reverse=True)
      for _, _, qw in found:
        lo, hi = min(lo, qw), max(hi, qw + wm[rw])
      taps[(rh, rw)] = found
  return wm, taps, -lo, hi - lo


def channel_block(channels: int) -> int:
  """Channels a grid step covers: all of them, or 128 when they are a multiple of 128."""
  return 128 if channels % 128 == 0 else channels


def vmem_bytes(g: Geom2, channels: int, itemsize: int) -> int:
  """VMEM one grid step of the largest kernel needs (double-buffered blocks plus scratch)."""
  cb = channel_block(channels)
  hp, wp = _pad_dims(g)
  fwd = (2 * _tile_bytes(g.H, g.W, cb, itemsize) + 2 * _tile_bytes(g.Ho, g.Wo, cb, itemsize)
         + 2 * _tile_bytes(g.Ho, g.Wo, cb, 1) + _tile_bytes(hp, wp, cb, 4))
  _, _, _, width = _bwd_plan(g)
  bwd = (2 * _tile_bytes(g.H, g.W, cb, itemsize) + 2 * _tile_bytes(g.Ho, g.Wo, cb, itemsize)
         + 2 * _tile_bytes(g.Ho, g.Wo, cb, 1) + 2 * _tile_bytes(g.Ho, width, cb, 4)
         + _tile_bytes(1, g.W, cb, 4))
  return max(fwd, bwd)


def fits(geom: Geometry, shape, dtype) -> bool:
  """Whether one image's block fits the VMEM budget (larger images stay on XLA)."""
  g = Geom2.from_geometry(geom)
  return vmem_bytes(g, int(shape[-1]), np.dtype(dtype).itemsize) <= VMEM_BUDGET


def _compiler_params(n_grid: int, need: int):
  parallel: Literal["parallel"] = "parallel"
  return pltpu.CompilerParams(dimension_semantics=(parallel,) * n_grid,
                              vmem_limit_bytes=int(min(max(need + (8 << 20), 32 << 20),
                                                       100 << 20)))


def _fori(n: int, body):
  """``for k in range(n): body(k)`` as one loop (a static loop when it runs once)."""
  if n == 1:
    body(jnp.int32(0))
    return
  lax.fori_loop(0, n, lambda k, c: (body(k), c)[1], jnp.int32(0))


def _col_mask(lo: int, hi: int, n: int, cb: int):
  """``(n, cb)`` bool: columns in ``[lo, hi)``; None when that is every column."""
  if lo <= 0 and hi >= n:
    return None
  col = lax.broadcasted_iota(jnp.int32, (n, cb), 0)
  return (col >= lo) & (col < hi)


def _tap_cols(g: Geom2, j: int) -> tuple[int, int]:
  """Output columns ``[lo, hi)`` whose tap column ``j`` lands on a real input column."""
  off = j * g.dw - g.pw  # input column of output column wo: wo * sw + off
  lo = max(0, -(off // g.sw))  # ceil(-off / sw)
  hi = min(g.Wo, (g.W - 1 - off) // g.sw + 1) if g.W - 1 - off >= 0 else 0
  return lo, max(lo, hi)


# ----------------------------------------------------------------------------- forward


def _fill_padded(x_ref, pad_ref, g: Geom2, fill):
  hp, wp = pad_ref.shape[0], pad_ref.shape[1]
  cb = pad_ref.shape[2]
  if g.ph:
    pad_ref[0:g.ph, :, :] = jnp.full((g.ph, wp, cb), fill, _F32)
  if hp > g.ph + g.H:
    pad_ref[g.ph + g.H:hp, :, :] = jnp.full((hp - g.ph - g.H, wp, cb), fill, _F32)
  if g.pw:
    pad_ref[g.ph:g.ph + g.H, 0:g.pw, :] = jnp.full((g.H, g.pw, cb), fill, _F32)
  if wp > g.pw + g.W:
    pad_ref[g.ph:g.ph + g.H, g.pw + g.W:wp, :] = jnp.full((g.H, wp - g.pw - g.W, cb), fill, _F32)
  pad_ref[g.ph:g.ph + g.H, g.pw:g.pw + g.W, :] = x_ref[...].astype(_F32)


def _row_taps(pad_ref, ho, i: int, j: int, g: Geom2):
  """The ``(Wo, cb)`` tile of tap ``(i, j)`` for output row ``ho`` (one strided load)."""
  cols = pl.ds(j * g.dw, g.Wo, stride=g.sw) if g.sw > 1 else pl.ds(j * g.dw, g.Wo)
  return pad_ref[ho * g.sh + i * g.dh, cols, :]


def _max_kernel(x_ref, *refs, g: Geom2, argmax: bool, activation: str | None = None):
  if argmax:
    y_ref, idx_ref, pad_ref = refs
  else:
    y_ref, pad_ref = refs
  cb = pad_ref.shape[2]
  _fill_padded(x_ref, pad_ref, g, lowest(_F32))
  col_ok = [_col_mask(*_tap_cols(g, j), g.Wo, cb) for j in range(g.kw)]

  def row(ho):
    best = jnp.full((g.Wo, cb), -jnp.inf, _F32)
    idx = jnp.full((g.Wo, cb), -1, jnp.int32)
    for i in range(g.kh):
      h = ho * g.sh + i * g.dh - g.ph
      h_ok = (h >= 0) & (h < g.H)
      for j in range(g.kw):
        xt = _row_taps(pad_ref, ho, i, j, g)
        better = (idx < 0) | beats(xt, best) if argmax else beats(xt, best)
        ok = h_ok if col_ok[j] is None else (col_ok[j] & h_ok)
        better = better & ok
        best = jnp.where(better, xt, best)
        if argmax:
          idx = jnp.where(better, i * g.kw + j, idx)
    best, idx = apply_activation(best, idx if argmax else None, activation)
    y_ref[ho] = best.astype(y_ref.dtype)
    if argmax:
      idx_ref[ho] = idx.astype(idx_ref.dtype)

  _fori(g.Ho, row)


def _avg_kernel(x_ref, y_ref, pad_ref, *, g: Geom2, include_pad: bool, divisor: int | None):
  cb = pad_ref.shape[2]
  _fill_padded(x_ref, pad_ref, g, 0.0)
  if divisor is None:
    cnt_w = _taps_inside(g, 1, lax.broadcasted_iota(jnp.int32, (g.Wo, cb), 0), include_pad)

  def row(ho):
    acc = jnp.zeros((g.Wo, cb), _F32)
    for i in range(g.kh):
      for j in range(g.kw):
        acc = acc + _row_taps(pad_ref, ho, i, j, g)
    if divisor is not None:
      out = acc / jnp.float32(divisor)
    else:
      cnt = _taps_inside(g, 0, ho, include_pad) * cnt_w
      out = acc / jnp.where(cnt == 0, 1, cnt).astype(_F32)
    y_ref[ho] = out.astype(y_ref.dtype)

  _fori(g.Ho, row)


def _as4(x: jax.Array, spatial: tuple[int, int]) -> jax.Array:
  return x.reshape(-1, spatial[0], spatial[1], x.shape[-1])


def _specs(nb: int, c: int, rows: int, cols: int):
  cb = channel_block(c)
  return cb, (nb, c // cb), pl.BlockSpec((None, rows, cols, cb), lambda b, k: (b, 0, 0, k))


def _forward_call(x: jax.Array, geom: Geometry, mode: str, interpret: bool | str,
                  include_pad: bool = False, divisor: int | None = None,
                  activation: str | None = None):
  g = Geom2.from_geometry(geom)
  out_shape = geom.output_shape(x.shape)
  c = x.shape[-1]
  x4 = _as4(x, (g.H, g.W))
  nb = x4.shape[0]
  cb, grid, in_spec = _specs(nb, c, g.H, g.W)
  _, _, out_spec = _specs(nb, c, g.Ho, g.Wo)
  shape4 = (nb, g.Ho, g.Wo, c)
  outs = [out_struct(shape4, x.dtype, x)]
  if mode == "argmax":
    outs.append(out_struct(shape4, taps_dtype(g.taps), x))
  if mode == "avg":
    kernel = functools.partial(_avg_kernel, g=g, include_pad=include_pad, divisor=divisor)
  else:
    kernel = functools.partial(_max_kernel, g=g, argmax=mode == "argmax", activation=activation)
  hp, wp = _pad_dims(g)
  n_bytes = x.size * x.dtype.itemsize + sum(
      int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize for o in outs)
  res = pl.pallas_call(
      kernel, out_shape=tuple(outs), grid=grid, in_specs=[in_spec],
      out_specs=tuple(out_spec for _ in outs),
      scratch_shapes=[pltpu.VMEM((hp, wp, cb), _F32)],
      compiler_params=_compiler_params(2, vmem_bytes(g, c, x.dtype.itemsize)),
      interpret=_interpret_arg(interpret), name=f"jaxpool_{mode}_pool_fwd_tpu",
      cost_estimate=pl.CostEstimate(flops=int(np.prod(shape4)) * g.taps, transcendentals=0,
                                    bytes_accessed=n_bytes))(x4)
  return tuple(r.reshape(out_shape) for r in res)


def max_forward(x: jax.Array, geom: Geometry, *, interpret: bool | str,
                activation: str | None = None) -> jax.Array:
  """Max pooling without the taps (then the activation). ``x: (*batch, *spatial, C)`` ->
  ``(*batch, *out, C)``."""
  return _forward_call(x, geom, "max", interpret, activation=activation)[0]


def max_forward_taps(x: jax.Array, geom: Geometry, *, interpret: bool | str,
                     activation: str | None = None):
  """Max pooling and each window's winning tap, row-major (``taps_dtype``; -1: none)."""
  return _forward_call(x, geom, "argmax", interpret, activation=activation)


def avg_forward(x: jax.Array, geom: Geometry, *, interpret: bool | str, count_include_pad: bool,
                divisor_override: int | None) -> jax.Array:
  """Average pooling; sums in float32."""
  return _forward_call(x, geom, "avg", interpret, count_include_pad, divisor_override)[0]


# ----------------------------------------------------------------------------- backward


def _backward_kernel(*refs, g: Geom2, mode: str, include_pad: bool, divisor: int | None):
  """``dx`` of one image and channel block, one input row and column phase at a time."""
  if mode == "max":
    idx_ref, dy_ref, dx_ref, dyp_ref, idxp_ref, row_ref = refs
  else:
    dy_ref, dx_ref, dyp_ref, row_ref = refs
  dtype = dx_ref.dtype
  acc_t = accumulator_dtype(dtype)
  cb = dyp_ref.shape[2]
  wm, plan, mlo, width = _bwd_plan(g)
  # The dy (and argmax) scratch: zeros (and -1) around the real windows.
  if mlo:
    dyp_ref[:, 0:mlo, :] = jnp.zeros((g.Ho, mlo, cb), _F32)
  if width > mlo + g.Wo:
    dyp_ref[:, mlo + g.Wo:width, :] = jnp.zeros((g.Ho, width - mlo - g.Wo, cb), _F32)
  if mode == "max":
    if mlo:
      idxp_ref[:, 0:mlo, :] = jnp.full((g.Ho, mlo, cb), -1, jnp.int32)
    if width > mlo + g.Wo:
      idxp_ref[:, mlo + g.Wo:width, :] = jnp.full((g.Ho, width - mlo - g.Wo, cb), -1, jnp.int32)
    idxp_ref[:, mlo:mlo + g.Wo, :] = idx_ref[...].astype(jnp.int32)
    dyp_ref[:, mlo:mlo + g.Wo, :] = dy_ref[...].astype(_F32)
  elif divisor is not None:
    dyp_ref[:, mlo:mlo + g.Wo, :] = dy_ref[...].astype(_F32) / jnp.float32(divisor)
  else:
    # Each window's share: dy over its divisor (the taps inside the counted region).
    cnt_w = _taps_inside(g, 1, lax.broadcasted_iota(jnp.int32, (g.Wo, cb), 0), include_pad)

    def scale(ho):
      cnt = _taps_inside(g, 0, ho, include_pad) * cnt_w
      div = jnp.where(cnt == 0, 1, cnt).astype(_F32)
      dyp_ref[ho, pl.ds(mlo, g.Wo), :] = dy_ref[ho].astype(_F32) / div

    _fori(g.Ho, scale)

  hm_count = -(-g.H // g.sh)

  def rows(hm):
    for rh in range(g.sh):
      h = hm * g.sh + rh

      def one_row(rh=rh, h=h):
        for rw in range(g.sw):
          if wm[rw] == 0:
            continue
          acc = None
          for t, qh, qw in plan[(rh, rw)]:
            ho = hm + qh
            ok = (ho >= 0) & (ho < g.Ho)
            hoc = jnp.clip(ho, 0, g.Ho - 1)
            cols = pl.ds(mlo + qw, wm[rw])
            dyt = dyp_ref[hoc, cols, :]
            if mode == "max":
              sel = ok & (idxp_ref[hoc, cols, :] == t)
              c = jnp.where(sel, dyt, 0.0)
              if acc is None:
                acc = c if t == g.taps - 1 else (0.0 + c).astype(dtype).astype(acc_t)
              else:
                # Round after every add, as the XLA path does when it adds 16-bit cotangents.
                acc = (acc + c).astype(dtype).astype(acc_t)
            else:
              c = jnp.where(ok, dyt, 0.0)
              if acc is None and len(plan[(rh, rw)]) < g.taps:
                # A phase that skips taps: the XLA path adds +0.0 for each, so a zero sum is
                # +0.0 (a select: XLA:CPU would fold 0.0 + c into c).
                acc = jnp.where(c == 0, 0.0, c)
              else:
                acc = c if acc is None else acc + c
          if acc is None:
            acc = jnp.zeros((wm[rw], cb), _F32)
          if g.sw == 1:
            row_ref[...] = acc
          else:
            row_ref[pl.ds(rw, wm[rw], stride=g.sw), :] = acc
        dx_ref[h] = row_ref[...].astype(dtype)

      if g.H % g.sh and rh >= g.H % g.sh:
        pl.when(h < g.H)(one_row)
      else:
        one_row()

  _fori(hm_count, rows)


def _backward_call(operands, in_shape, geom: Geometry, mode: str, interpret: bool | str,
                   include_pad: bool = False, divisor: int | None = None) -> jax.Array:
  g = Geom2.from_geometry(geom)
  dy = operands[-1]
  c = dy.shape[-1]
  ops4 = [_as4(o, (g.Ho, g.Wo)) for o in operands]
  nb = ops4[0].shape[0]
  cb, grid, in_spec = _specs(nb, c, g.Ho, g.Wo)
  _, _, out_spec = _specs(nb, c, g.H, g.W)
  _, _, _, width = _bwd_plan(g)
  scratch = [pltpu.VMEM((g.Ho, width, cb), _F32)]
  if mode == "max":
    scratch.append(pltpu.VMEM((g.Ho, width, cb), jnp.int32))
  scratch.append(pltpu.VMEM((g.W, cb), _F32))
  kernel = functools.partial(_backward_kernel, g=g, mode=mode, include_pad=include_pad,
                             divisor=divisor)
  shape4 = (nb, g.H, g.W, c)
  n_bytes = sum(o.size * o.dtype.itemsize for o in operands) + int(np.prod(shape4)) * \
      dy.dtype.itemsize
  dx = pl.pallas_call(
      kernel, out_shape=out_struct(shape4, dy.dtype, dy), grid=grid,
      in_specs=[in_spec] * len(ops4), out_specs=out_spec, scratch_shapes=scratch,
      compiler_params=_compiler_params(2, vmem_bytes(g, c, dy.dtype.itemsize)),
      interpret=_interpret_arg(interpret), name=f"jaxpool_{mode}_pool_bwd_tpu",
      cost_estimate=pl.CostEstimate(flops=int(np.prod(shape4)) * g.taps, transcendentals=0,
                                    bytes_accessed=n_bytes))(*ops4)
  return dx.reshape(in_shape)


def max_backward(taps: jax.Array, dy: jax.Array, in_shape, geom: Geometry, *,
                 interpret: bool | str) -> jax.Array:
  """``dx``: each input element sums, in descending tap order, the ``dy`` of windows choosing it.

  Args:
    taps: ``(*batch, *out, C)`` winning tap offsets from :func:`max_forward_taps`; ``-1``
      sends nothing.
    dy: ``(*batch, *out, C)`` cotangent.
    in_shape: the forward input's shape ``(*batch, *spatial, C)``.
  """
  return _backward_call((taps, dy), in_shape, geom, "max", interpret)


def avg_backward(dy: jax.Array, in_shape, geom: Geometry, *, interpret: bool | str,
                 count_include_pad: bool, divisor_override: int | None) -> jax.Array:
  """``dx``: each input element sums ``dy / divisor`` of the windows that hold it."""
  return _backward_call((dy,), in_shape, geom, "avg", interpret, count_include_pad,
                        divisor_override)
