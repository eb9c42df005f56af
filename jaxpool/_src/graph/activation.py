"""Neuron nodes: :class:`Activation` (MPS's ``MPSCNNNeuron*Node``), by name, and
:class:`Softmax` (MPS's ``MPSCNNSoftMaxNode``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import jax
import jax.numpy as jnp

from jaxpool._src.graph.base import Node, Ref, input_field
from jaxpool._src.graph.common import array_axis, axis_in_range, check_axis, check_choice


def _leaky_relu(x):
  return jax.nn.leaky_relu(x, 0.01)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh, "gelu": jax.nn.gelu,
    "silu": jax.nn.silu, "softplus": jax.nn.softplus, "elu": jax.nn.elu,
    "leaky_relu": _leaky_relu, "identity": lambda x: x,
}
"""The functions an :class:`Activation` node applies, by the name its ``fn`` takes."""


@dataclass(frozen=True)
class Activation(Node):
  """An elementwise activation (MPS's neuron nodes), by name: one of :data:`ACTIVATIONS`."""

  source: Ref = input_field()
  _: KW_ONLY
  fn: str = "relu"

  def _normalize(self):
    check_choice(self, "fn", self.fn, tuple(ACTIVATIONS))

  def forward(self, params, xs, in_specs):
    return ACTIVATIONS[self.fn](xs[0])

  def describe(self):
    return f"Activation {self.fn}"


def ReLU(name: str, source: Ref) -> Activation:  # noqa: N802 (reads as a node class)
  """``Activation(name, source, fn="relu")``."""
  return Activation(name, source, fn="relu")


@dataclass(frozen=True)
class Softmax(Node):
  """Softmax along one per-example axis (MPS's ``MPSCNNSoftMaxNode``, over the channels).

  ``x: (*batch, *shape) -> (*batch, *shape)``, ``exp(x) / sum(exp(x))`` along ``axis``
  (``jax.nn.softmax``), computed in float32 at least and cast back to the input dtype.

  Attributes:
    source: the input node.
    axis: the per-example axis, negative from the end; default ``-1`` (the channels of a
      channels-last image; ``0`` for a channels-first one).
  """

  source: Ref = input_field()
  _: KW_ONLY
  axis: int = -1

  def _normalize(self):
    self._set("axis", check_axis(self, "axis", self.axis))

  def check_inputs(self, in_specs):
    axis_in_range(self, "axis", self.axis, in_specs[0], self.inputs[0])

  def forward(self, params, xs, in_specs):
    x = xs[0]
    y = jax.nn.softmax(x.astype(jnp.promote_types(x.dtype, jnp.float32)),
                       axis=array_axis(x, in_specs[0], self.axis))
    return y.astype(x.dtype)

  def describe(self):
    return f"Softmax axis {self.axis}"
