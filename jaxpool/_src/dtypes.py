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


def check_dtype(name: str, a: jax.Array, *, allow_int: bool) -> None:
  """Raises a TypeError unless ``a`` has a float dtype (or an integer one with ``allow_int``) of
  at least 8 bits. Sub-byte dtypes (``int4``, ``float4_e2m1fn``) have no XLA window reductions."""
  dt = a.dtype
  is_float = jnp.issubdtype(dt, jnp.floating)
  is_int = jnp.issubdtype(dt, jnp.integer)
  allowed = "a float or integer" if allow_int else "a float"
  if is_float or (allow_int and is_int):
    if bits(dt) < 8:
      raise TypeError(
          f"{name} must have {allowed} dtype of at least 8 bits; got {dt} ({bits(dt)} bits).")
    return
  raise TypeError(f"{name} must have {allowed} dtype; got {dt}.")


def lowest(dtype) -> np.ndarray:
  """The identity of max for ``dtype``: ``-inf`` for floats, ``iinfo.min`` for ints.

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
  return np.array(jnp.iinfo(dtype).min, dtype)


def accumulator_dtype(dtype) -> np.dtype:
  """Sums of float types narrower than 32 bits (bfloat16, float16, float8) accumulate in
  float32."""
  dtype = np.dtype(dtype)
  return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def signbit(a: Any) -> Any:
  """``jnp.signbit`` for every float dtype (it takes 16 bits or more; float32 holds every
  narrower float exactly)."""
  return jnp.signbit(a) if bits(a.dtype) >= 16 else jnp.signbit(a.astype(jnp.float32))


def same_value(a: Any, b: Any) -> Any:
  """``a`` and ``b`` are the same value: equal with the same sign (so ``-0.0`` is not ``0.0``),
  or both NaN."""
  if not jnp.issubdtype(a.dtype, jnp.floating):
    return a == b
  return ((a == b) & (signbit(a) == signbit(b))) | (jnp.isnan(a) & jnp.isnan(b))


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
