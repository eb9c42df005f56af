"""The XLA path: forward ops on ``lax.reduce_window`` and their differentiation rules.

Max pooling is a ``custom_jvp``. Its primal is ``lax.reduce_window`` (the inference path, no
argmax kept); its JVP rule runs a tap loop that finds the argmax (int8 tap offset where the
window has at most 127 taps) and gathers the tangent there with ``lax.select_n``. That gather is
linear in the tangent, so JAX transposes it by itself into a scatter-add that XLA fuses into one
pass: each input element sums, in a fixed tap order, the cotangents of the windows that chose it.
No atomics, so the bits are the same on every run. The residual that reverse mode keeps is the
argmax, not the input, and forward mode (``jvp``, ``jacfwd``) and second order work because
nothing here is a ``custom_vjp``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.windows import (Geometry, argmax_dtype, tap_valid_1d, window_counts_1d)


def lowest(dtype) -> np.ndarray:
  """The identity of max for ``dtype``: ``-inf`` for floats, ``iinfo.min`` for ints."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return np.array(-np.inf, dtype)
  return np.array(np.iinfo(dtype).min, dtype)


def accumulator_dtype(dtype) -> np.dtype:
  """Sums of bfloat16/float16 accumulate in float32."""
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _window_args(geom: Geometry, ndim: int, *, with_extra: bool = True):
  pads = geom.full_padding if with_extra else geom.padding
  return dict(
      window_dimensions=geom.full_dims(ndim, geom.window, 1),
      window_strides=geom.full_dims(ndim, geom.strides, 1),
      padding=geom.full_dims(ndim, pads, (0, 0)),
      window_dilation=geom.full_dims(ndim, geom.dilation, 1),
  )


def _pad(x: jax.Array, geom: Geometry, fill) -> jax.Array:
  cfg = geom.full_dims(x.ndim, [(lo, hi, 0) for lo, hi in geom.full_padding], (0, 0, 0))
  return lax.pad(x, jnp.asarray(fill, x.dtype), cfg)


def _tap_slice(xp: jax.Array, geom: Geometry, tap) -> jax.Array:
  """The values tap ``tap`` reads for every output position (``xp`` already padded)."""
  ndim = xp.ndim
  start = geom.full_dims(ndim, [t * d for t, d in zip(tap, geom.dilation)], 0)
  strides = geom.full_dims(ndim, geom.strides, 1)
  out = geom.output_shape(xp.shape)
  limit = tuple(b + (o - 1) * s + 1 for b, o, s in zip(start, out, strides))
  return lax.slice(xp, start, limit, strides)


def _tap_mask(geom: Geometry, tap, ndim: int) -> np.ndarray | None:
  """Static mask of the output positions where ``tap`` reads a real element; None: all do."""
  mask = None
  for dim, t in enumerate(tap):
    valid = tap_valid_1d(geom, dim, t)
    if valid.all():
      continue
    shape = geom.full_dims(ndim, [len(valid) if i == dim else 1 for i in range(geom.nspatial)], 1)
    m = valid.reshape(shape)
    mask = m if mask is None else (mask & m)
  return mask


def has_empty_windows(geom: Geometry) -> bool:
  return any((window_counts_1d(geom, d, include_pad=False) == 0).any()
             for d in range(geom.nspatial))


# ----------------------------------------------------------------------------- max


def max_pool_forward(x: jax.Array, geom: Geometry) -> jax.Array:
  """Max pooling without the argmax: one ``lax.reduce_window``."""
  return lax.reduce_window(x, lowest(x.dtype), lax.max, **_window_args(geom, x.ndim))


def max_pool_argmax(x: jax.Array, geom: Geometry) -> tuple[jax.Array, jax.Array]:
  """Max pooling that also returns the winning tap of each window.

  Returns ``(y, tap)``: ``tap`` is the row-major offset of the argmax within the window
  (``argmax_dtype``), the first one on ties; NaN beats every number and the first NaN wins;
  padding never wins. A window with no real element gives ``y = lowest`` and ``tap = -1``.
  """
  ndim = x.ndim
  is_float = jnp.issubdtype(x.dtype, jnp.floating)
  xp = _pad(x, geom, lowest(x.dtype))
  adt = argmax_dtype(geom.num_taps)
  taps = geom.taps()
  first = _tap_slice(xp, geom, taps[0])
  # full_like, not full: the running values inherit the input's sharding (Explicit meshes).
  if _tap_mask(geom, taps[0], ndim) is None:  # tap 0 is real everywhere: it starts the race
    best, idx, start = first, lax.full_like(first, 0, adt), 1
  else:
    best, idx, start = lax.full_like(first, lowest(x.dtype)), lax.full_like(first, -1, adt), 0
  for i in range(start, len(taps)):
    xt = _tap_slice(xp, geom, taps[i])
    mask = _tap_mask(geom, taps[i], ndim)
    better = (idx < 0) | (xt > best)
    if is_float:
      better = better | (jnp.isnan(xt) & ~jnp.isnan(best))
    if mask is not None:
      better = better & mask
    best = jnp.where(better, xt, best)
    idx = jnp.where(better, jnp.asarray(i, adt), idx)
  return best, idx


