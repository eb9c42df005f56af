"""Against torchvision's own roi_align / roi_pool on NCHW (``data_format="channels_first"``):
values and the feature gradient equal to float32 rounding. Slow tier; skipped where
torchvision does not import (``pip install torch torchvision``)."""

import jax
import numpy as np
import pytest

import jaxpool

torch = pytest.importorskip("torch")
ops = pytest.importorskip("torchvision.ops")

pytestmark = pytest.mark.slow


def _case(rng):
  x = rng.standard_normal((2, 3, 10, 12)).astype(np.float32)
  pts = rng.uniform(-3, 14, (12, 4)).astype(np.float32)
  boxes = np.stack([rng.integers(0, 2, 12).astype(np.float32),
                    np.minimum(pts[:, 0], pts[:, 2]), np.minimum(pts[:, 1], pts[:, 3]),
                    np.maximum(pts[:, 0], pts[:, 2]), np.maximum(pts[:, 1], pts[:, 3])], 1)
  # torchvision's test boxes: whole map, one pixel, zero size, outside
  extra = np.array([[0, 0, 0, 11, 9], [1, 3, 3, 3, 3], [0, 4, 4, 4, 4], [1, 20, 20, 25, 25]],
                   np.float32)
  return x, np.concatenate([boxes, extra])


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
@pytest.mark.parametrize("output_size,scale", [((3, 4), 1.0), (5, 0.5)])
def test_roi_align_matches_torchvision(rng, aligned, sampling_ratio, output_size, scale):
  x, boxes = _case(rng)
  tx = torch.tensor(x, requires_grad=True)
  ty = ops.roi_align(tx, torch.tensor(boxes), output_size, spatial_scale=scale,
                     sampling_ratio=sampling_ratio, aligned=aligned)
  dy = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
  ty.backward(torch.tensor(dy))
  # (boxes reach past the map: a bound above what they need, torchvision's count has none)
  f = lambda v: jaxpool.roi_align(v, boxes, output_size, spatial_scale=scale,
                                  sampling_ratio=sampling_ratio, aligned=aligned,
                                  max_samples=16, data_format="channels_first")
  y, vjp = jax.vjp(f, x)
  np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(vjp(dy)[0], tx.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("output_size,scale", [((3, 4), 1.0), (2, 0.5)])
def test_roi_pool_matches_torchvision(rng, output_size, scale):
  x, boxes = _case(rng)
  tx = torch.tensor(x, requires_grad=True)
  ty = ops.roi_pool(tx, torch.tensor(boxes), output_size, spatial_scale=scale)
  dy = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
  ty.backward(torch.tensor(dy))
  f = lambda v: jaxpool.roi_pool(v, boxes, output_size, spatial_scale=scale,
                                 data_format="channels_first")
  y, vjp = jax.vjp(f, x)
  np.testing.assert_array_equal(y, ty.detach().numpy())
  np.testing.assert_allclose(vjp(dy)[0], tx.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_multi_scale_matches_torchvision(rng):
  feats = [rng.standard_normal((2, 4, 64 // s, 96 // s)).astype(np.float32) for s in (4, 8, 16)]
  xy = rng.uniform(0, 50, (10, 2))
  wh = np.exp(rng.uniform(np.log(10), np.log(300), (10, 2)))
  all_boxes = np.concatenate([xy, xy + wh], 1).astype(np.float32)
  per_image = [all_boxes[:6], all_boxes[6:]]
  shapes = [(64, 96), (60, 90)]
  layer = ops.MultiScaleRoIAlign(["p2", "p3", "p4"], (3, 2), 2)
  ty = layer({f"p{i + 2}": torch.tensor(f) for i, f in enumerate(feats)},
             [torch.tensor(b) for b in per_image], shapes)
  y = jaxpool.multi_scale_roi_align(feats, per_image, shapes, (3, 2), sampling_ratio=2,
                                    data_format="channels_first")
  np.testing.assert_allclose(y, ty.numpy(), rtol=1e-5, atol=1e-5)
