"""The XLA backend's window machinery: ``lax.reduce_window`` arguments, padding, and the tap
loops and tap readers that every XLA op (max, average, Lp, their tangents) is built from.

A window's taps are visited in row-major order, the order that breaks ties. Windows of at most
``UNROLL_TAPS`` taps run as straight-line code: one static slice per tap, which XLA fuses best.
Larger windows (global pooling, say) run a loop over the taps whose body reads its tap with a
dynamic slice: compile time and memory stay the same whatever the window's size. The loop body
is rematerialised in reverse mode, so the transpose keeps no per-tap residuals: it adds each
tap's cotangent into place (one output-sized update per tap).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.dtypes import exact_max, lowest
from jaxpool._src.windows import Geometry, tap_valid_1d, window_counts_1d

def window_args(geom: Geometry, ndim: int, *, with_extra: bool = True):
  pads = geom.full_padding if with_extra else geom.padding
  return dict(
      window_dimensions=geom.full_dims(ndim, geom.window, 1),
      window_strides=geom.full_dims(ndim, geom.strides, 1),
      padding=geom.full_dims(ndim, pads, (0, 0)),
      window_dilation=geom.full_dims(ndim, geom.dilation, 1),
  )


def pad(x: jax.Array, geom: Geometry, fill) -> jax.Array:
  cfg = geom.full_dims(x.ndim, [(lo, hi, 0) for lo, hi in geom.full_padding], (0, 0, 0))
  return lax.pad(x, jnp.asarray(fill, x.dtype), cfg)


# ----------------------------------------------------------------------------- taps

# Compile time grows with the taps below these (benchmarks/unroll_threshold.py measures both
# forms; docs/design/window-limits.md): the max's winner search and gather loop from 64 taps on;
# the sums (average and Lp tangents, Lp forward) run several times faster unrolled and compile
# fast, so they loop from 256.
UNROLL_TAPS = 64
UNROLL_SUM_TAPS = 256
TAPS_PER_TRIP = 8  # taps per trip of the loop

# Windows of more taps than this run separably (``xla_separable.py``): one spatial dim at a
# time, the last first, each a loop over that dim's taps. The rule depends on the geometry only;
# the Pallas kernels take at most this many taps in one call (``pallas/ops.py`` ``MAX_TAPS``) and
# larger max and min pools a dim at a time in the same order (``pallas/ops.py`` ``stages``), so
# every backend gives such a window the separable form's gradient (its summation order).
SEPARABLE_TAPS = 32


def is_separable(geom: Geometry) -> bool:
  """Whether ``geom``'s max, min and average pooling run separably (more than
  ``SEPARABLE_TAPS`` taps). For every stride: at strides near the window, where few windows
  share an element, the direct form's gradient ran 4-40x slower still than the separable one's
  on an H200 (docs/large-windows.md)."""
  return geom.num_taps > SEPARABLE_TAPS

Tap = tuple  # one coordinate per spatial dim: Python ints (straight-line code) or int32 scalars


def is_static(tap: Tap) -> bool:
  return all(isinstance(t, (int, np.integer)) for t in tap)


def _tap_coords(geom: Geometry, j: jax.Array) -> Tap:
  """The row-major coordinates of tap number ``j`` (an int32 scalar)."""
  coords = []
  for k in reversed(geom.window):
    coords.append(j % k)
    j = j // k
  return tuple(reversed(coords))


def fold_taps(geom: Geometry, step, init, start: int = 0, limit: int | None = None):
  """``carry = step(j, tap, carry)`` for the taps ``j = start, start + 1, ...`` in row-major
  order, from ``carry = init()``: straight-line code up to ``limit`` (``UNROLL_TAPS``) taps,
  else a loop.

  The loop is rematerialised as a whole in reverse mode: its residuals are the arrays it closes
  over (never an output-sized value it makes, such as a zero start), and its trips recompute
  their tap offsets instead of saving them.
  """
  if geom.num_taps <= (UNROLL_TAPS if limit is None else limit):
    carry = init()
    for j, tap in enumerate(geom.taps()):
      if j >= start:
        carry = step(j, tap, carry)
    return carry
  # Each trip runs TAPS_PER_TRIP taps (fewer trips: a GPU pays a launch per trip); a second loop
  # runs the remainder one tap a trip, so no trip needs a bound check.
  count = geom.num_taps - start
  full, rest = divmod(count, TAPS_PER_TRIP)

  def trips(first: int, per_trip: int):
    def trip(i, c):
      for u in range(per_trip):
        j = first + i * per_trip + u
        c = step(j, _tap_coords(geom, j), c)
      return c
    return jax.checkpoint(trip, prevent_cse=False)

  def loop():
    carry = lax.fori_loop(0, full, trips(start, TAPS_PER_TRIP), init())
    return lax.fori_loop(0, rest, trips(start + full * TAPS_PER_TRIP, 1), carry)

  return jax.checkpoint(loop, prevent_cse=False)()


def tap_slice(xp: jax.Array, geom: Geometry, tap: Tap) -> jax.Array:
  """The values tap ``tap`` reads for every output position (``xp`` already padded)."""
  ndim = xp.ndim
  start = geom.full_dims(ndim, [t * d for t, d in zip(tap, geom.dilation, strict=True)], 0)
  strides = geom.full_dims(ndim, geom.strides, 1)
  out = geom.output_shape(xp.shape)
  size = tuple((o - 1) * s + 1 for o, s in zip(out, strides, strict=True))
  if is_static(tap):
    return lax.slice(xp, start, tuple(b + n for b, n in zip(start, size, strict=True)), strides)
  return lax.slice(lax.dynamic_slice(xp, start, size), (0,) * ndim, size, strides)


def _phase_view(t: jax.Array, geom: Geometry) -> jax.Array:
  """The zero-padded ``t`` with each spatial dim split into ``(q, r)``, position ``q*s + r``.

  Tap ``j`` of output ``o`` reads ``o*s + j*d``: phase ``r = j*d % s`` at ``q = o + j*d // s``,
  a contiguous run over ``o``. Its slices equal the strided tap slices, but the transpose of a
  contiguous slice is a plain pad (or, in the loop, an in-place add of an output-sized block), so
  the transpose of a gather built on it (the max-pool gradient) is a sum of shifted planes with
  no interior padding: no division or remainder per element, several times faster on a CPU.
  """
  tp = pad(t, geom, 0)
  ndim = tp.ndim
  axes = geom.spatial_axes(ndim)
  extra = [(0, 0, 0)] * ndim
  split: list[int] = []
  for d in range(ndim):
    if d in axes:
      s = geom.strides[axes.index(d)]
      q = -(-tp.shape[d] // s)
      extra[d] = (0, q * s - tp.shape[d], 0)
      split += [q, s]
    else:
      split.append(tp.shape[d])
  return lax.pad(tp, np.array(0, tp.dtype), extra).reshape(split)


def _phase_slice(tv: jax.Array, geom: Geometry, tap: Tap, out_shape) -> jax.Array:
  """Tap ``tap``'s values for every output position, from the phase view ``tv``."""
  axes = geom.spatial_axes(len(out_shape))
  start: list = []
  size: list[int] = []
  for d, n in enumerate(out_shape):
    if d in axes:
      i = axes.index(d)
      q0, r = divmod(tap[i] * geom.dilation[i], geom.strides[i])
      start += [q0, r]
      size += [geom.out_spatial[i], 1]
    else:
      start.append(0)
      size.append(n)
  if is_static(tap):
    part = lax.slice(tv, start, [b + n for b, n in zip(start, size, strict=True)])
  else:
    part = lax.dynamic_slice(tv, start, size)
  return part.reshape(out_shape)


