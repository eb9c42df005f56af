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
* ``AvgPool``: ``count_include_pad=True`` (the default, as PyTorch) divides by the taps inside
  the padded input; the ceil-mode overhang never counts. Equinox divides by ``prod(kernel_size)``
  everywhere, the overhang included, so its edge windows in ceil mode are smaller.
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

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

import jaxpool

__all__ = ["MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "LPPool1d", "LPPool2d", "LPPool3d"]

IntOrSeq = int | Sequence[int]
PaddingArg = int | Sequence[int] | Sequence[tuple[int, int]]


def _per_dim(name: str, v: Any, n: int) -> tuple[int, ...]:
  if isinstance(v, int) and not isinstance(v, bool):
    return (v,) * n
  try:
    t = tuple(v)
  except TypeError:
    raise TypeError(f"{name} must be an int or a sequence of {n} ints; got {v!r}.") from None
  if len(t) != n:
    raise ValueError(f"{name} must be an int or a sequence of {n} ints; got {v!r}.")
  return t


def _pairs(v: Any, n: int) -> tuple[tuple[int, int], ...]:
  """Equinox's padding forms: an int, one int per dim, or one ``(lo, hi)`` pair per dim."""
  if isinstance(v, int) and not isinstance(v, bool):
    return ((v, v),) * n
  try:
    t = tuple(v)
  except TypeError:
    raise TypeError(f"padding must be an int, {n} ints or {n} (lo, hi) pairs; got {v!r}.") from None
  if len(t) != n:
    raise ValueError(f"padding must be an int, {n} ints or {n} (lo, hi) pairs; got {v!r}.")
  if all(isinstance(p, int) for p in t):
    return tuple((p, p) for p in t)
  return tuple(tuple(p) for p in t)


class _Pool(eqx.Module):
  """Shared configuration: static fields, so the layer is a pytree with no leaves."""

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
    self.kernel_size = _per_dim("kernel_size", kernel_size, n)
    self.stride = _per_dim("stride", stride, n)
    self.padding = _pairs(padding, n)
    self.use_ceil = use_ceil
    self.dilation = _per_dim("dilation", dilation, n)
    self.implementation = implementation

  def _kwargs(self) -> dict[str, Any]:
    return dict(window_shape=self.kernel_size, strides=self.stride, padding=self.padding,
                dilation=self.dilation, ceil_mode=self.use_ceil, data_format="channels_first",
                implementation=self.implementation)


class _MaxPool(_Pool):

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    return jaxpool.max_pool(x, **self._kwargs())


class _AvgPool(_Pool):
  count_include_pad: bool = eqx.field(static=True)
  divisor_override: int | None = eqx.field(static=True)

  def __init__(self, num_spatial_dims: int, kernel_size: IntOrSeq, stride: IntOrSeq = 1,
               padding: PaddingArg = 0, use_ceil: bool = False, *, dilation: IntOrSeq = 1,
               count_include_pad: bool = True, divisor_override: int | None = None,
               implementation: str | None = None):
    super().__init__(num_spatial_dims, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)
    self.count_include_pad = count_include_pad
    self.divisor_override = divisor_override

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    return jaxpool.avg_pool(x, count_include_pad=self.count_include_pad,
                            divisor_override=self.divisor_override, **self._kwargs())


class _LPPool(_Pool):
  norm_type: float = eqx.field(static=True)

  def __init__(self, num_spatial_dims: int, norm_type: float, kernel_size: IntOrSeq,
               stride: IntOrSeq = 1, padding: PaddingArg = 0, use_ceil: bool = False, *,
               dilation: IntOrSeq = 1, implementation: str | None = None):
    super().__init__(num_spatial_dims, kernel_size, stride, padding, use_ceil,
                     dilation=dilation, implementation=implementation)
    self.norm_type = norm_type

  def __call__(self, x: jax.Array, *, key: Any = None) -> jax.Array:
    """``(channels, *spatial)`` -> ``(channels, *out_spatial)``; ``key`` is ignored."""
    return jaxpool.lp_pool(x, self.norm_type, **self._kwargs())


def _fixed(base: type, n: int, name: str, doc: str) -> type:
  """A subclass of ``base`` with ``num_spatial_dims`` fixed to ``n`` (Equinox's signature)."""

  def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
    base.__init__(self, n, *args, **kwargs)  # type: ignore[misc]

  return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


_MAX_DOC = """{n}-D max pooling, as ``equinox.nn.MaxPool{n}d`` (channels first).

  Args:
    kernel_size: an int or {n} ints.
    stride: an int or {n} ints; default 1 (as Equinox; PyTorch's default is the kernel).
    padding: an int, {n} ints, or {n} ``(lo, hi)`` pairs.
    use_ceil: round the output size up (PyTorch's ``ceil_mode`` rule).
    dilation: an int or {n} ints (keyword; not in Equinox).
    implementation: ``None``, ``"xla"`` or ``"pallas"`` (keyword).
  """
_AVG_DOC = """{n}-D average pooling, as ``equinox.nn.AvgPool{n}d`` (channels first).

  Args:
    kernel_size, stride, padding, use_ceil: as ``MaxPool{n}d``.
    dilation, implementation: as ``MaxPool{n}d`` (keywords).
    count_include_pad: divide by the taps inside the padded input (default, as PyTorch) or
      by the real elements (keyword). The ceil-mode overhang never counts (Equinox counts it).
    divisor_override: a positive int replacing the divisor (keyword).
  """
_LP_DOC = """{n}-D Lp-norm pooling (PyTorch's ``LPPool{n}d``, Equinox's layout).

  Args:
    norm_type: ``p``, finite and ``>= 1`` (PyTorch's name).
    kernel_size, stride, padding, use_ceil: as ``MaxPool{n}d``.
    dilation, implementation: as ``MaxPool{n}d`` (keywords).
  """

MaxPool1d = _fixed(_MaxPool, 1, "MaxPool1d", _MAX_DOC.format(n=1))
MaxPool2d = _fixed(_MaxPool, 2, "MaxPool2d", _MAX_DOC.format(n=2))
MaxPool3d = _fixed(_MaxPool, 3, "MaxPool3d", _MAX_DOC.format(n=3))
AvgPool1d = _fixed(_AvgPool, 1, "AvgPool1d", _AVG_DOC.format(n=1))
AvgPool2d = _fixed(_AvgPool, 2, "AvgPool2d", _AVG_DOC.format(n=2))
AvgPool3d = _fixed(_AvgPool, 3, "AvgPool3d", _AVG_DOC.format(n=3))
LPPool1d = _fixed(_LPPool, 1, "LPPool1d", _LP_DOC.format(n=1))
LPPool2d = _fixed(_LPPool, 2, "LPPool2d", _LP_DOC.format(n=2))
LPPool3d = _fixed(_LPPool, 3, "LPPool3d", _LP_DOC.format(n=3))
