"""min_pool, masked pooling and the dtypes Flax accepts, against the NumPy reference.

The reference (tests/support/reference.py) writes the min rules out on their own (not as a negated
max) and treats a masked element as absent from every window. Gradients are checked exactly by the
reference's winner rule (integer-valued cotangents: every sum is exact) and averages to the dtype's
tolerance. The interop layers are compared with Flax's and Equinox's own pooling on int32, bool,
float16, bfloat16, float32 and float64.
"""

from __future__ import annotations

import itertools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise, jp, pool_configs, split, tie_rich, tol
from hypothesis import HealthCheck, given, settings

import jaxpool
from tiers import draws

# (shape, window, strides, padding, dilation, ceil_mode, data_format): 1-D and 2-D, both
# layouts, batch dims, padding, dilation and the ceil-mode overhang.
CASES = [
    ((2, 9, 3), (3,), (2,), ((1, 1),), (1,), True, "channels_last"),
    ((2, 3, 9), (2,), (2,), "SAME", (2,), False, "channels_first"),
    ((2, 2, 6, 5, 2), (2, 3), (2, 1), ((1, 0), (1, 2)), (1, 1), True, "channels_last"),
    ((1, 2, 7, 6), (3, 2), (1, 2), "VALID", (2, 1), False, "channels_first"),
    ((6, 5, 1), (2, 2), (1, 1), 1, (1, 1), False, "channels_last"),  # no batch dim
]
IDS = [f"{len(c[1])}d-{c[6][9:]}-{i}" for i, c in enumerate(CASES)]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int8, np.uint8, np.bool_]


def dtype_grid(dtypes, *more):
  """(case, dtype, *more) parameters. `make test` runs every case in float32 and every dtype on
  case 2 (2-D, two batch dims, padding, ceil mode); the other pairs are marked slow."""
  name = lambda d: d.__name__ if isinstance(d, type) else np.dtype(d).name
  return [pytest.param(case, dtype, *rest, id="-".join([IDS[i], name(dtype), *map(str, rest)]),
                       marks=() if dtype is np.float32 or i == 2 else pytest.mark.slow)
          for i, case in enumerate(CASES) for dtype in dtypes
          for rest in itertools.product(*more)]


def kwargs(case):
  shape, window, strides, padding, dilation, ceil_mode, data_format = case
  return shape, dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
                     ceil_mode=ceil_mode, data_format=data_format)


def sample(rng, shape, dtype):
  """Tie-rich values; floats with NaN and +-inf, and both signed zeros."""
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    x = rng.integers(-3, 4, size=shape)
    x = np.where(rng.random(shape) < 0.1, info.min, np.where(rng.random(shape) < 0.1, info.max, x))
    return x.astype(dtype) if info.min < 0 else np.abs(x).astype(dtype)
  x = tie_rich(rng, shape, np.float64, specials=True) - 2.0
  x[rng.random(shape) < 0.15] = -0.0
  return x.astype(dtype)


def random_mask(rng, shape, p=0.6):
  return rng.random(shape) < p


def cotangent(rng, shape):
  return rng.integers(1, 5, size=shape).astype(np.float32)


# ------------------------------------------------------------------------------ min_pool


@pytest.mark.parametrize("case,dtype", dtype_grid(DTYPES))
def test_min_pool_equals_reference(case, dtype, rng):
  shape, kw = kwargs(case)
  x = sample(rng, shape, dtype)
  assert_bitwise(jp.min_pool(x, **kw), ref.min_pool(x, **kw))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_min_pool_gradient_goes_to_the_first_minimum(case, rng):
  shape, kw = kwargs(case)
  x = sample(rng, shape, np.float32)
  y, vjp = jax.vjp(lambda v: jp.min_pool(v, **kw), x)
  dy = cotangent(rng, y.shape)
  want = ref.max_pool_grad(x, dy, minimum=True, **kw).astype(np.float32)
  assert_bitwise(vjp(dy)[0], want)  # integer cotangents: exact sums, +0.0 where none arrives
  # Forward mode: the tangent at each window's winner.
  t = rng.normal(size=shape).astype(np.float32)
  _, idx = ref.min_pool_with_indices(x, **kw)
  _, yt = jax.jvp(lambda v: jp.min_pool(v, **kw), (x,), (t,))
  assert_bitwise(yt, _gather_by_indices(t, idx, kw))


