"""Normalization layers: :class:`BatchNorm` (MPS's ``MPSCNNBatchNormalizationNode``)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxpool._src.graph.base import GradientNode, GradientState, Node, Ref, Spec, input_field
from jaxpool._src.graph.common import (batch_shape, check_bool, check_data_format,
                                       check_float_dtype, check_real)


@dataclass(frozen=True)
class BatchNormalizationState(GradientState):
  """A BatchNorm's gradient state (MPS's ``MPSCNNBatchNormalizationState``): the batch mean and
  inverse standard deviation its training forward used, ``(C,)`` each, and its ``scale``."""


@dataclass(frozen=True)
class BatchNormalizationGradient(GradientNode):
  """A BatchNorm's gradient (MPS's ``MPSCNNBatchNormalizationGradientNode``): ``dx``,
  ``dscale`` and ``dbias`` from the source gradient, the source image and the gradient state
  (the batch mean and inverse std), in closed form (``BatchNorm.backward``)."""


@dataclass(frozen=True)
class BatchNorm(Node):
  """Batch normalization (MPS's ``MPSCNNBatchNormalizationNode``; Flax's ``nn.BatchNorm``).

  In training mode (``Graph.apply(..., training=True)`` and every training graph) it normalises
  with the statistics of the batch over every dim but the channel one (the batch dims and the
  spatial dims): ``y = (x - mean) / sqrt(var + epsilon) * scale + bias``, with the *biased*
  batch variance, and updates the running statistics
  ``mean' = momentum * mean + (1 - momentum) * batch_mean`` (likewise ``var`` with the biased
  batch variance, as Flax; PyTorch keeps the unbiased one). In inference mode it normalises with
  the running statistics. Statistics are computed in float32 (at least) for any input dtype.

  Parameters ``{"scale": (C,), "bias": (C,)}`` (ones and zeros; either may be turned off); the
  running statistics ``{"mean": (C,), "var": (C,)}`` (zeros and ones) live in the graph's model
  state (``Graph.init_state()``), keyed by node name, as Flax's ``batch_stats`` collection.

  Its gradient state (MPS's ``MPSCNNBatchNormalizationState``) holds what the training forward
  used: ``{"mean", "inv_std"}`` of the batch, ``(C,)`` each, and the ``scale``.

  Attributes:
    source: the input node, ``(*spatial, C)`` per example (``(C, *spatial)`` for
      ``data_format="channels_first"``); any rank >= 1, e.g. ``(C,)`` after a ``Dense``.
    momentum: of the running statistics, in ``[0, 1]``.
    epsilon: added to the variance, ``> 0``.
    use_scale, use_bias: learn ``scale`` / ``bias``.
    data_format: ``"channels_last"`` or ``"channels_first"``.
    param_dtype: of the parameters and the running statistics.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxpool import graph as jg
    >>> x = jg.Input("x", shape=(4, 4, 3))
    >>> g = jg.Graph(jg.BatchNorm("bn", x))
    >>> params, state = g.init(jax.random.key(0)), g.init_state()
    >>> y, state = g.apply(params, state=state, training=True, x=jnp.ones((2, 4, 4, 3)))
    >>> state["bn"]["mean"]   # 0.9 * 0 + 0.1 * 1
    Array([0.1, 0.1, 0.1], dtype=float32)
  """

  source: Ref = input_field()
  _: KW_ONLY
  momentum: float = 0.9
  epsilon: float = 1e-5
  use_scale: bool = True
  use_bias: bool = True
  data_format: str = "channels_last"
  param_dtype: Any = jnp.float32
  has_params: ClassVar[bool] = True
  has_model_state: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "batch mean, inverse std, scale"
  gradient_class: ClassVar[type[GradientNode]] = BatchNormalizationGradient
  state_class: ClassVar[type[GradientState]] = BatchNormalizationState

  def _normalize(self):
    self._set("momentum", check_real(self, "momentum", self.momentum, 0.0, 1.0))
    self._set("epsilon", check_real(self, "epsilon", self.epsilon, 0.0, None, open_low=True))
    self._set("use_scale", check_bool(self, "use_scale", self.use_scale))
    self._set("use_bias", check_bool(self, "use_bias", self.use_bias))
    check_data_format(self, self.data_format)
    self._set("param_dtype", check_float_dtype(self, "param_dtype", self.param_dtype))

  def check_inputs(self, in_specs):
    (x,) = in_specs
    if len(x.shape) < 1:
      raise self._fail(f"input {self.inputs[0]!r} must have a channel dim; got shape {x.shape}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise self._fail(f"input {self.inputs[0]!r} must be a float array; got {x.dtype}.",
                       TypeError)

  # -- shapes -----------------------------------------------------------------------------------

  def _channel_axis(self, x: jax.Array, spec: Spec) -> int:
    """The channel axis of ``x`` (``(*batch, *shape)``)."""
    return len(batch_shape(x, spec)) if self.data_format == "channels_first" else x.ndim - 1

  def _channels(self, spec: Spec) -> int:
    return spec.shape[0 if self.data_format == "channels_first" else -1]

  def param_specs(self, in_specs):
    c = self._channels(in_specs[0])
    names = [n for n, on in (("scale", self.use_scale), ("bias", self.use_bias)) if on]
    return {n: Spec((c,), self.param_dtype) for n in names}

  def init_params(self, key, in_specs):
    fill = {"scale": jnp.ones, "bias": jnp.zeros}
    return {n: fill[n](s.shape, s.dtype) for n, s in self.param_specs(in_specs).items()}

  def init_model_state(self, in_specs):
    c = self._channels(in_specs[0])
    return {"mean": jnp.zeros((c,), self.param_dtype), "var": jnp.ones((c,), self.param_dtype)}

  # -- running ----------------------------------------------------------------------------------

  def _normalized(self, x, spec, mean, inv):
    """``(x - mean) * inv`` in the dtype of ``mean`` (float32 at least), ``mean`` and ``inv``
    ``(C,)``; returns it and the shape that broadcasts a ``(C,)`` vector against ``x``."""
    shape = [1] * x.ndim
    shape[self._channel_axis(x, spec)] = -1
    return (x.astype(mean.dtype) - mean.reshape(shape)) * inv.reshape(shape), shape

  def _affine(self, params, x, spec, mean, inv):
    """``(x - mean) * inv * scale + bias``, in the dtype of ``x``."""
    y, shape = self._normalized(x, spec, mean, inv)
    if self.use_scale:
      y = y * params["scale"].astype(y.dtype).reshape(shape)
    if self.use_bias:
      y = y + params["bias"].astype(y.dtype).reshape(shape)
    return y.astype(x.dtype)

  def _reduced_axes(self, x, spec) -> tuple[int, ...]:
    axis = self._channel_axis(x, spec)
    return tuple(i for i in range(x.ndim) if i != axis)

  def batch_statistics(self, x: jax.Array, spec: Spec) -> tuple[jax.Array, jax.Array]:
    """The batch mean and biased variance, ``(C,)`` each, in float32 (at least)."""
    axes = self._reduced_axes(x, spec)
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(xf, axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axes)
    return mean.reshape(-1), var

  def forward(self, params, xs, in_specs):
    """The training-mode forward (batch statistics): what the gradient node differentiates."""
    return self.forward_with_state(params, xs, in_specs)[0]

  def forward_with_state(self, params, xs, in_specs):
    y, gstate, _ = self._train(params, xs[0], in_specs[0])
    return y, gstate

  def _train(self, params, x, spec):
    """The training forward: ``(y, gradient state, batch variance)``."""
    mean, var = self.batch_statistics(x, spec)
    inv = lax.rsqrt(var + jnp.asarray(self.epsilon, var.dtype))
    gstate = {"mean": mean, "inv_std": inv}
    if self.use_scale:
      gstate["scale"] = params["scale"]
    return self._affine(params, x, spec, mean, inv), gstate, var

  def forward_mode(self, params, xs, in_specs, *, state, key, training):
    (x,), (spec,) = xs, in_specs
    if training:
      y, gstate, var = self._train(params, x, spec)
      m = self.momentum
      new = {k: (m * state[k] + (1 - m) * v).astype(state[k].dtype)
             for k, v in (("mean", gstate["mean"]), ("var", var))}
      return y, new, gstate
    cdt = jnp.promote_types(x.dtype, jnp.float32)
    mean, var = state["mean"].astype(cdt), state["var"].astype(cdt)
    y = self._affine(params, x, spec, mean, lax.rsqrt(var + jnp.asarray(self.epsilon, cdt)))
    return y, state, None

  def backward(self, xs, state, dy, in_specs, wrt):
    """``dx = inv * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * scale``,
    ``dscale = sum(dy * xhat)``, ``dbias = sum(dy)``, sums and means over the reduced dims."""
    (x,), (spec,) = xs, in_specs
    xhat, shape = self._normalized(x, spec, state["mean"], state["inv_std"])
    axes = self._reduced_axes(x, spec)
    g = jnp.asarray(dy).astype(xhat.dtype)
    dparams = {}
    if self.use_scale:
      dparams["scale"] = jnp.sum(g * xhat, axes).astype(self.param_dtype)
    if self.use_bias:
      dparams["bias"] = jnp.sum(g, axes).astype(self.param_dtype)
    dx = None
    if wrt[0]:
      if self.use_scale:
        g = g * state["scale"].astype(g.dtype).reshape(shape)
      inv = state["inv_std"].reshape(shape)
      dx = inv * (g - jnp.mean(g, axes, keepdims=True)
                  - xhat * jnp.mean(g * xhat, axes, keepdims=True))
      dx = dx.astype(x.dtype)
    return (dx,), dparams

  def describe(self):
    fmt = "" if self.data_format == "channels_last" else f" {self.data_format}"
    return f"BatchNorm momentum {self.momentum:g} eps {self.epsilon:g}{fmt}"
