"""Boxes that the ROI kernel tests share (tests/roi/test_roi_kernels.py and
test_roi_box_kernels.py), on maps of 2 images of 7 x 9 pixels."""

import numpy as np

# Boxes over every edge: outside the map (every sample dead), zero and negative size, one pixel,
# the whole map, the clamp bands.
EDGE = np.array([
    [0, 20.0, 20.0, 30.0, 25.0], [1, 3.0, 2.0, 3.0, 2.0], [0, 5.0, 4.0, 2.0, 1.0],
    [1, 2.0, 3.0, 3.0, 4.0], [0, 0.0, 0.0, 9.0, 7.0], [1, 6.3, 4.2, 9.8, 7.9],
    [0, -1.7, -0.6, 2.2, 1.9]], np.float32)


def random_boxes(rng, k, n=2, lo=-2.0, hi=10.0):
  """``k`` rows ``(image, x1, y1, x2, y2)``: images below ``n``, corners in ``[lo, hi]``."""
  pts = rng.uniform(lo, hi, (k, 4)).astype(np.float32)
  return np.stack([rng.integers(0, n, k).astype(np.float32),
                   np.minimum(pts[:, 0], pts[:, 2]), np.minimum(pts[:, 1], pts[:, 3]),
                   np.maximum(pts[:, 0], pts[:, 2]), np.maximum(pts[:, 1], pts[:, 3])], 1)


def gpu_case(rng, k=300):
  """The GPU tests' inputs: maps (2, 50, 76, 256) float64 (standard normal; the caller casts)
  and ``k`` boxes ``(K, 5)`` of sides 2-60 pixels, some partly outside, spread over both
  images."""
  x = rng.standard_normal((2, 50, 76, 256))
  side = np.exp(rng.uniform(np.log(2), np.log(60), (k, 2)))
  x1, y1 = rng.uniform(-4, 76 - side[:, 0] / 2), rng.uniform(-4, 50 - side[:, 1] / 2)
  boxes = np.stack([rng.integers(0, 2, k), x1, y1, x1 + side[:, 0], y1 + side[:, 1]],
                   1).astype(np.float32)
  return x, boxes
