"""The body the ROI pooling layers share (Flax linen and nnx, Equinox): their attributes'
checks, done once at construction under the attributes' names, and the call.

The layers keep torchvision's names (``RoIAlign``, ``RoIPool``, ``MultiScaleRoIAlign``) and
arguments; the framework classes in ``flax_linen.py``, ``flax_nnx.py`` and ``equinox.py`` add the
fields or ``__init__``. Nothing here imports a framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxpool._src.checks import check_bool, check_name, is_int
from jaxpool._src.roi import api as roi_api
from jaxpool._src.roi import multi_scale
from jaxpool._src.roi.plan import MODES
from jaxpool._src.windows import DATA_FORMATS, IMPLEMENTATIONS


class RoIBody:
  """The attributes every ROI layer has (a mixin; no fields)."""

  if TYPE_CHECKING:
    output_size: Any
    data_format: Any
    implementation: Any

  def _check_attributes(self) -> None:
    roi_api.output_size_pair(self.output_size)
    check_name("data_format", self.data_format, DATA_FORMATS)
    check_name("implementation", self.implementation, IMPLEMENTATIONS)


class RoIAlignBody(RoIBody):
  """:func:`jaxpool.roi_align` with the layer's attributes."""

  if TYPE_CHECKING:
    spatial_scale: Any
    sampling_ratio: Any
    aligned: Any
    mode: Any
    max_samples: Any

  def _check_attributes(self) -> None:
    super()._check_attributes()
    roi_api.positive_scale("spatial_scale", self.spatial_scale)
    roi_api.check_sampling(self.sampling_ratio, self.max_samples)
    check_bool("aligned", self.aligned)
    check_name("mode", self.mode, MODES)

  def _apply(self, inputs: Any, boxes: Any) -> jax.Array:
    return roi_api.roi_align(
        inputs, boxes, self.output_size, spatial_scale=self.spatial_scale,
        sampling_ratio=self.sampling_ratio, aligned=self.aligned, mode=self.mode,
        max_samples=self.max_samples, data_format=self.data_format,
        implementation=self.implementation)


class RoIPoolBody(RoIBody):
  """:func:`jaxpool.roi_pool` with the layer's attributes."""

  if TYPE_CHECKING:
    spatial_scale: Any

  def _check_attributes(self) -> None:
    super()._check_attributes()
    roi_api.positive_scale("spatial_scale", self.spatial_scale)

  def _apply(self, inputs: Any, boxes: Any) -> jax.Array:
    y = roi_api.roi_pool(inputs, boxes, self.output_size, spatial_scale=self.spatial_scale,
                         data_format=self.data_format, implementation=self.implementation)
    assert not isinstance(y, tuple)  # (no return_indices)
    return y


class MultiScaleRoIAlignBody(RoIBody):
  """:func:`jaxpool.multi_scale_roi_align` with the layer's attributes."""

  if TYPE_CHECKING:
    sampling_ratio: Any
    canonical_scale: Any
    canonical_level: Any
    eps: Any
    aligned: Any
    mode: Any
    max_samples: Any

  def _check_attributes(self) -> None:
    super()._check_attributes()
    roi_api.check_sampling(self.sampling_ratio, self.max_samples)
    roi_api.positive_scale("canonical_scale", self.canonical_scale)
    if not is_int(self.canonical_level):
      raise TypeError(f"canonical_level must be an int; got {self.canonical_level!r}.")
    roi_api.finite_number("eps", self.eps)
    check_bool("aligned", self.aligned)
    check_name("mode", self.mode, MODES)

  def _apply(self, features: Any, boxes: Any, image_shapes: Any) -> jax.Array:
    return multi_scale.multi_scale_roi_align(
        features, boxes, image_shapes, self.output_size, sampling_ratio=self.sampling_ratio,
        canonical_scale=self.canonical_scale, canonical_level=self.canonical_level,
        eps=self.eps, aligned=self.aligned, mode=self.mode, max_samples=self.max_samples,
        data_format=self.data_format, implementation=self.implementation)


def init_layer(layer: RoIBody, **attributes: Any) -> None:
  """The framework layers' ``__init__``: set the attributes (a list or tuple as a tuple, so the
  static fields hash) and check them under their names."""
  for name, value in attributes.items():
    setattr(layer, name, tuple(value) if isinstance(value, (list, tuple)) else value)
  layer._check_attributes()


def one_image(inputs: Any, boxes: Any) -> tuple[Any, Any]:
  """Equinox's per-example form: ``(C, H, W)`` with ``(K, 4)`` boxes becomes a batch of one
  (``(1, C, H, W)`` and ``[boxes]``); other forms pass as they are."""
  if jnp.ndim(inputs) == 3:
    return jnp.asarray(inputs)[None], [boxes]
  return inputs, boxes
