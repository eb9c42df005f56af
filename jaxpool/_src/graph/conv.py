"""Layers with weights: :class:`Conv` (MPS's ``MPSCNNConvolutionNode``) and :class:`Dense` (its
fully connected node); transposed convolution belongs here too."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src import windows
from jaxpool._src.graph.base import (Node, Ref, Spec, batch_shape, check_bool, check_float_dtype,
                                     check_image, check_padding, check_window, input_field,
                                     resolve_padding)

ACCUMULATOR_PRECISIONS = ("float", "half")


def _check_layer_config(node: Any) -> None:
  """``features``, ``use_bias``, ``accumulator_precision``, the initializers and ``param_dtype``
  of a :class:`Conv` or :class:`Dense`; canonicalises them in place."""
  if not windows.is_int(node.features):
    raise node._fail(f"features must be a positive int; got {node.features!r}"
                     + (" (a bool is not an int)." if isinstance(node.features, (bool, np.bool_))
                        else "."), TypeError)
  if node.features < 1:
    raise node._fail(f"features must be a positive int; got {node.features!r}.")
  node._set("features", int(node.features))
  node._set("use_bias", check_bool(node, "use_bias", node.use_bias))
  if not isinstance(node.accumulator_precision, str):
    raise node._fail(f"accumulator_precision must be one of {ACCUMULATOR_PRECISIONS}; got "
                     f"{node.accumulator_precision!r}.", TypeError)
  if node.accumulator_precision not in ACCUMULATOR_PRECISIONS:
    raise node._fail(f"accumulator_precision must be one of {ACCUMULATOR_PRECISIONS}; got "
                     f"{node.accumulator_precision!r}.")
  for name in ("weights_init", "bias_init"):
    if not callable(getattr(node, name)):
      raise node._fail(f"{name} must be an initializer, a function (key, shape, dtype) -> array "
                       f"such as jax.nn.initializers.zeros; got {getattr(node, name)!r}.",
                       TypeError)
  node._set("param_dtype", check_float_dtype(node, "param_dtype", node.param_dtype))


def _conv_precision(acc: str, dtype) -> dict[str, Any]:
  if acc == "float":
    return dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.promote_types(
        dtype, jnp.float32))
  return dict(precision=lax.Precision.DEFAULT, preferred_element_type=None)


# One shared default, so that two nodes built with the same config compare (and hash) equal.
HE_NORMAL = jax.nn.initializers.he_normal()


@dataclass(frozen=True)
class Conv(Node):
  """A convolution (MPS's ``MPSCNNConvolutionNode``), channels-last, with bias.

  Parameters ``{"w": (*window, C_in, features), "b": (features,)}`` come from the initializers
  (the "data source"): ``weights_init(key, shape, dtype)``, ``bias_init(key, shape, dtype)``.

  Attributes:
    source: the input node, ``(*spatial, C_in)`` per example.
    features: output channels.
    window: kernel size per spatial dim (its length is the number of spatial dims).
    strides: per spatial dim; default ones.
    padding: ``"VALID"``, ``"SAME"``, ``"FULL"`` or ``(lo, hi)`` pairs (see ``docs/graph.md``).
    dilation: per spatial dim; default ones.
    use_bias: add ``b``.
    accumulator_precision: ``"float"`` (MPS's ``.float``): ``lax.Precision.HIGHEST`` and a
      float32 (at least) ``preferred_element_type``, the result cast back to the input dtype;
      ``"half"`` (MPS's ``.half``): ``lax.Precision.DEFAULT``, the backend's fastest (TF32/bf16
      passes on GPUs and TPUs).
    weights_init, bias_init: initializers, as ``jax.nn.initializers``.
    param_dtype: dtype of the parameters.
  """

  source: Ref = input_field()
  _: KW_ONLY
  features: int = 1
  window: tuple[int, ...] = (3, 3)
  strides: tuple[int, ...] | None = None
  padding: Any = "SAME"
  dilation: tuple[int, ...] | None = None
  use_bias: bool = True
  accumulator_precision: str = "float"
  weights_init: Callable[..., jax.Array] = HE_NORMAL
  bias_init: Callable[..., jax.Array] = jax.nn.initializers.zeros
  param_dtype: Any = jnp.float32
  has_params: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "weights, bias"
  gradient_kind: ClassVar[str] = "ConvolutionGradient"

  def _normalize(self):
    self._set("window", check_window(self, self.window))
    n = len(self.window)
    # only None means the default (ones): a 0 is an error
    self._set("strides", self._check(windows.int_tuple, "strides", self.strides, n, default=1))
    self._set("dilation", self._check(windows.int_tuple, "dilation", self.dilation, n, default=1))
    self._set("padding", check_padding(self, self.padding, n))
    _check_layer_config(self)

  @property
  def nspatial(self) -> int:
    return len(self.window)

  def check_inputs(self, in_specs):
    (x,) = in_specs
    check_image(self, x, self.window)
    pads = self._pads(x.shape)
    for i, (L, p, k, d) in enumerate(zip(x.shape, pads, self.window, self.dilation)):
      self._check(windows.check_window_fits, i, L, p, d * (k - 1) + 1, self.window,
                  self.dilation, name="window")

  def _pads(self, shape):
    return resolve_padding(self.padding, shape[:-1], self.window, self.strides, self.dilation)

  def param_specs(self, in_specs):
    c_in = in_specs[0].shape[-1]
    specs = {"w": Spec((*self.window, c_in, self.features), self.param_dtype)}
    if self.use_bias:
      specs["b"] = Spec((self.features,), self.param_dtype)
    return specs

  def init_params(self, key, in_specs):
    kw, kb = jax.random.split(key)
    specs = self.param_specs(in_specs)
    params = {"w": self.weights_init(kw, specs["w"].shape, specs["w"].dtype)}
    if self.use_bias:
      params["b"] = self.bias_init(kb, specs["b"].shape, specs["b"].dtype)
    return params

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    n = self.nspatial
    batch = batch_shape(x, spec)
    xb = x.reshape((-1, *spec.shape))
    dn = lax.ConvDimensionNumbers(lhs_spec=(0, n + 1, *range(1, n + 1)),
                                  rhs_spec=(n + 1, n, *range(n)),
                                  out_spec=(0, n + 1, *range(1, n + 1)))
    y = lax.conv_general_dilated(
        xb, params["w"].astype(x.dtype), window_strides=self.strides,
        padding=self._pads(spec.shape), rhs_dilation=self.dilation, dimension_numbers=dn,
        **_conv_precision(self.accumulator_precision, x.dtype))
    if self.use_bias:
      y = y + params["b"].astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    y = y.astype(x.dtype)
    return y.reshape((*batch, *y.shape[1:]))

  def describe(self):
    pad = self.padding if isinstance(self.padding, str) else f"pad {self.padding}"
    return (f"Conv {'x'.join(map(str, self.window))}/{'x'.join(map(str, self.strides))} "
            f"{pad} -> {self.features}")


@dataclass(frozen=True)
class Dense(Node):
  """A fully connected layer that flattens the per-example dims of what it gets.

  Parameters ``{"w": (prod(in_shape), features), "b": (features,)}``.

  Attributes:
    source: the input node, any per-example shape.
    features, use_bias, accumulator_precision, weights_init, bias_init, param_dtype: as
      :class:`Conv`.
  """

  source: Ref = input_field()
  _: KW_ONLY
  features: int = 1
  use_bias: bool = True
  accumulator_precision: str = "float"
  weights_init: Callable[..., jax.Array] = HE_NORMAL
  bias_init: Callable[..., jax.Array] = jax.nn.initializers.zeros
  param_dtype: Any = jnp.float32
  has_params: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "weights, bias"

  def _normalize(self):
    _check_layer_config(self)

  def param_specs(self, in_specs):
    specs = {"w": Spec((math.prod(in_specs[0].shape), self.features), self.param_dtype)}
    if self.use_bias:
      specs["b"] = Spec((self.features,), self.param_dtype)
    return specs

  init_params = Conv.init_params

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    batch = batch_shape(x, spec)
    xf = x.reshape((*batch, math.prod(spec.shape)))
    y = jnp.matmul(xf, params["w"].astype(x.dtype),
                   **_conv_precision(self.accumulator_precision, x.dtype))
    if self.use_bias:
      y = y + params["b"].astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    return y.astype(x.dtype)

  def describe(self):
    return f"Dense -> {self.features}"