def _gather_by_indices(t, idx, kw):
  """The tangent at each flat spatial index (0 where -1), by the reference's layout."""
  cfg = ref.Config(t.shape, kw["window_shape"], kw["strides"], kw["padding"], kw["dilation"],
                   kw["ceil_mode"], kw["data_format"])
  trows, lead = cfg.to_rows(t, cfg.in_spatial)
  irows, _ = cfg.to_rows(idx, cfg.out_spatial)
  out = np.where(irows >= 0, np.take_along_axis(trows, np.maximum(irows, 0), axis=1), 0)
  return cfg.from_rows(out.astype(t.dtype), lead, cfg.out_spatial)


def test_min_pool_hand_cases():
  x = np.array([3., 1., 1., np.nan, 0., -0., -0., 0., np.inf, np.nan, np.nan, -np.inf],
               np.float32).reshape(1, 12, 1)
  y = jp.min_pool(x, (2,), (2,))[0, :, 0]
  assert_bitwise(y, np.array([1., np.nan, -0., -0., np.nan, np.nan], np.float32))
  g = jax.grad(lambda v: jp.min_pool(v, (2,), (2,)).sum())(x)[0, :, 0]
  # ties: the first 1; NaN wins; -0.0 beats +0.0 in either order; the first NaN wins
  assert_bitwise(g, np.array([0, 1, 0, 1, 0, 1, 1, 0, 0, 1, 1, 0], np.float32))


@pytest.mark.parametrize("dtype,empty", [
    (np.float32, np.inf), (ml_dtypes.bfloat16, np.inf), (np.int32, np.iinfo(np.int32).max),
    (np.uint8, 255), (np.int8, 127), (np.bool_, True),
    (ml_dtypes.float8_e4m3fn, float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)),
])
def test_min_pool_empty_window(dtype, empty):
  # window 2, dilation 3, padding (2, 2) on 2 elements: the middle window reads only padding
  x = np.array([5, 6]).astype(dtype).reshape(1, 2, 1)
  y = np.asarray(jp.min_pool(x, (2,), (1,), padding=((2, 2),), dilation=(3,)))[0, :, 0]
  assert y.dtype == np.dtype(dtype)
  assert y[1] == np.asarray(empty).astype(dtype), y
  assert y[0] == x[0, 1, 0] and y[2] == x[0, 0, 0]
  assert jaxpool.min_pool(x, (2,), (1,), padding=((2, 2),), dilation=(3,),
                          implementation="xla").dtype == np.dtype(dtype)


def test_min_pool_pallas_interpret_equals_xla(rng):
  x = sample(rng, (2, 7, 6, 3), np.float32)
  kw = dict(window_shape=(3, 3), strides=(2, 1), padding=1)
  assert_bitwise(jaxpool.min_pool(x, **kw, implementation="pallas"), jp.min_pool(x, **kw))
  g = lambda impl: jax.grad(lambda v: jaxpool.min_pool(v, **kw, implementation=impl).sum())(x)
  assert_bitwise(g("pallas"), g("xla"))


# ------------------------------------------------------------------------------ masked


@pytest.mark.parametrize("case,dtype", dtype_grid([np.float32, ml_dtypes.bfloat16, np.int32,
                                                  np.bool_]))
