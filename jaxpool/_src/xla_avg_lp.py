"""The XLA backend's average and Lp pooling, each a ``custom_jvp`` whose tangent is a
fixed-order tap sum (:func:`window_sum_linear`): JAX transposes it into a deterministic gradient.

Masked average pooling (a bool ``mask``, True at real elements) divides each window's sum of
unmasked elements by their count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src import xla_separable, xla_taps
from jaxpool._src.dtypes import accumulator_dtype
from jaxpool._src.windows import Geometry, window_counts_1d
from jaxpool._src.xla_taps import fold_taps, max_pool_forward, reader, window_sum

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


def window_sum_linear(t: jax.Array, geom: Geometry) -> jax.Array:
  """The same sum as a fixed-order sum of tap slices: for tangents.

  It is linear in ``t`` and built from pad, slice and add, so JAX transposes it into pads that
  XLA fuses into one gather-like pass: several times faster than the transpose of
  ``reduce_window`` (a padded reduce-window over the dilated cotangent), and deterministic. A
  separable window (more than ``SEPARABLE_TAPS`` taps) sums one dim at a time, with a transpose
  of its own by stride phase (the same bits as JAX's).
  """
  if xla_taps.is_separable(geom):
    return xla_separable.window_sum(t, geom)
  read = reader(t, geom, phase=geom.num_taps > xla_taps.UNROLL_SUM_TAPS)
  return fold_taps(geom, lambda j, tap, acc: acc + read(tap),
                   lambda: read((0,) * geom.nspatial), start=1,
                   limit=xla_taps.UNROLL_SUM_TAPS)


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


def _masked_divisor(mask: jax.Array, geom: Geometry, count_include_pad: bool,
                    divisor_override: int | None, dtype) -> jax.Array:
  """The divisor of a masked average: the unmasked real elements of each window, plus its
  padding taps with ``count_include_pad`` (masked elements never count); 1 where that is 0
  (the window's sum is 0 there); ``divisor_override`` replaces it."""
  if divisor_override is not None:
    return jnp.asarray(divisor_override, dtype)
  if count_include_pad:
    static = avg_divisor(geom, True, None, mask.ndim, dtype)  # real and padding taps
    div = jnp.asarray(static) - window_sum(jnp.logical_not(mask).astype(dtype), geom)
  else:
    div = window_sum(mask.astype(dtype), geom)
  return jnp.where(div > 0, div, jnp.ones_like(div))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def masked_avg_pool(x: jax.Array, mask: jax.Array, geom: Geometry, count_include_pad: bool,
                    divisor_override: int | None) -> jax.Array:
  """Average pooling of the elements where ``mask`` (bool, broadcastable to ``x``) is True."""
  acc = accumulator_dtype(x.dtype)
  mask = jnp.broadcast_to(mask, x.shape)
  div = _masked_divisor(mask, geom, count_include_pad, divisor_override, _real(acc))
  s = window_sum(jnp.where(mask, x.astype(acc), jnp.zeros((), acc)), geom)
  return (s / div).astype(x.dtype)


@masked_avg_pool.defjvp
def _masked_avg_pool_jvp(geom, count_include_pad, divisor_override, primals, tangents):
  (x, mask), (t, _) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  mask = jnp.broadcast_to(mask, x.shape)
  div = _masked_divisor(mask, geom, count_include_pad, divisor_override, _real(acc))
  y = masked_avg_pool(x, mask, geom, count_include_pad, divisor_override)
  ts = window_sum_linear(jnp.where(mask, t.astype(acc), jnp.zeros((), acc)), geom)
  return y, (ts / div).astype(x.dtype)


def _real(dtype) -> np.dtype:
  """The real dtype of ``dtype`` (float32 for complex64): divisors are counts."""
  dtype = np.dtype(dtype)
  return np.dtype(jnp.finfo(dtype).dtype) if jnp.issubdtype(dtype, jnp.complexfloating) else dtype


# ----------------------------------------------------------------------------- Lp
#
# ``(sum |x|^p)^(1/p)`` computed as written overflows for large |x| (1e20**3 in float32) and
# underflows for small |x| (1e-30**2). Each window is scaled by its largest |x|, m:
# ``y = m * (sum (|x|/m)^p)^(1/p)``, where every term is at most 1 and the largest is 1, so y is
# right to rounding wherever it is representable. The gradient is written the same way,
# ``dy = sum sign(x) (|x|/y)^(p-1) dx``, whose factors are at most 1.
#
# Infinities and NaN. A window with a NaN outputs NaN; else one with an infinite element outputs
# inf. Its weights (the factor of each element's tangent) are finite, so that a zero cotangent
# always sends exactly 0 (a NaN or infinite weight would make 0 * w = NaN in the transpose):
# NaN counts as larger than every number, infinities included (as in the max pool), and the
# window's largest elements, its NaNs or else its infinities, get ``sign(x)`` (1 for NaN), the
# limit of ``sign(x) (|x|/y)^(p-1)`` as they grow; every other element of the window gets that
# limit too, ``(|x|/y)^(p-1) -> 0`` for p > 1 and ``sign(x)`` for p == 1.


def _lp_sum_scaled(x: jax.Array, m: jax.Array, geom: Geometry, p: float) -> jax.Array:
  """``sum (|x|/m)^p`` over each window's real elements (``m > 0``)."""
  read = reader(x, geom, phase=geom.num_taps > xla_taps.UNROLL_SUM_TAPS)

  def step(j, tap, acc):
    r = jnp.abs(read(tap)) / m
    return acc + (r * r if p == 2 else r ** p)

  return fold_taps(geom, step, lambda: jnp.zeros_like(m), limit=xla_taps.UNROLL_SUM_TAPS)


def _lp_forward(xa: jax.Array, geom: Geometry, p: float) -> jax.Array:
  """Lp pooling of ``xa`` (already in the accumulator dtype)."""
  if p == 1:
    return window_sum(jnp.abs(xa), geom)
  # The scale is any positive number (y does not depend on it), so it is not differentiated.
  m = lax.stop_gradient(max_pool_forward(jnp.abs(xa), geom))  # NaN in, NaN; -inf if empty
  finite = (m > 0) & jnp.isfinite(m)
  scale = jnp.where(finite, m, 1)
  s = _lp_sum_scaled(xa, scale, geom, p)
  y = scale * (jnp.sqrt(s) if p == 2 else s ** (1.0 / p))
  # inf and NaN pass through (m is NaN where the window holds one); 0 and empty windows give 0.
  return jnp.where(finite, y, jnp.where(jnp.isnan(m) | (m > 0), m, 0))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def lp_pool(x: jax.Array, geom: Geometry, p: float) -> jax.Array:
  """``(sum |x|^p)^(1/p)`` over the real elements of each window."""
  return _lp_forward(x.astype(accumulator_dtype(x.dtype)), geom, p).astype(x.dtype)


def _lp_weight(xt: jax.Array, d: jax.Array, p: float) -> jax.Array:
  """The finite weight ``sign(x) (|x|/y)^(p-1)`` of element ``xt`` in a window whose output
  is ``d`` (1 where the output is 0), with the limits for inf and NaN (see above)."""
  finite = jnp.isfinite(d)
  # The formula on finite values only (a finite window holds finite elements), so that neither
  # this value nor its derivative (second order) is NaN where the select below drops it.
  xs = jnp.where(finite, xt, jnp.zeros((), xt.dtype))
  r = jnp.abs(xs) / jnp.where(finite, d, jnp.ones((), d.dtype))
  regular = jnp.sign(xs) * (r if p == 2 else r ** (p - 1))
  # A window whose output is NaN or inf: its largest elements (its NaNs, else its infinities).
  top = jnp.where(jnp.isnan(d), jnp.isnan(xt), jnp.isinf(xt))
  signs = jnp.where(jnp.isnan(xt), jnp.ones((), xt.dtype), jnp.sign(xt))
  return jnp.where(finite, regular, jnp.where(top, signs, jnp.zeros((), xt.dtype)))


def _lp_tangent(xa: jax.Array, d: jax.Array, t: jax.Array, geom: Geometry, p: float):
  """``sum w t`` over each window, ``w`` the finite weights of :func:`_lp_weight` (linear in
  ``t``; ``d``: the output, with 1 where it is 0)."""
  xread = reader(xa, geom, phase=geom.num_taps > xla_taps.UNROLL_SUM_TAPS)
  tread = reader(t, geom, phase=geom.num_taps > xla_taps.UNROLL_SUM_TAPS)

  def step(j, tap, acc):
    return acc + _lp_weight(xread(tap), d, p) * tread(tap)

  return fold_taps(geom, step, lambda: jnp.zeros_like(d), limit=xla_taps.UNROLL_SUM_TAPS)


@lp_pool.defjvp
def _lp_pool_jvp(geom, p, primals, tangents):
  (x,), (t,) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  xa, ta = x.astype(acc), t.astype(acc)
  y = _lp_forward(xa, geom, p)
  if p == 1:
    # Each element's weight is its own sign whatever the window holds (1 for NaN: finite).
    one = jnp.ones((), acc)
    dy = window_sum_linear(jnp.sign(jnp.where(jnp.isnan(xa), one, xa)) * ta, geom)
  else:
    # 0 where y == 0 (never NaN), and where y overflowed to inf from finite elements (every
    # |x|/y is 0 there); finite weights where the window holds inf or NaN (see above).
    # Rematerialised: reverse mode keeps x and y, not one weight per tap and output.
    tangent = jax.checkpoint(functools.partial(_lp_tangent, geom=geom, p=p), prevent_cse=False)
    dy = tangent(xa, jnp.where(y == 0, jnp.ones((), acc), y), ta)
  return y.astype(x.dtype), dy.astype(x.dtype)

