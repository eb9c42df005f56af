"""roi_align's dead samples (padding past a box's sample count, outside ``[-1, size]``, in an
unusable box) count as nothing: a NaN or inf they would read, or a NaN cotangent, goes nowhere
(torchvision's rule, per the NumPy reference), and the feature gradient's bits do not depend on
the static sample grid (eager == jit)."""

import jax
import numpy as np
import pytest
import roi_reference as rref

import jaxpool

H, W, C = 6, 8, 2
# Image 0: a small box at the top left (its padded samples run past it into the NaN/inf corner),
# a box below-right of the map (its samples lie outside [-1, size], by the NaN/inf pixels).
BOXES = np.array([[0, 0.5, 0.2, 2.4, 1.9], [0, 9.5, 7.5, 12.0, 10.0], [0, 1.0, 1.0, 6.5, 4.5]],
                 np.float32)


def _x(rng):
  x = rng.standard_normal((1, H, W, C)).astype(np.float32)
  x[0, 3:, 5:, 0] = np.nan  # outside the first two boxes' bins
  x[0, 3:, 5:, 1] = np.inf
  return x


@pytest.mark.parametrize("mode", ["avg", "max"])
def test_non_finite_outside_the_bins_stays_out(rng, mode):
  x = _x(rng)
  kw = dict(output_size=2, sampling_ratio=-1, mode=mode)
  with np.errstate(invalid="ignore"):  # the third box reads the NaN and inf pixels
    ref = rref.roi_align(x, BOXES, **kw)
  for f in (lambda v, b: jaxpool.roi_align(v, b, **kw),
            jax.jit(lambda v, b: jaxpool.roi_align(v, b, **kw))):  # jit: the padded grid
    y = np.asarray(f(x, BOXES))
    assert np.isfinite(y[:2]).all()
    np.testing.assert_allclose(y[:2], ref[:2], atol=1e-5, rtol=1e-5)


def test_nan_cotangent_touches_only_the_sampled_pixels(rng):
  x = rng.standard_normal((1, H, W, C)).astype(np.float32)
  dy = np.zeros((3, 2, 2, C), np.float32)
  dy[0, 1, 1, 0] = np.nan
  _, rdx, _ = rref.roi_align(x, BOXES, 2, sampling_ratio=-1, dy=dy)
  grad = jax.jit(jax.vjp(lambda v: jaxpool.roi_align(v, BOXES, 2), x)[1])
  dx = np.asarray(grad(dy)[0])
  np.testing.assert_array_equal(np.isnan(dx), np.isnan(rdx))
  assert 0 < np.isnan(rdx).sum() <= 9


@pytest.mark.parametrize("mode", ["avg", pytest.param("max", marks=pytest.mark.slow)])
def test_feature_gradient_same_bits_eager_and_jit(rng, mode):
  """Outside jit the sample grid fits the boxes (here 2 or 3 per axis); under jit it is
  ceil((H + 1) / ph) = 7 per axis: padding that must not change the order of the additions."""
  x = rng.standard_normal((1, 12, 12, C)).astype(np.float32)
  lo = rng.uniform(0.0, 3.0, (12, 2)).astype(np.float32)
  hi = lo + rng.uniform(0.5, 3.0, (12, 2)).astype(np.float32)
  boxes = np.concatenate([np.zeros((12, 1), np.float32), lo, hi], 1)  # overlapping boxes
  dy = rng.standard_normal((12, 2, 2, C)).astype(np.float32)
  f = lambda v: jaxpool.roi_align(v, boxes, 2, aligned=True, mode=mode)
  eager = np.asarray(jax.vjp(f, x)[1](dy)[0])
  jitted = np.asarray(jax.jit(lambda v, d: jax.vjp(f, v)[1](d)[0])(x, dy))
  np.testing.assert_array_equal(eager.view(np.uint32), jitted.view(np.uint32))
  np.testing.assert_array_equal(np.asarray(f(x)).view(np.uint32),
                                np.asarray(jax.jit(f)(x)).view(np.uint32))
