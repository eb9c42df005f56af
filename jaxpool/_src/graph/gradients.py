"""Gradient-state nodes and gradient nodes (MPS's ``MPSNNGradientStateNode`` and
``MPSNNGradientFilterNode``).

A gradient-state node is produced by its forward node: when a graph holds the state node of a
forward node, that forward node is run through ``forward_with_state`` and what it returns beside
its output (the argmax taps of a max pool, the weights of a convolution) becomes
the state node's value.

A gradient node stands for one forward node. Its inputs are, in order, its source gradient(s)
(the cotangent of the forward output: an image node, or the gradient nodes of the forward node's
consumers, whose cotangents for it are summed in order), the source images (the forward node's
inputs) and the gradient state. Its value is a :class:`Cotangents`: one cotangent per forward input
(``None`` where not wanted) and the cotangents of the forward node's parameters.

A forward node names the class of its gradient node (``gradient_kind``: ``"PoolingGradient"``,
``"ConvolutionGradient"``, ``"Gradient"``) and of its gradient-state node (``state_kind``:
``"GradientState"`` or a subclass named as MPS names it); the classes here register under their
names, so that ``node.gradient_filter()`` finds them while the node modules never import this one.

The gradient states of the nodes whose training and inference modes differ (BatchNorm, Dropout)
exist in training mode only: their forward keeps them then (``Node.forward_mode``).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxpool._src.graph.base import (Node, Spec, as_refs, check_bools, input_field,
                                     register_gradient_class)
from jaxpool._src.graph.inputs import Input
from jaxpool._src.graph.pooling import _Pool


class Cotangents(NamedTuple):
  """The value of a gradient node.

  Attributes:
    inputs: one cotangent per input of the forward node, ``None`` where not differentiated.
    params: the cotangents of the forward node's parameters (same structure), or ``None``.
  """

  inputs: tuple[jax.Array | None, ...]
  params: dict[str, jax.Array] | None


@register_gradient_class
@dataclass(frozen=True)
class GradientState(Node):
  """What a forward node keeps for its gradient (MPS's ``MPSNNGradientStateNode``).

  Build it with ``forward.gradient_state()``. Its only input is its forward node, which produces
  its value; see ``forward.state_doc`` for what it carries (a pooling node's that needs none,
  ``AvgPool``'s and ``L2Pool``'s, carries ``None``: MPS's pooling gradient takes a state for
  every pooling type).
  """

  # MPS's name for the field; it shadows Node.forward (the method), which a state node never runs.
  forward: Node = input_field(compare=True)  # type: ignore[assignment]
  _input_fields: ClassVar[tuple[str, ...]] = ("forward",)

  def _normalize(self):
    if not isinstance(self.forward, Node) or isinstance(self.forward, (GradientState,
                                                                        GradientNode, Input)):
      raise self._fail(f"forward must be a forward filter node; got {self.forward!r}.",
                       TypeError)
    if not (self.forward.keeps_state or self.forward.accepts_state):
      raise self._fail(f"{type(self.forward).__name__} {self.forward.name!r} keeps no gradient "
                       "state (its gradient needs only its source images).")

  def infer_in_graph(self, specs: dict[str, Any], nodes: dict[str, Node]) -> Any:
    fwd = nodes[self.forward.name]
    if fwd != self.forward:
      raise self._fail(f"the graph's node {fwd.name!r} is not the forward node this state was "
                       "built from.")
    return self.forward.state_spec(tuple(specs[i] for i in self.forward.inputs))

  def describe(self):
    return f"GradientState ({self.forward.state_doc})"


@register_gradient_class
@dataclass(frozen=True)
class BatchNormalizationState(GradientState):
  """A BatchNorm's gradient state (MPS's ``MPSCNNBatchNormalizationState``): the batch mean and
  inverse standard deviation its training forward used, ``(C,)`` each, and its ``scale``."""


@register_gradient_class
@dataclass(frozen=True)
class DropoutGradientState(GradientState):
  """A Dropout's gradient state (MPS's ``MPSCNNDropoutGradientState``): the keep mask its
  training forward drew, a bool array of the input's shape."""


