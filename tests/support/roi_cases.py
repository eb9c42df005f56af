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
