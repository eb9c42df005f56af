"""Regularization layers: :class:`Dropout` (MPS's ``MPSCNNDropoutNode``)."""

from __future__ import annotations

import zlib
from dataclasses import KW_ONLY, dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxpool._src.graph.base import GradientNode, GradientState, Node, Ref, Spec, input_field
from jaxpool._src.graph.common import check_real


@dataclass(frozen=True)
class DropoutGradientState(GradientState):
  """A Dropout's gradient state (MPS's ``MPSCNNDropoutGradientState``): the keep mask its
  training forward drew, a bool array of the input's shape."""


@dataclass(frozen=True)
class DropoutGradient(GradientNode):
  """A Dropout's gradient (MPS's ``MPSCNNDropoutGradientNode``): the source gradient times the
  kept mask, divided by ``1 - rate``."""


@dataclass(frozen=True)
class Dropout(Node):
  """Inverted dropout (MPS's ``MPSCNNDropoutNode``; Flax's ``nn.Dropout``, PyTorch's).

  In training mode each element is kept with probability ``1 - rate`` and scaled by
  ``1 / (1 - rate)``, the others are zeroed; in inference mode it is the identity. The mask is
  drawn from ``jax.random.fold_in(key, node_id)`` with ``key`` the caller's key and ``node_id``
  the CRC-32 of the node's name (:meth:`node_key`): the same key gives every Dropout node its own
  mask, and the same masks in ``Graph.apply(..., training=True)`` and in the training graph. The
  mask has the shape of the input, batch dims included (under ``vmap`` every example gets the
  same mask unless the key is vmapped too).

  Its gradient state (MPS's ``MPSCNNDropoutGradientState``) is the keep mask, a bool array (one
  byte per element); the gradient is ``dy * mask / (1 - rate)``.

  Attributes:
    source: the input node, any per-example shape.
    rate: the probability of zeroing an element, in ``[0, 1)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxpool import graph as jg
    >>> g = jg.Graph(jg.Dropout("drop", jg.Input("x", shape=(4,)), rate=0.5))
    >>> g.apply({}, key=jax.random.key(0), training=True, x=jnp.ones(4))
    Array([0., 0., 0., 2.], dtype=float32)
  """

  source: Ref = input_field()
  _: KW_ONLY
  rate: float = 0.5
  uses_key: ClassVar[bool] = True
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "the keep mask, bool"
  gradient_class: ClassVar[type[GradientNode]] = DropoutGradient
  state_class: ClassVar[type[GradientState]] = DropoutGradientState

  def _normalize(self):
    self._set("rate", check_real(self, "rate", self.rate, 0.0, 1.0, open_high=True))

  def node_key(self, key: jax.Array) -> jax.Array:
    """``key`` folded with this node's stable value (the CRC-32 of its name, 31 bits)."""
    return jax.random.fold_in(key, zlib.crc32(self.name.encode()) & 0x7FFFFFFF)

  def mask(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The keep mask (bool, ``True`` with probability ``1 - rate``) for the caller's ``key``."""
    return jax.random.bernoulli(self.node_key(key), 1.0 - self.rate, shape)

  def _apply_mask(self, v: jax.Array, keep: jax.Array) -> jax.Array:
    return jnp.where(keep, v / jnp.asarray(1.0 - self.rate, v.dtype), jnp.zeros((), v.dtype))

  def forward(self, params, xs, in_specs):
    """The inference-mode forward: the identity."""
    return xs[0]

  def forward_mode(self, params, xs, in_specs, *, state, key, training):
    (x,) = xs
    if not training:
      return x, state, None
    if self.rate == 0:  # as Flax: no key needed
      return x, state, jnp.ones(x.shape, jnp.bool_)
    if key is None:
      raise self._fail("needs a PRNG key in training mode: pass key=jax.random.key(...) (a new "
                       "one every step).")
    keep = self.mask(key, x.shape)
    return self._apply_mask(x, keep), state, keep

  def state_spec(self, in_specs):
    return Spec(in_specs[0].shape, jnp.bool_)

  def backward(self, xs, state, dy, in_specs, wrt):
    dx = self._apply_mask(jnp.asarray(dy).astype(xs[0].dtype), state) if wrt[0] else None
    return (dx,), None

  def describe(self):
    return f"Dropout rate {self.rate:g}"