def test_masked_max_min_equal_reference(case, dtype, rng):
  shape, kw = kwargs(case)
  x = sample(rng, shape, dtype)
  mask = random_mask(rng, shape)

  @jax.jit  # the three ops in one compile
  def run(x, mask):
    return (*jp.max_pool_with_indices(x, mask=mask, **kw), jp.max_pool(x, mask=mask, **kw),
            jp.min_pool(x, mask=mask, **kw))

  y, idx, y2, ymin = run(x, mask)
  want_y, want_idx = ref.max_pool_with_indices(x, mask=mask, **kw)
  assert_bitwise(y, want_y)
  assert_bitwise(idx, want_idx)
  assert_bitwise(y2, want_y)
  assert_bitwise(ymin, ref.min_pool(x, mask=mask, **kw))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_masked_gradients_exact(case, rng):
  shape, kw = kwargs(case)
  x = sample(rng, shape, np.float32)
  mask = random_mask(rng, shape, 0.5)
  for minimum, fn in ((False, jp.max_pool), (True, jp.min_pool)):
    y, vjp = jax.vjp(lambda v, fn=fn: fn(v, mask=mask, **kw), x)
    dy = cotangent(rng, y.shape)
    want = ref.max_pool_grad(x, dy, mask=mask, minimum=minimum, **kw).astype(np.float32)
    dx = vjp(dy)[0]
    assert_bitwise(dx, want)
    assert not np.asarray(dx)[~np.broadcast_to(mask, shape)].any()  # masked: no gradient


@pytest.mark.parametrize("case,dtype,count_include_pad",
                         dtype_grid([np.float32, np.int32], [True, False]))
def test_masked_avg_equals_reference(case, dtype, count_include_pad, rng):
  shape, kw = kwargs(case)
  x = rng.integers(-3, 4, size=shape).astype(np.float64)
  x[rng.random(shape) < 0.1] = np.nan  # only ever at masked elements: they must not leak
  mask = random_mask(rng, shape) & ~np.isnan(x)
  x = np.where(np.isnan(x) & (dtype == np.int32), 7, x).astype(dtype)
  avg = lambda v, mask: jp.avg_pool(v, mask=mask, count_include_pad=count_include_pad, **kw)
  want = ref.avg_pool(x, mask=mask, count_include_pad=count_include_pad, **kw)
  out_dtype = np.float32 if dtype == np.int32 else dtype
  if dtype != np.float32:
    y = avg(x, mask)
    assert y.dtype == out_dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), want, **tol(out_dtype, 9))
    return
  dy = cotangent(rng, want.shape)

  @jax.jit  # the average, its gradient and divisor_override in one compile
  def run(x, mask, dy):
    y, vjp = jax.vjp(lambda v: avg(v, mask), x)
    return y, vjp(dy)[0], jp.avg_pool(x, mask=mask, divisor_override=5, **kw)

  y, dx, y5 = run(x, mask, dy)
  assert y.dtype == out_dtype
  np.testing.assert_allclose(np.asarray(y, np.float64), want, **tol(out_dtype, 9))
  want_dx = ref.avg_pool_grad(dy, shape, mask=mask, count_include_pad=count_include_pad, **kw)
  np.testing.assert_allclose(dx, want_dx, **tol(np.float32, 9))
  # divisor_override still overrides
  np.testing.assert_allclose(y5, ref.avg_pool(x, mask=mask, divisor_override=5, **kw),
                             **tol(np.float32, 9))


