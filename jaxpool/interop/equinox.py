"""Equinox pooling layers, backed by jaxpool.

``MaxPool1d/2d/3d``, ``AvgPool1d/2d/3d`` and ``LPPool1d/2d/3d`` take ``equinox.nn``'s arguments
(``kernel_size``, ``stride=1``, ``padding=0``, ``use_ceil=False``) and its layout: channels first,
``(channels, *spatial)`` for one example (``jax.vmap`` over a batch, as everywhere in Equinox);
a leading batch dim works too. They add jaxpool's options as keywords (``dilation``,
``count_include_pad``, ``divisor_override``, ``implementation``) and its gradient
(deterministic, the first maximum on ties).

Where Equinox and PyTorch differ, and what these layers do (docs/api.md has the table):

* ``stride`` defaults to 1 (PyTorch's default is ``kernel_size``), as Equinox.
* ``use_ceil=True`` is jaxpool's ``ceil_mode``, PyTorch's rule: the last window must start
  inside the input or the left padding. Equinox instead pads ``stride`` more elements at the end
  whenever the size does not divide, then refuses the call if that padding exceeds the kernel
  (e.g. 5 elements, kernel 2, stride 2, padding 1), where PyTorch and jaxpool give 3 windows.
* ``AvgPool``: ``count_include_pad=True`` (the default) divides by ``prod(kernel_size)``
  everywhere, as Equinox does, the ceil-mode overhang included (PyTorch would leave the overhang
  out; pass ``divisor_override`` or ``count_include_pad=False`` for other divisors). Without
  ``use_ceil`` that is PyTorch's divisor too.
* Integer inputs average to a float (JAX's default float dtype), bool inputs too (the fraction of
  True; Equinox's ``AvgPool`` raises a TypeError for bool); ``MaxPool`` keeps the dtype.
* ``padding`` must be below the (dilated) window on each side; Equinox allows it up to the
  kernel size.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxpool.interop import equinox as jpe
  >>> pool = jpe.MaxPool2d(kernel_size=2, stride=2)
  >>> pool(jnp.ones((3, 28, 28))).shape
  (3, 14, 14)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from jaxpool._src import api
from jaxpool._src.checks import check_bool, check_divisor, check_name, check_norm
from jaxpool._src.windows import IMPLEMENTATIONS, check_rank, effective_window
from jaxpool.interop._args import eqx_padding, eqx_per_dim
from jaxpool.interop._roi import (MultiScaleRoIAlignBody, RoIAlignBody, RoIPoolBody, init_layer,
                                  one_image)

__all__ = ["MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "LPPool1d", "LPPool2d", "LPPool3d", "RoIAlign", "RoIPool", "MultiScaleRoIAlign"]

IntOrSeq = int | Sequence[int]
PaddingArg = int | Sequence[int] | Sequence[tuple[int, int]]


class _Pool(eqx.Module):
  """Shared configuration: static fields, so the layer is a pytree with no leaves.

  Every argument is checked here, under Equinox's names, and kept as tuples of Python ints.
  """

  num_spatial_dims: int = eqx.field(static=True)
  kernel_size: tuple[int, ...] = eqx.field(static=True)
  stride: tuple[int, ...] = eqx.field(static=True)
  padding: tuple[tuple[int, int], ...] = eqx.field(static=True)
  use_ceil: bool = eqx.field(static=True)
  dilation: tuple[int, ...] = eqx.field(static=True)
  implementation: str | None = eqx.field(static=True)

  def __init__(self, num_spatial_dims: int, kernel_size: IntOrSeq, stride: IntOrSeq = 1,
               padding: PaddingArg = 0, use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    n = num_spatial_dims
    self.num_spatial_dims = n
    self.kernel_size = eqx_per_dim("kernel_size", kernel_size, n)
    self.stride = eqx_per_dim("stride", stride, n)
    self.padding = eqx_padding(padding, n)
    self.use_ceil = check_bool("use_ceil", use_ceil)
    self.dilation = eqx_per_dim("dilation", dilation, n)
    self.implementation = check_name("implementation", implementation, IMPLEMENTATIONS)
    for i, ((lo, hi), k, d) in enumerate(zip(self.padding, self.kernel_size, self.dilation,
                                             strict=True)):
      e = effective_window(k, d)
      if lo >= e or hi >= e:
        kernel = f"kernel_size {k}" if d == 1 else f"dilation*(kernel_size-1)+1 = {e}"
        raise ValueError(
            f"padding must be smaller than the window ({kernel}) on each side, so that every "
            f"window holds a real element; got {(lo, hi)} in spatial dim {i} "
            f"(padding={padding!r}). Equinox allows padding equal to the kernel size.")

  def _check(self, x: Any) -> Any:
    """Explicit input checks, so that no error names an argument the user never wrote."""
    shape = np.shape(x)
    n = self.num_spatial_dims
    check_rank("x", shape, n, "channels_first")
    for i, (L, (lo, hi), k, d) in enumerate(zip(shape[-n:], self.padding, self.kernel_size,
                                                 self.dilation, strict=True)):
      if L + lo + hi < effective_window(k, d):
        raise ValueError(
            f"kernel_size {self.kernel_size} (dilation {self.dilation}) is larger than the "
            f"padded input in spatial dim {i}: size {L} plus padding {(lo, hi)}; x has shape "
            f"{tuple(shape)}.")
    return x

  def _kwargs(self) -> dict[str, Any]:
    return dict(window_shape=self.kernel_size, strides=self.stride, padding=self.padding,
                dilation=self.dilation, ceil_mode=self.use_ceil, data_format="channels_first",
                implementation=self.implementation)


class _MaxPool(_Pool):
  """The body of :class:`MaxPool1d`, :class:`MaxPool2d` and :class:`MaxPool3d`."""

  def __init__(self, num_spatial_dims: int, kernel_size: IntOrSeq, stride: IntOrSeq = 1,
               padding: PaddingArg = 0, use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    super().__init__(num_spatial_dims, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)

  def _pool(self, x: jax.Array) -> jax.Array:
    return api.max_pool(self._check(x), **self._kwargs())


class _AvgPool(_Pool):
  """The body of :class:`AvgPool1d`, :class:`AvgPool2d` and :class:`AvgPool3d`."""

  count_include_pad: bool = eqx.field(static=True)
  divisor_override: int | None = eqx.field(static=True)

  def __init__(self, num_spatial_dims: int, kernel_size: IntOrSeq, stride: IntOrSeq = 1,
               padding: PaddingArg = 0, use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               count_include_pad: bool = True, divisor_override: int | None = None,
               implementation: str | None = None):
    super().__init__(num_spatial_dims, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)
    self.count_include_pad = check_bool("count_include_pad", count_include_pad)
    self.divisor_override = check_divisor("divisor_override", divisor_override)

  def _pool(self, x: jax.Array) -> jax.Array:
    divisor = self.divisor_override
    if divisor is None and self.count_include_pad:
      divisor = math.prod(self.kernel_size)  # Equinox's divisor, the ceil overhang included
    return api.avg_pool(self._check(x), count_include_pad=self.count_include_pad,
                        divisor_override=divisor, **self._kwargs())


class _LPPool(_Pool):
  """The body of :class:`LPPool1d`, :class:`LPPool2d` and :class:`LPPool3d`."""

  norm_type: float = eqx.field(static=True)

  def __init__(self, num_spatial_dims: int, norm_type: float, kernel_size: IntOrSeq,
               stride: IntOrSeq = 1, padding: PaddingArg = 0, use_ceil: bool = False, *,
               dilation: IntOrSeq = 1, implementation: str | None = None):
    p = check_norm("norm_type", norm_type)
    super().__init__(num_spatial_dims, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)
    self.norm_type = p

  def _pool(self, x: jax.Array) -> jax.Array:
    return api.lp_pool(self._check(x), self.norm_type, **self._kwargs())


# The layers, written out as Equinox writes its own (equinox/nn/_pool.py): each with its
# signature (num_spatial_dims fixed) and a __call__ under its own named scope, so that docs,
# IDEs and profiles see them.


class MaxPool1d(_MaxPool):
  """1-D max pooling, as ``equinox.nn.MaxPool1d`` (channels first).

  Args:
    kernel_size: an int or 1 ints.
    stride: an int or 1 ints; default 1 (as Equinox; PyTorch's default is the kernel).
    padding: an int, 1 ints, or 1 ``(lo, hi)`` pairs.
    use_ceil: round the output size up (PyTorch's ``ceil_mode`` rule).
    dilation: an int or 1 ints (keyword; not in Equinox).
    implementation: ``None``, ``"xla"`` or ``"pallas"`` (keyword).
  """

  def __init__(self, kernel_size: IntOrSeq, stride: IntOrSeq = 1, padding: PaddingArg = 0,
               use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    super().__init__(1, kernel_size, stride, padding, use_ceil, dilation=dilation,
                     implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.MaxPool1d"):
      return self._pool(x)


class MaxPool2d(_MaxPool):
  """2-D max pooling, as ``equinox.nn.MaxPool2d`` (channels first).

  Args:
    kernel_size: an int or 2 ints.
    stride: an int or 2 ints; default 1 (as Equinox; PyTorch's default is the kernel).
    padding: an int, 2 ints, or 2 ``(lo, hi)`` pairs.
    use_ceil: round the output size up (PyTorch's ``ceil_mode`` rule).
    dilation: an int or 2 ints (keyword; not in Equinox).
    implementation: ``None``, ``"xla"`` or ``"pallas"`` (keyword).
  """

  def __init__(self, kernel_size: IntOrSeq, stride: IntOrSeq = 1, padding: PaddingArg = 0,
               use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    super().__init__(2, kernel_size, stride, padding, use_ceil, dilation=dilation,
                     implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.MaxPool2d"):
      return self._pool(x)


class MaxPool3d(_MaxPool):
  """3-D max pooling, as ``equinox.nn.MaxPool3d`` (channels first).

  Args:
    kernel_size: an int or 3 ints.
    stride: an int or 3 ints; default 1 (as Equinox; PyTorch's default is the kernel).
    padding: an int, 3 ints, or 3 ``(lo, hi)`` pairs.
    use_ceil: round the output size up (PyTorch's ``ceil_mode`` rule).
    dilation: an int or 3 ints (keyword; not in Equinox).
    implementation: ``None``, ``"xla"`` or ``"pallas"`` (keyword).
  """

  def __init__(self, kernel_size: IntOrSeq, stride: IntOrSeq = 1, padding: PaddingArg = 0,
               use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    super().__init__(3, kernel_size, stride, padding, use_ceil, dilation=dilation,
                     implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.MaxPool3d"):
      return self._pool(x)


class AvgPool1d(_AvgPool):
  """1-D average pooling, as ``equinox.nn.AvgPool1d`` (channels first).

  Args:
    kernel_size, stride, padding, use_ceil: as :class:`MaxPool1d`.
    dilation, implementation: as :class:`MaxPool1d` (keywords).
    count_include_pad: divide by ``prod(kernel_size)`` (default, as Equinox, the ceil-mode
      overhang included) or by the real elements (keyword).
    divisor_override: a positive int replacing the divisor (keyword).
  """

  def __init__(self, kernel_size: IntOrSeq, stride: IntOrSeq = 1, padding: PaddingArg = 0,
               use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               count_include_pad: bool = True, divisor_override: int | None = None,
               implementation: str | None = None):
    super().__init__(1, kernel_size, stride, padding, use_ceil, dilation=dilation,
                     count_include_pad=count_include_pad, divisor_override=divisor_override,
                     implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.AvgPool1d"):
      return self._pool(x)


class AvgPool2d(_AvgPool):
  """2-D average pooling, as ``equinox.nn.AvgPool2d`` (channels first).

  Args:
    kernel_size, stride, padding, use_ceil: as :class:`MaxPool2d`.
    dilation, implementation: as :class:`MaxPool2d` (keywords).
    count_include_pad: divide by ``prod(kernel_size)`` (default, as Equinox, the ceil-mode
      overhang included) or by the real elements (keyword).
    divisor_override: a positive int replacing the divisor (keyword).
  """

  def __init__(self, kernel_size: IntOrSeq, stride: IntOrSeq = 1, padding: PaddingArg = 0,
               use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               count_include_pad: bool = True, divisor_override: int | None = None,
               implementation: str | None = None):
    super().__init__(2, kernel_size, stride, padding, use_ceil, dilation=dilation,
                     count_include_pad=count_include_pad, divisor_override=divisor_override,
                     implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.AvgPool2d"):
      return self._pool(x)


class AvgPool3d(_AvgPool):
  """3-D average pooling, as ``equinox.nn.AvgPool3d`` (channels first).

  Args:
    kernel_size, stride, padding, use_ceil: as :class:`MaxPool3d`.
    dilation, implementation: as :class:`MaxPool3d` (keywords).
    count_include_pad: divide by ``prod(kernel_size)`` (default, as Equinox, the ceil-mode
      overhang included) or by the real elements (keyword).
    divisor_override: a positive int replacing the divisor (keyword).
  """

  def __init__(self, kernel_size: IntOrSeq, stride: IntOrSeq = 1, padding: PaddingArg = 0,
               use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               count_include_pad: bool = True, divisor_override: int | None = None,
               implementation: str | None = None):
    super().__init__(3, kernel_size, stride, padding, use_ceil, dilation=dilation,
                     count_include_pad=count_include_pad, divisor_override=divisor_override,
                     implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.AvgPool3d"):
      return self._pool(x)


class LPPool1d(_LPPool):
  """1-D Lp-norm pooling (PyTorch's ``LPPool1d``, Equinox's layout).

  Args:
    norm_type: ``p``, finite and ``>= 1`` (PyTorch's name).
    kernel_size, stride, padding, use_ceil: as :class:`MaxPool1d`.
    dilation, implementation: as :class:`MaxPool1d` (keywords).
  """

  def __init__(self, norm_type: float, kernel_size: IntOrSeq, stride: IntOrSeq = 1,
               padding: PaddingArg = 0, use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    super().__init__(1, norm_type, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.LPPool1d"):
      return self._pool(x)


class LPPool2d(_LPPool):
  """2-D Lp-norm pooling (PyTorch's ``LPPool2d``, Equinox's layout).

  Args:
    norm_type: ``p``, finite and ``>= 1`` (PyTorch's name).
    kernel_size, stride, padding, use_ceil: as :class:`MaxPool2d`.
    dilation, implementation: as :class:`MaxPool2d` (keywords).
  """

  def __init__(self, norm_type: float, kernel_size: IntOrSeq, stride: IntOrSeq = 1,
               padding: PaddingArg = 0, use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    super().__init__(2, norm_type, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.LPPool2d"):
      return self._pool(x)


class LPPool3d(_LPPool):
  """3-D Lp-norm pooling (PyTorch's ``LPPool3d``, Equinox's layout).

  Args:
    norm_type: ``p``, finite and ``>= 1`` (PyTorch's name).
    kernel_size, stride, padding, use_ceil: as :class:`MaxPool3d`.
    dilation, implementation: as :class:`MaxPool3d` (keywords).
  """

  def __init__(self, norm_type: float, kernel_size: IntOrSeq, stride: IntOrSeq = 1,
               padding: PaddingArg = 0, use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               implementation: str | None = None):
    super().__init__(3, norm_type, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.LPPool3d"):
      return self._pool(x)


# ROI pooling (torchvision's names and arguments, channels first; jaxpool/interop/_roi.py).


class RoIAlign(RoIAlignBody, eqx.Module):
  """:func:`jaxpool.roi_align`, channels first, called on ``(x, boxes)``: one example
  ``(C, H, W)`` with ``(K, 4)`` boxes (``jax.vmap`` over a batch, as Equinox does), or a batch
  ``(N, C, H, W)`` with ``(K, 5)`` rows or a list of ``(K_i, 4)``.

  Args: as :func:`jaxpool.roi_align` (keywords after ``output_size``; ``data_format`` defaults
  to ``"channels_first"``), checked here.
  """

  output_size: Any = eqx.field(static=True)
  spatial_scale: float = eqx.field(static=True)
  sampling_ratio: int = eqx.field(static=True)
  aligned: bool = eqx.field(static=True)
  mode: str = eqx.field(static=True)
  max_samples: Any = eqx.field(static=True)
  data_format: str = eqx.field(static=True)
  implementation: str | None = eqx.field(static=True)

  def __init__(self, output_size: IntOrSeq, *, spatial_scale: float = 1.0,
               sampling_ratio: int = -1, aligned: bool = False, mode: str = "avg",
               max_samples: IntOrSeq | None = None, data_format: str = "channels_first",
               implementation: str | None = None):
    init_layer(self, output_size=output_size, spatial_scale=spatial_scale,
               sampling_ratio=sampling_ratio, aligned=aligned, mode=mode, max_samples=max_samples,
               data_format=data_format, implementation=implementation)

  def __call__(self, x: jax.Array, boxes: Any, *, key: Any = None) -> jax.Array:
    """``(K, C, ph, pw)`` (``(K, ph, pw, C)`` channels last); ``key`` is ignored."""
    with jax.named_scope("jaxpool.equinox.RoIAlign"):
      return self._apply(*one_image(x, boxes))


class RoIPool(RoIPoolBody, eqx.Module):
  """:func:`jaxpool.roi_pool`, channels first, called on ``(x, boxes)`` as :class:`RoIAlign`.

  Args: as :func:`jaxpool.roi_pool` (keywords after ``output_size``).
  """

  output_size: Any = eqx.field(static=True)
  spatial_scale: float = eqx.field(static=True)
  data_format: str = eqx.field(static=True)
  implementation: str | None = eqx.field(static=True)

  def __init__(self, output_size: IntOrSeq, *, spatial_scale: float = 1.0,
               data_format: str = "channels_first", implementation: str | None = None):
    init_layer(self, output_size=output_size, spatial_scale=spatial_scale,
               data_format=data_format, implementation=implementation)

  def __call__(self, x: jax.Array, boxes: Any, *, key: Any = None) -> jax.Array:
    with jax.named_scope("jaxpool.equinox.RoIPool"):
      return self._apply(*one_image(x, boxes))


class MultiScaleRoIAlign(MultiScaleRoIAlignBody, eqx.Module):
  """:func:`jaxpool.multi_scale_roi_align`, channels first, called on
  ``(features, boxes, image_shapes)`` (a batch: the levels ``(N, C, H_l, W_l)``).

  Args: as :func:`jaxpool.multi_scale_roi_align` (keywords after ``output_size``).
  """

  output_size: Any = eqx.field(static=True)
  sampling_ratio: int = eqx.field(static=True)
  canonical_scale: float = eqx.field(static=True)
  canonical_level: int = eqx.field(static=True)
  eps: float = eqx.field(static=True)
  aligned: bool = eqx.field(static=True)
  mode: str = eqx.field(static=True)
  max_samples: Any = eqx.field(static=True)
  data_format: str = eqx.field(static=True)
  implementation: str | None = eqx.field(static=True)

  def __init__(self, output_size: IntOrSeq, *, sampling_ratio: int = 2,
               canonical_scale: float = 224.0, canonical_level: int = 4, eps: float = 1e-6,
               aligned: bool = False, mode: str = "avg", max_samples: IntOrSeq | None = None,
               data_format: str = "channels_first", implementation: str | None = None):
    init_layer(self, output_size=output_size, sampling_ratio=sampling_ratio,
               canonical_scale=canonical_scale, canonical_level=canonical_level, eps=eps,
               aligned=aligned, mode=mode, max_samples=max_samples, data_format=data_format,
               implementation=implementation)

  def __call__(self, features: Any, boxes: Any, image_shapes: Any, *,
               key: Any = None) -> jax.Array:
    with jax.named_scope("jaxpool.equinox.MultiScaleRoIAlign"):
      return self._apply(features, boxes, image_shapes)
