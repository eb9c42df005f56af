"""Pallas kernels for TPUs (the Mosaic TPU backend), 2-D pooling in channels_last.

Every kernel sees its operands as ``(B, H, W, C)`` (the leading batch dims flattened; a 1-D pool
is ``H = 1``). A grid step covers one image and a block of ``chan_block`` channels: its block
``(H, W, chan_block)`` sits in VMEM, channels on the 128 lanes, columns on the sublanes. No
gather: the kernel copies its block (in float32) into a VMEM scratch padded on every side with
the fill value (``-inf`` for max, ``0`` for average), then walks the output rows in a loop; for
output row ``ho`` and tap ``(i, j)`` it reads the padded row ``ho * sh + i * dh`` at columns
``j * dw + wo * sw`` as one sublane-strided load (``pl.ds(start, Wo, stride=sw)``, static start
and stride), a ``(Wo, chan_block)`` tile. Padding never reaches a max: a tap's rows are real
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

from jaxpool._src.api_args import Activation
from jaxpool._src.pallas.calls import out_struct
from jaxpool._src.pallas.types import ForwardMode, PoolKind
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
    lifted = geom.lift(2)
    (h, w), (ho, wo), (kh, kw) = lifted.in_spatial, lifted.out_spatial, lifted.window
    (sh, sw), (dh, dw) = lifted.strides, lifted.dilation
    (ph, pw), (phh, pwh) = lifted.pad_lo, lifted.pad_hi
    return Geom2(h, w, ho, wo, kh, kw, sh, sw, dh, dw, ph, pw, phh, pwh, lifted)


VMEM_BUDGET = 48 * 2**20  # bytes of VMEM one grid step may use (v5e/v6e have 128 MiB, v7x 64)
# The VMEM limit asked of Mosaic: the need plus a headroom, within these bounds.
VMEM_HEADROOM, VMEM_LIMIT_MIN, VMEM_LIMIT_MAX = 8 * 2**20, 32 * 2**20, 100 * 2**20
LANES, SUBLANES = 128, 8  # a vector register's (and Mosaic's 32-bit tile's) lanes and sublanes
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
  sublanes = SUBLANES * max(4 // itemsize, 1)  # packed dtypes tile (16, 128) / (32, 128)
  return rows * _round_up(cols, sublanes) * _round_up(chans, LANES) * itemsize


def _pad_dims(geom2: Geom2) -> tuple[int, int]:
  """Rows and columns of the padded input scratch: the input after ``ph``/``pw`` and every tap."""
  pad_rows = max(geom2.ph + geom2.H, (geom2.Ho - 1) * geom2.sh + (geom2.kh - 1) * geom2.dh + 1)
  pad_cols = max(geom2.pw + geom2.W, (geom2.Wo - 1) * geom2.sw + (geom2.kw - 1) * geom2.dw + 1)
  return pad_rows, pad_cols


def _taps_inside(geom2: Geom2, dim: int, position, include_pad: bool):
  """Taps of window ``position`` (traced) along ``dim`` in the counted region, tap by tap:
  Mosaic lowers ``windows.window_count``'s closed form (integer division) only for a known TPU."""
  geom = geom2.geom
  window, stride, dilation = geom.window[dim], geom.strides[dim], geom.dilation[dim]
  (pad_lo, pad_hi), size = geom.padding[dim], geom.in_spatial[dim]
  lo, hi = (-pad_lo, size + pad_hi) if include_pad else (0, size)
  count = jnp.zeros(jnp.shape(position), jnp.int32)
  for tap in range(window):
    in_pos = position * stride + tap * dilation - pad_lo
    count = count + ((in_pos >= lo) & (in_pos < hi)).astype(jnp.int32)
  return count