def test_masked_hand_cases():
  # two sequences of lengths 3 and 2, padded to 4 steps with junk (NaN must not leak)
  seq = np.array([[1., 5., 2., np.nan], [4., 3., np.nan, 9.]], np.float32)[..., None]
  mask = (np.arange(4) < np.array([3, 2])[:, None])[..., None]
  y, idx = jp.max_pool_with_indices(seq, (2,), (2,), mask=mask)
  assert_bitwise(y[..., 0], np.array([[5., 2.], [4., -np.inf]], np.float32))
  assert_bitwise(idx[..., 0], np.array([[1, 2], [0, -1]], np.int32))
  assert_bitwise(jp.min_pool(seq, (2,), (2,), mask=mask)[..., 0],
                 np.array([[1., 2.], [3., np.inf]], np.float32))
  assert_bitwise(jp.avg_pool(seq, (2,), (2,), mask=mask)[..., 0],
                 np.array([[3., 2.], [3.5, 0.]], np.float32))
  # count_include_pad: padding counts, masked elements do not: [pad, 1, 5], [5, 2, masked]
  assert_bitwise(jp.avg_pool(seq[:1], (3,), (2,), padding=1, mask=mask[:1])[0, :, 0],
                 np.array([2., 3.5], np.float32))
  # A mask that broadcasts: one per time step, shared over batch and channels.
  x = np.arange(12.0, dtype=np.float32).reshape(2, 3, 2)[:, :, :1] * np.ones((1, 1, 2))
  tmask = np.array([True, False, True])[:, None]  # (3, 1)
  np.testing.assert_array_equal(jp.max_pool(x, (2,), mask=tmask), x[:, [0, 2]])  # skips 1
  g = jax.grad(lambda v: jp.max_pool(v, (3,), mask=tmask).sum())(x)
  np.testing.assert_array_equal(g[:, :, 0], [[0, 0, 1], [0, 0, 1]])


def test_masked_jvp_vmap_jit(rng):
  shape, kw = kwargs(CASES[2])
  x = sample(rng, shape, np.float32)
  mask = random_mask(rng, shape)
  t = rng.normal(size=shape).astype(np.float32)
  _, idx = ref.max_pool_with_indices(x, mask=mask, **kw)
  _, yt = jax.jvp(lambda v: jp.max_pool(v, mask=mask, **kw), (x,), (t,))
  assert_bitwise(yt, _gather_by_indices(t, idx, kw))
  # vmap(grad) over a leading axis, the mask mapped too, under jit
  per = lambda v, m: jax.grad(lambda u: jp.min_pool(u, mask=m, **kw).sum())(v)
  batched = jax.jit(jax.vmap(per))(x, mask)
  for i in range(shape[0]):
    assert_bitwise(batched[i], per(x[i], mask[i]))
  # avg: jvp of a masked average is the average of the masked tangent
  _, at = jax.jvp(lambda v: jp.avg_pool(v, mask=mask, **kw), (np.ones_like(x),), (t,))
  np.testing.assert_allclose(at, ref.avg_pool(t, mask=mask, **kw), **tol(np.float32, 9))


def test_all_masked_and_empty_windows(rng):
  x = rng.normal(size=(2, 6, 3)).astype(np.float32)
  none = np.zeros_like(x, bool)
  y, idx = jp.max_pool_with_indices(x, (2,), (2,), mask=none)
  assert (np.asarray(y) == -np.inf).all() and (np.asarray(idx) == -1).all()
  assert (np.asarray(jp.min_pool(x, (2,), (2,), mask=none)) == np.inf).all()
  assert not np.asarray(jp.avg_pool(x, (2,), (2,), mask=none)).any()
  for fn in (jp.max_pool, jp.min_pool, jp.avg_pool):
    assert not np.asarray(jax.grad(lambda v, fn=fn: fn(v, (2,), (2,), mask=none).sum())(x)).any()
  xi = x.astype(np.int32)
  assert (np.asarray(jp.max_pool(xi, (2,), mask=none)) == np.iinfo(np.int32).min).all()
  assert (np.asarray(jp.min_pool(xi, (2,), mask=none)) == np.iinfo(np.int32).max).all()


