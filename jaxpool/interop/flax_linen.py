"""Flax linen pooling, backed by jaxpool: functions and ``nn.Module`` layers.

``max_pool`` and ``avg_pool`` take ``flax.linen.max_pool``/``avg_pool``'s arguments and return
the same values on every configuration Flax supports (tested in tests/test_interop.py), with
jaxpool's gradient (deterministic, the first maximum on ties) and extra keyword options. The
layers ``MaxPool``, ``AvgPool``, ``LPPool`` and ``L2Pool`` wrap them as modules without
parameters, so that they can sit in an ``nn.Sequential``.

Layout, as Flax: ``(*batch, *spatial, features)``, channels last; strides default to 1 (PyTorch's
default is the window); padding ``"VALID"``, ``"SAME"`` or ``(lo, hi)`` pairs (plus jaxpool's
``"SAME_LOWER"`` and ints).

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
from typing import Any

import flax.linen as nn
import jax

import jaxpool

__all__ = ["max_pool", "avg_pool", "lp_pool", "MaxPool", "AvgPool", "LPPool", "L2Pool"]


def _tuple(v: Sequence[int] | None) -> tuple[int, ...] | None:
  return None if v is None else tuple(v)


def _padding(padding: Any) -> Any:
  if isinstance(padding, (str, int)):
    return padding
  return tuple(tuple(p) for p in padding)


def max_pool(inputs: jax.typing.ArrayLike, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Any = "VALID", *,
             dilation: Sequence[int] | None = None, ceil_mode: bool = False,
             implementation: str | None = None) -> jax.Array:
  """``flax.linen.max_pool`` with jaxpool's gradient.

  Args:
    inputs: ``(*batch, *spatial, features)``.
    window_shape: taps per spatial dim.
    strides: per spatial dim; ``None`` means all ones (Flax's default).
    padding: ``"VALID"``, ``"SAME"`` or ``(lo, hi)`` pairs (and jaxpool's other forms).
    dilation, ceil_mode, implementation: as :func:`jaxpool.max_pool` (not in Flax).

  Returns:
    ``(*batch, *out_spatial, features)``.
  """
  return jaxpool.max_pool(inputs, tuple(window_shape), _tuple(strides), _padding(padding),
                          dilation=_tuple(dilation), ceil_mode=ceil_mode,
                          implementation=implementation)  # type: ignore[arg-type]


def avg_pool(inputs: jax.typing.ArrayLike, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Any = "VALID",
             count_include_pad: bool = True, *, dilation: Sequence[int] | None = None,
             ceil_mode: bool = False, divisor_override: int | None = None,
             implementation: str | None = None) -> jax.Array:
  """``flax.linen.avg_pool``: ``count_include_pad=True`` (Flax's and PyTorch's default) divides
  by the window size, ``False`` by the number of real elements.

  Args:
    inputs: ``(*batch, *spatial, features)``.
    window_shape, strides, padding: as :func:`max_pool`.
    count_include_pad: whether padded taps count in the divisor.
    dilation, ceil_mode, divisor_override, implementation: as :func:`jaxpool.avg_pool`.

  Returns:
    ``(*batch, *out_spatial, features)``.
  """
  return jaxpool.avg_pool(inputs, tuple(window_shape), _tuple(strides), _padding(padding),
                          dilation=_tuple(dilation), ceil_mode=ceil_mode,
                          count_include_pad=count_include_pad,
                          divisor_override=divisor_override,
                          implementation=implementation)  # type: ignore[arg-type]


def lp_pool(inputs: jax.typing.ArrayLike, p: float, window_shape: Sequence[int],
            strides: Sequence[int] | None = None, padding: Any = "VALID", *,
            dilation: Sequence[int] | None = None, ceil_mode: bool = False,
            implementation: str | None = None) -> jax.Array:
  """Lp-norm pooling (not in Flax): ``(sum |x|^p)^(1/p)`` per window, as :func:`jaxpool.lp_pool`.

  Returns:
    ``(*batch, *out_spatial, features)``.
  """
  return jaxpool.lp_pool(inputs, p, tuple(window_shape), _tuple(strides), _padding(padding),
                         dilation=_tuple(dilation), ceil_mode=ceil_mode,
                         implementation=implementation)  # type: ignore[arg-type]


class MaxPool(nn.Module):
  """Max pooling as a linen module (no parameters): :func:`max_pool` with its attributes.

  Attributes:
    window_shape, strides, padding, dilation, ceil_mode, implementation: as :func:`max_pool`.
  """

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  implementation: str | None = None

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return max_pool(inputs, self.window_shape, self.strides, self.padding,
                    dilation=self.dilation, ceil_mode=self.ceil_mode,
                    implementation=self.implementation)


class AvgPool(nn.Module):
  """Average pooling as a linen module (no parameters): :func:`avg_pool` with its attributes.

  Attributes:
    window_shape: taps per spatial dim.
    strides, padding, count_include_pad: as :func:`avg_pool` (Flax's defaults).
    dilation, ceil_mode, divisor_override, implementation: as :func:`jaxpool.avg_pool`.
  """

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"
  count_include_pad: bool = True
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  divisor_override: int | None = None
  implementation: str | None = None

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return avg_pool(inputs, self.window_shape, self.strides, self.padding,
                    self.count_include_pad, dilation=self.dilation, ceil_mode=self.ceil_mode,
                    divisor_override=self.divisor_override, implementation=self.implementation)


class LPPool(nn.Module):
  """Lp-norm pooling as a linen module (PyTorch's ``LPPool`` with Flax's layout).

  Attributes:
    p: the norm's order, finite and ``>= 1``.
    window_shape, strides, padding, dilation, ceil_mode, implementation: as :func:`max_pool`.
  """

  p: float
  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  implementation: str | None = None

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return lp_pool(inputs, self.p, self.window_shape, self.strides, self.padding,
                   dilation=self.dilation, ceil_mode=self.ceil_mode,
                   implementation=self.implementation)


class L2Pool(nn.Module):
  """L2-norm pooling (MPS's ``MPSCNNPoolingL2Norm``): :class:`LPPool` with ``p=2``.

  Attributes:
    window_shape, strides, padding, dilation, ceil_mode, implementation: as :func:`max_pool`.
  """

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"
  dilation: Sequence[int] | None = None
  ceil_mode: bool = False
  implementation: str | None = None

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    return lp_pool(inputs, 2, self.window_shape, self.strides, self.padding,
                   dilation=self.dilation, ceil_mode=self.ceil_mode,
                   implementation=self.implementation)
