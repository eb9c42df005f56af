"""max_pool, max_pool_grad: exact agreement with the NumPy reference (docs/semantics.md)."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise, assert_same_bits, jp, pool_configs, split, tie_rich
from tiers import draws

SETTINGS = hypothesis.settings(max_examples=draws(12, 6), deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])

# (shape, window, strides, padding, dilation, ceil_mode, data_format)
GRID = [
    ((2, 6, 7, 3), (2, 2), (2, 2), "VALID", None, False, "channels_last"),
    ((2, 6, 7, 3), (3, 3), (1, 1), "VALID", None, False, "channels_last"),  # overlapping
    ((2, 6, 7, 3), (3, 3), (2, 2), "SAME", None, False, "channels_last"),
    ((2, 6, 7, 3), (3, 2), (2, 3), "SAME_LOWER", None, False, "channels_last"),
    ((2, 3, 6, 7), (3, 3), (2, 2), 1, None, True, "channels_first"),
    ((2, 3, 5, 5), (2, 2), (2, 2), ((1, 0), (0, 1)), None, True, "channels_first"),
    ((1, 8, 9, 2), (3, 3), (2, 2), ((2, 2), (1, 3)), (2, 2), False, "channels_last"),  # empties
    ((1, 9, 2), (3,), (2,), 2, (3,), True, "channels_last"),  # 1-D, dilation + ceil
    ((11, 4), (4,), None, "SAME", None, False, "channels_last"),  # no batch dim
    ((2, 2, 5, 4, 6, 3), (2, 2, 3), (2, 1, 2), "SAME", None, True, "channels_last"),  # 3-D, 2 batch
    ((2, 4, 5, 6), (2, 3, 2), (1, 2, 2), ((1, 1), (0, 2), (1, 0)), (2, 1, 2), False,
     "channels_first"),
    ((1, 1, 1, 1), (1, 1), None, "VALID", None, False, "channels_last"),
]


def _kw(window, strides, padding, dilation, ceil_mode, data_format):
  return dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode, data_format=data_format)


@pytest.mark.parametrize("case", GRID)
def test_max_pool_grid(case, rng):
  shape, *cfg = case
  kw = _kw(*cfg)
  x = tie_rich(rng, shape, specials=True)  # ties, NaN, -inf, +inf
  y = jp.max_pool(x, **kw)
  assert_bitwise(y, ref.max_pool(x, **kw))
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)  # integer dy: sums are exact
  dx = jp.max_pool_grad(x, dy, **kw)
  assert_bitwise(dx, ref.max_pool_grad(x, dy, **kw).astype(np.float32) + 0.0)
  # jax.grad of the forward and the standalone gradient: the same bits
  g = jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy))(x)
  assert_same_bits(g, dx)


@SETTINGS
@hypothesis.given(cfg=pool_configs(), seed=st.integers(0, 2**31 - 1), specials=st.booleans())
def test_max_pool_property(cfg, seed, specials):
  shape, kw = split(cfg)
  rng = np.random.default_rng(seed)
  x = tie_rich(rng, shape, specials=specials)
  y = jp.max_pool(x, **kw)
  y_ref, i_ref = ref.max_pool_with_indices(x, **kw)
  assert_bitwise(y, y_ref)
  y2, i = jp.max_pool_with_indices(x, **kw)
  assert_bitwise(y2, y_ref)
  assert_bitwise(i, i_ref)
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  dx = jp.max_pool_grad(x, dy, **kw)
  assert_bitwise(dx, ref.max_pool_grad(x, dy, **kw).astype(np.float32) + 0.0)
  # non-integer cotangents: float32 sums, to within rounding of the float64 reference
  dy = rng.standard_normal(y.shape).astype(np.float32)
  dx = jp.max_pool_grad(x, dy, **kw)
  np.testing.assert_allclose(dx, ref.max_pool_grad(x, dy, **kw), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ hand cases


def _img(a):
  """A 2-D array as a (1, H, W, 1) channels-last image."""
  return np.asarray(a, np.float32)[None, :, :, None]


def test_directml_documented_example():
  """DML_MAX_POOLING_GRAD_OPERATOR_DESC's example: 2x2 window, stride 1, no padding."""
  x = _img([[1, 2, 3], [2, 4, 2], [5, 6, 7]])
  dy = _img([[1, 2], [4, 5]])
  y, i = jp.max_pool_with_indices(x, (2, 2))
  np.testing.assert_array_equal(y[0, ..., 0], [[4, 4], [6, 7]])
  np.testing.assert_array_equal(i[0, ..., 0], [[4, 4], [7, 8]])
  dx = jp.max_pool_grad(x, dy, (2, 2))
  np.testing.assert_array_equal(dx[0, ..., 0], [[0, 0, 0], [0, 3, 0], [0, 4, 5]])
  # and the same in DirectML's own layout (N, C, H, W)
  dx_cf = jp.max_pool_grad(np.moveaxis(x, -1, 1), np.moveaxis(dy, -1, 1), (2, 2),
                                data_format="channels_first")
  np.testing.assert_array_equal(dx_cf[0, 0], [[0, 0, 0], [0, 3, 0], [0, 4, 5]])