def test_large_window_loop_path(rng):
  # 81 taps: the fori_loop tap path (over UNROLL_TAPS), masked and min
  x = sample(rng, (2, 12, 12, 2), np.float32)
  mask = random_mask(rng, x.shape, 0.3)
  kw = dict(window_shape=(9, 9), strides=(3, 3), padding=2)
  assert_bitwise(jp.min_pool(x, mask=mask, **kw), ref.min_pool(x, mask=mask, **kw))
  y, vjp = jax.vjp(lambda v: jp.max_pool(v, mask=mask, **kw), x)
  dy = cotangent(rng, y.shape)
  assert_bitwise(vjp(dy)[0], ref.max_pool_grad(x, dy, mask=mask, **kw).astype(np.float32))


PROPERTY = dict(cfg=pool_configs(max_nspatial=2), seed=st.integers(0, 2**31 - 1),
                op=st.sampled_from(["max", "min", "avg"]), masked=st.booleans())
PROPERTY_SETTINGS = settings(max_examples=draws(25, 12), deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@settings(PROPERTY_SETTINGS, max_examples=draws(12, 6))
@given(**PROPERTY)
def test_property_against_reference(cfg, seed, op, masked):
  _check_property(cfg, seed, op, masked)


@pytest.mark.slow  # (`make test` runs 12 examples: test_property_against_reference)
@PROPERTY_SETTINGS
@given(**PROPERTY)
def test_property_against_reference_more_examples(cfg, seed, op, masked):
  _check_property(cfg, seed, op, masked)


def _check_property(cfg, seed, op, masked):
  shape, kw = split(cfg)
  rng = np.random.default_rng(seed)
  x = sample(rng, shape, np.float32)
  mask = random_mask(rng, shape) if masked else None
  if op == "avg":
    x = np.nan_to_num(x, posinf=5.0, neginf=-5.0)
    np.testing.assert_allclose(jp.avg_pool(x, mask=mask, **kw),
                               ref.avg_pool(x, mask=mask, **kw), **tol(np.float32, 9))
    return
  fn = jp.max_pool if op == "max" else jp.min_pool
  y, vjp = jax.vjp(lambda v: fn(v, mask=mask, **kw), x)
  reference = ref.max_pool if op == "max" else ref.min_pool
  assert_bitwise(y, reference(x, mask=mask, **kw))
  dy = cotangent(rng, y.shape)
  assert_bitwise(vjp(dy)[0], ref.max_pool_grad(x, dy, mask=mask, minimum=op == "min",
                                               **kw).astype(np.float32))


# ------------------------------------------------------------------------------ dtypes


def test_int_and_bool_averages_are_default_floats(rng):
  x = rng.integers(-50, 50, size=(2, 6, 5, 3)).astype(np.int32)
  kw = dict(window_shape=(2, 3), strides=(2, 1), padding="SAME")
  y = jp.avg_pool(x, **kw)
  assert y.dtype == np.float32
  np.testing.assert_allclose(y, ref.avg_pool(x, **kw), rtol=1e-6)
  assert jp.lp_pool(x, 2, **kw).dtype == np.float32
  np.testing.assert_allclose(jp.lp_pool(x, 2, **kw), ref.lp_pool(x, 2, **kw), rtol=1e-6)
  b = x > 0
  np.testing.assert_allclose(jp.avg_pool(b, **kw), ref.avg_pool(b, **kw), rtol=1e-6)
  with jax.enable_x64(True):
    assert jp.avg_pool(x, **kw).dtype == np.float64
    assert jp.avg_pool(x.astype(np.uint8), **kw).dtype == np.float64
    np.testing.assert_allclose(jp.avg_pool(x, **kw), ref.avg_pool(x, **kw), rtol=1e-13)
  assert jp.max_pool(x, **kw).dtype == np.int32 and jp.min_pool(b, **kw).dtype == np.bool_


def test_complex_average(rng):
  x = (rng.normal(size=(2, 7, 3)) + 1j * rng.normal(size=(2, 7, 3))).astype(np.complex64)
  mask = random_mask(rng, x.shape)
  for m in (None, mask):
    kw = dict(window_shape=(3,), strides=(2,), padding=1, mask=m)
    y = jp.avg_pool(x, **kw)
    assert y.dtype == np.complex64
    np.testing.assert_allclose(y, ref.avg_pool(x, **kw), rtol=1e-5, atol=1e-6)
  # the pallas kernels do not take complex: the registry says so
  with pytest.raises(ValueError, match="cannot serve avg_pool.*complex64"):
    jaxpool.avg_pool(x, (3,), implementation="pallas")


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_], ids=lambda d: d.__name__)
def test_gradients_of_integer_inputs_raise_type_error(dtype):
  x = np.ones((1, 4, 4, 1), dtype)
  for fn in (jaxpool.max_pool, jaxpool.min_pool, jaxpool.avg_pool):
    with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
      jax.grad(lambda v, fn=fn: fn(v, (2, 2)).sum())(x)