def _phase_taps(t: jax.Array, geom: Geometry) -> list[jax.Array]:
  """Every tap's values for every output position, as contiguous slices of a phase view.

  The padded ``t`` is padded again to a multiple of the stride and each spatial dim split into
  ``(q, r)``, position ``q*s + r``. Tap ``j`` of output ``o`` reads ``o*s + j*d``: phase
  ``r = j*d % s`` at ``q = o + j*d // s``, a contiguous run over ``o``. The result equals the
  strided tap slices, but the transpose of a contiguous slice is a plain pad, so JAX's transpose
  of a gather built on it (the max-pool gradient) is a sum of shifted planes with no interior
  padding: no division or remainder per element, several times faster on a CPU.
  """
  tp = _pad(t, geom, 0)
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
  tv = lax.pad(tp, np.array(0, tp.dtype), extra).reshape(split)
  out_shape = geom.output_shape(t.shape)
  taps = []
  for tap in geom.taps():
    start, limit = [], []
    for d in range(ndim):
      if d in axes:
        i = axes.index(d)
        off = tap[i] * geom.dilation[i]
        q0, r = divmod(off, geom.strides[i])
        start += [q0, r]
        limit += [q0 + geom.out_spatial[i], r + 1]
      else:
        start.append(0)
        limit.append(tp.shape[d])
    taps.append(lax.slice(tv, start, limit).reshape(out_shape))
  return taps


def gather_at_argmax(t: jax.Array, idx: jax.Array, geom: Geometry) -> jax.Array:
  """``y_t[o] = t[argmax(o)]``; zero for a window with no real element.

  Linear in ``t``; JAX's transpose of it is the max-pool gradient (a deterministic,
  fused scatter-add of each window's cotangent into its argmax).
  """
  if explicit_sharding(t) is None and explicit_sharding(idx) is None:
    cases = _phase_taps(t, geom)
  else:
    # Under Explicit mesh axes the phase view's reshape would need an out_sharding for every
    # split; the strided slices need none and give the same values (and, transposed, bits).
    # (``idx`` is checked too: under ``linearize`` a tangent's type may not carry the sharding
    # that its cotangent has when the transpose runs, as in JAX 0.11.)
    tp = _pad(t, geom, 0)
    cases = [_tap_slice(tp, geom, tap) for tap in geom.taps()]
  # An empty window has idx == -1 and its taps all read padding, which is zero in the padded
  # ``t`` and dropped by the transpose of the pad: tap 0 serves it with no extra case.
  which = jnp.maximum(idx, 0) if has_empty_windows(geom) else idx
  if len(cases) == 1:
    return cases[0]
  return lax.select_n(which, *cases)


