"""Dtype rules every backend shares: which dtypes an op takes, identities, accumulators, and the
order that decides a max pool's winner."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np


def bits(dtype) -> int:
  """Bits per element (4 for ``int4``, whose NumPy itemsize says 1)."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return int(jnp.finfo(dtype).bits)
  if jnp.issubdtype(dtype, jnp.integer):
    return int(jnp.iinfo(dtype).bits)
  return dtype.itemsize * 8


def check_dtype(name: str, a: jax.Array, *, allow_int: bool, allow_bool: bool = False,
                complex_reason: str | None = None) -> None:
  """Raises a TypeError unless ``a``'s dtype is one the op takes.

  Floats of at least 8 bits always; integers with ``allow_int``; bool with ``allow_bool``; never
  complex (:func:`check_avg_dtype` takes it): the error then says ``complex_reason``, why the
  op has no complex form, where one is given. Sub-byte dtypes (``int4``, ``float4_e2m1fn``)
  have no XLA window reductions.
  """
  dt = a.dtype
  is_float = jnp.issubdtype(dt, jnp.floating)
  is_int = jnp.issubdtype(dt, jnp.integer)
  kinds = ["float"] + (["integer"] if allow_int else []) + (["bool"] if allow_bool else [])
  allowed = "a " + (" or ".join(kinds) if len(kinds) < 3 else ", ".join(kinds[:-1])
                    + " or " + kinds[-1])
  if is_float or (allow_int and is_int):
    if bits(dt) < 8:
      raise TypeError(
          f"{name} must have {allowed} dtype of at least 8 bits; got {dt} ({bits(dt)} bits).")
    return
  if allow_bool and dt == np.dtype(np.bool_):
    return
  if jnp.issubdtype(dt, jnp.complexfloating) and complex_reason is not None:
    raise TypeError(f"{name} must have {allowed} dtype; got {dt}: {complex_reason}.")
  raise TypeError(f"{name} must have {allowed} dtype; got {dt}.")


def check_avg_dtype(name: str, a: jax.Array) -> None:
  """Average pooling's dtypes: floats, integers, bool and complex (a sum has no order to need).
  Integers and bool are averaged in :func:`average_dtype`."""
  if jnp.issubdtype(a.dtype, jnp.complexfloating):
    return
  check_dtype(name, a, allow_int=True, allow_bool=True)


def average_dtype(dtype) -> np.dtype:
  """The dtype of an average (or Lp norm) of ``dtype``: itself for floats and complex; for
  integers and bool JAX's default float (float32, float64 under ``jax_enable_x64``), as
  ``flax.linen.avg_pool`` and ``jnp.mean`` return."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return dtype
  return np.dtype(jnp.result_type(float))


def lowest(dtype) -> np.ndarray:
  """The identity of max for ``dtype``: ``-inf`` for floats, ``iinfo.min`` for ints, False for
  bool.

  Float dtypes with no infinity (``float8_e4m3fn`` and the other ``fn``/``fnuz`` formats) use
  their lowest finite value: casting ``-inf`` to them gives NaN, which would win every window.
  """
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    with np.errstate(invalid="ignore", over="ignore"):
      neg_inf = np.array(-np.inf, dtype)
    if np.isneginf(neg_inf.astype(np.float32)):
      return neg_inf
    return np.array(jnp.finfo(dtype).min, dtype)
  if dtype == np.dtype(np.bool_):
    return np.array(False)
  return np.array(jnp.iinfo(dtype).min, dtype)


def reverse_order(a: Any) -> Any:
  """An exact map that reverses the order of ``a``'s dtype (its own inverse), so that
  ``reverse_order(max_pool(reverse_order(x)))`` is the min pool with the mirrored rules.

  Floats: ``-a`` (exact; NaN stays NaN, ties stay ties, and ``-0.0``/``+0.0`` swap, so the min
  pool picks ``-0.0`` over ``+0.0`` as ``lax.min`` does). Integers, signed or unsigned: ``~a``
  (``-a - 1`` resp. ``max - a``: no overflow, unlike ``-a`` at ``iinfo.min``). Bool: ``not a``.
  Max pooling's identity (``lowest``) maps to the largest value: ``+inf``, ``iinfo.max``, True,
  or the largest finite value of a float type without infinity.
  """
  if jnp.issubdtype(a.dtype, jnp.floating):
    return -a
  if a.dtype == np.dtype(np.bool_):
    return jnp.logical_not(a)
  return jnp.bitwise_not(a)


def accumulator_dtype(dtype) -> np.dtype:
  """Sums of float types narrower than 32 bits (bfloat16, float16, float8) accumulate in
  float32."""
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def beats(x: Any, best: Any) -> Any:
  """Whether ``x`` replaces the running maximum ``best`` of a window scanned in tap order.

  Strictly greater wins, so the first of equal values is kept (the lowest index on ties); a NaN
  beats every number and the first NaN is kept; ``+0.0`` beats ``-0.0``, as in ``lax.max`` and
  ``lax.reduce_window``, so that the value at the argmax is the forward's value, bit for bit.
  Works on arrays of any backend (XLA, and inside Pallas kernels).
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x > best
  # Equal values have equal bits except +0.0 (bits 0) and -0.0 (the signed minimum): a signed
  # comparison of the bits of equal values finds +0.0 over -0.0 (cheaper than two sign bits).
  if bits(x.dtype) < 16:
    x, best = x.astype(jnp.float32), best.astype(jnp.float32)
  as_int = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[bits(x.dtype)]
  zero_up = (x == best) & (lax.bitcast_convert_type(x, as_int)
                           > lax.bitcast_convert_type(best, as_int))
  return (jnp.logical_not(x <= best) & (best == best)) | zero_up


