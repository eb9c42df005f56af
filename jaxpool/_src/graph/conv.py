"""Layers with weights: :class:`Conv` (MPS's ``MPSCNNConvolutionNode``, grouped too),
:class:`ConvTranspose` (``MPSCNNConvolutionTransposeNode``) and :class:`Dense` (its fully
connected node)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src import checks, windows
from jaxpool._src.graph.base import GradientNode, Node, Ref, Spec, input_field
from jaxpool._src.graph.common import (Initializer, batch_shape, check_bool, check_choice,
                                       check_data_format, check_float_dtype, check_image,
                                       check_padding, check_window, flatten_example,
                                       resolve_padding, spatial_shape)
from jaxpool._src.windows import effective_window

ACCUMULATOR_PRECISIONS = ("float", "half")


def _check_layer_config(node: Any) -> None:
  """``features``, ``use_bias``, ``accumulator_precision``, the initializers and ``param_dtype``
  of a :class:`Conv` or :class:`Dense`; canonicalises them in place."""
  if not checks.is_int(node.features):
    raise node._fail(f"features must be a positive int; got {node.features!r}"
                     + (" (a bool is not an int)." if isinstance(node.features, (bool, np.bool_))
                        else "."), TypeError)
  if node.features < 1:
    raise node._fail(f"features must be a positive int; got {node.features!r}.")
  node._set("features", int(node.features))
  node._set("use_bias", check_bool(node, "use_bias", node.use_bias))
  check_choice(node, "accumulator_precision", node.accumulator_precision,
               ACCUMULATOR_PRECISIONS)
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


# One shared default, so that two nodes built with the same config compare (and hash) equal; an
# Initializer (not the closure he_normal() returns), so that graphs pickle.
HE_NORMAL = Initializer("he_normal")


@dataclass(frozen=True)
class ConvolutionGradient(GradientNode):
  """A convolution's gradient (MPS's ``MPSCNNConvolutionGradientNode``): the input cotangent
  and the weight and bias cotangents (``jax.vjp`` of the convolution, with the weights its
  gradient state kept)."""


@dataclass(frozen=True)
class _Convolution(Node):
  """What :class:`Conv` and :class:`ConvTranspose` share: config, checks, parameters, layout."""

  source: Ref = input_field()
  _: KW_ONLY
  features: int = 1
  window: tuple[int, ...] = (3, 3)
  strides: tuple[int, ...] | None = None
  padding: Any = "SAME"
  dilation: tuple[int, ...] | None = None
  groups: int = 1
  use_bias: bool = True
  accumulator_precision: str = "float"
  weights_init: Callable[..., jax.Array] = HE_NORMAL
  bias_init: Callable[..., jax.Array] = jax.nn.initializers.zeros
  param_dtype: Any = jnp.float32
  data_format: str = "channels_last"
  has_params: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "weights, bias"
  gradient_class: ClassVar[type[GradientNode]] = ConvolutionGradient

  def _normalize(self):
    self._set("window", check_window(self, self.window))
    n = len(self.window)
    # only None means the default (ones): a 0 is an error
    self._set("strides", self._check(checks.int_tuple, "strides", self.strides, n, default=1))
    self._set("dilation", self._check(checks.int_tuple, "dilation", self.dilation, n, default=1))
    self._set("padding", check_padding(self, self.padding, n))
    _check_layer_config(self)
    if not checks.is_int(self.groups) or self.groups < 1:
      raise self._fail(f"groups must be a positive int; got {self.groups!r}.",
                       TypeError if not checks.is_int(self.groups) else ValueError)
    self._set("groups", int(self.groups))
    if self.features % self.groups:
      raise self._fail(f"features ({self.features}) must be divisible by groups "
                       f"({self.groups}).")
    self._set("data_format", check_data_format(self, self.data_format))

  @property
  def nspatial(self) -> int:
    return len(self.window)

  def _spatial(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    return spatial_shape(shape, self.data_format)

  def _channels(self, shape: tuple[int, ...]) -> int:
    return shape[-1] if self.data_format == "channels_last" else shape[0]

  def check_inputs(self, in_specs):
    (x,) = in_specs
    check_image(self, x, self.window, self.data_format)
    c_in = self._channels(x.shape)
    if c_in % self.groups:
      raise self._fail(f"input {self.inputs[0]!r} has {c_in} channels, not divisible by groups "
                       f"({self.groups}); shape {x.shape} ({self.data_format}).")

  def param_specs(self, in_specs):
    c_in = self._channels(in_specs[0].shape)
    specs = {"w": Spec((*self.window, c_in // self.groups, self.features), self.param_dtype)}
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

  def _conv(self, params, x, spec, w, **kw) -> jax.Array:
    """``lax.conv_general_dilated`` of ``x`` (batch dims folded into one) with ``w``
    (``(*window, C_in // groups, features)``) in this node's layout, plus the bias."""
    n = self.nspatial
    batch = batch_shape(x, spec)
    xb = x.reshape((-1, *spec.shape))
    image = (0, n + 1, *range(1, n + 1)) if self.data_format == "channels_last" else tuple(
        range(n + 2))
    dn = lax.ConvDimensionNumbers(lhs_spec=image, rhs_spec=(n + 1, n, *range(n)),
                                  out_spec=image)
    y = lax.conv_general_dilated(
        xb, w.astype(x.dtype), rhs_dilation=self.dilation, dimension_numbers=dn,
        feature_group_count=self.groups,
        **kw, **_conv_precision(self.accumulator_precision, x.dtype))
    if self.use_bias:
      shape = [1] * y.ndim
      shape[1 if self.data_format == "channels_first" else -1] = -1
      y = y + params["b"].astype(y.dtype).reshape(shape)
    y = y.astype(x.dtype)
    return y.reshape((*batch, *y.shape[1:]))

  def _describe(self, op: str) -> str:
    pad = self.padding if isinstance(self.padding, str) else f"pad {self.padding}"
    groups = f" groups {self.groups}" if self.groups > 1 else ""
    layout = " channels_first" if self.data_format == "channels_first" else ""
    return (f"{op} {'x'.join(map(str, self.window))}/{'x'.join(map(str, self.strides or ()))} "
            f"{pad}{groups}{layout} -> {self.features}")


@dataclass(frozen=True)
class Conv(_Convolution):
  """A convolution (MPS's ``MPSCNNConvolutionNode``), grouped or not, with bias.

  ``x: (*batch, *spatial, C_in)`` (``(*batch, C_in, *spatial)`` with
  ``data_format="channels_first"``) ``-> (*batch, *out_spatial, features)`` (or
  ``(*batch, features, *out_spatial)``), ``out = (L + lo + hi - e) // s + 1`` per spatial dim
  (``e = d * (k - 1) + 1``, ``(lo, hi)`` from the padding policy).

  Parameters ``{"w": (*window, C_in // groups, features), "b": (features,)}`` (the same layout
  for both data formats, so parameters are interchangeable) come from the initializers (the
  "data source"): ``weights_init(key, shape, dtype)``, ``bias_init(key, shape, dtype)``.

  Attributes:
    source: the input node, ``(*spatial, C_in)`` per example (``(C_in, *spatial)``
      channels-first).
    features: output channels.
    window: kernel size per spatial dim (its length is the number of spatial dims).
    strides: per spatial dim; default ones.
    padding: ``"VALID"``, ``"SAME"``, ``"FULL"`` or ``(lo, hi)`` pairs (see ``docs/graph.md``).
    dilation: per spatial dim; default ones.
    groups: ``feature_group_count``: the channels are split into ``groups`` groups, output group
      ``j`` sees only input group ``j``; ``C_in`` and ``features`` must be divisible by it
      (``groups == C_in == features`` is a depthwise convolution).
    use_bias: add ``b``.
    accumulator_precision: ``"float"`` (MPS's ``.float``): ``lax.Precision.HIGHEST`` and a
      float32 (at least) ``preferred_element_type``, the result cast back to the input dtype;
      ``"half"`` (MPS's ``.half``): ``lax.Precision.DEFAULT``, the backend's fastest (TF32/bf16
      passes on GPUs and TPUs).
    weights_init, bias_init: initializers, as ``jax.nn.initializers`` (the default
      ``he_normal`` is an :class:`~jaxpool._src.graph.common.Initializer`, which pickles).
    param_dtype: dtype of the parameters.
    data_format: ``"channels_last"`` (default) or ``"channels_first"``.
  """

  def check_inputs(self, in_specs):
    super().check_inputs(in_specs)
    spatial = self._spatial(in_specs[0].shape)
    pads = self._pads(in_specs[0].shape)
    for i, (L, p, k, d) in enumerate(zip(spatial, pads, self.window, self.dilation, strict=True)):
      self._check(windows.check_window_fits, i, L, p, effective_window(k, d), self.window,
                  self.dilation, name="window")

  def _pads(self, shape):
    return resolve_padding(self.padding, self._spatial(shape), self.window, self.strides,
                           self.dilation)

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    return self._conv(params, x, spec, params["w"], window_strides=self.strides,
                      padding=self._pads(spec.shape))

  def describe(self):
    return self._describe("Conv")


@dataclass(frozen=True)
class ConvTranspose(_Convolution):
  """A transposed convolution (MPS's ``MPSCNNConvolutionTransposeNode``, PyTorch's
  ``ConvTranspose``): the transpose of :class:`Conv`'s input-to-output map, with bias.

  Each input position ``i`` adds ``x[i, c] * w[t, c, f]`` to output position
  ``i * s + t * d - lo`` for every tap ``t``; positions outside ``[0, out)`` are dropped::

    out = (L - 1) * s + e - lo - hi          e = d * (k - 1) + 1

  which is PyTorch's ``ConvTranspose`` output size with ``padding=p`` (``lo = hi = p``), and
  ``out`` is exactly the input size of the ``Conv`` (same window, strides, dilation, padding)
  whose input gradient this is. The padding policy gives ``(lo, hi)`` as that ``Conv`` would:
  ``"VALID"`` ``(0, 0)`` (every position a tap reaches); ``"SAME"`` ``out = L * s`` (Flax's and
  TensorFlow's ``SAME``), ``lo = max(e - s, 0) // 2``, ``hi = e - s - lo`` (a negative ``hi``
  adds ``s - e`` positions at the end that get only the bias); ``"FULL"`` ``(e - 1, e - 1)``;
  or ``(lo, hi)`` pairs (PyTorch's ``padding=p, output_padding=q`` is ``(p, p - q)``).

  ``x: (*batch, *spatial, C_in) -> (*batch, *out_spatial, features)`` (channels-first:
  ``(*batch, C_in, *spatial) -> (*batch, features, *out_spatial)``). Parameters
  ``{"w": (*window, C_in // groups, features), "b": (features,)}`` (PyTorch's weight
  ``(C_in, features // groups, *window)`` is ``w`` with its axes moved, no flip). The fields are
  :class:`Conv`'s.
  """

  def pads(self, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``(lo, hi)`` per spatial dim, cropped from the full output (see the class docstring)."""
    strides, dilation = self.strides or (), self.dilation or ()  # set by _normalize
    if self.padding == "SAME":
      out = []
      for k, s, d in zip(self.window, strides, dilation, strict=True):
        total = effective_window(k, d) - s
        lo = max(total, 0) // 2
        out.append((lo, total - lo))
      return tuple(out)
    return resolve_padding(self.padding, self._spatial(shape), self.window, strides, dilation)

  def check_inputs(self, in_specs):
    super().check_inputs(in_specs)
    for i, (L, (lo, hi), k, s, d) in enumerate(zip(self._spatial(in_specs[0].shape),
                                                    self.pads(in_specs[0].shape), self.window,
                                                    self.strides, self.dilation, strict=True)):
      e = effective_window(k, d)
      if (L - 1) * s + e - lo - hi < 1:
        raise self._fail(f"padding {self.padding!r} crops the whole output in spatial dim {i}: "
                         f"(L - 1) * s + e - lo - hi = ({L} - 1) * {s} + {e} - "
                         f"{lo} - {hi} < 1.")

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    # a stride-1 convolution of the stride-dilated input with the spatially flipped kernel
    pads = [(d * (k - 1) - lo, d * (k - 1) - hi) for (lo, hi), k, d in
            zip(self.pads(spec.shape), self.window, self.dilation, strict=True)]
    w = jnp.flip(params["w"], axis=tuple(range(self.nspatial)))
    return self._conv(params, x, spec, w, window_strides=(1,) * self.nspatial, padding=pads,
                      lhs_dilation=self.strides)

  def describe(self):
    return self._describe("ConvTranspose")


@dataclass(frozen=True)
class Dense(Node):
  """A fully connected layer that flattens the per-example dims of what it gets.

  ``x: (*batch, *shape) -> (*batch, features)``. Parameters
  ``{"w": (prod(shape), features), "b": (features,)}``.

  Attributes:
    source: the input node, any per-example shape.
    features, use_bias, accumulator_precision, weights_init, bias_init, param_dtype: as
      :class:`Conv`.
    data_format: the layout of an image input; the flattening is always in channels-last order
      (as :class:`~jaxpool._src.graph.shape.Flatten`): with ``"channels_first"`` a
      ``(C, *spatial)`` input is flattened as ``(*spatial, C)``, so the parameters are those of
      the channels-last graph. The default flattens in memory order, which for a
      ``(C, *spatial)`` array is PyTorch's ``flatten`` order.
  """

  source: Ref = input_field()
  _: KW_ONLY
  features: int = 1
  use_bias: bool = True
  accumulator_precision: str = "float"
  weights_init: Callable[..., jax.Array] = HE_NORMAL
  bias_init: Callable[..., jax.Array] = jax.nn.initializers.zeros
  param_dtype: Any = jnp.float32
  data_format: str = "channels_last"
  has_params: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "weights, bias"

  def _normalize(self):
    _check_layer_config(self)
    self._set("data_format", check_data_format(self, self.data_format))

  def param_specs(self, in_specs):
    specs = {"w": Spec((math.prod(in_specs[0].shape), self.features), self.param_dtype)}
    if self.use_bias:
      specs["b"] = Spec((self.features,), self.param_dtype)
    return specs

  init_params = _Convolution.init_params

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    y = jnp.matmul(flatten_example(x, spec, self.data_format), params["w"].astype(x.dtype),
                   **_conv_precision(self.accumulator_precision, x.dtype))
    if self.use_bias:
      y = y + params["b"].astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    return y.astype(x.dtype)

  def describe(self):
    return f"Dense -> {self.features}"