def test_ties_go_to_lowest_row_major_index():
  x = _img([[5, 5], [5, 5]])
  y, i = jp.max_pool_with_indices(x, (2, 2))
  assert i.item() == 0 and y.item() == 5
  dx = jp.max_pool_grad(x, np.full((1, 1, 1, 1), 7.0, np.float32), (2, 2))
  np.testing.assert_array_equal(dx[0, ..., 0], [[7, 0], [0, 0]])
  # a tie between the second row's first element and a later one: the earlier wins
  x = _img([[1, 2], [3, 3]])
  assert jp.max_pool_with_indices(x, (2, 2))[1].item() == 2


def test_nan_beats_everything_first_nan_wins():
  nan, inf = np.nan, np.inf
  x = _img([[inf, 1, nan], [nan, 2, 3], [0, 0, 0]])
  y, i = jp.max_pool_with_indices(x, (2, 2))
  assert np.isnan(y[0, 0, 0, 0]) and i[0, 0, 0, 0] == 3  # NaN at (1, 0) beats +inf at (0, 0)
  assert np.isnan(y[0, 0, 1, 0]) and i[0, 0, 1, 0] == 2  # first NaN in row-major order
  assert np.isnan(y[0, 1, 0, 0]) and i[0, 1, 0, 0] == 3
  assert y[0, 1, 1, 0] == 3 and i[0, 1, 1, 0] == 5
  dy = _img([[1, 10], [100, 1000]])
  dx = jp.max_pool_grad(x, dy, (2, 2))
  np.testing.assert_array_equal(dx[0, ..., 0], [[0, 0, 10], [101, 0, 1000], [0, 0, 0]])
  g = jax.grad(lambda v: jnp.sum(jp.max_pool(v, (2, 2)) * dy))(x)
  assert_same_bits(g, dx)