@dataclass(frozen=True)
class GradientNode(Node):
  """The gradient of one forward node (MPS's ``MPSNNGradientFilterNode``).

  Attributes:
    forward: the forward node; its config (window, strides, padding...) is the gradient's.
    source_gradient: node(s) giving the cotangent of the forward output (summed in order); a
      gradient node contributes its cotangent for ``forward``. Empty for a scalar forward
      output (a loss): the seed is 1.
    source_image: the forward node's inputs, in order (MPS's ``sourceImage``).
    gradient_state: the forward node's :class:`GradientState` (where it keeps one).
    wrt: which forward inputs to differentiate; default every float input.
  """

  # Shadows Node.forward (the method; a gradient node never runs it). _normalize rejects anything
  # but a forward node, the None default included, so a built gradient node always holds one.
  forward: Node = field(default=None, repr=False)  # type: ignore[assignment]
  source_gradient: Any = input_field(default=None)
  source_image: Any = input_field(default=None)
  gradient_state: Any = input_field(default=None)
  _: KW_ONLY
  wrt: tuple[bool, ...] | None = None
  forward_name: str = field(init=False, default="")
  source_gradients: tuple[str, ...] = field(init=False, default=())
  source_images: tuple[str, ...] = field(init=False, default=())
  state: str | None = field(init=False, default=None)
  _input_fields: ClassVar[tuple[str, ...]] = ("source_gradient", "source_image",
                                              "gradient_state")

  def _normalize(self):
    fwd = self.forward
    if not isinstance(fwd, Node) or isinstance(fwd, (GradientState, GradientNode, Input)):
      raise self._fail(f"forward must be a forward filter node; got {fwd!r}.", TypeError)
    self._set("forward_name", fwd.name)
    n_sg = len(as_refs(self.source_gradient))
    n_si = len(as_refs(self.source_image))
    self._set("source_gradients", self.inputs[:n_sg])
    self._set("source_images", self.inputs[n_sg:n_sg + n_si])
    states = self.inputs[n_sg + n_si:]
    if len(states) > 1:
      raise self._fail(f"gradient_state must be one node; got {self.gradient_state!r}.")
    self._set("state", states[0] if states else None)
    if self.source_images != fwd.inputs:
      raise self._fail(f"source_image {self.source_images} must be the inputs of its forward "
                       f"node {fwd.name!r}: {fwd.inputs}.")
    if fwd.keeps_state and self.state is None:
      raise self._fail(f"{type(fwd).__name__} {fwd.name!r} needs its gradient state "
                       f"({fwd.name!r}.gradient_state()).")
    if not (fwd.keeps_state or fwd.accepts_state) and self.state is not None:
      raise self._fail(f"{type(fwd).__name__} {fwd.name!r} keeps no gradient state; got "
                       f"gradient_state {self.state!r}.")
    st = self.gradient_state
    if isinstance(st, GradientState) and st.forward.name != fwd.name:
      raise self._fail(f"gradient_state {st.name!r} belongs to forward node "
                       f"{st.forward.name!r}, not to {fwd.name!r}.")
    if self.wrt is not None:
      self._set("wrt", check_bools(self, "wrt", self.wrt))
      if len(self.wrt) != len(fwd.inputs):
        raise self._fail(f"wrt must have one bool per input of {fwd.name!r} "
                         f"({len(fwd.inputs)}); got {self.wrt!r}.")

  # -- build time ------------------------------------------------------------------------------

  def resolved_wrt(self, in_specs: tuple[Spec, ...]) -> tuple[bool, ...]:
    if self.wrt is not None:
      return self.wrt
    return tuple(bool(jnp.issubdtype(s.dtype, jnp.floating)) for s in in_specs)

  def infer_in_graph(self, specs: dict[str, Any], nodes: dict[str, Node]) -> Cotangents:
    fwd = self.forward
    if fwd.name in nodes and nodes[fwd.name] != fwd:
      raise self._fail(f"the graph's node {fwd.name!r} is not the forward node this gradient "
                       "was built from.")
    if self.state is not None:
      st = nodes[self.state]
      if not isinstance(st, GradientState) or st.forward.name != fwd.name:
        owner = st.forward.name if isinstance(st, GradientState) else "no forward node"
        raise self._fail(f"gradient_state {self.state!r} belongs to {owner!r}, not to its "
                         f"forward node {fwd.name!r}.")
    in_specs = tuple(specs[i] for i in self.source_images)
    out = fwd.infer(in_specs)
    if not self.source_gradients and out.shape != ():
      raise self._fail(f"needs a source_gradient: the output of {fwd.name!r} has shape "
                       f"{out.shape}, not a scalar.")
    for s in self.source_gradients:
      node = nodes[s]
      if isinstance(node, GradientNode):
        slots = [k for k, i in enumerate(node.forward.inputs) if i == fwd.name]
        wrt = node.resolved_wrt(tuple(specs[i] for i in node.source_images))
        if not slots or not any(wrt[k] for k in slots):
          raise self._fail(f"source gradient {s!r} (the gradient of {node.forward.name!r}) "
                           f"carries no cotangent for {fwd.name!r}.")
      elif isinstance(node, GradientState):
        raise self._fail(f"source gradient {s!r} is a gradient state, not an image.")
      elif specs[s].shape != out.shape:
        raise self._fail(f"source gradient {s!r} has shape {specs[s].shape}, but the output of "
                         f"{fwd.name!r} has shape {out.shape}.")
    state_spec = specs[self.state] if self.state is not None else None
    wrt = self.resolved_wrt(in_specs)

    def run(xs, st, dy):
      return Cotangents(*fwd.backward(xs, st, dy, in_specs, wrt))

    return jax.eval_shape(run, in_specs, state_spec, out)

  # -- run time --------------------------------------------------------------------------------

  def source_gradient_value(self, values: dict[str, Any], nodes: dict[str, Node],
                            in_specs: tuple[Spec, ...]) -> jax.Array:
    total = None
    for s in self.source_gradients:
      node, v = nodes[s], values[s]
      if isinstance(node, GradientNode):
        parts = [v.inputs[k] for k, i in enumerate(node.forward.inputs)
                 if i == self.forward.name and v.inputs[k] is not None]
      else:
        parts = [v]
      for p in parts:
        total = p if total is None else total + p
    if total is None:  # a scalar output: d out / d out = 1
      out = self.forward.infer(in_specs)
      if self.forward.name in values:
        # (full_like of the loss itself, so that inside shard_map the seed varies as it does)
        total = jax.lax.full_like(values[self.forward.name], 1, out.dtype)
      else:
        # A gradient node built by hand for a loss that its graph does not hold: the seed is
        # made like the source images (1 plus zeros like the others), varying as the loss would.
        total = jax.lax.full_like(values[self.source_images[0]], 1, out.dtype, out.shape)
        for i in self.source_images[1:]:
          total = total + jax.lax.full_like(values[i], 0, out.dtype, out.shape)
    return total

  def evaluate(self, values: dict[str, Any], nodes: dict[str, Node],
               specs: dict[str, Any]) -> Cotangents:
    in_specs = tuple(specs[i] for i in self.source_images)
    dy = self.source_gradient_value(values, nodes, in_specs)
    xs = tuple(values[i] for i in self.source_images)
    state = values[self.state] if self.state is not None else None
    dxs, dparams = self.forward.backward(xs, state, dy, in_specs, self.resolved_wrt(in_specs))
    return Cotangents(tuple(dxs), dparams)

  def describe(self):
    return f"{type(self.forward).__name__}Gradient"


