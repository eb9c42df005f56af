"""Equality with flax.linen's pooling and lax.reduce_window where both support the config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from core_strategies import assert_same_bits, jp, tie_rich, unique_values
from jax import lax

nn = pytest.importorskip("flax.linen")

# (shape, window, strides, padding): flax's padding is "VALID", "SAME" or (lo, hi) pairs
CONFIGS = [
    ((2, 7, 6, 3), (2, 2), (2, 2), "VALID"),
    ((2, 7, 6, 3), (3, 3), (1, 1), "SAME"),
    ((2, 7, 6, 3), (3, 2), (2, 3), "SAME"),
    ((2, 7, 6, 3), (3, 3), (2, 2), ((1, 1), (2, 0))),
    ((4, 9, 2), (4,), (3,), ((3, 1),)),  # 1-D
    ((5, 6, 2), (2, 3), None, "VALID"),  # no batch dim
    ((2, 4, 5, 6, 2), (2, 3, 2), (2, 1, 2), "SAME"),  # 3-D
]


@pytest.mark.parametrize("shape,window,strides,padding", CONFIGS)
def test_max_pool_equals_flax(shape, window, strides, padding, rng):
  x = tie_rich(rng, shape, specials=True)
  y = jp.max_pool(x, window, strides, padding)
  assert_same_bits(y, nn.max_pool(jnp.asarray(x), window, strides, padding))
  # gradients on tie-free inputs (flax's select_and_scatter_add picks the same, unique, max);
  # integer cotangents so the sums over overlapping windows are exact in both
  xu = unique_values(rng, shape)
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  g_flax = jax.grad(lambda v: jnp.sum(nn.max_pool(v, window, strides, padding) * dy))(xu)
  assert_same_bits(jp.max_pool_grad(xu, dy, window, strides, padding), g_flax)


@pytest.mark.parametrize("shape,window,strides,padding,count_include_pad",
                         [(*c, i % 2 == 0) for i, c in enumerate(CONFIGS)] + [(*CONFIGS[3], False)])
def test_avg_pool_equals_flax(shape, window, strides, padding, count_include_pad, rng):
  x = rng.standard_normal(shape).astype(np.float32)
  y = jp.avg_pool(x, window, strides, padding, count_include_pad=count_include_pad)
  expected = nn.avg_pool(jnp.asarray(x), window, strides, padding,
                         count_include_pad=count_include_pad)
  np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
  dy = rng.standard_normal(y.shape).astype(np.float32)
  g = jp.avg_pool_grad(dy, shape, window, strides, padding, count_include_pad=count_include_pad)
  g_flax = jax.grad(lambda v: jnp.sum(nn.avg_pool(v, window, strides, padding,
                                                  count_include_pad=count_include_pad) * dy))(x)
  np.testing.assert_allclose(g, g_flax, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dilation", [(1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_max_pool_equals_reduce_window(dilation, data_format, rng):
  """lax.reduce_window(max, -inf) with the same window, strides, padding and dilation."""
  shape = (2, 9, 8, 3) if data_format == "channels_last" else (2, 3, 9, 8)
  x = tie_rich(rng, shape, specials=True)
  window, strides, padding = (3, 2), (2, 1), ((1, 2), (0, 1))
  spatial = (1, 2) if data_format == "channels_last" else (2, 3)

  def full(vals, fill):
    out = [fill] * 4
    for a, v in zip(spatial, vals, strict=True):
      out[a] = v
    return tuple(out)

  expected = lax.reduce_window(jnp.asarray(x), -jnp.inf, lax.max, full(window, 1),
                               full(strides, 1), full(padding, (0, 0)),
                               window_dilation=full(dilation, 1))
  y = jp.max_pool(x, window, strides, padding, dilation=dilation, data_format=data_format)
  assert_same_bits(y, expected)
  # integer max: identity iinfo.min
  xi = rng.integers(-100, 100, size=shape).astype(np.int32)
  expected = lax.reduce_window(jnp.asarray(xi), np.int32(np.iinfo(np.int32).min), lax.max,
                               full(window, 1), full(strides, 1), full(padding, (0, 0)),
                               window_dilation=full(dilation, 1))
  assert_same_bits(jp.max_pool(xi, window, strides, padding, dilation=dilation,
                               data_format=data_format), expected)