def test_all_minus_inf_window_picks_first_real_element_not_padding():
  x = np.full((1, 3, 3, 1), -np.inf, np.float32)
  dy = np.ones((1, 2, 2, 1), np.float32)
  kw = dict(window_shape=(2, 2), strides=(2, 2), padding=((1, 0), (1, 0)))
  y, i = jp.max_pool_with_indices(x, **kw)
  assert np.all(np.isneginf(y))
  np.testing.assert_array_equal(i[0, ..., 0], [[0, 1], [3, 4]])
  dx = jp.max_pool_grad(x, dy, **kw)
  np.testing.assert_array_equal(dx[0, ..., 0], [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
  assert_bitwise(dx, ref.max_pool_grad(x, dy, **kw).astype(np.float32))


def test_padding_never_wins_even_over_negative_values():
  x = _img([[-5, -6], [-7, -8]])
  y, i = jp.max_pool_with_indices(x, (2, 2), padding=1)
  np.testing.assert_array_equal(y[0, ..., 0], [[-5, -5, -6], [-5, -5, -6], [-7, -7, -8]])
  np.testing.assert_array_equal(i[0, ..., 0], [[0, 0, 1], [0, 0, 1], [2, 2, 3]])


def test_dilation_with_empty_windows():
  """Dilation 3 over a length-2 input padded (2, 2): some windows hold no real element."""
  x = np.array([4.0, 9.0], np.float32).reshape(1, 2, 1)
  kw = dict(window_shape=(2,), strides=(1,), padding=((2, 2),), dilation=(3,))
  y, i = jp.max_pool_with_indices(x, **kw)
  # windows start at -2..0 (+ overhang): taps {-2, 1}, {-1, 2}, {0, 3}
  np.testing.assert_array_equal(y[0, :, 0], [9.0, -np.inf, 4.0])
  np.testing.assert_array_equal(i[0, :, 0], [1, -1, 0])
  dy = np.array([1.0, 100.0, 10.0], np.float32).reshape(1, 3, 1)
  dx = jp.max_pool_grad(x, dy, **kw)
  np.testing.assert_array_equal(dx[0, :, 0], [10.0, 1.0])  # the empty window's dy is dropped
  g = jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy))(x)
  assert_same_bits(g, dx)


def test_ceil_mode_overhang():
  """Length 5, window 2, stride 2: floor gives 2 outputs, ceil 3 (the last window overhangs)."""
  x = np.array([1.0, 3.0, 2.0, 0.0, -4.0], np.float32).reshape(1, 5, 1)
  assert jp.max_pool(x, (2,), (2,)).shape == (1, 2, 1)
  y, i = jp.max_pool_with_indices(x, (2,), (2,), ceil_mode=True)
  np.testing.assert_array_equal(y[0, :, 0], [3.0, 2.0, -4.0])
  np.testing.assert_array_equal(i[0, :, 0], [1, 2, 4])
  dx = jp.max_pool_grad(x, np.array([1.0, 2.0, 4.0], np.float32).reshape(1, 3, 1), (2,),
                             (2,), ceil_mode=True)
  np.testing.assert_array_equal(dx[0, :, 0], [0, 1, 2, 0, 4])


def test_ceil_mode_last_window_must_not_start_in_right_padding():
  """L=3, k=2, s=2, padding 1: ceil((3+2-2)/2)+1 = 3 windows, but the third would start on the
  right padding (padded position 4 >= L + lo = 4), so PyTorch keeps 2."""
  x = np.array([1.0, 3.0, 2.0], np.float32).reshape(1, 3, 1)
  y = jp.max_pool(x, (2,), (2,), 1, ceil_mode=True)
  np.testing.assert_array_equal(y[0, :, 0], [1.0, 3.0])
  # without padding the overhanging window starts inside the input and is kept
  y = jp.max_pool(x, (2,), (2,), ceil_mode=True)
  np.testing.assert_array_equal(y[0, :, 0], [3.0, 2.0])


def test_overlapping_windows_sum_in_gradient():
  x = np.array([0.0, 9.0, 0.0, 0.0, 8.0], np.float32).reshape(1, 5, 1)
  dy = np.array([1.0, 2.0, 4.0], np.float32).reshape(1, 3, 1)
  dx = jp.max_pool_grad(x, dy, (3,))
  np.testing.assert_array_equal(dx[0, :, 0], [0, 3, 0, 0, 4])


def test_bfloat16_float16_exact_forward_and_grad(rng):
  for dtype in (jnp.bfloat16, np.float16):
    x = tie_rich(rng, (2, 7, 6, 3), dtype=dtype, specials=True)
    kw = dict(window_shape=(3, 3), strides=(2, 2), padding="SAME")
    y = jp.max_pool(x, **kw)
    assert y.dtype == dtype
    assert_bitwise(y, ref.max_pool(x, **kw))
    dy = rng.integers(-3, 4, size=y.shape).astype(dtype)
    dx = jp.max_pool_grad(x, dy, **kw)
    assert dx.dtype == dtype
    assert_bitwise(dx, ref.max_pool_grad(x, dy, **kw).astype(dtype) + np.zeros((), dtype))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.int16])
