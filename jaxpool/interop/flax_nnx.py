"""Flax nnx pooling layers, backed by jaxpool.

``nnx.max_pool``/``nnx.avg_pool`` are Flax's functions (the same as linen's); this module
gives them as ``nnx.Module`` layers without parameters (``MaxPool``, ``AvgPool``, ``LPPool``,
``L2Pool``), with Flax's argument names, layout ``(*batch, *spatial, features)`` and defaults
(strides all ones, ``count_include_pad=True``), plus jaxpool's keyword options. The functions
are re-exported from :mod:`jaxpool.interop.flax_linen`.

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

from jaxpool.interop.flax_linen import avg_pool, lp_pool, max_pool

__all__ = ["max_pool", "avg_pool", "lp_pool", "MaxPool", "AvgPool", "LPPool", "L2Pool"]


def _static(v: Any) -> Any:
  """Lists to tuples, so that the module's config is hashable, static pytree metadata."""
  if isinstance(v, (list, tuple)):
    return tuple(_static(i) for i in v)
  return v


class MaxPool(nnx.Module):
  """Max pooling layer: :func:`jaxpool.interop.flax_linen.max_pool` with fixed arguments.

  Args:
    window_shape: taps per spatial dim.
    strides: per spatial dim; ``None`` means all ones (Flax's default).
    padding: ``"VALID"``, ``"SAME"``, ``(lo, hi)`` pairs (and jaxpool's other forms).
    dilation, ceil_mode, implementation: as :func:`jaxpool.max_pool`.
  """

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Any = "VALID", *, dilation: Sequence[int] | None = None,
               ceil_mode: bool = False, implementation: str | None = None):
    self.window_shape = _static(window_shape)
    self.strides = _static(strides)
    self.padding = _static(padding)
    self.dilation = _static(dilation)
    self.ceil_mode = ceil_mode
    self.implementation = implementation

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    """``(*batch, *spatial, features)`` -> ``(*batch, *out_spatial, features)``."""
    return max_pool(inputs, self.window_shape, self.strides, self.padding,
                    dilation=self.dilation, ceil_mode=self.ceil_mode,
                    implementation=self.implementation)


class AvgPool(nnx.Module):
  """Average pooling layer: :func:`jaxpool.interop.flax_linen.avg_pool` with fixed arguments.

  Args:
    window_shape, strides, padding: as :class:`MaxPool`.
    count_include_pad: divide by the window size (``True``, Flax's and PyTorch's default) or
      by the number of real elements.
    dilation, ceil_mode, divisor_override, implementation: as :func:`jaxpool.avg_pool`.
  """

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Any = "VALID", count_include_pad: bool = True, *,
               dilation: Sequence[int] | None = None, ceil_mode: bool = False,
               divisor_override: int | None = None, implementation: str | None = None):
    self.window_shape = _static(window_shape)
    self.strides = _static(strides)
    self.padding = _static(padding)
    self.count_include_pad = count_include_pad
    self.dilation = _static(dilation)
    self.ceil_mode = ceil_mode
    self.divisor_override = divisor_override
    self.implementation = implementation

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    """``(*batch, *spatial, features)`` -> ``(*batch, *out_spatial, features)``."""
    return avg_pool(inputs, self.window_shape, self.strides, self.padding,
                    self.count_include_pad, dilation=self.dilation, ceil_mode=self.ceil_mode,
                    divisor_override=self.divisor_override, implementation=self.implementation)


class LPPool(nnx.Module):
  """Lp-norm pooling layer (PyTorch's ``LPPool`` with Flax's layout).

  Args:
    p: the norm's order, finite and ``>= 1``.
    window_shape, strides, padding, dilation, ceil_mode, implementation: as :class:`MaxPool`.
  """

  def __init__(self, p: float, window_shape: Sequence[int],
               strides: Sequence[int] | None = None, padding: Any = "VALID", *,
               dilation: Sequence[int] | None = None, ceil_mode: bool = False,
               implementation: str | None = None):
    self.p = p
    self.window_shape = _static(window_shape)
    self.strides = _static(strides)
    self.padding = _static(padding)
    self.dilation = _static(dilation)
    self.ceil_mode = ceil_mode
    self.implementation = implementation

  def __call__(self, inputs: jax.typing.ArrayLike) -> jax.Array:
    """``(*batch, *spatial, features)`` -> ``(*batch, *out_spatial, features)``."""
    return lp_pool(inputs, self.p, self.window_shape, self.strides, self.padding,
                   dilation=self.dilation, ceil_mode=self.ceil_mode,
                   implementation=self.implementation)


class L2Pool(LPPool):
  """L2-norm pooling layer (MPS's ``MPSCNNPoolingL2Norm``): :class:`LPPool` with ``p=2``."""

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Any = "VALID", *, dilation: Sequence[int] | None = None,
               ceil_mode: bool = False, implementation: str | None = None):
    super().__init__(2, window_shape, strides, padding, dilation=dilation,
                     ceil_mode=ceil_mode, implementation=implementation)