# ------------------------------------------------------------------------------ bad input

X = np.zeros((2, 6, 3), np.float32)
E = re.escape


@pytest.mark.parametrize("op", ["max_pool", "min_pool", "avg_pool", "max_pool_with_indices"])
def test_bad_mask(op):
  fn = getattr(jp, op)
  with pytest.raises(TypeError, match="mask must be a bool array.*float32"):
    fn(X, (2,), mask=np.ones_like(X))
  with pytest.raises(TypeError, match="mask must be a bool array.*int32"):
    fn(X, (2,), mask=np.ones(X.shape, np.int32))
  with pytest.raises(ValueError, match="mask.*" + E("(2, 6, 3)") + ".*" + E("(2, 5, 3)")):
    fn(X, (2,), mask=np.ones((2, 5, 3), bool))
  with pytest.raises(ValueError, match="mask.*" + E("(2, 6, 3)") + ".*" + E("(4, 1, 1, 1)")):
    fn(X, (2,), mask=np.ones((4, 1, 1, 1), bool))  # broadcasts, but not to x's shape
  with pytest.raises(TypeError, match="mask must be an array"):
    fn(X, (2,), mask="yes")


@pytest.mark.parametrize("op", ["max_pool", "min_pool", "avg_pool"])
def test_pallas_with_mask_says_why(op):
  with pytest.raises(ValueError, match=f"implementation='pallas' cannot serve {op}.*take no "
                     "mask"):
    getattr(jaxpool, op)(X, (2,), mask=np.ones(X.shape, bool), implementation="pallas")
  # implementation=None takes XLA
  assert getattr(jaxpool, op)(X, (2,), mask=np.ones(X.shape, bool)).shape == (2, 5, 3)


def test_complex_max_min_raise():
  for fn in (jp.max_pool, jp.min_pool, jp.max_pool_with_indices):
    with pytest.raises(TypeError, match="x must have a float, integer or bool dtype; got "
                       "complex64: complex numbers have no order"):
      fn(X.astype(np.complex64), (2,))


# ------------------------------------------------------------------------------ interop

eqx = pytest.importorskip("equinox")
nn = pytest.importorskip("flax.linen")
flax_pooling = pytest.importorskip("flax.linen.pooling")

from jaxpool.interop import equinox as jpe  # noqa: E402
from jaxpool.interop import flax_linen as jpl  # noqa: E402
from jaxpool.interop import flax_nnx as jpn  # noqa: E402

INTEROP_DTYPES = ["int32", "bool", "float16", "bfloat16", "float32", "float64"]


def _typed(rng, shape, name):
  if name == "bool":
    return rng.random(shape) < 0.5
  x = rng.integers(-4, 5, size=shape)
  if name != "int32":
    x = x + rng.permutation(x.size).reshape(shape) / (4.0 * x.size)  # few ties in avg
  return x.astype(jnp.dtype(name))


def _close(a, b, name):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape
  ulp = {"float16": 2 * 2**-10, "bfloat16": 2 * 2**-7}.get(name, 1e-6)
  np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=ulp, atol=ulp)