def test_integer_forward(dtype, rng):
  info = np.iinfo(dtype)
  x = rng.integers(info.min, info.max, size=(2, 6, 5, 3), endpoint=True).astype(dtype)
  x[0, 0, 0, 0] = info.min
  kw = dict(window_shape=(2, 3), strides=(2, 1), padding=((1, 1), (2, 0)), dilation=(2, 1))
  y = jp.max_pool(x, **kw)
  assert y.dtype == dtype
  assert_bitwise(y, ref.max_pool(x, **kw))
  y2, i = jp.max_pool_with_indices(x, **kw)
  y_ref, i_ref = ref.max_pool_with_indices(x, **kw)
  assert_bitwise(y2, y_ref)
  assert_bitwise(i, i_ref)


def test_integer_empty_window_is_iinfo_min():
  x = np.array([3, 5], np.int32).reshape(1, 2, 1)
  y = jp.max_pool(x, (2,), padding=((2, 2),), dilation=(3,))
  np.testing.assert_array_equal(y[0, :, 0], [5, np.iinfo(np.int32).min, 3])


def test_gradient_deterministic(rng):
  x = tie_rich(rng, (4, 16, 16, 8))
  dy = rng.standard_normal((4, 8, 8, 8)).astype(np.float32)
  kw = dict(window_shape=(3, 3), strides=(2, 2), padding="SAME")
  a = jp.max_pool_grad(x, dy, **kw)
  b = jp.max_pool_grad(x, dy, **kw)
  c = jax.jit(jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy)))(x)
  assert_same_bits(a, b)
  assert_same_bits(a, c)


def test_no_batch_dims_and_many_batch_dims(rng):
  x = tie_rich(rng, (5, 6, 2))
  assert_bitwise(jp.max_pool(x, (2, 2)), ref.max_pool(x, (2, 2)))
  x = tie_rich(rng, (2, 1, 2, 5, 6, 2))
  assert_bitwise(jp.max_pool(x, (2, 2)), ref.max_pool(x, (2, 2)))


@hypothesis.settings(SETTINGS, max_examples=draws(6, 3))
@hypothesis.given(cfg=pool_configs(), seed=st.integers(0, 2**31 - 1))
def test_cpu_phase_backward_is_jax_transpose(cfg, seed):
  """On a CPU the gradient is the transpose written by stride phase (``xla.scatter_to_taps``):
  the same bits, signed zeros included, as the transpose JAX derives from the tap gather, under
  jit; reverse mode reaches it through the gather's own transpose primitive (lowered with
  ``scatter_to_taps`` on a CPU)."""
  from jaxpool._src import windows, xla
  shape, kw = split(cfg)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(tie_rich(rng, shape))
  geom = windows.make_geometry(shape, kw["window_shape"], kw["strides"], kw["padding"],
                               kw["dilation"], kw["ceil_mode"], data_format=kw["data_format"])
  y, taps = xla.max_pool_taps(x, geom)
  dy = rng.standard_normal(y.shape).astype(np.float32)
  dy[rng.random(y.shape) < 0.3] = -0.0
  dy = jnp.asarray(dy)
  phase = jax.jit(lambda taps, dy: jax.vjp(lambda t: xla.gather_at_taps(t, taps, geom), x)[1](
      dy)[0])
  derived = jax.jit(lambda taps, dy: jax.linear_transpose(
      lambda t: xla._gather_at_taps(t, taps, geom), x)(dy)[0])
  assert_bitwise(phase(taps, dy), derived(taps, dy))
  assert_bitwise(xla.scatter_to_taps(taps, dy, geom), derived(taps, dy))
  assert "jaxpool_xla_max_pool_gather_transpose" in str(jax.make_jaxpr(phase)(taps, dy))