def reader(t: jax.Array, geom: Geometry, *, phase: bool):
  """``read(tap)``: tap ``tap``'s values of the zero-padded ``t`` for every output position,
  through the phase view (fast transposes) or strided slices. Under Explicit mesh axes the phase
  view's reshape would need an out_sharding for every split; the strided slices need none and
  give the same values."""
  out_shape = geom.output_shape(t.shape)
  if phase and explicit_sharding(t) is None:
    tv = _phase_view(t, geom)
    return lambda tap: _phase_slice(tv, geom, tap, out_shape)
  tp = pad(t, geom, 0)
  return lambda tap: tap_slice(tp, geom, tap)


def tap_mask(geom: Geometry, tap: Tap, ndim: int):
  """Mask of the output positions where ``tap`` reads a real element; None: all do."""
  mask = None
  static = is_static(tap)
  for dim, t in enumerate(tap):
    if static:
      valid = tap_valid_1d(geom, dim, t)
      if valid.all():
        continue
    else:
      lo, _ = geom.padding[dim]
      out, s, d = geom.out_spatial[dim], geom.strides[dim], geom.dilation[dim]
      if lo == 0 and (out - 1) * s + (geom.window[dim] - 1) * d < geom.in_spatial[dim]:
        continue  # every tap of every window is real along this dim
      pos = np.arange(out, dtype=np.int32) * s + t * d - lo
      valid = (pos >= 0) & (pos < geom.in_spatial[dim])
    shape = geom.full_dims(ndim, [out_n if i == dim else 1
                                  for i, out_n in enumerate(geom.out_spatial)], 1)
    m = valid.reshape(shape)
    mask = m if mask is None else (mask & m)
  return mask


