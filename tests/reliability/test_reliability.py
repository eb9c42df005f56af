"""Reliability: bounded compile time for any window, every accepted dtype right, extreme values.

Each case here was once wrong or hung: large windows (the tap loop was unrolled), float8 (its
-inf is NaN), Lp pooling at the ends of the float range, unpooling with indices that do not fit,
huge sizes, and bad arguments that gave errors not naming them.
"""

import math
import re
import time

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise, jp
from hypothesis import given, settings

from jaxpool._src import windows, xla
from tiers import draws

E = re.escape


def _eqn_count(jaxpr) -> int:
  """Equations in a jaxpr, sub-jaxprs (loops, custom rules, pjit) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          n += _eqn_count(inner)
  return n


# ----------------------------------------------------------------------------- large windows


def _timed(fn, *args):
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


# A hang detector, not a benchmark: the unrolled tap loop took 358 s and 18 GB for the first.
HANG_BOUND_S = 60


@pytest.mark.parametrize("shape, window, kw", [
    ((1, 64, 64, 1), (64, 64), {}),
    ((2, 256, 256, 1), (256, 256), {}),
    ((2, 3100, 3), (3000,), dict(strides=(7,), padding=((5, 7),))),
], ids=["global_64x64", "global_256x256", "1d_3000_taps"])
def test_large_window_gradient_compiles_fast(rng, shape, window, kw):
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  grad = jax.jit(jax.grad(lambda v: jp.max_pool(v, window, **kw).sum()))
  assert _timed(grad, x) < HANG_BOUND_S
  dx = np.asarray(grad(x))
  np.testing.assert_array_equal(dx, ref.max_pool_grad(np.asarray(x), np.ones(
      jax.eval_shape(lambda v: jp.max_pool(v, window, **kw), x).shape), window, **kw))


def test_program_size_does_not_grow_with_the_window():
  def size(k):
    x = jax.ShapeDtypeStruct((1, k + 5, k + 3, 2), jnp.float32)
    f = jax.grad(lambda v: (jp.max_pool(v, (k, k), padding=1)
                            + jp.avg_pool(v, (k, k), padding=1)
                            + jp.lp_pool(v, 3, (k, k), padding=1)).sum())
    return _eqn_count(jax.make_jaxpr(f)(x).jaxpr)

  # Loops above the unroll thresholds: these windows are separable (xla_separable.py), whose
  # max loops from 64 taps in a dim and average sums from 256; Lp's sums loop over the whole
  # window's taps.
  assert size(257) == size(300) == size(301) > 0


# Configurations above the unroll threshold with every edge: padding, dilation, ceil mode,
# empty windows, strides that skip elements, channels_first, two batch dims.
# (`make test` runs the first and the last; the three between are marked slow.)
slow = pytest.mark.slow
LARGE = [
    ((2, 23, 21, 3), (9, 8), dict(strides=(2, 3), padding=((4, 2), (3, 7)), ceil_mode=True)),
    pytest.param((1, 90, 2), (70,), dict(strides=(5,), padding=((69, 0),), dilation=(1,)),
                 marks=slow),
    pytest.param((2, 3, 30, 30), (6, 12), dict(strides=(4, 1), dilation=(3, 2), padding=2,
                                               data_format="channels_first"), marks=slow),
    pytest.param((2, 2, 9, 10, 11, 2), (5, 4, 4), dict(strides=(2, 3, 2), padding="SAME"),
                 marks=slow),
    # above the sums' threshold too: average and Lp loop as well
    ((1, 40, 37, 2), (17, 17), dict(strides=(3, 4), padding=((4, 2), (0, 5)), ceil_mode=True)),
]


@pytest.mark.parametrize("shape, window, kw", LARGE)
def test_large_windows_match_reference(rng, shape, window, kw):
  assert math.prod(window) > xla.UNROLL_TAPS
  # Small integers: many ties, and exact float sums.
  x = rng.integers(-3, 4, shape).astype(np.float32)
  ry, ridx = ref.max_pool_with_indices(x, window, **kw)
  dy = rng.integers(-4, 5, ry.shape).astype(np.float32)

  @jax.jit  # every op in one compile
  def run(x, dy):
    return (*jp.max_pool_with_indices(x, window, **kw), jp.max_pool(x, window, **kw),
            jp.max_pool_grad(x, dy, window, **kw), jp.avg_pool(x, window, **kw),
            jp.avg_pool_grad(dy, x.shape, window, **kw), jp.lp_pool(x, 3, window, **kw),
            jp.lp_pool_grad(x, dy, 3, window, **kw))

  y, idx, y2, dx, avg, davg, lp, dlp = run(x, dy)
  assert_bitwise(y, ry)
  assert_bitwise(idx, ridx)
  assert_bitwise(y2, ry)
  assert_bitwise(dx, ref.max_pool_grad(x, dy, window, **kw).astype(np.float32))
  np.testing.assert_allclose(avg, ref.avg_pool(x, window, **kw), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(davg, ref.avg_pool_grad(dy, x.shape, window, **kw),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lp, ref.lp_pool(x, 3, window, **kw), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dlp, ref.lp_pool_grad(x, dy, 3, window, **kw), rtol=1e-4,
                             atol=1e-4)


def test_large_window_forward_mode_and_vmap_of_grad(rng):
  x = jnp.asarray(rng.standard_normal((3, 20, 20, 2)), jnp.float32)
  t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  cfg = dict(window_shape=(10, 10), strides=(3, 3), padding=1)
  f = lambda v: jp.max_pool(v, **cfg)
  u = jnp.asarray(rng.standard_normal(jax.eval_shape(f, x).shape), jnp.float32)

  @jax.jit  # one compile for the four
  def run(x, t, u):
    _, jvp_out = jax.jvp(f, (x,), (t,))
    _, vjp = jax.vjp(f, x)
    per_example = jax.vmap(jax.grad(lambda v: f(v[None]).sum()))(x)
    return jvp_out, vjp(u)[0], per_example, jax.grad(lambda v: f(v).sum())(x)

  jvp_out, vjp_u, per_example, whole = run(x, t, u)
  # <J t, u> == <t, J^T u>: forward and reverse mode describe the same linear map.
  np.testing.assert_allclose(np.vdot(jvp_out, u), np.vdot(t, vjp_u), rtol=1e-5)
  assert_bitwise(per_example, whole)


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype, has_inf", [
    (jnp.float8_e4m3fn, False), (jnp.float8_e5m2, True), (jnp.float8_e4m3fnuz, False),
    (jnp.float8_e5m2fnuz, False),
])
def test_float8_max_pool(rng, dtype, has_inf):
  x32 = rng.integers(-8, 9, (2, 5, 6, 3)).astype(np.float32) / 4
  x = jnp.asarray(x32, dtype)
  kw = dict(strides=(2, 2), padding=1)
  y = jp.max_pool(x, (2, 3), **kw)
  expected = ref.max_pool(np.asarray(x).astype(np.float32), (2, 3), **kw)
  assert y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y).astype(np.float32), expected)
  y2, _ = jp.max_pool_with_indices(x, (2, 3), **kw)
  np.testing.assert_array_equal(np.asarray(y2).astype(np.float32), expected)
  np.testing.assert_allclose(np.asarray(jp.avg_pool(x, (2, 3), **kw)).astype(np.float32),
                             ref.avg_pool(np.asarray(x).astype(np.float32), (2, 3), **kw),
                             rtol=0.13, atol=0.13)
  # A window with no real element gives the dtype's lowest: -inf where it exists. (Taps at -2
  # and 1 of a single element: both in the padding.)
  empty = jp.max_pool(x[:, :1, 0], (2,), padding=2, dilation=(3,))
  lowest = -np.inf if has_inf else float(jnp.finfo(dtype).min)
  np.testing.assert_array_equal(np.asarray(empty).astype(np.float32), lowest)


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.float4_e2m1fn])
@pytest.mark.parametrize("op", ["max_pool", "avg_pool"])
def test_sub_byte_dtypes_are_refused(dtype, op):
  x = jnp.zeros((1, 4, 4, 1), dtype)
  with pytest.raises(TypeError, match=r"x must have a float.* dtype.*; got u?(int4|float4)"):
    getattr(jp, op)(x, (2, 2))


# ----------------------------------------------------------------------------- Lp range


@pytest.mark.parametrize("p, value, dtype", [
    (3, 1e20, np.float32), (2, 1e-30, np.float32), (50, 10.0, np.float32),
    (2, 1e30, np.float32), (7, 1e-20, np.float32), (2.5, 1e150, np.float64),
    (3, 1e-200, np.float64), (2, 3e4, np.float16), (4, 1e30, jnp.bfloat16),
])
def test_lp_pool_over_the_whole_range(p, value, dtype):
  # Two equal elements per window: y = value * 2^(1/p) and dy/dx = 2^(1/p - 1) each.
  with jax.enable_x64(dtype == np.float64):
    x = jnp.asarray(np.full((1, 4, 1), value), dtype)
    y = jp.lp_pool(x, p, (2,), strides=(2,))
    g = jax.grad(lambda v: jp.lp_pool(v, p, (2,), strides=(2,)).astype(jnp.float32).sum())(x)
    expect_y = float(np.asarray(jnp.asarray(value, dtype), np.float64)) * 2 ** (1 / p)
    rtol = 1e-12 if dtype == np.float64 else float(jnp.finfo(dtype).eps) * 4
    np.testing.assert_allclose(np.asarray(y, np.float64), expect_y, rtol=rtol)
    assert np.all(np.isfinite(np.asarray(g, np.float64)))
    np.testing.assert_allclose(np.asarray(g, np.float64), 2 ** (1 / p - 1), rtol=rtol)


def test_lp_pool_gradient_is_never_nan_for_finite_input():
  x = jnp.asarray([[0.0, 0.0, 3e38, -3e38, 1e-45, 0.0, -1e-45, 5.0]], jnp.float32)[..., None]
  for p in (1, 1.5, 2, 3, 10):
    g = jax.grad(lambda v, p=p: jp.lp_pool(v, p, (2,), strides=(2,)).sum())(x)
    assert not np.any(np.isnan(np.asarray(g))), p


@settings(max_examples=draws(40, 20), deadline=None)
# (From 1e-37: XLA on a CPU flushes float32 subnormals to zero, below 1.2e-38.)
@given(p=st.sampled_from([1.0, 1.5, 2.0, 3.0, 8.0]), exponent=st.integers(-37, 36),
       seed=st.integers(0, 2**16))
def test_lp_pool_scale_invariance(p, exponent, seed):
  # Lp pooling is homogeneous: lp(c x) = c lp(x), so a float32 input of any magnitude matches
  # the float64 reference of the unscaled input, times the scale.
  base = np.random.default_rng(seed).uniform(0.5, 2.0, (1, 6, 6, 1)).astype(np.float32)
  scale = np.float32(10.0) ** exponent
  x = base * scale
  if not np.all(np.isfinite(x)) or np.any(x == 0):
    return
  y = np.asarray(jp.lp_pool(x, p, (3, 3), strides=(2, 2), padding=1), np.float64)
  # The reference sees the float32 input scaled by a power of two (exact) into its range.
  c = 2.0 ** np.round(np.log2(np.abs(x).max()))
  expected = ref.lp_pool(x.astype(np.float64) / c, p, (3, 3), strides=(2, 2), padding=1) * c
  np.testing.assert_allclose(y, expected, rtol=2e-5)


# ----------------------------------------------------------------------------- unpooling


def test_max_unpool_rejects_indices_outside_the_plane():
  x = jnp.arange(16.0).reshape(1, 4, 4, 1)
  y, i = jp.max_pool_with_indices(x, (2, 2), strides=(2, 2))
  with pytest.raises(ValueError, match=E("indices must lie in [-1, 9)") + ".*got 13"):
    jp.max_unpool(y, i, (3, 3))
  for bad in (16, 10**6, -2):
    with pytest.raises(ValueError, match=f"indices must lie in .*got {bad}"):
      jp.max_unpool(y, i.at[0, 0, 0, 0].set(bad), (4, 4))


def test_max_unpool_under_jit_drops_indices_outside_the_plane():
  y = jnp.asarray([1.0, 2.0, 3.0]).reshape(1, 3, 1)
  i = jnp.asarray([0, 16, -1], jnp.int32).reshape(1, 3, 1)
  out = jax.jit(lambda a, b: jp.max_unpool(a, b, (4,)))(y, i)
  np.testing.assert_array_equal(np.asarray(out)[0, :, 0], [1.0, 0.0, 0.0, 0.0])


# ----------------------------------------------------------------------------- huge values


@pytest.mark.parametrize("kw, name", [
    (dict(window_shape=(2**40,), padding=2**39), "window_shape"),
    (dict(window_shape=(2,), dilation=(2**40,)), "dilation"),
    (dict(window_shape=(2,), strides=(2**63,)), "strides"),
    (dict(window_shape=(2,), strides=(2**64,)), "strides"),
    (dict(window_shape=(2**31,)), "window_shape"),
    (dict(window_shape=(2**30,), padding=2**30 - 1), "padded input"),
    (dict(window_shape=(2,), padding=2**63), "padding"),
    (dict(window_shape=(2,), padding=((0, 2**40),)), "padding"),
])
@pytest.mark.parametrize("op", ["max_pool", "avg_pool", "max_pool_with_indices"])
def test_huge_values_are_value_errors(kw, name, op):
  x = jnp.zeros((1, 10, 1))
  start = time.perf_counter()
  with pytest.raises(ValueError, match=name):
    getattr(jp, op)(x, **kw)
  assert time.perf_counter() - start < 5


def test_taps_must_fit_in_int32():
  with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1 taps"):
    windows.make_geometry((1, 2**16, 2**16, 1), (2**16, 2**16))


# ----------------------------------------------------------------------------- smaller


def test_complex_dy_is_refused():
  x = jnp.ones((1, 4, 4, 1))
  dy = jnp.ones((1, 2, 2, 1), jnp.complex64)
  with pytest.raises(TypeError, match="dy must have .* dtype; got complex64"):
    jp.max_pool_grad(x, dy, (2, 2), strides=(2, 2))
  with pytest.raises(TypeError, match="dy must have .* dtype; got complex64"):
    jp.lp_pool_grad(x, dy, 2, (2, 2), strides=(2, 2))


@pytest.mark.parametrize("value, name", [(None, "x"), ([[1.0, 2.0], [3.0]], "x")])
def test_non_arrays_name_the_argument(value, name):
  with pytest.raises(TypeError, match=f"{name} must be an array"):
    jp.max_pool(value, (1,))
  with pytest.raises(TypeError, match="dy must be an array"):
    jp.max_pool_grad(np.ones((1, 2, 1)), value, (1,))


@pytest.mark.parametrize("shape", [(1, -1, 4, 1), (1, 4, -5, 1)])
def test_negative_input_shape(shape):
  with pytest.raises(ValueError, match="input_shape entries must be >= 0"):
    jp.avg_pool_grad(jnp.ones((1, 2, 2, 1)), shape, (2, 2))


@pytest.mark.parametrize("values", [[-0.0, 0.0], [0.0, -0.0], [-0.0, -0.0, 0.0, -0.0]])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_signed_zero_maximum_agrees_everywhere(values, implementation):
  x = jnp.asarray(values, jnp.float32).reshape(1, -1, 1)
  window = (len(values),)
  y = jp.max_pool(x, window, implementation=implementation)
  y2, i = jp.max_pool_with_indices(x, window, implementation=implementation)
  assert_bitwise(y, y2)
  assert_bitwise(y, xla.max_pool_forward(x, windows.make_geometry(x.shape, window)))
  assert_bitwise(jnp.take(x[0, :, 0], i[0, :, 0]), y[0, :, 0])  # the value at the argmax
  ry, ri = ref.max_pool_with_indices(np.asarray(x), window)
  assert_bitwise(y, ry)
  assert_bitwise(i, ri)


# ----------------------------------------------------------------------------- adversarial


@st.composite
def extreme_configs(draw):
  """Valid configurations at the edges: windows up to 4x the unroll threshold, strides larger
  than the window, dilations that jump over the input, padding up to the window, ceil mode."""
  n = draw(st.integers(1, 2))
  window = tuple(draw(st.integers(1, 12)) for _ in range(n))
  dilation = tuple(draw(st.sampled_from([1, 1, 2, 5])) for _ in range(n))
  strides = tuple(draw(st.sampled_from([1, 2, 7, 40])) for _ in range(n))
  eff = [d * (k - 1) + 1 for k, d in zip(window, dilation, strict=True)]
  padding = tuple((draw(st.integers(0, e - 1)), draw(st.integers(0, e - 1))) for e in eff)
  spatial = tuple(max(1, e - lo - hi + draw(st.integers(0, 6)))
                  for e, (lo, hi) in zip(eff, padding, strict=True))
  ceil_mode = draw(st.booleans())
  batch = draw(st.sampled_from([(1,), (2,), ()]))
  dtype = draw(st.sampled_from([np.float32, np.float16, np.int8, np.int32]))
  return (*batch, *spatial, 2), window, dict(strides=strides, padding=padding,
                                             dilation=dilation, ceil_mode=ceil_mode), dtype


@settings(max_examples=draws(12, 6), deadline=None)
@given(cfg=extreme_configs(), seed=st.integers(0, 2**16))
def test_extreme_configs_match_reference(cfg, seed):
  _check_extreme_config(cfg, seed)


@pytest.mark.slow  # (`make test` runs 12 examples: test_extreme_configs_match_reference)
@settings(max_examples=draws(30, 15), deadline=None)
@given(cfg=extreme_configs(), seed=st.integers(0, 2**16))
def test_extreme_configs_match_reference_more_examples(cfg, seed):
  _check_extreme_config(cfg, seed)


def _check_extreme_config(cfg, seed):
  shape, window, kw, dtype = cfg
  if len(shape) < len(window) + 1:
    return
  rng = np.random.default_rng(seed)
  x = rng.integers(-3, 4, shape).astype(dtype)
  ry, ridx = ref.max_pool_with_indices(x, window, **kw)
  floating = np.issubdtype(dtype, np.floating)
  dy = rng.integers(-3, 4, ry.shape).astype(dtype) if floating else None

  @jax.jit  # the forward and the gradient in one compile
  def run(x, dy):
    y, idx = jp.max_pool_with_indices(x, window, **kw)
    return y, idx, None if dy is None else jp.max_pool_grad(x, dy, window, **kw)

  y, idx, dx = run(x, dy)
  assert_bitwise(y, ry)
  assert_bitwise(idx, ridx)
  if floating:
    assert_bitwise(dx, ref.max_pool_grad(x, dy, window, **kw).astype(dtype))


@settings(max_examples=draws(40, 20), deadline=None)
@given(cfg=extreme_configs())
def test_window_counts_closed_form(cfg):
  shape, window, kw, _ = cfg
  if len(shape) < len(window) + 1:
    return
  geom = windows.make_geometry(shape, window, kw["strides"], kw["padding"], kw["dilation"],
                               kw["ceil_mode"])
  for dim in range(geom.nspatial):
    for include_pad in (False, True):
      o = np.arange(geom.out_spatial[dim])[:, None]
      t = np.arange(geom.window[dim])[None, :]
      pos = o * geom.strides[dim] + t * geom.dilation[dim] - geom.padding[dim][0]
      lo = -geom.padding[dim][0] if include_pad else 0
      hi = geom.in_spatial[dim] + (geom.padding[dim][1] if include_pad else 0)
      brute = ((pos >= lo) & (pos < hi)).sum(axis=1)
      np.testing.assert_array_equal(windows.window_counts_1d(geom, dim, include_pad), brute)
