"""Flax nnx pooling layers, backed by jaxpool.

``nnx.max_pool``/``nnx.min_pool``/``nnx.avg_pool`` are Flax's functions (the same as linen's);
this module gives them as ``nnx.Module`` layers without parameters (``MaxPool``, ``MinPool``,
``AvgPool``, ``LPPool``, ``L2Pool``), with Flax's argument names, layout
``(*batch, *spatial, features)`` and defaults (strides all ones, ``count_include_pad=True``),
plus jaxpool's keyword options (``data_format`` among them). The arguments are checked when a
layer is constructed, with the rules of :mod:`jaxpool.interop.flax_linen`, and kept as tuples
of ints (static, hashable config). The functions are re-exported from
:mod:`jaxpool.interop.flax_linen`.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxpool.interop import flax_nnx as jpn
  >>> model = nnx.Sequential(nnx.Conv(1, 8, (3, 3), rngs=nnx.Rngs(0)), nnx.relu,
  ...                        jpn.MaxPool((2, 2), strides=(2, 2)))
  >>> model(jnp.ones((4, 28, 28, 1))).shape
  (4, 14, 14, 8)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxpool._src.checks import check_bool, check_divisor, check_norm
from jaxpool.interop._args import flax_config
from jaxpool.interop._layers import AvgPoolBody, LPPoolBody, MaxPoolBody, MinPoolBody
from jaxpool.interop._roi import MultiScaleRoIAlignBody, RoIAlignBody, RoIPoolBody, init_layer
from jaxpool.interop.flax_linen import Padding, avg_pool, lp_pool, max_pool, min_pool

__all__ = ["max_pool", "min_pool", "avg_pool", "lp_pool", "MaxPool", "MinPool", "AvgPool",
           "LPPool", "L2Pool", "RoIAlign", "RoIPool", "MultiScaleRoIAlign"]


class _Pool(nnx.Module):
  """The checked configuration, kept as static attributes (tuples, strings, bools)."""

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None,
               padding: Padding, dilation: Sequence[int] | None, ceil_mode: bool,
               data_format: str, implementation: str | None):
    cfg = flax_config(window_shape, strides, padding, dilation=dilation, ceil_mode=ceil_mode,
                      data_format=data_format, implementation=implementation)
    self.window_shape: tuple[int, ...] = cfg["window_shape"]
    self.strides: tuple[int, ...] | None = cfg["strides"]
    self.padding: Any = cfg["padding"]
    self.dilation: tuple[int, ...] | None = cfg["dilation"]
    self.ceil_mode: bool = cfg["ceil_mode"]
    self.data_format: str = cfg["data_format"]
    self.implementation: str | None = cfg["implementation"]



# Each layer checks its arguments in __init__ and keeps the checked form; the call is the body
# it shares with the linen layers (jaxpool/interop/_layers.py).


class MaxPool(MaxPoolBody, _Pool):
  """Max pooling layer: :func:`jaxpool.interop.flax_linen.max_pool` with fixed arguments.

  Args:
    window_shape: taps per spatial dim, a sequence of ints.
    strides: ``None`` (all ones, Flax's default) or one int per spatial dim.
    padding: ``"VALID"``, ``"SAME"``, ``"SAME_LOWER"``, an int or ``(lo, hi)`` pairs.
    dilation, ceil_mode, implementation: as :func:`jaxpool.max_pool`.
    data_format: ``"channels_last"`` (default, Flax's layout) or ``"channels_first"``.
  """

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Padding = "VALID", *, dilation: Sequence[int] | None = None,
               ceil_mode: bool = False, data_format: str = "channels_last",
               implementation: str | None = None):
    super().__init__(window_shape, strides, padding, dilation, ceil_mode, data_format,
                     implementation)

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    """``(*batch, *spatial, features)`` -> ``(*batch, *out_spatial, features)``."""
    return self._apply_pool(inputs)


class MinPool(MinPoolBody, _Pool):
  """Min pooling layer: :func:`jaxpool.interop.flax_linen.min_pool` with fixed arguments.

  Args: as :class:`MaxPool`.
  """

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Padding = "VALID", *, dilation: Sequence[int] | None = None,
               ceil_mode: bool = False, data_format: str = "channels_last",
               implementation: str | None = None):
    super().__init__(window_shape, strides, padding, dilation, ceil_mode, data_format,
                     implementation)

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    """``(*batch, *spatial, features)`` -> ``(*batch, *out_spatial, features)``."""
    return self._apply_pool(inputs)


class AvgPool(AvgPoolBody, _Pool):
  """Average pooling layer: :func:`jaxpool.interop.flax_linen.avg_pool` with fixed arguments.

  Args:
    window_shape, strides, padding, data_format: as :class:`MaxPool`.
    count_include_pad: divide by the window size (``True``, Flax's and PyTorch's default) or
      by the number of real elements.
    dilation, ceil_mode, divisor_override, implementation: as :func:`jaxpool.avg_pool`.
  """

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Padding = "VALID", count_include_pad: bool = True, *,
               dilation: Sequence[int] | None = None, ceil_mode: bool = False,
               divisor_override: int | None = None, data_format: str = "channels_last",
               implementation: str | None = None):
    super().__init__(window_shape, strides, padding, dilation, ceil_mode, data_format,
                     implementation)
    self.count_include_pad = check_bool("count_include_pad", count_include_pad)
    self.divisor_override = check_divisor("divisor_override", divisor_override)

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    """``(*batch, *spatial, features)`` -> ``(*batch, *out_spatial, features)``."""
    return self._apply_pool(inputs)


class LPPool(LPPoolBody, _Pool):
  """Lp-norm pooling layer (PyTorch's ``LPPool`` with Flax's layout).

  Args:
    p: the norm's order, finite and ``>= 1``.
    window_shape, strides, padding, dilation, ceil_mode, data_format, implementation: as
      :class:`MaxPool`.
  """

  def __init__(self, p: float, window_shape: Sequence[int],
               strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
               dilation: Sequence[int] | None = None, ceil_mode: bool = False,
               data_format: str = "channels_last", implementation: str | None = None):
    self.p = check_norm("p", p)
    super().__init__(window_shape, strides, padding, dilation, ceil_mode, data_format,
                     implementation)

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    """``(*batch, *spatial, features)`` -> ``(*batch, *out_spatial, features)``."""
    return self._apply_pool(inputs)


class L2Pool(LPPool):
  """L2-norm pooling layer (MPS's ``MPSCNNPoolingL2Norm``): :class:`LPPool` with ``p=2``."""

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Padding = "VALID", *, dilation: Sequence[int] | None = None,
               ceil_mode: bool = False, data_format: str = "channels_last",
               implementation: str | None = None):
    super().__init__(2, window_shape, strides, padding, dilation=dilation,
                     ceil_mode=ceil_mode, data_format=data_format,
                     implementation=implementation)


# ROI pooling layers (torchvision's names and arguments; the body in jaxpool/interop/_roi.py).


class RoIAlign(RoIAlignBody, nnx.Module):
  """:func:`jaxpool.roi_align` as an nnx layer (no parameters), called on ``(inputs, boxes)``.

  Args: as :func:`jaxpool.roi_align` (keywords after ``output_size``), checked here.
  """

  def __init__(self, output_size: int | Sequence[int], *, spatial_scale: float = 1.0,
               sampling_ratio: int = -1, aligned: bool = False, mode: str = "avg",
               max_samples: int | Sequence[int] | None = None,
               data_format: str = "channels_last", implementation: str | None = None):
    init_layer(self, output_size=output_size, spatial_scale=spatial_scale,
               sampling_ratio=sampling_ratio, aligned=aligned, mode=mode, max_samples=max_samples,
               data_format=data_format, implementation=implementation)

  def __call__(self, inputs: jax.typing.ArrayLike, boxes) -> jax.Array:
    return self._apply(inputs, boxes)


class RoIPool(RoIPoolBody, nnx.Module):
  """:func:`jaxpool.roi_pool` as an nnx layer (no parameters), called on ``(inputs, boxes)``.

  Args: as :func:`jaxpool.roi_pool` (keywords after ``output_size``), checked here.
  """

  def __init__(self, output_size: int | Sequence[int], *, spatial_scale: float = 1.0,
               data_format: str = "channels_last", implementation: str | None = None):
    init_layer(self, output_size=output_size, spatial_scale=spatial_scale,
               data_format=data_format, implementation=implementation)

  def __call__(self, inputs: jax.typing.ArrayLike, boxes) -> jax.Array:
    return self._apply(inputs, boxes)


class MultiScaleRoIAlign(MultiScaleRoIAlignBody, nnx.Module):
  """:func:`jaxpool.multi_scale_roi_align` as an nnx layer (no parameters), called on
  ``(features, boxes, image_shapes)``.

  Args: as :func:`jaxpool.multi_scale_roi_align` (keywords after ``output_size``).
  """

  def __init__(self, output_size: int | Sequence[int], *, sampling_ratio: int = 2,
               canonical_scale: float = 224.0, canonical_level: int = 4, eps: float = 1e-6,
               aligned: bool = False, mode: str = "avg",
               max_samples: int | Sequence[int] | None = None,
               data_format: str = "channels_last", implementation: str | None = None):
    init_layer(self, output_size=output_size, sampling_ratio=sampling_ratio,
               canonical_scale=canonical_scale, canonical_level=canonical_level, eps=eps,
               aligned=aligned, mode=mode, max_samples=max_samples, data_format=data_format,
               implementation=implementation)

  def __call__(self, features, boxes, image_shapes) -> jax.Array:
    return self._apply(features, boxes, image_shapes)