def _bwd_plan(geom2: Geom2):
  """Static plan of the backward gather.

  Returns ``(phase_cols, taps, margin, width)``: ``phase_cols[phase_w]`` columns in phase
  ``phase_w``; ``taps[(phase_h, phase_w)]`` the ``(tap, offset_h, offset_w)`` that can hold an
  element of that phase (``windows.phase_taps`` per dim), in descending tap; and the ``dy``
  scratch's column margin and width, so that every run ``margin + offset_w + [0,
  phase_cols[phase_w])`` is in it.
  """
  phase_cols = [-(-(geom2.W - phase_w) // geom2.sw) for phase_w in range(geom2.sw)]
  taps, lo, hi = {}, 0, geom2.Wo
  for phase_h in range(geom2.sh):
    for phase_w in range(geom2.sw):
      found = [] if phase_cols[phase_w] == 0 else sorted(
          ((i * geom2.kw + j, offset_h, offset_w)
           for i, offset_h in phase_taps(geom2.geom, 0, phase_h)
           for j, offset_w in phase_taps(geom2.geom, 1, phase_w)), reverse=True)
      for _, _, offset_w in found:
        lo, hi = min(lo, offset_w), max(hi, offset_w + phase_cols[phase_w])
      taps[(phase_h, phase_w)] = found
  return phase_cols, taps, -lo, hi - lo


def channel_block(channels: int) -> int:
  """Channels a grid step covers: all of them, or 128 when they are a multiple of 128."""
  return LANES if channels % LANES == 0 else channels


def vmem_bytes(geom2: Geom2, channels: int, itemsize: int) -> int:
  """VMEM one grid step of the largest kernel needs (double-buffered blocks plus scratch)."""
  chan_block = channel_block(channels)
  pad_rows, pad_cols = _pad_dims(geom2)
  fwd = (2 * _tile_bytes(geom2.H, geom2.W, chan_block, itemsize)
         + 2 * _tile_bytes(geom2.Ho, geom2.Wo, chan_block, itemsize)
         + 2 * _tile_bytes(geom2.Ho, geom2.Wo, chan_block, 1)
         + _tile_bytes(pad_rows, pad_cols, chan_block, 4))
  _, _, _, width = _bwd_plan(geom2)
  bwd = (2 * _tile_bytes(geom2.H, geom2.W, chan_block, itemsize)
         + 2 * _tile_bytes(geom2.Ho, geom2.Wo, chan_block, itemsize)
         + 2 * _tile_bytes(geom2.Ho, geom2.Wo, chan_block, 1)
         + 2 * _tile_bytes(geom2.Ho, width, chan_block, 4)
         + _tile_bytes(1, geom2.W, chan_block, 4))
  return max(fwd, bwd)


def fits(geom: Geometry, shape, dtype) -> bool:
  """Whether one image's block fits the VMEM budget (larger images stay on XLA)."""
  geom2 = Geom2.from_geometry(geom)
  return vmem_bytes(geom2, int(shape[-1]), np.dtype(dtype).itemsize) <= VMEM_BUDGET


def _compiler_params(n_grid: int, need: int):
  parallel: Literal["parallel"] = "parallel"
  return pltpu.CompilerParams(dimension_semantics=(parallel,) * n_grid,
                              vmem_limit_bytes=int(min(max(need + VMEM_HEADROOM, VMEM_LIMIT_MIN),
                                                       VMEM_LIMIT_MAX)))


def _fori(trips: int, body):
  """``for step in range(trips): body(step)`` as one loop (a static loop when it runs once)."""
  if trips == 1:
    body(jnp.int32(0))
    return
  lax.fori_loop(0, trips, lambda step, carry: (body(step), carry)[1], jnp.int32(0))


def _col_mask(lo: int, hi: int, n_cols: int, chan_block: int):
  """``(n_cols, chan_block)`` bool: columns in ``[lo, hi)``; None when that is every column."""
  if lo <= 0 and hi >= n_cols:
    return None
  col = lax.broadcasted_iota(jnp.int32, (n_cols, chan_block), 0)
  return (col >= lo) & (col < hi)


def _tap_cols(geom2: Geom2, j: int) -> tuple[int, int]:
  """Output columns ``[lo, hi)`` whose tap column ``j`` lands on a real input column."""
  offset = j * geom2.dw - geom2.pw  # input column of output column wo: wo * sw + offset
  lo = max(0, -(offset // geom2.sw))  # ceil(-offset / sw)
  hi = min(geom2.Wo, (geom2.W - 1 - offset) // geom2.sw + 1) if geom2.W - 1 - offset >= 0 else 0
  return lo, max(lo, hi)


# ----------------------------------------------------------------------------- forward


def _fill_padded(x_ref, pad_ref, geom2: Geom2, fill):
  pad_rows, pad_cols, chan_block = pad_ref.shape
  if geom2.ph:
    pad_ref[0:geom2.ph, :, :] = jnp.full((geom2.ph, pad_cols, chan_block), fill, _F32)
  if pad_rows > geom2.ph + geom2.H:
    pad_ref[geom2.ph + geom2.H:pad_rows, :, :] = jnp.full(
        (pad_rows - geom2.ph - geom2.H, pad_cols, chan_block), fill, _F32)
  if geom2.pw:
    pad_ref[geom2.ph:geom2.ph + geom2.H, 0:geom2.pw, :] = jnp.full(
        (geom2.H, geom2.pw, chan_block), fill, _F32)
  if pad_cols > geom2.pw + geom2.W:
    pad_ref[geom2.ph:geom2.ph + geom2.H, geom2.pw + geom2.W:pad_cols, :] = jnp.full(
        (geom2.H, pad_cols - geom2.pw - geom2.W, chan_block), fill, _F32)
  pad_ref[geom2.ph:geom2.ph + geom2.H, geom2.pw:geom2.pw + geom2.W, :] = x_ref[...].astype(_F32)


def _row_taps(pad_ref, out_row, i: int, j: int, geom2: Geom2):
  """The ``(Wo, chan_block)`` tile of tap ``(i, j)`` of output row ``out_row``: a strided load."""
  cols = (pl.ds(j * geom2.dw, geom2.Wo, stride=geom2.sw) if geom2.sw > 1
          else pl.ds(j * geom2.dw, geom2.Wo))
  return pad_ref[out_row * geom2.sh + i * geom2.dh, cols, :]


def _max_kernel(x_ref, *refs, geom2: Geom2, argmax: bool, activation: Activation = None):
  if argmax:
    y_ref, idx_ref, pad_ref = refs
  else:
    y_ref, pad_ref = refs
  chan_block = pad_ref.shape[2]
  _fill_padded(x_ref, pad_ref, geom2, lowest(_F32))
  col_ok = [_col_mask(*_tap_cols(geom2, j), geom2.Wo, chan_block) for j in range(geom2.kw)]

  def row(out_row):
    best = jnp.full((geom2.Wo, chan_block), -jnp.inf, _F32)
    idx = jnp.full((geom2.Wo, chan_block), -1, jnp.int32)
    for i in range(geom2.kh):
      in_row = out_row * geom2.sh + i * geom2.dh - geom2.ph
      row_ok = (in_row >= 0) & (in_row < geom2.H)
      for j in range(geom2.kw):
        value = _row_taps(pad_ref, out_row, i, j, geom2)
        better = (idx < 0) | beats(value, best) if argmax else beats(value, best)
        valid = row_ok if col_ok[j] is None else (col_ok[j] & row_ok)
        better = better & valid
        best = jnp.where(better, value, best)
        if argmax:
          idx = jnp.where(better, i * geom2.kw + j, idx)
    best, idx = apply_activation(best, idx if argmax else None, activation)
    y_ref[out_row] = best.astype(y_ref.dtype)
    if argmax:
      idx_ref[out_row] = idx.astype(idx_ref.dtype)

  _fori(geom2.Ho, row)


def _avg_kernel(x_ref, y_ref, pad_ref, *, geom2: Geom2, include_pad: bool, divisor: int | None):
  chan_block = pad_ref.shape[2]
  _fill_padded(x_ref, pad_ref, geom2, 0.0)
  if divisor is None:
    out_cols = lax.broadcasted_iota(jnp.int32, (geom2.Wo, chan_block), 0)
    col_counts = _taps_inside(geom2, 1, out_cols, include_pad)

  def row(out_row):
    acc = jnp.zeros((geom2.Wo, chan_block), _F32)
    for i in range(geom2.kh):
      for j in range(geom2.kw):
        acc = acc + _row_taps(pad_ref, out_row, i, j, geom2)
    if divisor is not None:
      out = acc / jnp.float32(divisor)
    else:
      counts = _taps_inside(geom2, 0, out_row, include_pad) * col_counts
      out = acc / jnp.where(counts == 0, 1, counts).astype(_F32)
    y_ref[out_row] = out.astype(y_ref.dtype)

  _fori(geom2.Ho, row)


def _as4(x: jax.Array, spatial: tuple[int, int]) -> jax.Array:
  return x.reshape(-1, spatial[0], spatial[1], x.shape[-1])


def _specs(n_batch: int, channels: int, rows: int, cols: int):
  chan_block = channel_block(channels)
  spec = pl.BlockSpec((None, rows, cols, chan_block), lambda batch, block: (batch, 0, 0, block))
  return chan_block, (n_batch, channels // chan_block), spec


def _forward_call(x: jax.Array, geom: Geometry, mode: ForwardMode, interpret: bool | str,
                  include_pad: bool = False, divisor: int | None = None,
                  activation: Activation = None):
  geom2 = Geom2.from_geometry(geom)
  out_shape = geom.output_shape(x.shape)
  channels = x.shape[-1]
  x_view = _as4(x, (geom2.H, geom2.W))
  n_batch = x_view.shape[0]
  chan_block, grid, in_spec = _specs(n_batch, channels, geom2.H, geom2.W)
  _, _, out_spec = _specs(n_batch, channels, geom2.Ho, geom2.Wo)
  out_view_shape = (n_batch, geom2.Ho, geom2.Wo, channels)
  outs = [out_struct(out_view_shape, x.dtype, x)]
  if mode == "argmax":
    outs.append(out_struct(out_view_shape, taps_dtype(geom2.taps), x))
  if mode == "avg":
    kernel = functools.partial(_avg_kernel, geom2=geom2, include_pad=include_pad, divisor=divisor)
  else:
    kernel = functools.partial(_max_kernel, geom2=geom2, argmax=mode == "argmax",
                               activation=activation)
  pad_rows, pad_cols = _pad_dims(geom2)
  n_bytes = x.size * x.dtype.itemsize + sum(
      int(np.prod(out.shape)) * np.dtype(out.dtype).itemsize for out in outs)
  results = pl.pallas_call(
      kernel, out_shape=tuple(outs), grid=grid, in_specs=[in_spec],
      out_specs=tuple(out_spec for _ in outs),
      scratch_shapes=[pltpu.VMEM((pad_rows, pad_cols, chan_block), _F32)],
      compiler_params=_compiler_params(2, vmem_bytes(geom2, channels, x.dtype.itemsize)),
      interpret=_interpret_arg(interpret), name=f"jaxpool_{mode}_pool_fwd_tpu",
      cost_estimate=pl.CostEstimate(flops=int(np.prod(out_view_shape)) * geom2.taps,
                                    transcendentals=0, bytes_accessed=n_bytes))(x_view)
  return tuple(result.reshape(out_shape) for result in results)


def max_forward(x: jax.Array, geom: Geometry, *, interpret: bool | str,
                activation: Activation = None) -> jax.Array:
  """Max pooling without the taps (then the activation). ``x: (*batch, *spatial, C)`` ->
  ``(*batch, *out, C)``."""
  return _forward_call(x, geom, "max", interpret, activation=activation)[0]


def max_forward_taps(x: jax.Array, geom: Geometry, *, interpret: bool | str,
                     activation: Activation = None):
  """Max pooling and each window's winning tap, row-major (``taps_dtype``; -1: none)."""
  return _forward_call(x, geom, "argmax", interpret, activation=activation)


def avg_forward(x: jax.Array, geom: Geometry, *, interpret: bool | str, count_include_pad: bool,
                divisor_override: int | None) -> jax.Array:
  """Average pooling; sums in float32."""
  return _forward_call(x, geom, "avg", interpret, count_include_pad, divisor_override)[0]


# ----------------------------------------------------------------------------- backward


def _backward_kernel(*refs, geom2: Geom2, mode: PoolKind, include_pad: bool,
                     divisor: int | None):
  """``dx`` of one image and channel block, one input row and column phase at a time."""
  if mode == "max":
    idx_ref, dy_ref, dx_ref, dyp_ref, idxp_ref, row_ref = refs
  else:
    dy_ref, dx_ref, dyp_ref, row_ref = refs
  dtype = dx_ref.dtype
  acc_t = accumulator_dtype(dtype)
  chan_block = dyp_ref.shape[2]
  phase_cols, plan, margin, width = _bwd_plan(geom2)
  # The dy (and argmax) scratch: zeros (and -1) around the real windows.
  if margin:
    dyp_ref[:, 0:margin, :] = jnp.zeros((geom2.Ho, margin, chan_block), _F32)
  if width > margin + geom2.Wo:
    dyp_ref[:, margin + geom2.Wo:width, :] = jnp.zeros(
        (geom2.Ho, width - margin - geom2.Wo, chan_block), _F32)
  if mode == "max":
    if margin:
      idxp_ref[:, 0:margin, :] = jnp.full((geom2.Ho, margin, chan_block), -1, jnp.int32)
    if width > margin + geom2.Wo:
      idxp_ref[:, margin + geom2.Wo:width, :] = jnp.full(
          (geom2.Ho, width - margin - geom2.Wo, chan_block), -1, jnp.int32)
    idxp_ref[:, margin:margin + geom2.Wo, :] = idx_ref[...].astype(jnp.int32)
    dyp_ref[:, margin:margin + geom2.Wo, :] = dy_ref[...].astype(_F32)
  elif divisor is not None:
    dyp_ref[:, margin:margin + geom2.Wo, :] = dy_ref[...].astype(_F32) / jnp.float32(divisor)
  else:
    # Each window's share: dy over its divisor (the taps inside the counted region).
    out_cols = lax.broadcasted_iota(jnp.int32, (geom2.Wo, chan_block), 0)
    col_counts = _taps_inside(geom2, 1, out_cols, include_pad)

    def scale(out_row):
      counts = _taps_inside(geom2, 0, out_row, include_pad) * col_counts
      denominator = jnp.where(counts == 0, 1, counts).astype(_F32)
      dyp_ref[out_row, pl.ds(margin, geom2.Wo), :] = dy_ref[out_row].astype(_F32) / denominator

    _fori(geom2.Ho, scale)

  phase_rows = -(-geom2.H // geom2.sh)

  def rows(phase_row):
    for phase_h in range(geom2.sh):
      in_row = phase_row * geom2.sh + phase_h

      def one_row(phase_h=phase_h, in_row=in_row):
        for phase_w in range(geom2.sw):
          if phase_cols[phase_w] == 0:
            continue
          acc = None
          for tap, offset_h, offset_w in plan[(phase_h, phase_w)]:
            out_row = phase_row + offset_h
            valid = (out_row >= 0) & (out_row < geom2.Ho)
            row_in = jnp.clip(out_row, 0, geom2.Ho - 1)
            cols = pl.ds(margin + offset_w, phase_cols[phase_w])
            dy_tile = dyp_ref[row_in, cols, :]
            if mode == "max":
              chosen = valid & (idxp_ref[row_in, cols, :] == tap)
              term = jnp.where(chosen, dy_tile, 0.0)
              if acc is None:
                acc = term if tap == geom2.taps - 1 else (0.0 + term).astype(dtype).astype(acc_t)
              else:
                # Round after every add, as the XLA path does when it adds 16-bit cotangents.
                acc = (acc + term).astype(dtype).astype(acc_t)
            else:
              term = jnp.where(valid, dy_tile, 0.0)
              if acc is None and len(plan[(phase_h, phase_w)]) < geom2.taps:
                # A phase that skips taps: the XLA path adds +0.0 for each, so a zero sum is
                # +0.0 (a select: XLA:CPU would fold 0.0 + c into c).
                acc = jnp.where(term == 0, 0.0, term)
              else:
                acc = term if acc is None else acc + term
          if acc is None:
            acc = jnp.zeros((phase_cols[phase_w], chan_block), _F32)
          if geom2.sw == 1:
            row_ref[...] = acc
          else:
            row_ref[pl.ds(phase_w, phase_cols[phase_w], stride=geom2.sw), :] = acc
        dx_ref[in_row] = row_ref[...].astype(dtype)

      if geom2.H % geom2.sh and phase_h >= geom2.H % geom2.sh:
        pl.when(in_row < geom2.H)(one_row)
      else:
        one_row()

  _fori(phase_rows, rows)


def _backward_call(operands, in_shape, geom: Geometry, mode: PoolKind, interpret: bool | str,
                   include_pad: bool = False, divisor: int | None = None) -> jax.Array:
  geom2 = Geom2.from_geometry(geom)
  dy = operands[-1]
  channels = dy.shape[-1]
  views = [_as4(operand, (geom2.Ho, geom2.Wo)) for operand in operands]
  n_batch = views[0].shape[0]
  chan_block, grid, in_spec = _specs(n_batch, channels, geom2.Ho, geom2.Wo)
  _, _, out_spec = _specs(n_batch, channels, geom2.H, geom2.W)
  _, _, _, width = _bwd_plan(geom2)
  scratch = [pltpu.VMEM((geom2.Ho, width, chan_block), _F32)]
  if mode == "max":
    scratch.append(pltpu.VMEM((geom2.Ho, width, chan_block), jnp.int32))
  scratch.append(pltpu.VMEM((geom2.W, chan_block), _F32))
  kernel = functools.partial(_backward_kernel, geom2=geom2, mode=mode, include_pad=include_pad,
                             divisor=divisor)
  in_view_shape = (n_batch, geom2.H, geom2.W, channels)
  n_bytes = (sum(operand.size * operand.dtype.itemsize for operand in operands)
             + int(np.prod(in_view_shape)) * dy.dtype.itemsize)
  dx = pl.pallas_call(
      kernel, out_shape=out_struct(in_view_shape, dy.dtype, dy), grid=grid,
      in_specs=[in_spec] * len(views), out_specs=out_spec, scratch_shapes=scratch,
      compiler_params=_compiler_params(2, vmem_bytes(geom2, channels, dy.dtype.itemsize)),
      interpret=_interpret_arg(interpret), name=f"jaxpool_{mode}_pool_bwd_tpu",
      cost_estimate=pl.CostEstimate(flops=int(np.prod(in_view_shape)) * geom2.taps,
                                    transcendentals=0, bytes_accessed=n_bytes))(*views)
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
