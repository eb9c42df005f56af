"""The max-pool forward kernel for GPUs (Pallas Triton): the maximum of each window, and its tap.

A program covers one output row and a tile of columns and lanes (``triton/tile.py``). It scans
the window's taps in order (a dim of more than ``tile.LOOP_TAPS`` taps in a loop) with a running
maximum that ranks NaN above every number and +0.0 above -0.0 (:func:`nan_max`), and takes a
tap where that maximum's bits change: of equal values the first keeps it, +0.0 replaces -0.0
and the first NaN wins (``dtypes.beats``' order). On an NVIDIA GPU that is one instruction a tap
for the maximum, two more for the taps; a window holding NaN gives the canonical NaN there (a
NaN, as XLA's maximum gives one).

At the edges no load leaves the input: a tap outside it reads a copy of the nearest real tap of
its own window (which cannot change the maximum), and the winner is mapped back to the real tap
(:func:`_real_tap`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.api_args import Activation
from jaxpool._src.autodiff import apply_activation
from jaxpool._src.dtypes import beats, lowest
from jaxpool._src.pallas.triton.tile import both_paths, fold, load, loop_dim, output_row, plgpu
from jaxpool._src.pallas.types import MaxForm
from jaxpool._src.windows import Geometry, real_taps

# PTX's canonical NaN (the bits of a float32 NaN that ``max.NaN.f32`` returns), which the form
# "canonical" of :func:`nan_max` gives for every NaN as PTX does.
CANONICAL_NAN_BITS = 0x7FFFFFFF


def compare_dtype(dtype) -> np.dtype:
  """The dtype the kernel compares in: float32 for 16-bit floats (exact; Triton would convert
  them for every op), else ``dtype``."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return np.dtype(np.float32)
  return dtype


def max_kernel(x_ref, *out_refs, geom: Geometry, block_cols: int, block_lanes: int, lanes: int,
               rows: int, with_taps: bool, form: MaxForm, interpret: bool,
               activation: Activation = None):
  """One output row's maxima (then ``activation``), and with ``with_taps`` each window's
  winning tap (row-major, -1 where the window holds no real tap).

  ``form`` is :func:`nan_max`'s ("beats" for integers).
  """
  row = output_row(geom, block_cols, block_lanes, lanes, rows, interpret)
  tile, batch, outs = row.tile, row.batch, row.outs
  dtype = x_ref.dtype
  idx_t = out_refs[1].dtype if with_taps else np.dtype(np.int8)
  cmp_t = compare_dtype(dtype)
  low = lowest(dtype)

  def tap_at(dim: int, offset):
    """The input position along ``dim`` of tap ``offset`` (along ``dim``) of the tile's windows."""
    return outs[dim] * geom.strides[dim] + offset * geom.dilation[dim] - geom.pad_lo[dim]

  def load_max_tap(tap, real):
    """Tap ``tap`` of the tile's windows. At the edges (``real``: each dim's first and last
    real tap, per window) a tap outside the input reads the nearest real tap of its window,
    dim by dim: a copy, which cannot change a maximum. Of the taps holding the first maximum,
    the first is then a copy of the first real one, or that one, and :func:`_real_tap` maps it
    back: the first tap reading a real tap ``m`` has, in each dim, 0 where ``m`` is that dim's
    first real tap and ``m``'s own index elsewhere, an order on the real taps that is
    row-major's."""
    positions = []
    for dim, offset in enumerate(tap):
      if real is not None and geom.window[dim] > 1:
        offset = jnp.clip(offset, *real[dim])
      position = tap_at(dim, offset)
      if real is not None:  # (a window with no real tap reads anywhere inside; see empty)
        position = jnp.clip(position, 0, geom.in_spatial[dim] - 1)
      positions.append(position)
    return load(x_ref, tile.index(batch, *positions))

  loop = loop_dim(geom)

  def body(edge: bool):
    idx: Any = None
    real = ([real_taps(geom, dim, position, xp=jnp) for dim, position in enumerate(outs)]
            if edge else None)

    def step(tap_id, tap, carry):
      best, idx = carry
      value = load_max_tap(tap, real).astype(cmp_t)
      new = nan_max(best, value, form)
      if with_taps:
        tap_at_idx = (np.array(tap_id, idx_t) if isinstance(tap_id, int)
                      else lax.convert_element_type(tap_id, idx_t))
        idx = jnp.where(bits(new) != bits(best), tap_at_idx, idx)
      return new, idx

    taps = geom.taps()
    value = load_max_tap(taps[0], real).astype(cmp_t)
    best = nan_max(value, value, form)  # (NaN made canonical, as the scan's maxima are)
    if with_taps:
      idx = jnp.full(tile.shape, 0, idx_t)
    if loop is None:
      for tap_id, tap in enumerate(taps[1:], 1):
        best, idx = step(tap_id, tap, (best, idx))
    else:  # (one dim of many taps: its taps in a loop)
      best, idx = fold(1, len(taps) - 1, lambda t, c: step(t, tuple(
          t if dim == loop else 0 for dim in range(len(geom.window))), c), (best, idx))
    out_at = tile.index(batch, *outs)
    if real is not None:
      # Windows with no real tap: the lowest value, no tap.
      empty = None
      for dim, (first, last) in enumerate(real):
        if geom.window[dim] > 1 or geom.pad_lo[dim] or geom.pad_hi[dim] or geom.extra[dim]:
          no_tap = tile.cols_of(first > last)
          empty = no_tap if empty is None else empty | no_tap
      if empty is not None:
        best = jnp.where(empty, np.array(low, cmp_t), best)
      if with_taps:
        idx = _real_tap(geom, idx, [[tile.cols_of(end) for end in spans] for spans in real])
        if empty is not None:
          idx = jnp.where(empty, np.array(-1, idx_t), idx)
    best, idx = apply_activation(best, idx, activation)  # (fused: no pass of its own)
    tile.store(out_refs[0], out_at, best.astype(dtype), row.col_mask)
    if with_taps:
      tile.store(out_refs[1], out_at, idx, row.col_mask)

  both_paths(row.interior, body, interpret)


