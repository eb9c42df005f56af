"""max_pool_with_indices and max_unpool against the reference (PyTorch's return_indices)."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import (assert_bitwise, assert_same_bits, jp, pool_configs, split, tie_rich,
                             unique_values)
from tiers import draws

SETTINGS = hypothesis.settings(max_examples=draws(12, 6), deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


def _out_size(kw, shape):
  n = len(kw["window_shape"])
  return shape[-n:] if kw.get("data_format") == "channels_first" else shape[-n - 1:-1]


@SETTINGS
@hypothesis.given(cfg=pool_configs(), seed=st.integers(0, 2**31 - 1))
def test_indices_and_unpool_property(cfg, seed):
  shape, kw = split(cfg)
  rng = np.random.default_rng(seed)
  x = tie_rich(rng, shape, specials=True)
  y, i = jp.max_pool_with_indices(x, **kw)
  y_ref, i_ref = ref.max_pool_with_indices(x, **kw)
  assert i.dtype == np.int32
  assert_bitwise(y, y_ref)
  assert_bitwise(i, i_ref)
  size = _out_size(kw, shape)
  u = jp.max_unpool(y, i, size, data_format=kw["data_format"])
  assert u.shape == x.shape
  assert_bitwise(u, ref.max_unpool(y_ref, i_ref, size, data_format=kw["data_format"]))


def test_documented_examples():
  x = np.array([[1, 2, 3], [2, 4, 2], [5, 6, 7]], np.float32)[None, :, :, None]
  _, i = jp.max_pool_with_indices(x, (2, 2))
  np.testing.assert_array_equal(i[0, ..., 0], [[4, 4], [7, 8]])  # DirectML's IndicesTensor
  x = jnp.arange(16.0).reshape(1, 4, 4, 1)
  y, i = jp.max_pool_with_indices(x, (2, 2), strides=(2, 2))
  np.testing.assert_array_equal(i[0, ..., 0], [[5, 7], [13, 15]])
  u = jp.max_unpool(y, i, (4, 4))
  expected = np.zeros((4, 4), np.float32)
  expected[1, 1], expected[1, 3], expected[3, 1], expected[3, 3] = 5, 7, 13, 15
  np.testing.assert_array_equal(u[0, :, :, 0], expected)


def test_indices_are_per_plane_and_layout_independent(rng):
  """Flat index within each (batch, channel) spatial plane, padding excluded, both layouts."""
  x = unique_values(rng, (2, 3, 5, 7, 4))  # 2 batch dims
  kw = dict(window_shape=(2, 3), strides=(2, 2), padding=((1, 0), (1, 1)), ceil_mode=True)
  y, i = jp.max_pool_with_indices(x, **kw)
  yc, ic = jp.max_pool_with_indices(np.moveaxis(x, -1, 2), **kw, data_format="channels_first")
  assert_same_bits(np.moveaxis(yc, 2, -1), y)
  assert_same_bits(np.moveaxis(ic, 2, -1), i)
  assert int(i.min()) >= 0 and int(i.max()) < 5 * 7
  # the index points at the value: x[b0, b1, i // 7, i % 7, c] == y
  b0, b1, _, _, c = np.indices(i.shape)
  np.testing.assert_array_equal(x[b0, b1, i // 7, i % 7, c], y)


def test_empty_windows_give_minus_one_and_unpool_drops_them():
  x = np.array([4.0, 9.0], np.float32).reshape(1, 2, 1)
  y, i = jp.max_pool_with_indices(x, (2,), padding=((2, 2),), dilation=(3,))
  np.testing.assert_array_equal(i[0, :, 0], [1, -1, 0])
  np.testing.assert_array_equal(jp.max_unpool(y, i, (2,))[0, :, 0], [4.0, 9.0])


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_unpool_roundtrip_non_overlapping(nd, rng):
  """Windows that tile the input: pooling the unpooled output gives y back, and the unpooled
  output is x at each argmax and 0 elsewhere."""
  spatial = (6, 4, 4)[:nd]
  shape = (2, *spatial, 3)
  x = np.abs(unique_values(rng, shape)) + 1.0
  kw = dict(window_shape=(2,) * nd, strides=(2,) * nd)
  y, i = jp.max_pool_with_indices(x, **kw)
  u = jp.max_unpool(y, i, spatial)
  assert_same_bits(jp.max_pool(u, **kw), y)
  assert_bitwise(u, np.where(np.asarray(u) != 0, x, 0).astype(np.float32))
  assert int(np.count_nonzero(u)) == y.size


def test_unpool_overlapping_windows_same_value(rng):
  """Two windows picking the same element both write its value: no order dependence."""
  x = tie_rich(rng, (2, 6, 6, 2))
  kw = dict(window_shape=(3, 3), strides=(1, 1))
  y, i = jp.max_pool_with_indices(x, **kw)
  u = jp.max_unpool(y, i, (6, 6))
  assert_bitwise(u, ref.max_unpool(*ref.max_pool_with_indices(x, **kw), (6, 6)))


def _unpool_grad_case(rng):
  x = tie_rich(rng, (2, 7, 6, 3), specials=True)
  kw = dict(window_shape=(3, 3), strides=(2, 2), padding="SAME")  # overlapping: duplicates
  y, i = jp.max_pool_with_indices(x, **kw)
  w = rng.standard_normal(x.shape).astype(np.float32)
  gy = jax.grad(lambda v: jnp.sum(jp.max_unpool(v, i, (7, 6)) * w))(y)
  flat_w = np.moveaxis(w, -1, 1).reshape(2, 3, -1)
  flat_i = np.moveaxis(np.asarray(i), -1, 1).reshape(2, 3, -1)
  gathered = np.take_along_axis(flat_w, flat_i, axis=-1).reshape(2, 3, *y.shape[1:3])
  return x, kw, i, w, gy, np.moveaxis(gathered, 1, -1)


def test_gradients_through_indices_and_unpool(rng):
  x, kw, i, w, gy, gathered = _unpool_grad_case(rng)
  dy = rng.integers(-3, 4, size=i.shape).astype(np.float32)
  g1 = jax.grad(lambda v: jnp.sum(jp.max_pool_with_indices(v, **kw)[0] * dy))(x)
  assert_same_bits(g1, jp.max_pool_grad(x, dy, **kw))
  # unpool is linear in y; its gradient is PyTorch's gather: every window that picked an element
  # gets that element's cotangent.
  np.testing.assert_array_equal(np.asarray(gy), gathered)


def test_unpool_gradient_is_pytorch_gather(rng):
  *_, gy, gathered = _unpool_grad_case(rng)
  np.testing.assert_array_equal(gy, gathered)


def test_indices_int32_under_x64(rng):
  with jax.enable_x64(True):
    x = tie_rich(rng, (1, 5, 5, 2), np.float64)
    y, i = jp.max_pool_with_indices(x, (2, 2))
    assert y.dtype == np.float64 and i.dtype == np.int32
    assert_bitwise(i, ref.max_pool_with_indices(x, (2, 2))[1])
    assert jp.max_unpool(y, i, (5, 5)).dtype == np.float64
