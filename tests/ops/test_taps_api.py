"""max_pool_with_taps and max_pool_grad_from_taps: the forward's 1-byte gradient state and the
gradient from it, against the NumPy reference and against jax.vjp of max_pool."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise, assert_same_bits, pool_configs, split, tie_rich

import jaxpool
from tiers import draws

SETTINGS = hypothesis.settings(max_examples=draws(12, 6), deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])

# (shape, window, strides, padding, dilation, ceil_mode, data_format)
GRID = [
    ((2, 6, 7, 3), (2, 2), (2, 2), "VALID", None, False, "channels_last"),
    ((2, 6, 7, 3), (3, 3), (1, 1), "VALID", None, False, "channels_last"),  # overlapping
    ((2, 6, 7, 3), (3, 2), (2, 3), "SAME_LOWER", None, False, "channels_last"),
    ((2, 3, 6, 7), (3, 3), (2, 2), 1, None, True, "channels_first"),
    ((1, 8, 9, 2), (3, 3), (2, 2), ((2, 2), (1, 3)), (2, 2), False, "channels_last"),  # empties
    ((1, 9, 2), (3,), (2,), 2, (3,), True, "channels_last"),  # 1-D, dilation + ceil
    ((2, 4, 5, 6), (2, 3, 2), (1, 2, 2), ((1, 1), (0, 2), (1, 0)), (2, 1, 2), False,
     "channels_first"),  # 3-D
]


def _kw(window, strides, padding, dilation, ceil_mode, data_format):
  return dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode, data_format=data_format)


def _signed_zeros(rng, shape):
  """Tie-rich values with negatives, +-0.0, NaN and -inf."""
  x = tie_rich(rng, shape, specials=True) - 2.0
  u = rng.random(shape)
  x[u < 0.15] = 0.0
  x[(u >= 0.15) & (u < 0.3)] = -0.0
  return x.astype(np.float32)


def _vjp_of_max_pool(x, dy, activation=None, implementation="xla", **kw):
  f = functools.partial(jaxpool.max_pool, activation=activation, implementation=implementation,
                        **kw)
  return jax.vjp(f, x)[1](dy)[0]


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("case", GRID)
def test_taps_and_gradient_grid(case, activation, rng):
  shape, *cfg = case
  kw = _kw(*cfg)
  x = _signed_zeros(rng, shape)
  y, taps = jaxpool.max_pool_with_taps(x, **kw, activation=activation, implementation="xla")
  y_ref, taps_ref = ref.max_pool_with_taps(x, **kw, activation=activation)
  assert taps.dtype == np.int8
  assert_bitwise(y, y_ref)
  np.testing.assert_array_equal(taps, taps_ref)
  dy = tie_rich(rng, y.shape) - 1.5
  dx = jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **kw, implementation="xla")
  assert_same_bits(dx, _vjp_of_max_pool(x, dy, activation, **kw))
  if activation is None:
    np.testing.assert_array_equal(dx, ref.max_pool_grad(x, dy, **kw).astype(np.float32))


PROPERTY = dict(cfg=pool_configs(), seed=st.integers(0, 2**31 - 1),
                activation=st.sampled_from([None, "relu"]))


@hypothesis.settings(SETTINGS, max_examples=draws(6, 3))
@hypothesis.given(**PROPERTY)
def test_taps_property(cfg, seed, activation):
  _check_taps_property(cfg, seed, activation)


@pytest.mark.slow  # (`make test` runs 6 examples: test_taps_property)
@SETTINGS
@hypothesis.given(**PROPERTY)
def test_taps_property_more_examples(cfg, seed, activation):
  _check_taps_property(cfg, seed, activation)


def _check_taps_property(cfg, seed, activation):
  shape, kw = split(cfg)
  rng = np.random.default_rng(seed)
  x = _signed_zeros(rng, shape)
  y, taps = jaxpool.max_pool_with_taps(x, **kw, activation=activation, implementation="xla")
  y_ref, taps_ref = ref.max_pool_with_taps(x, **kw, activation=activation)
  assert_bitwise(y, y_ref)
  np.testing.assert_array_equal(taps, taps_ref)
  # the same winners as max_pool_with_indices (where there is one)
  if activation is None:
    _, idx = jaxpool.max_pool_with_indices(x, **kw, implementation="xla")
    np.testing.assert_array_equal(np.asarray(idx) < 0, np.asarray(taps) < 0)
  dy = tie_rich(rng, y.shape) - 1.5
  dx = jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **kw, implementation="xla")
  assert_same_bits(dx, _vjp_of_max_pool(x, dy, activation, **kw))


def test_masked_taps_gradient_is_the_vjp(rng):
  x = _signed_zeros(rng, (2, 7, 6, 2))
  mask = rng.random((2, 7, 6, 1)) < 0.6
  kw = dict(window_shape=(3, 2), strides=(2, 1), padding="SAME")
  y, taps = jaxpool.max_pool_with_taps(x, **kw, mask=mask)
  _, taps_ref = ref.max_pool_with_taps(x, **kw, mask=mask)
  np.testing.assert_array_equal(taps, taps_ref)
  dy = tie_rich(rng, y.shape) - 1.5
  want = jax.vjp(lambda v: jaxpool.max_pool(v, **kw, mask=mask), x)[1](dy)[0]
  assert_same_bits(jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **kw), want)


@pytest.mark.parametrize("window,dtype", [((2, 2), np.int8), ((11, 11), np.int8),
                                          ((12, 12), np.int16)])
def test_taps_dtype(window, dtype):
  x = jnp.zeros((1, 12, 12, 1))
  _, taps = jaxpool.max_pool_with_taps(x, window, implementation="xla")
  assert taps.dtype == dtype and taps.shape == (1, 13 - window[0], 13 - window[1], 1)


def test_documented_example():
  x = jnp.array([[1., 2., 3.], [2., 4., 2.], [5., 6., 7.]])[None, :, :, None]
  y, taps = jaxpool.max_pool_with_taps(x, (2, 2))
  np.testing.assert_array_equal(taps[0, ..., 0], [[3, 2], [3, 3]])
  dy = jnp.array([[1., 2.], [4., 5.]])[None, :, :, None]
  assert_same_bits(jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, (2, 2)),
                   jaxpool.max_pool_grad(x, dy, (2, 2)))


# ----------------------------------------------------------------------------- transforms

KW = dict(window_shape=(3, 3), strides=(2, 2), padding="SAME")


@pytest.fixture
def case(rng):
  x = _signed_zeros(rng, (2, 7, 8, 3))
  y, taps = jaxpool.max_pool_with_taps(x, **KW)
  dy = jnp.asarray(tie_rich(rng, y.shape) - 1.5)
  return x, taps, dy


def test_under_jit_without_retracing(case):
  x, taps, dy = case
  traces = []

  @jax.jit
  def f(dy, taps):
    traces.append(1)
    return jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **KW)

  assert_same_bits(f(dy, taps), jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **KW))
  f(dy + 1, taps)
  assert len(traces) == 1


def test_vmap(case):
  x, taps, dy = case
  got = jax.vmap(lambda d, t: jaxpool.max_pool_grad_from_taps(d, t, x.shape[1:], **KW))(dy, taps)
  assert_same_bits(got, jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **KW))
  # and the forward's taps under vmap equal the batched call's
  _, t2 = jax.vmap(lambda v: jaxpool.max_pool_with_taps(v, **KW))(x)
  assert_same_bits(t2, taps)


def test_linear_jvp_and_vjp(case):
  x, taps, dy = case
  f = lambda d: jaxpool.max_pool_grad_from_taps(d, taps, x.shape, **KW)
  dx = f(dy)
  t = jnp.flip(dy, 1)
  out, tangent = jax.jvp(f, (dy,), (t,))
  assert_same_bits(out, dx)
  assert_same_bits(tangent, f(t))  # linear: the tangent map is itself
  # its transpose is the gather at the taps: the jvp of max_pool
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape).astype(np.float32))
  (back,) = jax.vjp(f, dy)[1](ct)
  _, want = jax.jvp(lambda v: jaxpool.max_pool(v, **KW), (x,), (ct,))
  assert_same_bits(back, want)
  # grad of a function of it
  g = jax.grad(lambda d: jnp.sum(f(d) ** 2))(dy)
  assert g.shape == dy.shape and bool(jnp.all(jnp.isfinite(g)))


def test_gradient_of_a_forward_with_taps(case):
  """y of max_pool_with_taps is differentiable, with max_pool's gradient."""
  x, _, dy = case
  got = jax.vjp(lambda v: jaxpool.max_pool_with_taps(v, **KW)[0], x)[1](dy)[0]
  assert_same_bits(got, _vjp_of_max_pool(x, dy, **KW, implementation=None))


