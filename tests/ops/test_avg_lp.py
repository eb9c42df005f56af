"""avg_pool, lp_pool, l2_pool and gradients against the NumPy reference (docs/semantics.md)."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_same_bits, jp, pool_configs, split, tie_rich, tol
from tiers import draws

SETTINGS = hypothesis.settings(max_examples=draws(10, 5), deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])

GRID = [
    ((2, 6, 7, 3), (2, 2), (2, 2), "VALID", None, False, "channels_last"),
    ((2, 6, 7, 3), (3, 3), (1, 1), "SAME", None, False, "channels_last"),
    ((2, 3, 7, 6), (3, 2), (2, 3), "SAME_LOWER", None, True, "channels_first"),
    ((2, 3, 6, 7), (3, 3), (2, 2), 1, None, True, "channels_first"),
    ((1, 8, 9, 2), (3, 3), (2, 2), ((2, 2), (1, 3)), (2, 2), True, "channels_last"),  # empties
    ((3, 9, 2), (4,), (3,), ((3, 1),), None, True, "channels_last"),
    ((2, 4, 5, 6, 2), (2, 3, 2), (2, 2, 1), "SAME", (1, 1, 2), True, "channels_last"),
]


def _kw(window, strides, padding, dilation, ceil_mode, data_format):
  return dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode, data_format=data_format)


def _grad_of(f, x, dy):
  return jax.grad(lambda v: jnp.sum(f(v) * dy))(x)


# ------------------------------------------------------------------------------ average


AVG_MODES = [(True, None), (False, None), (True, 5), (False, 2)]
# every case with one divisor mode (cycling), and the empty-window case with all four
AVG_GRID = ([(c, *AVG_MODES[i % 4]) for i, c in enumerate(GRID)]
            + [(GRID[4], *m) for m in AVG_MODES if m != AVG_MODES[0]])


@pytest.mark.parametrize("case,count_include_pad,divisor_override", AVG_GRID)
def test_avg_pool_grid(case, count_include_pad, divisor_override, rng):
  shape, *cfg = case
  kw = dict(_kw(*cfg), count_include_pad=count_include_pad, divisor_override=divisor_override)
  taps = math.prod(kw["window_shape"])
  x = rng.standard_normal(shape).astype(np.float32)
  y = jp.avg_pool(x, **kw)
  assert y.dtype == np.float32
  np.testing.assert_allclose(y, ref.avg_pool(x, **kw), **tol(np.float32, taps))
  dy = rng.standard_normal(y.shape).astype(np.float32)
  dx = jp.avg_pool_grad(dy, x.shape, **kw)
  np.testing.assert_allclose(dx, ref.avg_pool_grad(dy, x.shape, **kw), **tol(np.float32, taps))
  assert_same_bits(_grad_of(lambda v: jp.avg_pool(v, **kw), x, dy), dx)


@SETTINGS
@hypothesis.given(cfg=pool_configs(), seed=st.integers(0, 2**31 - 1),
                  count_include_pad=st.booleans(),
                  divisor_override=st.sampled_from([None, None, 1, 3]))
def test_avg_pool_property(cfg, seed, count_include_pad, divisor_override):
  shape, kw = split(cfg)
  kw.update(count_include_pad=count_include_pad, divisor_override=divisor_override)
  taps = math.prod(kw["window_shape"])
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  y = jp.avg_pool(x, **kw)
  np.testing.assert_allclose(y, ref.avg_pool(x, **kw), **tol(np.float32, taps))
  dy = rng.standard_normal(y.shape).astype(np.float32)
  dx = jp.avg_pool_grad(dy, shape, **kw)
  np.testing.assert_allclose(dx, ref.avg_pool_grad(dy, shape, **kw), **tol(np.float32, taps))


def test_avg_pytorch_divisors_hand_case():
  x = np.ones((1, 3, 3, 1), np.float32)
  kw = dict(window_shape=(2, 2), strides=(2, 2), padding=1)
  np.testing.assert_array_equal(jp.avg_pool(x, **kw, count_include_pad=True)[0, ..., 0],
                                [[0.25, 0.5], [0.5, 1.0]])
  np.testing.assert_array_equal(jp.avg_pool(x, **kw, count_include_pad=False)[0, ..., 0],
                                [[1.0, 1.0], [1.0, 1.0]])
  np.testing.assert_array_equal(jp.avg_pool(x, **kw, divisor_override=2)[0, ..., 0],
                                [[0.5, 1.0], [1.0, 2.0]])


def test_avg_ceil_overhang_never_counted():
  """L=4, k=3, s=2, padding 1, ceil: windows [-1,1], [1,3], [3,5]; 4 is padding, 5 overhang:
  divisors 3, 3, 2.

  PyTorch's avg_pool1d(ones(4), 3, 2, 1, ceil_mode=True) gives [2/3, 1, 1/2].
  """
  x = np.ones((1, 4, 1), np.float32)
  kw = dict(window_shape=(3,), strides=(2,), padding=1, ceil_mode=True)
  y = jp.avg_pool(x, **kw, count_include_pad=True)
  np.testing.assert_allclose(y[0, :, 0], [2 / 3, 1.0, 0.5], rtol=1e-7)
  y = jp.avg_pool(x, **kw, count_include_pad=False)
  np.testing.assert_array_equal(y[0, :, 0], [1.0, 1.0, 1.0])
  dx = jp.avg_pool_grad(np.ones((1, 3, 1), np.float32), x.shape, **kw)
  np.testing.assert_allclose(dx[0, :, 0], [1 / 3, 2 / 3, 1 / 3, 1 / 3 + 1 / 2], rtol=1e-6)


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_empty_window_is_zero(count_include_pad):
  x = np.array([4.0, 8.0], np.float32).reshape(1, 2, 1)
  kw = dict(window_shape=(2,), padding=((2, 2),), dilation=(3,),
            count_include_pad=count_include_pad)
  y = jp.avg_pool(x, **kw)
  div = 2.0 if count_include_pad else 1.0
  np.testing.assert_array_equal(y[0, :, 0], [8.0 / div, 0.0, 4.0 / div])
  dx = jp.avg_pool_grad(np.array([1.0, 100.0, 10.0], np.float32).reshape(1, 3, 1),
                             x.shape, **kw)
  np.testing.assert_array_equal(dx[0, :, 0], [10.0 / div, 1.0 / div])
  assert np.all(np.isfinite(dx))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_avg_low_precision_accumulates_in_float32(dtype):
  """[256, 1 x 7]: summed in bfloat16, 256 + 1 rounds back to 256 (mean 32)."""
  x = np.array([256.0] + [1.0] * 7, dtype).reshape(1, 8, 1)
  y = jp.avg_pool(x, (8,))
  assert y.dtype == dtype
  assert y[0, 0, 0] == np.asarray(263.0 / 8, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_avg_lp_low_precision_vs_float32_reference(dtype, rng):
  x = rng.standard_normal((2, 7, 6, 3)).astype(dtype)
  kw = dict(window_shape=(3, 3), strides=(2, 1), padding="SAME")
  y = jp.avg_pool(x, **kw)
  assert y.dtype == dtype
  np.testing.assert_allclose(y.astype(np.float32), ref.avg_pool(x, **kw).astype(dtype)
                             .astype(np.float32), **tol(dtype))
  y = jp.lp_pool(x, 3, **kw)
  assert y.dtype == dtype
  np.testing.assert_allclose(y.astype(np.float32), ref.lp_pool(x, 3, **kw).astype(dtype)
                             .astype(np.float32), **tol(dtype))
  dy = rng.standard_normal(y.shape).astype(dtype)
  dx = jp.avg_pool_grad(dy, x.shape, **kw)
  assert dx.dtype == dtype
  np.testing.assert_allclose(dx.astype(np.float32), ref.avg_pool_grad(dy, x.shape, **kw),
                             **tol(dtype, 9))


# ------------------------------------------------------------------------------ Lp


LP_PS = [1, 1.5, 2, 3]
LP_GRID = ([(c, LP_PS[i % 4]) for i, c in enumerate(GRID)]
           + [(GRID[4], p) for p in LP_PS if p != LP_PS[0]])


@pytest.mark.parametrize("case,p", LP_GRID)
def test_lp_pool_grid(case, p, rng):
  shape, *cfg = case
  kw = _kw(*cfg)
  taps = math.prod(kw["window_shape"])
  x = rng.standard_normal(shape).astype(np.float32)
  x[rng.random(shape) < 0.2] = 0.0
  y = jp.lp_pool(x, p, **kw)
  np.testing.assert_allclose(y, ref.lp_pool(x, p, **kw), **tol(np.float32, taps))
  dy = rng.standard_normal(y.shape).astype(np.float32)
  dx = jp.lp_pool_grad(x, dy, p, **kw)
  np.testing.assert_allclose(dx, ref.lp_pool_grad(x, dy, p, **kw), rtol=1e-5, atol=1e-5)
  assert_same_bits(_grad_of(lambda v: jp.lp_pool(v, p, **kw), x, dy), dx)


@hypothesis.settings(SETTINGS, max_examples=draws(8, 4))
@hypothesis.given(cfg=pool_configs(), seed=st.integers(0, 2**31 - 1),
                  p=st.sampled_from([1.0, 1.25, 2.0, 2.5, 4.0]))
def test_lp_pool_property(cfg, seed, p):
  shape, kw = split(cfg)
  rng = np.random.default_rng(seed)
  x = tie_rich(rng, shape) - 1.5  # includes zero windows
  y = jp.lp_pool(x, p, **kw)
  np.testing.assert_allclose(y, ref.lp_pool(x, p, **kw), **tol(np.float32,
                                                               math.prod(kw["window_shape"])))
  dy = rng.standard_normal(y.shape).astype(np.float32)
  dx = jp.lp_pool_grad(x, dy, p, **kw)
  assert np.all(np.isfinite(dx))
  np.testing.assert_allclose(dx, ref.lp_pool_grad(x, dy, p, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1, 1.5, 2, 3])
def test_lp_zero_window_gradient_is_zero_not_nan(p):
  x = np.array([0.0, 0.0, 3.0, -4.0], np.float32).reshape(1, 4, 1)
  y = jp.lp_pool(x, p, (2,), (2,))
  np.testing.assert_allclose(y[0, :, 0], [0.0, (3.0**p + 4.0**p) ** (1 / p)], rtol=1e-6)
  dx = jp.lp_pool_grad(x, np.ones((1, 2, 1), np.float32), p, (2,), (2,))
  np.testing.assert_allclose(dx[0, :, 0], ref.lp_pool_grad(x, np.ones((1, 2, 1)), p, (2,),
                                                           (2,))[0, :, 0], rtol=1e-6)
  assert dx[0, 0, 0] == 0 and dx[0, 1, 0] == 0
  g = jax.grad(lambda v: jnp.sum(jp.lp_pool(v, p, (2,), (2,))))(x)
  assert np.all(np.isfinite(g))


def test_lp_empty_window():
  x = np.array([3.0, -4.0], np.float32).reshape(1, 2, 1)
  kw = dict(window_shape=(2,), padding=((2, 2),), dilation=(3,))
  y = jp.lp_pool(x, 2, **kw)
  np.testing.assert_array_equal(y[0, :, 0], [4.0, 0.0, 3.0])
  dx = jp.lp_pool_grad(x, np.array([1.0, 100.0, 10.0], np.float32).reshape(1, 3, 1), 2,
                            **kw)
  np.testing.assert_array_equal(dx[0, :, 0], [10.0, -1.0])


def test_l2_pool_is_lp_2(rng):
  x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
  kw = dict(window_shape=(3, 3), strides=(2, 2), padding="SAME", ceil_mode=True)
  assert_same_bits(jp.l2_pool(x, **kw), jp.lp_pool(x, 2, **kw))
  x = np.array([3.0, 4.0, 0.0, 0.0], np.float32).reshape(1, 4, 1)
  np.testing.assert_array_equal(jp.l2_pool(x, (2,), (2,))[0, :, 0], [5.0, 0.0])
  dx = jax.grad(lambda v: jnp.sum(jp.l2_pool(v, (2,), (2,))))(x)
  np.testing.assert_allclose(dx[0, :, 0], [0.6, 0.8, 0.0, 0.0], rtol=1e-6)


def test_lp_p1_is_sum_of_abs(rng):
  x = rng.standard_normal((3, 8, 2)).astype(np.float32)
  y = jp.lp_pool(x, 1, (3,), (2,), "SAME")
  s = jp.avg_pool(np.abs(x), (3,), (2,), "SAME", divisor_override=1)
  np.testing.assert_allclose(y, s, rtol=1e-6)
