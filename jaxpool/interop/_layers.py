"""The body that the Flax linen and nnx pooling layers share, one class per kind of layer.

A linen layer keeps its attributes as written (dataclass fields) and checks them in
``__post_init__``; an nnx layer checks them in ``__init__`` and keeps the checked form. Both
are then the same layer: the checks (:meth:`FlaxPool._check_attributes`) and the call
(:meth:`FlaxPool._apply_pool`) are written once here, over the attributes ``window_shape``,
``strides``, ``padding``, ``dilation``, ``ceil_mode``, ``data_format`` and ``implementation``
(plus ``count_include_pad`` and ``divisor_override`` for the average, ``p`` for the Lp norm).
The functions of :mod:`jaxpool.interop.flax_linen` run the same steps (:func:`flax_config`,
:func:`checked_inputs`, the public function). Nothing here imports Flax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxpool._src import api
from jaxpool._src.checks import check_bool, check_divisor, check_norm
from jaxpool._src.windows import check_rank
from jaxpool.interop._args import flax_config


def checked_inputs(inputs: Any, cfg: dict[str, Any]) -> Any:
  """``inputs``, once checked to have the spatial dims that ``cfg`` (from
  :func:`flax_config`) names, under Flax's argument name."""
  check_rank("inputs", np.shape(inputs), len(cfg["window_shape"]), cfg["data_format"])
  return inputs


class FlaxPool:
  """What every Flax-style pooling layer does with its attributes (a mixin; no fields)."""

  if TYPE_CHECKING:  # set by the framework's class: dataclass fields (linen) or __init__ (nnx)
    window_shape: Any
    strides: Any
    padding: Any
    dilation: Any
    ceil_mode: Any
    data_format: Any
    implementation: Any

  def _pool_config(self) -> dict[str, Any]:
    """The checked window arguments, as the core's keyword arguments."""
    return flax_config(self.window_shape, self.strides, self.padding, dilation=self.dilation,
                       ceil_mode=self.ceil_mode, data_format=self.data_format,
                       implementation=self.implementation)

  def _check_attributes(self) -> dict[str, Any]:
    """Checks every attribute (at construction), naming it; returns :meth:`_pool_config`."""
    return self._pool_config()

  def _apply_pool(self, inputs: Any) -> jax.Array:
    raise NotImplementedError(type(self).__name__)


class MaxPoolBody(FlaxPool):
  """:func:`jaxpool.interop.flax_linen.max_pool` with the layer's attributes."""

  def _apply_pool(self, inputs: Any) -> jax.Array:
    cfg = self._pool_config()
    return api.max_pool(checked_inputs(inputs, cfg), **cfg)


class MinPoolBody(FlaxPool):
  """:func:`jaxpool.interop.flax_linen.min_pool` with the layer's attributes."""

  def _apply_pool(self, inputs: Any) -> jax.Array:
    cfg = self._pool_config()
    return api.min_pool(checked_inputs(inputs, cfg), **cfg)


class AvgPoolBody(FlaxPool):
  """:func:`jaxpool.interop.flax_linen.avg_pool` with the layer's attributes."""

  if TYPE_CHECKING:
    count_include_pad: Any
    divisor_override: Any

  def _check_attributes(self) -> dict[str, Any]:
    cfg = super()._check_attributes()
    check_bool("count_include_pad", self.count_include_pad)
    check_divisor("divisor_override", self.divisor_override)
    return cfg

  def _apply_pool(self, inputs: Any) -> jax.Array:
    cfg = self._pool_config()
    return api.avg_pool(checked_inputs(inputs, cfg), **cfg,
                        count_include_pad=check_bool("count_include_pad", self.count_include_pad),
                        divisor_override=check_divisor("divisor_override", self.divisor_override))


class LPPoolBody(FlaxPool):
  """:func:`jaxpool.interop.flax_linen.lp_pool` with the layer's attributes (``p`` among
  them)."""

  if TYPE_CHECKING:
    p: Any

  def _check_attributes(self) -> dict[str, Any]:
    check_norm("p", self.p)  # first, as the functions check it first
    return super()._check_attributes()

  def _apply_pool(self, inputs: Any) -> jax.Array:
    p = check_norm("p", self.p)
    cfg = self._pool_config()
    return api.lp_pool(checked_inputs(inputs, cfg), p, **cfg)