# ----------------------------------------------------------------------------- Pallas


# `make test` keeps case_0 (overlapping windows) without an activation and case_2 (dilation,
# empty windows) with the ReLU; the other four are marked slow (the channels_first taps kernels:
# test_pallas.py's 2d_first_wide).
@pytest.mark.parametrize("case_,activation", [
    pytest.param(case_, act, id=f"case_{i}-{act}",
                 marks=() if (i, act) in ((0, None), (2, "relu")) else pytest.mark.slow)
    for act in (None, "relu") for i, case_ in enumerate([GRID[1], GRID[3], GRID[4]])])
def test_pallas_equals_xla(case_, activation, rng):
  shape, *cfg = case_
  kw = _kw(*cfg)
  x = _signed_zeros(rng, shape)
  y, taps = jaxpool.max_pool_with_taps(x, **kw, activation=activation, implementation="pallas")
  yx, tx = jaxpool.max_pool_with_taps(x, **kw, activation=activation, implementation="xla")
  # Bit for bit, -0.0 included; a NaN for a NaN (the compiled kernels give the canonical one:
  # which NaN is not part of the contract, docs/pallas.md).
  assert_bitwise(y, yx)
  assert_same_bits(taps, tx)
  dy = jnp.asarray(tie_rich(rng, y.shape) - 1.5)
  dx = jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **kw, implementation="pallas")
  assert_same_bits(dx, jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **kw,
                                                       implementation="xla"))
  assert_same_bits(dx, _vjp_of_max_pool(x, dy, activation, implementation="pallas", **kw))


