"""The public ROI pooling functions: ``roi_align``, ``roi_pool``, ``multi_scale_roi_align``.

Each checks its arguments (``checks.py`` and the box checks here), asks the backend registry
(``dispatch.choose``) which backend serves the call and calls that backend's method for the op.
The semantics, side by side with torchvision's and DirectML's, are in docs/roi.md.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src import dispatch
from jaxpool._src.api_args import DataFormat, Implementation, as_array
from jaxpool._src.backend import Op
from jaxpool._src.checks import check_bool, check_name, int_tuple, is_int
from jaxpool._src.dtypes import check_dtype
from jaxpool._src.roi import batched
from jaxpool._src.roi.plan import MODES, AlignConfig, Level, PoolConfig
from jaxpool._src.windows import DATA_FORMATS

Boxes = Any  # a (K, 5) array, or a sequence of (K_i, 4) arrays, one per image
Mode = Literal["avg", "max"]
_BOXES = ("boxes must be a (K, 5) array of rows (image, x1, y1, x2, y2) or a list of (K_i, 4) "
          "arrays (x1, y1, x2, y2), one per image")


# ----------------------------------------------------------------------------- argument checks


def check_maps(name: str, x: Any, data_format: Any) -> jax.Array:
  x = as_array(name, x)
  check_dtype(name, x, allow_int=False)
  if x.ndim != 4:
    layout = "(N, H, W, C)" if data_format == "channels_last" else "(N, C, H, W)"
    raise ValueError(f"{name} must be a 4-D array {layout} ({data_format}); got shape "
                     f"{tuple(x.shape)}.")
  if data_format == "channels_first":
    x = jnp.moveaxis(x, 1, -1)
  if 0 in x.shape[1:3]:
    raise ValueError(f"{name} must have a non-empty spatial plane; got shape {tuple(x.shape)}.")
  if x.shape[0] == 0 or x.shape[3] == 0:
    raise ValueError(f"{name} must have at least one image and one channel; got shape "
                     f"{tuple(x.shape)} ({data_format}).")
  return x


def unsplit(a: Any) -> Any:
  """``a`` whole on every device where an Explicit mesh splits it (else as it is, lists item by
  item). A box may name any image, and the sampling plan's arrays carry no mesh axes, so the
  ROI functions read their inputs whole, as XLA arranges by itself under an Auto mesh (there the
  per-image form splits with the batch: docs/roi.md, "Sharding")."""
  if isinstance(a, (list, tuple)):
    return type(a)(unsplit(v) for v in a)
  if not isinstance(a, jax.Array):
    return a
  spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", None)
  if spec is None or all(p is None for p in spec):
    return a
  return jax.sharding.reshard(a, jax.sharding.PartitionSpec())


def check_elements(name: str, size: int) -> None:
  """The max modes address single elements of the feature maps with int32."""
  if size >= 2**31:
    raise ValueError(f"{name} must have fewer than 2**31 elements for a maximum (its indices "
                     f"are int32); got {size}.")


def _box_array(name: str, b: Any) -> jax.Array:
  b = as_array(name, b)
  if not (jnp.issubdtype(b.dtype, jnp.floating) or jnp.issubdtype(b.dtype, jnp.integer)):
    raise TypeError(f"{name} must have a float or integer dtype; got {b.dtype}.")
  return b


def split_boxes(boxes: Boxes, images: int) -> tuple[jax.Array, jax.Array]:
  """``(image, coords)``: ``(K,)`` int32 and ``(K, 4)`` float (float32 for integer boxes).

  Outside ``jit`` (concrete boxes), an image index that is not an integer in ``[0, images)``
  and a coordinate that is not finite raise a ValueError naming the box.
  """
  if isinstance(boxes, (list, tuple)):
    if len(boxes) != images:
      raise ValueError(f"{_BOXES}: a list needs one array per image ({images}); got "
                       f"{len(boxes)}.")
    parts = [_box_array(f"boxes[{i}]", b) for i, b in enumerate(boxes)]
    for i, b in enumerate(parts):
      if b.ndim != 2 or b.shape[1] != 4:
        raise ValueError(f"{_BOXES}; got boxes[{i}] of shape {tuple(b.shape)}.")
    dtype = jnp.result_type(*parts) if parts else jnp.float32
    coords = (jnp.concatenate([b.astype(dtype) for b in parts]) if parts
              else jnp.zeros((0, 4), jnp.float32))
    image = jnp.concatenate([jnp.full((b.shape[0],), i, jnp.int32)
                             for i, b in enumerate(parts)]) if parts else jnp.zeros(0, jnp.int32)
    raw_image = None
  else:
    b = _box_array("boxes", boxes)
    if b.ndim != 2 or b.shape[1] != 5:
      raise ValueError(f"{_BOXES}; got an array of shape {tuple(b.shape)}.")
    raw_image, coords = b[:, 0], b[:, 1:]
    image = raw_image.astype(jnp.int32)  # truncation toward zero, as torchvision's cast
  if not jnp.issubdtype(coords.dtype, jnp.floating):
    coords = coords.astype(jnp.float32)
  _check_concrete(raw_image, coords, images)
  return image, coords


def _check_concrete(raw_image: jax.Array | None, coords: jax.Array, images: int) -> None:
  """What ``jit`` cannot check, checked outside it."""
  if isinstance(coords, jax.core.Tracer) or isinstance(raw_image, jax.core.Tracer):
    return
  c = np.asarray(coords, np.float64)
  bad = np.flatnonzero(~np.isfinite(c).all(axis=1))
  if bad.size:
    k = int(bad[0])
    raise ValueError(f"boxes must have finite coordinates; box {k} has {c[k].tolist()} (under "
                     f"jit, such a box gives NaN outputs).")
  if raw_image is not None:
    i = np.asarray(raw_image, np.float64)
    bad = np.flatnonzero((i != np.round(i)) | (i < 0) | (i >= images) | ~np.isfinite(i))
    if bad.size:
      k = int(bad[0])
      raise ValueError(f"boxes[:, 0] must be image indices, integers in [0, {images}); box {k} "
                       f"has {i[k]} (under jit, an index out of range gives zeros).")


def output_size_pair(value: Any) -> tuple[int, int]:
  if is_int(value):
    value = (value, value)
  return int_tuple("output_size", value, 2)  # type: ignore[return-value]


def finite_number(name: str, value: Any, what: str = "a finite number") -> float:
  """A static real number: a Python or NumPy int or float, or a concrete 0-d JAX array."""
  if isinstance(value, jax.Array) and value.ndim == 0 and not isinstance(value, jax.core.Tracer):
    if jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating):
      value = value.item()
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be {what} (a static Python or NumPy number, not traced); got "
                    f"{value!r}.")
  v = float(value)
  if not math.isfinite(v):
    raise ValueError(f"{name} must be {what}; got {value!r}.")
  return v


def positive_scale(name: str, value: Any) -> float:
  v = finite_number(name, value, "a positive finite number")
  if not v > 0:
    raise ValueError(f"{name} must be a positive finite number; got {value!r}.")
  return v


def check_sampling(sampling_ratio: Any, max_samples: Any) -> tuple[int, tuple[int, int] | None]:
  if not is_int(sampling_ratio):
    raise TypeError(f"sampling_ratio must be an int (<= 0: adaptive); got {sampling_ratio!r}.")
  cap = None
  if max_samples is not None:
    cap = _pair("max_samples", max_samples)
  return operator.index(sampling_ratio), cap


def _pair(name: str, value: Any) -> tuple[int, int]:
  if is_int(value):
    value = (value, value)
  return int_tuple(name, value, 2)  # type: ignore[return-value]


_needed = jax.jit(lambda coords, scale, out: jnp.max(
    jnp.ceil((coords[:, 2:] - coords[:, :2]) * scale[:, None] / out[None, :]), axis=0,
    initial=0.0))


def sample_grid(sampling_ratio: int, cap: tuple[int, int] | None, coords: jax.Array,
                scale: jax.Array, levels: tuple[Level, ...],
                output_size: tuple[int, int]) -> tuple[int, int]:
  """The static sample grid ``(Sy, Sx)``: see ``roi_align``'s ``max_samples``."""
  if sampling_ratio > 0:
    return (sampling_ratio, sampling_ratio)
  if cap is None:
    cap = (max(-(-(lv.height + 1) // output_size[0]) for lv in levels),
           max(-(-(lv.width + 1) // output_size[1]) for lv in levels))
    if not isinstance(coords, jax.core.Tracer) and not isinstance(scale, jax.core.Tracer):
      # Concrete boxes: the smallest grid that holds them (plus one against rounding), within
      # the cap, so the result is the one jit gives, with fewer samples.
      need = np.asarray(_needed(coords.astype(jnp.float32), scale,
                                jnp.asarray(output_size[::-1], jnp.float32)))
      need = np.where(np.isfinite(need), need, 0)
      return (int(min(cap[0], max(need[1] + 1, 1))), int(min(cap[1], max(need[0] + 1, 1))))
  return cap


# ----------------------------------------------------------------------------- roi_align


def roi_align(x: Any, boxes: Boxes, output_size: int | Sequence[int], *,
              spatial_scale: float = 1.0, sampling_ratio: int = -1, aligned: bool = False,
              mode: Mode = "avg", max_samples: int | Sequence[int] | None = None,
              data_format: DataFormat = "channels_last",
              implementation: Implementation = None, mask: Any = None) -> jax.Array:
  """ROI align (Mask R-CNN): each box of a feature map pooled into ``output_size`` bins by
  bilinear sampling, with torchvision's semantics and gradients for the features and the boxes.

  Args:
    x: ``(N, H, W, C)`` (``channels_last``) or ``(N, C, H, W)`` (``channels_first``); float32,
      bfloat16 or float16, sampled and summed in float32 (so is float64, in this version).
    boxes: ``(K, 5)`` rows ``(image, x1, y1, x2, y2)`` or a list of ``N`` arrays ``(K_i, 4)``
      of ``(x1, y1, x2, y2)``, one per image, in input-image coordinates; or ``(N, K, 4)``:
      ``boxes[b, k]`` pools image ``b`` (per-image proposals, padded to ``K``; see ``mask``),
      the form that splits over a batch-sharded mesh with the features (docs/roi.md; on
      one GPU it runs the kernels as the ``(K, 5)`` form does).
    output_size: ``(ph, pw)`` bins (an int for a square grid).
    spatial_scale: map coordinates per box coordinate (1/16 for a stride-16 map).
    sampling_ratio: samples per bin along each axis; ``<= 0``: ``ceil(roi_size / output_size)``
      per box (torchvision's adaptive count), capped at ``max_samples``.
    aligned: subtract half a pixel from the box (torchvision's ``aligned=True``); without it, a
      region is at least 1 pixel in each direction.
    mode: ``"avg"`` (the mean of the samples, torchvision) or ``"max"`` (their maximum,
      DirectML's ``ReductionFunction``: the gradient goes to the first maximum; NaN wins).
    max_samples: with ``sampling_ratio <= 0``, the most samples per bin along each axis (an int
      or ``(y, x)``), the static size of the sample grid. Default: enough for every box inside
      the feature map, ``ceil((H + 1) / ph)`` by ``ceil((W + 1) / pw)`` (outside ``jit``,
      the smallest grid that holds the boxes' samples: the same output and feature gradient,
      bit for bit, the box gradient to rounding). A box needing more is sampled
      ``max_samples`` times per axis.
    data_format: ``"channels_last"`` or ``"channels_first"`` (torchvision's NCHW).
    implementation: ``None`` (on an NVIDIA GPU, ``mode="avg"`` runs the Pallas Triton
      kernels, the rest the XLA path), ``"pallas"`` (the kernels; a ValueError for what they
      do not serve) or ``"xla"``: docs/roi.md, "Where it runs". Per-image ``(N, K, 4)`` boxes
      run the XLA path whatever ``implementation`` says (the form that splits with the batch);
      so do sizes past the kernels' int32 indexing.
    mask: with ``(N, K, 4)`` boxes, an ``(N, K)`` bool array: False marks a padding row, whose
      output is zeros with zero gradients, whatever its coordinates (default: all True).

  Returns:
    ``(K, ph, pw, C)`` (``(K, C, ph, pw)`` channels first), in ``x``'s dtype; ``(N, K, ph, pw,
    C)`` (``(N, K, C, ph, pw)``) for ``(N, K, 4)`` boxes, the values and gradients of the
    ``(K, 5)`` form with the same boxes, bit for bit. A sample outside ``[-1, H] x [-1, W]``
    counts as 0; a bin without samples gives 0. Under ``jit``, a box
    whose image index is out of range gives zeros and a box with a NaN or infinite
    coordinate gives NaN, neither with a gradient (outside ``jit``, both raise).

  Differentiable in ``x`` and in the box coordinates (``jax.grad``, ``jax.jvp``, any order),
  with the gradient conventions of docs/roi.md; the feature gradient is deterministic (no
  atomics, no scatter), the same bits on every run.

  Raises:
    ValueError, TypeError: for a bad argument, naming it and the value received.

  Example:
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> roi_align(x, jnp.array([[0, 0., 0., 2., 2.]]), 1, sampling_ratio=2)[:, :, :, 0]
    Array([[[5.]]], dtype=float32)
  """
  check_name("data_format", data_format, DATA_FORMATS)
  x = unsplit(check_maps("x", x, data_format))
  boxes, mask = unsplit(boxes), unsplit(mask)
  output_size = output_size_pair(output_size)
  scale = positive_scale("spatial_scale", spatial_scale)
  ratio, cap = check_sampling(sampling_ratio, max_samples)
  aligned = check_bool("aligned", aligned)
  check_name("mode", mode, MODES)
  if mode == "max":
    check_elements("x", x.size)
  per_image = batched.per_image(boxes, mask)
  if per_image:
    parts = batched.split(boxes, mask, x.shape[0])
    image, coords = batched.flat(*parts)
  else:
    image, coords = split_boxes(boxes, x.shape[0])
  N, H, W, _ = x.shape
  levels = (Level(N, H, W, scale, 0),)
  level = jnp.zeros(image.shape, jnp.int32)
  samples = sample_grid(ratio, cap, coords, jnp.full(image.shape, scale, jnp.float32), levels,
                        output_size)
  cfg = AlignConfig(output_size, levels, ratio, samples, aligned, mode,
                    parts[1].shape[1] if per_image else 0)
  backend = dispatch.choose(Op.ROI_ALIGN, implementation, x, None, caller="roi_align",
                            config=cfg)
  y = backend.roi_align((x,), image, coords, level, cfg)
  if per_image:
    y = batched.unflat(y, parts[1])
  return jnp.moveaxis(y, -1, -3) if data_format == "channels_first" else y


# ----------------------------------------------------------------------------- roi_pool


def roi_pool(x: Any, boxes: Boxes, output_size: int | Sequence[int], *,
             spatial_scale: float = 1.0, data_format: DataFormat = "channels_last",
             return_indices: bool = False, implementation: Implementation = None
             ) -> jax.Array | tuple[jax.Array, jax.Array]:
  """ROI max pooling (Fast R-CNN) with torchvision's rounding: each box's corners rounded to
  map pixels, split into integer bins, the maximum of each.

  Args:
    x, boxes, output_size, spatial_scale, data_format, implementation: as :func:`roi_align`.
    return_indices: also return torchvision's argmax: the flat index ``h * W + w`` of each
      maximum in its image's plane, per channel (-1: none).

  Returns:
    ``y`` ``(K, ph, pw, C)`` (or channels first), or ``(y, indices)``. Unlike
    :func:`max_pool`: the maximum starts from float32's lowest value under ``>``, so NaN never
    wins and a bin of only NaN or -inf gives ``-3.4028235e38`` (``-inf`` in bfloat16 and
    float16) with index -1; an empty bin (a box outside the map) gives 0 and index -1. Under
    ``jit``, a box whose image index is out of range gives zeros (index -1), one with a NaN or
    infinite coordinate NaN (outside ``jit`` both raise).

  The gradient goes to each bin's maximum (sums where bins overlap, deterministic); the boxes'
  gradient is zero (their coordinates are rounded).

  Example:
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> roi_pool(x, jnp.array([[0, 0., 0., 3., 3.]]), 2)[0, :, :, 0]
    Array([[ 5.,  7.],
           [13., 15.]], dtype=float32)
  """
  check_name("data_format", data_format, DATA_FORMATS)
  x = unsplit(check_maps("x", x, data_format))
  boxes = unsplit(boxes)
  output_size = output_size_pair(output_size)
  scale = positive_scale("spatial_scale", spatial_scale)
  return_indices = check_bool("return_indices", return_indices)
  check_elements("x", x.size)
  image, coords = split_boxes(boxes, x.shape[0])
  N, H, W, _ = x.shape
  cfg = PoolConfig(output_size, Level(N, H, W, scale, 0))
  backend = dispatch.choose(Op.ROI_POOL, implementation, x, None, caller="roi_pool",
                            config=cfg)
  y, indices = backend.roi_pool(x, image, coords.astype(jnp.float32), cfg)
  if data_format == "channels_first":
    y, indices = jnp.moveaxis(y, -1, 1), jnp.moveaxis(indices, -1, 1)
  return (y, indices) if return_indices else y
