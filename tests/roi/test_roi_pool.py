"""roi_pool against the NumPy reference: torchvision's rounding and bins, the maximum under
``>`` (NaN never wins), empty bins, the indices, the gradient to the argmax, the zero box
gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import roi_reference as rref

import jaxpool

N, H, W, C = 2, 6, 8, 2


def _x(rng):
  # few distinct values: ties decide the argmax
  x = rng.integers(-3, 4, (N, H, W, C)).astype(np.float32)
  flat = x.reshape(-1)
  flat[rng.choice(flat.size, 6, replace=False)] = np.nan
  flat[rng.choice(flat.size, 4, replace=False)] = -np.inf
  return x


BOXES = np.array([
    [0, 0.0, 0.0, 7.0, 5.0],      # the whole map
    [1, 1.5, 0.5, 4.49, 3.5],     # halves: C's round goes away from zero
    [0, -2.5, -1.5, 2.0, 1.0],    # partly outside
    [1, 10.0, 9.0, 14.0, 12.0],   # outside: empty bins
    [0, 3.0, 2.0, 3.0, 2.0],      # one pixel
    [1, 5.0, 4.0, 2.0, 1.0],      # negative size: raised to one pixel
], np.float32)


@pytest.mark.parametrize("output_size,scale", [((3, 2), 1.0), (2, 0.5)])
def test_values_indices_and_gradient(rng, output_size, scale):
  x = _x(rng)
  ry, ridx = rref.roi_pool(x, BOXES, output_size, scale)
  dy = rng.standard_normal(ry.shape).astype(np.float32)
  _, _, rdx = rref.roi_pool(x, BOXES, output_size, scale, dy=dy)

  @jax.jit
  def run(x, boxes, dy):
    f = lambda v, b: jaxpool.roi_pool(v, b, output_size, spatial_scale=scale)
    y, vjp = jax.vjp(f, x, boxes)
    _, idx = jaxpool.roi_pool(x, boxes, output_size, spatial_scale=scale, return_indices=True)
    return (y, idx, *vjp(dy))

  y, idx, dx, db = run(x, BOXES, dy)
  np.testing.assert_array_equal(y, ry.astype(np.float32))
  np.testing.assert_array_equal(idx, ridx)
  np.testing.assert_allclose(dx, rdx, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(db, 0)


def test_empty_bins_nan_and_the_floor():
  x = np.full((1, 2, 2, 1), np.nan, np.float32)
  x[0, 1, 1, 0] = -np.inf
  boxes = np.array([[0, 0.0, 0.0, 1.0, 1.0], [0, 5.0, 5.0, 6.0, 6.0]], np.float32)
  y, idx = jaxpool.roi_pool(x, boxes, 1, return_indices=True)
  assert y[0, 0, 0, 0] == -np.finfo(np.float32).max and idx[0, 0, 0, 0] == -1  # nothing wins
  assert y[1, 0, 0, 0] == 0 and idx[1, 0, 0, 0] == -1  # empty bin
  x[0, 0, 1, 0] = 2.0
  y, idx = jaxpool.roi_pool(x, boxes, 1, return_indices=True)
  assert y[0, 0, 0, 0] == 2.0 and idx[0, 0, 0, 0] == 1


def test_channels_first_and_lists(rng):
  x = _x(rng)
  per_image = [BOXES[BOXES[:, 0] == i, 1:] for i in range(N)]
  order = np.argsort(BOXES[:, 0], kind="stable")
  a = jaxpool.roi_pool(x, BOXES[order], 2)
  b = jaxpool.roi_pool(np.moveaxis(x, -1, 1), per_image, 2, data_format="channels_first")
  np.testing.assert_array_equal(np.moveaxis(np.asarray(b), 1, -1), a)


def _grads(rng):
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  boxes = np.concatenate([BOXES, BOXES])  # overlapping bins share pixels
  f = lambda v: (jaxpool.roi_pool(v, boxes, 3) ** 2).sum()
  g = jax.jit(jax.grad(f))
  return x, f, g(x), g(x.copy())


def test_gradient_same_bits(rng):
  _, _, g1, g2 = _grads(rng)
  np.testing.assert_array_equal(np.asarray(g1).view(np.uint32), np.asarray(g2).view(np.uint32))


@pytest.mark.slow
def test_gradient_vmap(rng):
  x, f, g1, _ = _grads(rng)
  xs = np.stack([x, -x])
  v = jax.vmap(jax.grad(f))(xs)
  np.testing.assert_array_equal(v[0], g1)
  np.testing.assert_array_equal(v[1], jax.grad(f)(-x))


def test_bfloat16(rng):
  x = jnp.asarray(rng.standard_normal((N, H, W, C)), jnp.bfloat16)
  y = jaxpool.roi_pool(x, BOXES[:3], 2)
  assert y.dtype == jnp.bfloat16
  ry, _ = rref.roi_pool(np.asarray(x.astype(jnp.float32)), BOXES[:3], 2)
  np.testing.assert_array_equal(np.asarray(y, np.float32), ry)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_bin_of_only_nan_and_minus_inf(dtype):
  """float32's lowest value; -inf in bfloat16 and float16 (which cannot hold it)."""
  x = jnp.asarray(np.array([np.nan, -np.inf] * 8, np.float32).reshape(1, 4, 4, 1), dtype)
  y, idx = jaxpool.roi_pool(x, np.array([[0, 0.0, 0.0, 3.0, 3.0]], np.float32), 2,
                            return_indices=True)
  want = -np.finfo(np.float32).max if dtype == jnp.float32 else -np.inf
  np.testing.assert_array_equal(np.asarray(y, np.float32), want)
  np.testing.assert_array_equal(idx, -1)


def test_bins_whose_size_divides_exactly_under_jit():
  """A bin size ``roi / n`` that is a whole multiple in float32 (11 / 7 * 7 == 11) keeps its
  last bin's end under ``jit``: XLA turns a division by a constant into a product with its
  inverse, ``11 * (1 / 7)``, one bit larger, whose ``ceil`` reached one pixel further (a
  column and a row of every such box's last bins took a pixel outside them)."""
  x = np.zeros((1, 30, 50, 1), np.float32)
  x[0, 9, 43, 0] = 5.0  # just right of the box's last column (42)
  x[0, 23, 33, 0] = 7.0  # just below its last row (22)
  boxes = np.array([[0, 32.0, 8.0, 42.0, 22.0]], np.float32)  # 11 x 15 pixels
  ry, ridx = rref.roi_pool(x, boxes, 7)
  y, idx = jax.jit(lambda v, b: jaxpool.roi_pool(v, b, 7, return_indices=True))(x, boxes)
  np.testing.assert_array_equal(idx, ridx)
  np.testing.assert_array_equal(y, ry.astype(np.float32))
