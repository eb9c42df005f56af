"""multi_scale_roi_align: torchvision's level mapping (canonical 224 at level 4, eps 1e-6) and
each box pooled from its level only, against the NumPy reference."""

import jax
import numpy as np
import roi_reference as rref

import jaxpool
from jaxpool._src.roi import multi_scale

C = 2
SHAPES = [(64, 96), (60, 90)]  # images before padding; the padded batch is 64 x 96


def _features(rng):
  # P2..P5 of a 64 x 96 batch: strides 4, 8, 16, 32
  return [rng.standard_normal((2, 64 // s, 96 // s, C)).astype(np.float32)
          for s in (4, 8, 16, 32)]


def _boxes(rng, k):
  xy = rng.uniform(0, 50, (k, 2))
  # square roots of the areas from 10 to 400 pixels: every level, and clamps at both ends
  side = np.exp(rng.uniform(np.log(10), np.log(400), (k, 1)))
  return np.concatenate([xy, xy + side * rng.uniform(0.5, 1.5, (k, 2))], 1).astype(np.float32)


def test_levels_follow_torchvision(rng):
  feats = _features(rng)
  scales = multi_scale.infer_scales([f.shape[1:3] for f in feats], SHAPES)
  assert scales == (0.25, 0.125, 0.0625, 0.03125)
  boxes = np.concatenate([_boxes(rng, 40), [[0, 0, 112, 112], [0, 0, 224, 224],
                                           [0, 0, 448, 448], [0, 0, 1, 1]]]).astype(np.float32)
  got = multi_scale.map_levels(boxes, scales, 224.0, 4, 1e-6)
  np.testing.assert_array_equal(got, rref.fpn_levels(boxes, scales))
  assert list(got[-4:]) == [1, 2, 3, 0]


def test_each_box_from_its_level(rng):
  feats = _features(rng)
  per_image = [_boxes(rng, 5), _boxes(rng, 3)]
  kw = dict(output_size=(3, 2), sampling_ratio=2, aligned=True)

  @jax.jit
  def run(feats, boxes, dy):
    f = lambda fs, b: jaxpool.multi_scale_roi_align(fs, b, SHAPES, **kw)
    y, vjp = jax.vjp(f, feats, boxes)
    return y, vjp(dy)

  rows = np.concatenate([np.c_[np.full(len(b), i), b] for i, b in enumerate(per_image)])
  scales = (0.25, 0.125, 0.0625, 0.03125)
  levels = rref.fpn_levels(rows[:, 1:], scales)
  dy = rng.standard_normal((len(rows), 3, 2, C)).astype(np.float32)
  y, (dfeats, dboxes) = run(feats, per_image, dy)
  for k, lvl in enumerate(levels):
    ry, rdx, rdb = rref.roi_align(feats[lvl], rows[k:k + 1], spatial_scale=scales[lvl],
                                  dy=dy[k:k + 1], **kw)
    np.testing.assert_allclose(y[k], ry[0], rtol=1e-5, atol=1e-5)
    mine = np.concatenate(dboxes)[k]
    np.testing.assert_allclose(mine, rdb[0], rtol=1e-4, atol=1e-4)
  for lvl in range(4):
    ks = [k for k, v in enumerate(levels) if v == lvl]
    _, rdx, _ = rref.roi_align(feats[lvl], rows[ks].reshape(-1, 5), spatial_scale=scales[lvl],
                               dy=dy[ks], **kw)
    np.testing.assert_allclose(dfeats[lvl], rdx, rtol=1e-5, atol=1e-5)
