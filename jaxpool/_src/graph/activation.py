"""Neuron nodes: :class:`Activation` (MPS's ``MPSCNNNeuron*Node``), by name; softmax belongs here
too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import jax
import jax.numpy as jnp

from jaxpool._src.graph.base import Node, Ref, input_field


def _leaky_relu(x):
  return jax.nn.leaky_relu(x, 0.01)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh, "gelu": jax.nn.gelu,
    "silu": jax.nn.silu, "softplus": jax.nn.softplus, "elu": jax.nn.elu,
    "leaky_relu": _leaky_relu, "identity": lambda x: x,
}


@dataclass(frozen=True)
class Activation(Node):
  """An elementwise activation (MPS's neuron nodes), by name: one of :data:`ACTIVATIONS`."""

  source: Ref = input_field()
  _: KW_ONLY
  fn: str = "relu"

  def _normalize(self):
    if not isinstance(self.fn, str):
      raise self._fail(f"fn must be one of {tuple(ACTIVATIONS)}; got {self.fn!r}.", TypeError)
    if self.fn not in ACTIVATIONS:
      raise self._fail(f"fn must be one of {tuple(ACTIVATIONS)}; got {self.fn!r}.")

  def forward(self, params, xs, in_specs):
    return ACTIVATIONS[self.fn](xs[0])

  def describe(self):
    return f"Activation {self.fn}"


def ReLU(name: str, source: Ref) -> Activation:  # noqa: N802 (reads as a node class)
  """``Activation(name, source, fn="relu")``."""
  return Activation(name, source, fn="relu")