@register_gradient_class
@dataclass(frozen=True)
class PoolingGradient(GradientNode):
  """A pooling node's gradient (MPS's ``MPSCNNPoolingGradientNode``): source gradient, source
  image, gradient state, and the forward's window, strides and padding."""

  def _pool(self) -> _Pool:
    fwd = self.forward
    if not isinstance(fwd, _Pool):
      raise self._fail(f"forward must be a pooling node; got {fwd!r}.", TypeError)
    return fwd

  @property
  def window(self) -> tuple[int, ...]:
    return self._pool().window

  @property
  def strides(self) -> tuple[int, ...]:
    strides = self._pool().strides
    if strides is None:  # set by the pooling node's _normalize
      raise self._fail("its forward node has no strides.")
    return strides

  @property
  def padding(self) -> Any:
    return self._pool().padding

  @property
  def offset(self) -> tuple[int, ...]:
    offset = self._pool().offset
    if offset is None:  # set by the pooling node's _normalize
      raise self._fail("its forward node has no offset.")
    return offset

  @property
  def dilation(self) -> tuple[int, ...]:
    return self._pool().dilation_

  @property
  def ceil_mode(self) -> bool:
    return self._pool().ceil_mode

  @property
  def data_format(self) -> str:
    return self._pool().data_format

  def describe(self):
    f = self.forward
    pad = f.padding if isinstance(f.padding, str) else f"pad {f.padding}"
    return (f"{type(f).__name__}Gradient {'x'.join(map(str, f.window))}/"
            f"{'x'.join(map(str, f.strides))} {pad}")


@register_gradient_class
@dataclass(frozen=True)
class ConvolutionGradient(GradientNode):
  """A convolution's gradient (MPS's ``MPSCNNConvolutionGradientNode``): the input cotangent
  and the weight and bias cotangents (``jax.vjp`` of the convolution, with the weights its
  gradient state kept)."""


@register_gradient_class
@dataclass(frozen=True)
class Gradient(GradientNode):
  """The gradient of any other node (dense, activation, flatten, add, loss): ``jax.vjp`` of its
  forward at the source images."""


@register_gradient_class
@dataclass(frozen=True)
class BatchNormalizationGradient(GradientNode):
  """A BatchNorm's gradient (MPS's ``MPSCNNBatchNormalizationGradientNode``): ``dx``,
  ``dscale`` and ``dbias`` from the source gradient, the source image and the gradient state
  (the batch mean and inverse std), in closed form (``BatchNorm.backward``)."""


@register_gradient_class
@dataclass(frozen=True)
class DropoutGradient(GradientNode):
  """A Dropout's gradient (MPS's ``MPSCNNDropoutGradientNode``): the source gradient times the
  kept mask, divided by ``1 - rate``."""