FLAX_INTEROP = (((3, 3), (2, 1), "SAME"), ((2, 2), (2, 2), "VALID"),
                ((2, 3), None, ((1, 0), (1, 1))))


@pytest.mark.parametrize("name", INTEROP_DTYPES)
def test_interop_flax_dtypes(name, rng):
  with jax.enable_x64(name == "float64"):
    x = _typed(rng, (2, 7, 6, 3), name)
    if name == "bool":  # Flax's reduce_window sum refuses bool; jaxpool averages it
      for window, strides, padding in FLAX_INTEROP:
        for cip in (True, False):
          with pytest.raises(TypeError):
            nn.avg_pool(x, window, strides, padding, cip)

    @jax.jit  # every configuration, ours and Flax's: one compile
    def run(x):
      same, avgs = [], []
      for window, strides, padding in FLAX_INTEROP:
        for ours, theirs in ((jpl.max_pool, nn.max_pool), (jpl.min_pool, flax_pooling.min_pool)):
          same.append((ours(x, window, strides, padding), theirs(x, window, strides, padding)))
        want = flax_pooling.min_pool(x, window, strides, padding)
        same.append((jpn.MinPool(window, strides, padding)(x), want))
        same.append((jpl.MinPool(window, strides, padding).apply({}, x), want))
        for cip in (True, False):
          avgs.append((jpl.avg_pool(x, window, strides, padding, cip),
                       None if name == "bool" else nn.avg_pool(x, window, strides, padding, cip)))
      return same, avgs

    same, avgs = run(x)
    for ours, theirs in same:
      assert_bitwise(ours, theirs)
    configs = [(*c, cip) for c in FLAX_INTEROP for cip in (True, False)]
    for (window, strides, padding, cip), (y, want) in zip(configs, avgs, strict=True):
      if name == "bool":
        _close(y, ref.avg_pool(x, window, strides, padding, count_include_pad=cip), "float32")
        continue
      if name == "int32" or cip:
        assert y.dtype == want.dtype  # (Flax promotes float16 averages without cip)
      _close(y, want, name)


EQX_INTEROP = (dict(kernel_size=2, stride=2), dict(kernel_size=3, stride=2, padding=1),
               dict(kernel_size=3, stride=2, padding=1, use_ceil=True),
               dict(kernel_size=(2, 3), stride=(2, 2), use_ceil=True))


@pytest.mark.parametrize("name", INTEROP_DTYPES)
def test_interop_equinox_dtypes(name, rng):
  with jax.enable_x64(name == "float64"):
    x = _typed(rng, (3, 9, 8), name)
    if name == "bool":  # Equinox's average refuses bool
      for kw in EQX_INTEROP:
        with pytest.raises(TypeError):
          eqx.nn.AvgPool2d(**kw)(x)

    @jax.jit  # every layer, ours and Equinox's: one compile
    def run(x):
      maxes = [(jpe.MaxPool2d(**kw)(x), eqx.nn.MaxPool2d(**kw)(x)) for kw in EQX_INTEROP]
      avgs = [] if name == "bool" else [(jpe.AvgPool2d(**kw)(x), eqx.nn.AvgPool2d(**kw)(x))
                                        for kw in EQX_INTEROP]
      return maxes, avgs

    maxes, avgs = run(x)
    for ours, theirs in maxes:
      assert_bitwise(ours, theirs)
    for ours, theirs in avgs:
      _close(ours, theirs, name)


def test_equinox_ceil_average_equals_equinox():
  x = jnp.arange(1.0, 6.0).reshape(1, 5)
  assert_bitwise(jpe.AvgPool1d(2, 2, use_ceil=True)(x), eqx.nn.AvgPool1d(2, 2, use_ceil=True)(x))
  assert_bitwise(jpe.AvgPool1d(2, 2, use_ceil=True)(x), np.array([[1.5, 3.5, 2.5]], np.float32))
