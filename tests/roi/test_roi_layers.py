"""The ROI layers (Flax linen and nnx, Equinox) are the functions with their attributes, and
check those attributes at construction under their names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool
from jaxpool.interop import equinox as jpe
from jaxpool.interop import flax_linen as jpl
from jaxpool.interop import flax_nnx as jpn

X = np.random.default_rng(0).standard_normal((2, 6, 7, 3)).astype(np.float32)
BOXES = np.array([[0, 0.5, 1.0, 5.0, 4.5], [1, 2.0, 0.0, 6.5, 5.0]], np.float32)
KW = dict(spatial_scale=0.9, sampling_ratio=2, aligned=True)


def test_layers_are_the_functions():
  want = jaxpool.roi_align(X, BOXES, (2, 3), **KW)
  linen = jpl.RoIAlign((2, 3), **KW)
  np.testing.assert_array_equal(linen.apply({}, X, BOXES), want)
  np.testing.assert_array_equal(jpn.RoIAlign((2, 3), **KW)(X, BOXES), want)
  xc = np.moveaxis(X, -1, 1)
  eqx_layer = jpe.RoIAlign((2, 3), **KW)
  np.testing.assert_array_equal(np.moveaxis(np.asarray(eqx_layer(xc, BOXES)), 1, -1), want)
  # one example, as Equinox calls a layer under vmap
  one = eqx_layer(xc[1], BOXES[1:, 1:])
  np.testing.assert_array_equal(np.moveaxis(np.asarray(one), 1, -1), want[1:])


@pytest.mark.slow
def test_pool_layers_are_the_functions():
  xc = np.moveaxis(X, -1, 1)
  pool = jaxpool.roi_pool(X, BOXES, 2)
  np.testing.assert_array_equal(jpl.RoIPool(2).apply({}, X, BOXES), pool)
  np.testing.assert_array_equal(jpn.RoIPool(2)(X, BOXES), pool)
  np.testing.assert_array_equal(np.moveaxis(np.asarray(jpe.RoIPool(2)(xc, BOXES)), 1, -1), pool)
  feats = [X, X[:, ::2, ::2]]
  per_image = [BOXES[:1, 1:], BOXES[1:, 1:]]
  ms = jaxpool.multi_scale_roi_align(feats, per_image, [(6, 7), (6, 7)], 2)
  np.testing.assert_array_equal(
      jpl.MultiScaleRoIAlign(2).apply({}, feats, per_image, [(6, 7), (6, 7)]), ms)
  np.testing.assert_array_equal(jpn.MultiScaleRoIAlign(2)(feats, per_image, [(6, 7), (6, 7)]),
                                ms)
  feats_cf = [np.moveaxis(f, -1, 1) for f in feats]
  eq = jpe.MultiScaleRoIAlign(2)(feats_cf, per_image, [(6, 7), (6, 7)])
  np.testing.assert_array_equal(np.moveaxis(np.asarray(eq), 1, -1), ms)


@pytest.mark.parametrize("make,match", [
    (lambda: jpl.RoIAlign(0), r"output_size entries must be >= 1"),
    (lambda: jpn.RoIAlign((2, 2), mode="sum"), r"mode must be one of"),
    (lambda: jpe.RoIAlign(2, spatial_scale=-1.0), r"spatial_scale must be a positive"),
    (lambda: jpe.RoIPool(2, data_format="NCHW"), r"data_format must be one of"),
    (lambda: jpn.MultiScaleRoIAlign(2, canonical_level=4.0), r"canonical_level must be an int"),
    (lambda: jpl.RoIPool((2, 2), implementation="cuda"), r"implementation must be one of"),
    (lambda: jpe.MultiScaleRoIAlign(2, eps=float("nan")), r"eps must be a finite number"),
    (lambda: jpl.MultiScaleRoIAlign(2, eps="a"), r"eps must be a finite number"),
])
def test_attributes_checked_at_construction(make, match):
  with pytest.raises((TypeError, ValueError), match=match):
    make()


def test_equinox_layer_is_a_pytree_without_leaves():
  layer = jpe.RoIAlign(2, sampling_ratio=2)
  assert jax.tree_util.tree_leaves(layer) == []
  g = jax.grad(lambda b: layer(jnp.asarray(np.moveaxis(X, -1, 1)), b).sum())(BOXES)
  assert g.shape == BOXES.shape


@pytest.mark.parametrize("make", [jpn.RoIAlign, jpe.RoIAlign, jpn.MultiScaleRoIAlign,
                                  jpe.MultiScaleRoIAlign])
def test_sequence_attributes_kept_as_tuples(make):
  layer = make([2, 3], max_samples=[4, 5])
  assert layer.output_size == (2, 3) and layer.max_samples == (4, 5)
