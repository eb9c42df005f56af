"""Flax linen pooling, backed by jaxpool: functions and ``nn.Module`` layers.

``max_pool``, ``min_pool`` and ``avg_pool`` take ``flax.linen.max_pool``/``avg_pool``'s (and
``flax.linen.pooling.min_pool``'s) arguments and return
the same values on every configuration Flax supports, but for a padding as large as the window,
a negative padding and bools as sizes, which are refused (tests/interop/test_interop.py and
tests/interop/test_layer_arguments.py), with jaxpool's gradient (deterministic, the first maximum on
ties) and extra keyword options, for float, integer and bool inputs alike (an integer
average is a float, as in Flax). The layers ``MaxPool``, ``MinPool``, ``AvgPool``, ``LPPool`` and
``L2Pool`` wrap them as modules without
parameters, so that they can sit in an ``nn.Sequential``.

Arguments, as Flax: ``window_shape`` a sequence of ints (its length is the number of spatial
dims; an int is refused, as in Flax); ``strides`` ``None`` (all ones; PyTorch's default is the
window) or one int per spatial dim; ``padding`` ``"VALID"``, ``"SAME"`` (any case) or one
``(lo, hi)`` pair per spatial dim, plus jaxpool's ``"SAME_LOWER"`` and an int (both sides of every
dim). NumPy ints are ints. Layout ``(*batch, *spatial, features)`` (Flax's, channels last), or
``data_format="channels_first"`` for ``(*batch, features, *spatial)``. docs/interop.md lists what
is accepted and refused, with the reasons.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> from jaxpool.interop import flax_linen as jpl
  >>> model = nn.Sequential([nn.Conv(8, (3, 3)), nn.relu, jpl.MaxPool((2, 2), strides=(2, 2))])
  >>> x = jnp.ones((4, 28, 28, 1))
  >>> model.apply(model.init(jax.random.key(0), x), x).shape
  (4, 14, 14, 8)
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from jaxpool._src import api
from jaxpool._src.checks import check_bool, check_divisor, check_norm
from jaxpool.interop._args import flax_config
from jaxpool.interop._layers import (AvgPoolBody, LPPoolBody, MaxPoolBody, MinPoolBody,
                                     checked_inputs)
from jaxpool.interop._roi import MultiScaleRoIAlignBody, RoIAlignBody, RoIPoolBody

__all__ = ["max_pool", "min_pool", "avg_pool", "lp_pool", "MaxPool", "MinPool", "AvgPool",
           "LPPool", "L2Pool", "RoIAlign", "RoIPool", "MultiScaleRoIAlign"]

Padding = str | int | Sequence[tuple[int, int]]


def max_pool(inputs: jax.typing.ArrayLike, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
             dilation: Sequence[int] | None = None, ceil_mode: bool = False,
             data_format: str = "channels_last", implementation: str | None = None) -> jax.Array:
  """``flax.linen.max_pool`` with jaxpool's gradient.

  Args:
    inputs: ``(*batch, *spatial, features)`` (``data_format="channels_last"``, Flax's layout)
      or ``(*batch, features, *spatial)`` (``"channels_first"``).
    window_shape: taps per spatial dim, a sequence of ints.
    strides: ``None`` (all ones, Flax's default) or one int per spatial dim.
    padding: ``"VALID"``, ``"SAME"``, ``"SAME_LOWER"``, an int or ``(lo, hi)`` pairs.
    dilation, ceil_mode, implementation: as :func:`jaxpool.max_pool` (not in Flax).
    data_format: ``"channels_last"`` (default) or ``"channels_first"`` (not in Flax).

  Returns:
    ``(*batch, *out_spatial, features)`` (or channels first).

  Raises:
    TypeError, ValueError: for a bad argument, naming it as written here.
  """
  cfg = flax_config(window_shape, strides, padding, dilation=dilation, ceil_mode=ceil_mode,
                    data_format=data_format, implementation=implementation)
  return api.max_pool(checked_inputs(inputs, cfg), **cfg)


def min_pool(inputs: jax.typing.ArrayLike, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
             dilation: Sequence[int] | None = None, ceil_mode: bool = False,
             data_format: str = "channels_last", implementation: str | None = None) -> jax.Array:
  """``flax.linen.pooling.min_pool`` (``nnx.min_pool``) with jaxpool's gradient.

  Args: as :func:`max_pool`.

  Returns:
    ``(*batch, *out_spatial, features)`` (or channels first): :func:`jaxpool.min_pool`.
  """
  cfg = flax_config(window_shape, strides, padding, dilation=dilation, ceil_mode=ceil_mode,
                    data_format=data_format, implementation=implementation)
  return api.min_pool(checked_inputs(inputs, cfg), **cfg)


def avg_pool(inputs: jax.typing.ArrayLike, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Padding = "VALID",
             count_include_pad: bool = True, *, dilation: Sequence[int] | None = None,
             ceil_mode: bool = False, divisor_override: int | None = None,
             data_format: str = "channels_last", implementation: str | None = None) -> jax.Array:
  """``flax.linen.avg_pool``: ``count_include_pad=True`` (Flax's and PyTorch's default) divides
  by the window size, ``False`` by the number of real elements.

  Args:
    inputs: ``(*batch, *spatial, features)`` (or channels first, as :func:`max_pool`).
    window_shape, strides, padding, data_format: as :func:`max_pool`.
    count_include_pad: whether padded taps count in the divisor.
    dilation, ceil_mode, divisor_override, implementation: as :func:`jaxpool.avg_pool`.

  Returns:
    ``(*batch, *out_spatial, features)`` (or channels first), in the input's dtype; for
    integer inputs in JAX's default float dtype, as Flax (bool too, where Flax raises).
  """
  cfg = flax_config(window_shape, strides, padding, dilation=dilation, ceil_mode=ceil_mode,
                    data_format=data_format, implementation=implementation)
  return api.avg_pool(checked_inputs(inputs, cfg), **cfg,
                          count_include_pad=check_bool("count_include_pad", count_include_pad),
                          divisor_override=check_divisor("divisor_override", divisor_override))


def lp_pool(inputs: jax.typing.ArrayLike, p: float, window_shape: Sequence[int],
            strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
            dilation: Sequence[int] | None = None, ceil_mode: bool = False,
            data_format: str = "channels_last", implementation: str | None = None) -> jax.Array:
  """Lp-norm pooling (not in Flax): ``(sum |x|^p)^(1/p)`` per window, as :func:`jaxpool.lp_pool`.

  Args:
    p: the norm's order, finite and ``>= 1``.
    Others: as :func:`max_pool`.

  Returns:
    ``(*batch, *out_spatial, features)`` (or channels first).
  """
  p = check_norm("p", p)
  cfg = flax_config(window_shape, strides, padding, dilation=dilation, ceil_mode=ceil_mode,
                    data_format=data_format, implementation=implementation)
  return api.lp_pool(checked_inputs(inputs, cfg), p, **cfg)


# The layers: Flax's attributes as fields, checked when a layer is constructed; the checks and
# the call are the body they share with the nnx layers (jaxpool/interop/_layers.py).


class MaxPool(MaxPoolBody, nn.Module):
  """Max pooling as a linen module (no parameters): :func:`max_pool` with its attributes.

  Attributes:
    window_shape, strides, padding, dilation, ceil_mode, implementation, data_format: as
      :func:`max_pool`; checked when the module is constructed.
  """

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Padding = "VALID"
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  implementation: str | None = None
  data_format: str = "channels_last"

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return self._apply_pool(inputs)


class MinPool(MinPoolBody, nn.Module):
  """Min pooling as a linen module (no parameters): :func:`min_pool` with its attributes.

  Attributes:
    window_shape, strides, padding, dilation, ceil_mode, implementation, data_format: as
      :func:`max_pool`; checked when the module is constructed.
  """

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Padding = "VALID"
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  implementation: str | None = None
  data_format: str = "channels_last"

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return self._apply_pool(inputs)


class AvgPool(AvgPoolBody, nn.Module):
  """Average pooling as a linen module (no parameters): :func:`avg_pool` with its attributes.

  Attributes:
    window_shape: taps per spatial dim.
    strides, padding, count_include_pad, data_format: as :func:`avg_pool` (Flax's defaults).
    dilation, ceil_mode, divisor_override, implementation: as :func:`jaxpool.avg_pool`.
  """

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Padding = "VALID"
  count_include_pad: bool = True
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  divisor_override: int | None = None
  implementation: str | None = None
  data_format: str = "channels_last"

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return self._apply_pool(inputs)


class LPPool(LPPoolBody, nn.Module):
  """Lp-norm pooling as a linen module (PyTorch's ``LPPool`` with Flax's layout).

  Attributes:
    p: the norm's order, finite and ``>= 1``.
    window_shape, strides, padding, dilation, ceil_mode, implementation, data_format: as
      :func:`max_pool`.
  """

  p: float
  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Padding = "VALID"
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  implementation: str | None = None
  data_format: str = "channels_last"

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return self._apply_pool(inputs)


class L2Pool(LPPoolBody, nn.Module):
  """L2-norm pooling (MPS's ``MPSCNNPoolingL2Norm``): :class:`LPPool` with ``p=2``.

  Attributes:
    window_shape, strides, padding, dilation, ceil_mode, implementation, data_format: as
      :func:`max_pool`.
  """

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Padding = "VALID"
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  implementation: str | None = None
  data_format: str = "channels_last"
  p = 2.0  # (not annotated, so not a field: the norm is fixed)

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return self._apply_pool(inputs)


# ROI pooling layers (torchvision's names and arguments; the body in jaxpool/interop/_roi.py).


class RoIAlign(RoIAlignBody, nn.Module):
  """:func:`jaxpool.roi_align` as a linen module (no parameters), called on
  ``(inputs, boxes)``.

  Attributes:
    output_size, spatial_scale, sampling_ratio, aligned, mode, max_samples, data_format,
      implementation: as :func:`jaxpool.roi_align`; checked when the module is constructed.
  """

  output_size: int | Sequence[int]
  spatial_scale: float = 1.0
  sampling_ratio: int = -1
  aligned: bool = False
  mode: str = "avg"
  max_samples: int | Sequence[int] | None = None
  data_format: str = "channels_last"
  implementation: str | None = None

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, inputs: jax.typing.ArrayLike, boxes) -> jax.Array:
    """``(N, H, W, C)`` and boxes (``(K, 5)`` or a list) -> ``(K, ph, pw, C)``."""
    return self._apply(inputs, boxes)


class RoIPool(RoIPoolBody, nn.Module):
  """:func:`jaxpool.roi_pool` as a linen module (no parameters), called on
  ``(inputs, boxes)``.

  Attributes:
    output_size, spatial_scale, data_format, implementation: as :func:`jaxpool.roi_pool`.
  """

  output_size: int | Sequence[int]
  spatial_scale: float = 1.0
  data_format: str = "channels_last"
  implementation: str | None = None

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, inputs: jax.typing.ArrayLike, boxes) -> jax.Array:
    return self._apply(inputs, boxes)


class MultiScaleRoIAlign(MultiScaleRoIAlignBody, nn.Module):
  """:func:`jaxpool.multi_scale_roi_align` as a linen module (no parameters), called on
  ``(features, boxes, image_shapes)``.

  Attributes:
    output_size, sampling_ratio, canonical_scale, canonical_level, eps, aligned, mode,
      max_samples, data_format, implementation: as :func:`jaxpool.multi_scale_roi_align`.
  """

  output_size: int | Sequence[int]
  sampling_ratio: int = 2
  canonical_scale: float = 224.0
  canonical_level: int = 4
  eps: float = 1e-6
  aligned: bool = False
  mode: str = "avg"
  max_samples: int | Sequence[int] | None = None
  data_format: str = "channels_last"
  implementation: str | None = None

  def __post_init__(self) -> None:
    self._check_attributes()
    super().__post_init__()

  def __call__(self, features, boxes, image_shapes) -> jax.Array:
    return self._apply(features, boxes, image_shapes)