def _real_tap(geom: Geometry, idx, real):
  """The real taps that the copies in ``idx`` (window taps, row-major) read: each dim's tap
  clamped to ``real``'s ``(first, last)``."""
  rest, parts = idx.astype(jnp.int32), []
  for size in reversed(geom.window):
    parts.append(rest % size)
    rest = rest // size
  out: Any = None
  for dim, part in enumerate(reversed(parts)):
    if geom.window[dim] > 1:
      part = jnp.clip(part, *real[dim])
    out = part if out is None else out * geom.window[dim] + part
  return out.astype(idx.dtype)


def nan_max(best, x, form: MaxForm):
  """The running maximum ``best`` of a window scanned in tap order, after tap ``x``, in
  :func:`dtypes.beats`' order: NaN above every number, ``+0.0`` above ``-0.0``.

  "ptx": PTX's ``max.NaN.f32``, one instruction, whose NaN results are the canonical NaN.
  "beats": ``dtypes.beats`` itself, the XLA path's rule, so that interpret mode decides as the
  XLA path does on the same backend (XLA's CPU comparisons treat subnormals as zeros); the
  first NaN is kept. "canonical": "beats" with PTX's NaN results.
  """
  if form == "ptx":
    assert plgpu is not None  # (triton._max_form gives "ptx" only with the Triton backend)
    return plgpu.elementwise_inline_asm(
        "max.NaN.f32 $0, $1, $2;", args=[best, x], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]
  new = jnp.where(beats(x, best), x, best)
  if form == "canonical":
    canonical = np.array(np.uint32(CANONICAL_NAN_BITS)).view(np.float32).astype(x.dtype)
    new = jnp.where(new != new, canonical, new)
  return new


def bits(value):
  """``value``'s bits as unsigned integers (floats), or ``value``."""
  if not jnp.issubdtype(value.dtype, jnp.floating):
    return value
  unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[value.dtype.itemsize]
  return lax.bitcast_convert_type(value, unsigned)
