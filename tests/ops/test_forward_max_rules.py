"""Max pooling without the taps (the inference forward) keeps the max rules on every platform.

XLA:CPU's float max reductions drop NaN and return ``-0.0`` beside ``+0.0`` on arrays of a few
thousand elements and more (jax 0.10.2: a 2x2 stride-2 ``lax.reduce_window`` of a (1, 36, 39,
5) float32 array, ``jnp.max`` over an axis likewise). On a CPU jaxpool's ``max_pool`` and
``min_pool`` (masked too) take the tap loop's values there (``xla.max_pool_values``), and
adaptive and global max pooling and Lp pooling's scale reduce integer order keys
(``dtypes.exact_max``), as does ``max_pool`` where an output dim is very long. Against NumPy
loops: NaN wins, ``+0.0`` above ``-0.0`` (``-0.0`` below ``+0.0`` for min). (Subnormals are
left out: XLA:CPU compares them as zero, which docs/pallas.md states for every comparison of the
XLA path.) Before that, every float32 case here failed (NaN lost or signed zeros wrong), and the
bfloat16 ones of the first shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise

import jaxpool
from jaxpool._src import xla, xla_taps
from jaxpool._src.windows import make_geometry

VALUES = np.array([0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)


def _inputs(shape, seed, dtype=np.float32):
  rng = np.random.default_rng(seed)
  p = np.array([24, 24, 8, 8, 1, 2, 2, 31], np.float64)
  return rng.choice(VALUES, size=shape, p=p / p.sum()).astype(dtype)


def _max_rule(w: np.ndarray, axis) -> np.ndarray:
  """The maximum over ``axis`` (a tuple) under max pooling's rules, in float64 loops' terms."""
  w = w.astype(np.float64)
  nan = np.isnan(w).any(axis=axis)
  m = np.where(np.isnan(w), -np.inf, w).max(axis=axis)
  plus_zero = ((w == 0) & ~np.signbit(w)).any(axis=axis)
  return np.where(nan, np.nan, np.where((m == 0) & plus_zero, 0.0, m))


SHAPES = [
    ((1, 36, 39, 5), (2, 2), (2, 2)), ((3, 32, 16, 7), (2, 2), (2, 2)),
    ((2, 27, 28, 3), (1, 7), (1, 7)), ((4, 30, 28, 5), (4, 4), (4, 4)),
    ((2, 24, 26, 4), (3, 3), (1, 1)),
]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, window, strides", SHAPES)
def test_max_and_min_pool_forwards(shape, window, strides, dtype):
  x = jnp.asarray(_inputs(shape, sum(shape), dtype))
  for fn, reference in ((jaxpool.max_pool, ref.max_pool), (jaxpool.min_pool, ref.min_pool)):
    expected = reference(np.asarray(x), window, strides, "VALID")
    assert_bitwise(jax.jit(lambda v, fn=fn: fn(v, window, strides))(x), expected)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the forms a CPU lowers")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, window, strides", SHAPES[:3])
def test_the_keyed_forms(shape, window, strides, dtype, monkeypatch):
  """The forms that reduce integer keys on a CPU: ``xla_taps.max_pool_forward`` (output dims
  longer than ``FOLD_MAX_OUT``, Lp pooling's scale), and ``max_pool_values`` traced where the
  default backend is not a CPU (a GPU host's CPU device). Fresh ``jit``s: the public
  functions' traces are cached. (Before, the second dropped NaN: it lowered XLA's float
  reduction for the CPU.)"""
  x = jnp.asarray(_inputs(shape, sum(shape), dtype))
  geom = make_geometry(shape, window, strides, "VALID")
  expected = ref.max_pool(np.asarray(x), window, strides, "VALID")
  assert_bitwise(jax.jit(lambda v: xla_taps.max_pool_forward(v, geom))(x), expected)
  monkeypatch.setattr(xla.jax, "default_backend", lambda: "gpu")
  text = jax.jit(lambda v: xla.max_pool_values(v, geom)).lower(x).as_text()
  assert "bitcast_convert" in text  # (the keys)
  assert_bitwise(jax.jit(lambda v: xla.max_pool_values(v, geom))(x), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_global_and_adaptive_max_pool_forwards(dtype):
  x = jnp.asarray(_inputs((3, 32, 40, 6), 7, dtype))
  got = jax.jit(jaxpool.global_max_pool)(x)
  assert_bitwise(got.reshape(3, 6), _max_rule(np.asarray(x), (1, 2)).astype(dtype))
  got = jax.jit(lambda v: jaxpool.adaptive_max_pool(v, (8, 10)))(x)
  blocks = np.asarray(x).reshape(3, 8, 4, 10, 4, 6)
  assert_bitwise(got, _max_rule(blocks, (2, 4)).astype(dtype))


def test_exact_max_maps_every_float32_class_back():
  """The order keys' inverse: every class of float32 (NaN as a NaN) and narrower formats."""
  from jaxpool._src import dtypes
  for dtype in (np.float32, jnp.bfloat16, np.float16, jnp.float8_e4m3fn):
    v = jnp.asarray(VALUES.astype(dtype))
    back = dtypes.from_order_key(dtypes.order_key(v), v.dtype)
    assert back.dtype == v.dtype
    assert_bitwise(np.asarray(back, np.float32), np.asarray(v, np.float32))
