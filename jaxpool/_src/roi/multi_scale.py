"""``multi_scale_roi_align``: torchvision's ``MultiScaleRoIAlign`` over FPN levels.

Each box is pooled once, from the level its size maps to: the levels' maps are tables of
pixels one after the other (``plan.Level``: the XLA path concatenates them, ``roi/xla.py``; the
GPU kernels read each level's map where it is, ``roi/kernels.py``), and each box's plan
addresses its own level's rows, scale and size, so no box is pooled at a level it does not
use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src import dispatch
from jaxpool._src.api_args import DataFormat, Implementation
from jaxpool._src.backend import Op
from jaxpool._src.checks import check_bool, check_name, is_int
from jaxpool._src.roi.api import (Boxes, Mode, check_elements, check_maps, check_sampling,
                                  finite_number, output_size_pair, positive_scale, sample_grid,
                                  split_boxes, unsplit)
from jaxpool._src.roi.plan import MODES, AlignConfig, Level
from jaxpool._src.windows import DATA_FORMATS


def infer_scales(sizes: Sequence[Sequence[int]],
                 image_shapes: Sequence[Sequence[int]]) -> tuple[float, ...]:
  """torchvision's ``_setup_scales``: each level's scale, ``2 ** round(log2(map height /
  largest image height))`` (rounded half to even, as ``torch.round``)."""
  if isinstance(image_shapes, (np.ndarray, jax.Array)):
    image_shapes = np.asarray(image_shapes).tolist()  # an (images, 2) array of ints
  if isinstance(image_shapes, (str, bytes)) or not isinstance(image_shapes, Sequence):
    raise TypeError(f"image_shapes must be a sequence of (height, width) pairs; got "
                    f"{image_shapes!r}.")
  if len(image_shapes) == 0:
    raise ValueError("image_shapes must hold the (height, width) of at least one image; got "
                     "an empty sequence.")
  for shape in image_shapes:
    if (not isinstance(shape, Sequence) or len(shape) != 2
        or not all(is_int(v) and v > 0 for v in shape)):
      raise ValueError(f"image_shapes must hold (height, width) pairs of positive ints; got "
                       f"{shape!r}.")
  top = max(s[0] for s in image_shapes)
  scales = tuple(float(2.0 ** float(np.round(np.log2(np.float32(h / top))))) for h, _ in sizes)
  if any(a <= b for a, b in zip(scales, scales[1:])):
    raise ValueError(f"features must be the levels finest first (P2, P3, ...), their inferred "
                     f"scales strictly decreasing; got scales {list(scales)} (map heights "
                     f"{[int(h) for h, _ in sizes]}, largest image height {top}).")
  return scales


def map_levels(coords: jax.Array, scales: tuple[float, ...], canonical_scale: float,
               canonical_level: int, eps: float) -> jax.Array:
  """torchvision's ``LevelMapper``: ``floor(canonical_level + log2(sqrt(area) /
  canonical_scale) + eps)`` clamped to the levels present, as an index into ``scales`` (a box
  of NaN or negative area goes to the first level)."""
  k_min = int(-math.log2(scales[0]))
  k_max = int(-math.log2(scales[-1]))
  c = jax.lax.stop_gradient(coords.astype(jnp.float32))
  area = (c[:, 2] - c[:, 0]) * (c[:, 3] - c[:, 1])
  lvl = jnp.floor(canonical_level + jnp.log2(jnp.sqrt(area) / canonical_scale)
                  + jnp.float32(eps))
  lvl = jnp.where(jnp.isnan(lvl), k_min, jnp.clip(lvl, k_min, k_max))
  return lvl.astype(jnp.int32) - k_min


def multi_scale_roi_align(features: Sequence[Any], boxes: Boxes,
                          image_shapes: Sequence[Sequence[int]],
                          output_size: int | Sequence[int], *, sampling_ratio: int = 2,
                          canonical_scale: float = 224.0, canonical_level: int = 4,
                          eps: float = 1e-6, aligned: bool = False, mode: Mode = "avg",
                          max_samples: int | Sequence[int] | None = None,
                          data_format: DataFormat = "channels_last",
                          implementation: Implementation = None) -> jax.Array:
  """ROI align over the levels of a feature pyramid (torchvision's ``MultiScaleRoIAlign``).

  Each box is pooled from one level, ``floor(canonical_level + log2(sqrt(area) /
  canonical_scale) + eps)`` clamped to the levels given (the canonical 224-pixel box at level
  4): only that level is read for it.

  Args:
    features: the levels' maps, finest first (P2, P3, ...), each ``(N, H_l, W_l, C)`` (or
      channels first), one dtype; each level's scale is inferred as torchvision does, the power
      of two nearest to its height over the largest image height.
    boxes: as :func:`roi_align`, in input-image coordinates.
    image_shapes: the ``(height, width)`` of each image (before batching pads them).
    output_size, sampling_ratio, aligned, mode, max_samples, data_format, implementation: as
      :func:`roi_align` (``sampling_ratio`` defaults to 2, torchvision's layer default).
    canonical_scale, canonical_level, eps: the level mapping's constants.

  Returns:
    ``(K, ph, pw, C)`` (or channels first), the boxes in the order given.

  Example:
    >>> p2, p3 = jnp.ones((1, 16, 16, 4)), jnp.ones((1, 8, 8, 4))
    >>> boxes = [jnp.array([[0., 0., 20., 20.], [0., 0., 60., 60.]])]
    >>> multi_scale_roi_align([p2, p3], boxes, [(64, 64)], 7).shape
    (2, 7, 7, 4)
  """
  check_name("data_format", data_format, DATA_FORMATS)
  if isinstance(features, (str, bytes)) or not isinstance(features, Sequence) or not features:
    raise TypeError(f"features must be a non-empty list of feature maps; got {features!r}.")
  maps = tuple(unsplit(check_maps(f"features[{i}]", f, data_format))
               for i, f in enumerate(features))
  boxes = unsplit(boxes)
  first = maps[0]
  for i, m in enumerate(maps):
    if m.shape[0] != first.shape[0] or m.shape[3] != first.shape[3] or m.dtype != first.dtype:
      raise ValueError(f"features must share the batch size, channels and dtype; features[0] "
                       f"is {tuple(first.shape)} {first.dtype} (channels last), features[{i}] "
                       f"{tuple(m.shape)} {m.dtype}.")
  output_size = output_size_pair(output_size)
  ratio, cap = check_sampling(sampling_ratio, max_samples)
  aligned = check_bool("aligned", aligned)
  check_name("mode", mode, MODES)
  if mode == "max":
    check_elements("features", sum(m.size for m in maps))
  canonical_scale = positive_scale("canonical_scale", canonical_scale)
  if not is_int(canonical_level):
    raise TypeError(f"canonical_level must be an int; got {canonical_level!r}.")
  eps = finite_number("eps", eps)
  scales = infer_scales([m.shape[1:3] for m in maps], image_shapes)
  image, coords = split_boxes(boxes, first.shape[0])
  levels, offset = [], 0
  for m, s in zip(maps, scales):
    levels.append(Level(m.shape[0], m.shape[1], m.shape[2], s, offset))
    offset += m.shape[0] * m.shape[1] * m.shape[2]
  level = map_levels(coords, scales, canonical_scale, int(canonical_level), eps)
  scale = jnp.asarray(scales, jnp.float32)[level]
  samples = sample_grid(ratio, cap, coords, scale, tuple(levels), output_size)
  cfg = AlignConfig(output_size, tuple(levels), ratio, samples, aligned, mode)
  backend = dispatch.choose(Op.ROI_ALIGN, implementation, first, None,
                            caller="multi_scale_roi_align", config=cfg)
  y = backend.roi_align(maps, image, coords, level, cfg)
  return jnp.moveaxis(y, -1, 1) if data_format == "channels_first" else y