def _cpu_barrier(y: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
  # XLA:CPU drops optimization barriers before fusion, and then fuses the whole tap loop into
  # every tap of the scatter that reads the argmax: k-fold recomputation and a 10x slower
  # backward. A conditional is a real fusion boundary; its predicate is always true (a tap
  # index is below its dtype's max), but XLA cannot prove it, so it writes (y, idx) once.
  # One element, indexed without a reshape (a reshape would merge sharded dims).
  pred = idx[(0,) * idx.ndim] < jnp.iinfo(idx.dtype).max
  # (The branches must differ, or XLA folds the conditional away.)
  return lax.cond(pred, lambda a: a, lambda a: jax.tree.map(jnp.zeros_like, a), (y, idx))


def explicit_sharding(a: jax.Array):
  """``(mesh, spec)`` when ``a`` is sharded over Explicit mesh axes (sharding in types)."""
  sharding: Any = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    return None
  return sharding.mesh, spec


def _argmax_materialized(x: jax.Array, geom: Geometry) -> tuple[jax.Array, jax.Array]:
  """``max_pool_argmax`` whose outputs XLA writes once, rather than fusing into each reader."""
  y, idx = max_pool_argmax(x, geom)
  if idx.size == 0:
    return y, idx
  if explicit_sharding(idx) is not None:
    # Explicit sharding: the predicate's element lives on one device; keep the plain barrier.
    return lax.optimization_barrier((y, idx))
  return lax.platform_dependent(y, idx, cpu=_cpu_barrier,
                                default=lambda y, idx: lax.optimization_barrier((y, idx)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def max_pool(x: jax.Array, geom: Geometry) -> jax.Array:
  return max_pool_forward(x, geom)


@max_pool.defjvp
def _max_pool_jvp(geom, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx = _argmax_materialized(x, geom)
  return y, gather_at_argmax(t, idx, geom)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def max_pool_with_argmax(x: jax.Array, geom: Geometry) -> tuple[jax.Array, jax.Array]:
  return max_pool_argmax(x, geom)


@max_pool_with_argmax.defjvp
def _max_pool_with_argmax_jvp(geom, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx = _argmax_materialized(x, geom)
  return (y, idx), (gather_at_argmax(t, idx, geom), np.zeros(idx.shape, jax.dtypes.float0))


def flat_indices(idx: jax.Array, geom: Geometry) -> jax.Array:
  """Tap offsets -> flat row-major index in the input's spatial plane (int32; -1: none)."""
  ndim = idx.ndim
  idx32 = idx.astype(jnp.int32)
  flat = lax.full_like(idx32, 0)
  row = 1
  for dim in reversed(range(geom.nspatial)):
    inner = int(np.prod(geom.window[dim + 1:], dtype=np.int64))
    tap_d = (idx32 // inner) % geom.window[dim]
    shape = geom.full_dims(ndim, [geom.out_spatial[dim] if i == dim else 1
                                  for i in range(geom.nspatial)], 1)
    start = (np.arange(geom.out_spatial[dim], dtype=np.int32) * geom.strides[dim]
             - geom.padding[dim][0]).reshape(shape)
    flat = flat + (start + tap_d * geom.dilation[dim]) * row
    row *= geom.in_spatial[dim]
  return jnp.where(idx < 0, -1, flat)


# ----------------------------------------------------------------------------- average


def avg_divisor(geom: Geometry, count_include_pad: bool, divisor_override: int | None,
                ndim: int, dtype) -> np.ndarray:
  """The static divisor of every output position, shaped to broadcast against the output."""
  if divisor_override is not None:
    return np.asarray(divisor_override, dtype)
  div = np.ones((), np.int64)
  for d in range(geom.nspatial):
    counts = window_counts_1d(geom, d, include_pad=count_include_pad)
    div = np.multiply.outer(div, counts)
  div = np.where(div == 0, 1, div)  # a window with no real element outputs 0 (its sum is 0)
  shape = geom.full_dims(ndim, geom.out_spatial, 1)
  return div.reshape(shape).astype(dtype)


def window_sum(x: jax.Array, geom: Geometry) -> jax.Array:
  """Sum over each window's real elements: one ``lax.reduce_window`` (the forward path)."""
  return lax.reduce_window(x, np.array(0, x.dtype), lax.add, **_window_args(geom, x.ndim))


def window_sum_linear(t: jax.Array, geom: Geometry) -> jax.Array:
  """The same sum as a fixed-order sum of strided tap slices: for tangents.

  It is linear in ``t`` and built from pad, slice and add, so JAX transposes it into interior
  pads that XLA fuses into one gather-like pass: several times faster than the transpose of
  ``reduce_window`` (a padded reduce-window over the dilated cotangent), and deterministic.
  """
  tp = _pad(t, geom, 0)
  first, *rest = geom.taps()
  out = _tap_slice(tp, geom, first)
  for tap in rest:
    out = out + _tap_slice(tp, geom, tap)
  return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def avg_pool(x: jax.Array, geom: Geometry, count_include_pad: bool,
             divisor_override: int | None) -> jax.Array:
  acc = accumulator_dtype(x.dtype)
  s = window_sum(x.astype(acc), geom)
  div = avg_divisor(geom, count_include_pad, divisor_override, x.ndim, acc)
  return (s / div).astype(x.dtype)


@avg_pool.defjvp
def _avg_pool_jvp(geom, count_include_pad, divisor_override, primals, tangents):
  (x,), (t,) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  div = avg_divisor(geom, count_include_pad, divisor_override, x.ndim, acc)
  y = avg_pool(x, geom, count_include_pad, divisor_override)
  return y, (window_sum_linear(t.astype(acc), geom) / div).astype(x.dtype)


# ----------------------------------------------------------------------------- Lp


def _abs_pow(a: jax.Array, p: float) -> jax.Array:
  if p == 1:
    return jnp.abs(a)
  if p == 2:
    return a * a
  return jnp.abs(a) ** p


def _root(s: jax.Array, p: float) -> jax.Array:
  if p == 1:
    return s
  if p == 2:
    return jnp.sqrt(s)
  return s ** (1.0 / p)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def lp_pool(x: jax.Array, geom: Geometry, p: float) -> jax.Array:
  """``(sum |x|^p)^(1/p)`` over the real elements of each window."""
  acc = accumulator_dtype(x.dtype)
  return _root(window_sum(_abs_pow(x.astype(acc), p), geom), p).astype(x.dtype)


@lp_pool.defjvp
def _lp_pool_jvp(geom, p, primals, tangents):
  (x,), (t,) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  xa = x.astype(acc)
  y = _root(window_sum(_abs_pow(xa, p), geom), p)
  # d y = sum(sign(x) |x|^(p-1) dx) / y^(p-1), and 0 where y == 0 (never NaN).
  if p == 1:
    g = jnp.sign(xa)
  elif p == 2:
    g = xa
  else:
    g = jnp.sign(xa) * _abs_pow(xa, p - 1)
  num = window_sum_linear(g * t.astype(acc), geom)
  if p == 1:
    dy = num
  else:
    positive = y > 0
    denom = jnp.where(positive, y if p == 2 else y ** (p - 1), 1)
    dy = jnp.where(positive, num / denom, 0)
  return y.astype(x.dtype), dy.astype(x.dtype)