def test_pallas_runs_the_backward_kernel(case):
  x, taps, dy = case
  f = lambda d: jaxpool.max_pool_grad_from_taps(d, taps, x.shape, **KW, implementation="pallas")
  jaxpr = str(jax.make_jaxpr(f)(dy))
  assert "jaxpool_max_pool_gather_transpose" in jaxpr and "scatter" not in jaxpr
  # linear: its jvp and vmap go through the primitives' rules
  assert_same_bits(jax.jvp(f, (dy,), (dy,))[1], f(dy))
  got = jax.vmap(lambda d, t: jaxpool.max_pool_grad_from_taps(
      d, t, x.shape[1:], **KW, implementation="pallas"))(dy, taps)
  assert_same_bits(got, f(dy))


# ----------------------------------------------------------------------------- errors


def test_errors(case):
  x, taps, dy = case
  grad = jaxpool.max_pool_grad_from_taps
  with pytest.raises(ValueError, match=r"dy must have the shape of the forward output for "
                                       r"input_shape \(2, 7, 9, 3\), \(2, 4, 5, 3\); got "
                                       r"\(2, 4, 4, 3\)"):
    grad(dy, taps, (2, 7, 9, 3), **KW)
  with pytest.raises(ValueError, match=r"taps must have dy's shape \(2, 4, 4, 3\) \(the forward "
                                       r"output's\); got \(2, 4, 3, 3\)"):
    grad(dy, taps[:, :, :3], x.shape, **KW)
  with pytest.raises(TypeError, match="taps must be an integer array"):
    grad(dy, taps.astype(jnp.float32), x.shape, **KW)
  with pytest.raises(ValueError, match=r"taps must lie in \[-1, 9\) for window_shape \(3, 3\); "
                                       r"got values in \[-?\d, 9\]"):
    grad(dy, taps.at[0, 0, 0, 0].set(9), x.shape, **KW)
  with pytest.raises(TypeError, match="dy must have a float dtype|dy must be a float"):
    grad(dy.astype(jnp.int32), taps, x.shape, **KW)
  with pytest.raises(TypeError, match="input_shape must be a tuple of ints"):
    grad(dy, taps, (2, 7.0, 8, 3), **KW)
  with pytest.raises(ValueError, match="activation must be one of"):
    jaxpool.max_pool_with_taps(x, **KW, activation="tanh")
  with pytest.raises(ValueError, match="implementation='pallas' cannot serve "
                                       "max_pool_grad_from_taps"):
    grad(dy, taps, x.shape, (9, 9), (2, 2), "SAME", implementation="pallas")
  with pytest.raises(TypeError, match="complex"):
    jaxpool.max_pool_with_taps(x.astype(jnp.complex64), **KW)
  with pytest.raises(ValueError, match="implementation='pallas' cannot serve max_pool_with_taps"):
    jaxpool.max_pool_with_taps(x, **KW, mask=x > 0, implementation="pallas")