def has_empty_windows(geom: Geometry) -> bool:
  return any((window_counts_1d(geom, d, include_pad=False) == 0).any()
             for d in range(geom.nspatial))


def input_shape(out_shape: tuple[int, ...], geom: Geometry) -> tuple[int, ...]:
  """The input shape whose pooled output has ``out_shape``."""
  shape = list(out_shape)
  for ax, L in zip(geom.spatial_axes(len(shape)), geom.in_spatial, strict=True):
    shape[ax] = L
  return tuple(shape)


def explicit_sharding(a: jax.Array):
  """``(mesh, spec)`` when ``a`` is sharded over Explicit mesh axes (sharding in types)."""
  sharding: Any = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    return None
  return sharding.mesh, spec


# ----------------------------------------------------------------------------- forwards


def reads_windows_whole(geom: Geometry) -> bool:
  """Whether max pooling without the taps reads each window whole (one ``lax.reduce_window``):
  a window of at most ``SEPARABLE_TAPS`` taps, or windows that overlap fewer than 3 times a
  dim (``3 * stride > window`` in every spatial dim), where each input element is read fewer
  than ``3^d`` times whatever the window's size, and the stages of the separable form, one
  pass over the data each, cost more than they save (on an H200 the separable forward ran
  0.80-0.91x XLA's at 9x9/s4, 13x13/s6, 17x17/s8, 31x31/s15, 25x25/s25, 5x5x5/s2, 7x7x7/s3:
  docs/large-windows.md)."""
  return not is_separable(geom) or all(3 * s > k for k, s in zip(geom.window, geom.strides,
                                                                  strict=True))


def max_pool_reduce(x: jax.Array, geom: Geometry, init=None) -> jax.Array:
  """Max pooling without the taps as XLA's float max reduces it, from ``init`` (default the
  dtype's lowest): one ``lax.reduce_window``, or one a spatial dim for a separable window whose
  windows overlap three times or more in a dim (:func:`reads_windows_whole`; the same values
  either way: a maximum's order does not matter, ``+0.0`` above ``-0.0`` included)."""
  init = lowest(x.dtype) if init is None else init
  if not reads_windows_whole(geom):
    return _reduce_by_dims(x, geom, init, lax.max)
  return lax.reduce_window(x, init, lax.max, **window_args(geom, x.ndim))


def max_pool_forward(x: jax.Array, geom: Geometry) -> jax.Array:
  """:func:`max_pool_reduce` with max pooling's rules on every platform
  (:func:`dtypes.exact_max`: on a CPU it reduces integer order keys)."""
  return exact_max(lambda v, low: max_pool_reduce(v, geom, low), x)


def window_sum(x: jax.Array, geom: Geometry) -> jax.Array:
  """Sum over each window's real elements: one ``lax.reduce_window`` (the forward path), or
  one a spatial dim for a separable window (:func:`is_separable`)."""
  if is_separable(geom):
    return _reduce_by_dims(x, geom, np.array(0, x.dtype), lax.add)
  return lax.reduce_window(x, np.array(0, x.dtype), lax.add, **window_args(geom, x.ndim))


def _reduce_by_dims(x: jax.Array, geom: Geometry, init, op) -> jax.Array:
  """``lax.reduce_window`` over one spatial dim at a time, the last first: work that grows with
  the sum of the window's sizes, not their product."""
  for i in reversed(range(geom.nspatial)):
    only = lambda v, fill, i=i: [v if j == i else fill for j in range(geom.nspatial)]
    x = lax.reduce_window(
        x, init, op, window_dimensions=geom.full_dims(x.ndim, only(geom.window[i], 1), 1),
        window_strides=geom.full_dims(x.ndim, only(geom.strides[i], 1), 1),
        padding=geom.full_dims(x.ndim, only(geom.full_padding[i], (0, 0)), (0, 0)),
        window_dilation=geom.full_dims(x.ndim, only(geom.dilation[i], 1), 1))
  return x