def order_key(v: Any) -> Any:
  """Integers in the order of :func:`beats`: the first maximum of ``order_key(v)`` (as
  ``jnp.argmax`` finds it) is where a max pool's scan of ``v`` ends.

  Floats: the bits as signed integers, with the magnitude bits of negative values flipped (so
  ``-0.0`` sorts just below ``+0.0``), and every NaN the largest key. Floats narrower than 32
  bits are converted to float32 first (exact): int32 keys, which XLA reduces faster on a GPU
  than 16-bit ones (docs/design/global-max.md, ``keyed32``: 1.2-1.4x), and formats
  without a sign bit or with unusual NaNs (``float8_e8m0fnu``, the ``fnuz`` formats) sort right
  too. Integers and bool: ``v``.
  """
  if not jnp.issubdtype(v.dtype, jnp.floating):
    return v
  if bits(v.dtype) < 32:
    v = v.astype(jnp.float32)
  n = bits(v.dtype)
  as_int = {32: jnp.int32, 64: jnp.int64}[n]
  top = np.array(np.iinfo(as_int).max, as_int)
  key = _flip_negatives(lax.bitcast_convert_type(v, as_int), n)
  return jnp.where(jnp.isnan(v), top, key)


def _flip_negatives(b: Any, n: int) -> Any:
  """The ``n``-bit signed integers ``b`` (a float's bits, a JAX or NumPy array) with the
  magnitude bits of the negative ones flipped: :func:`order_key`'s map, its own inverse."""
  # (an arithmetic shift: all ones for negative values)
  return b ^ ((b >> (n - 1)) & np.array((1 << (n - 1)) - 1, f"int{n}"))


def from_order_key(key: Any, dtype) -> Any:
  """The value of :func:`order_key`'s ``key`` as ``dtype`` (floats): its inverse, every NaN
  becoming one quiet NaN."""
  n = bits(key.dtype)
  as_float = {32: jnp.float32, 64: jnp.float64}[n]
  return lax.bitcast_convert_type(_flip_negatives(key, n), as_float).astype(dtype)


def _start_key(dtype) -> np.ndarray:
  """:func:`order_key` of ``lowest(dtype)`` (a float dtype), computed in NumPy: a constant."""
  low = lowest(dtype).astype(np.float32 if bits(dtype) < 32 else dtype)
  n = bits(low.dtype)
  return _flip_negatives(low.view(f"int{n}"), n)


def exact_max(reduce: Any, x: Any) -> Any:
  """``reduce(x, lowest(x.dtype))``, a max reduction of ``x`` (``lax.reduce_window`` or
  ``jnp.max`` with ``lax.max``, the second argument its start value), with the rules of
  :func:`beats` on every platform: NaN wins, ``+0.0`` above ``-0.0``.

  XLA:CPU's float max reductions break those rules on larger arrays (jax 0.10.2: a 2x2 stride-2
  ``reduce_window`` of a (1, 36, 39, 5) float32 array dropped NaNs and returned ``-0.0``
  beside ``+0.0``; ``jnp.max`` over an axis likewise): on a CPU the reduction runs on
  :func:`order_key`'s integers, which it compares exactly, and the result is mapped back (a NaN
  becomes one quiet NaN). Elsewhere ``x`` is reduced as it is.
  Integers and bool are reduced as they are."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return reduce(x, lowest(x.dtype))

  def keyed(v):
    return from_order_key(reduce(order_key(v), _start_key(v.dtype)), v.dtype)

  return lax.platform_dependent(x, cpu=keyed, default=lambda v: reduce(v, lowest(v.dtype)))
