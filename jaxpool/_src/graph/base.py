"""The base of every node: :class:`Node`, its input fields, and the gradient nodes' base types.

A node is an op, its static config and the names of its input nodes (``inputs``). It keeps the
input node objects it was built from (``refs``, not compared, not hashed) only so that
:class:`~jaxpool.graph.Graph` can find every node from the outputs; an input may also be given by
name, which is resolved when the graph is built. Nodes never hold arrays: parameters live in a
separate pytree keyed by node name.

Every array a node sees is ``(*batch, *shape)`` where ``shape`` is the per-example shape the graph
infers at build time (images are channels-last, ``(*spatial, C)``); the batch dims are whatever the
caller passes (none under ``vmap``, as MPS's ``encodeBatch``).

The gradient side (MPS's ``MPSNNGradientStateNode`` and ``MPSNNGradientFilterNode``) sits here
too, beside :class:`Node`: a gradient-state node is produced by its forward node (when a graph
holds the state node of a forward node, that node runs ``forward_with_state`` and what it returns
beside its output becomes the state's value); a gradient node stands for one forward node, its
inputs its source gradient(s) (summed in order), the source images (the forward node's inputs)
and the gradient state, and its value a :class:`Cotangents`. A forward node names the classes of
its gradient and gradient-state nodes itself (``gradient_class``, ``state_class``): every node's
default is :class:`Gradient` and :class:`GradientState`; a node module that has its own (pooling:
``PoolingGradient``; conv, normalization, regularization) defines it beside the node. The
gradient states of the nodes whose training and inference modes differ (BatchNorm, Dropout)
exist in training mode only: their forward keeps them then (``Node.forward_mode``).

Every node module imports this one and none imports a node module back; the checks the node
modules share (errors naming the node) are in ``common.py``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

Ref = Union["Node", str]
Spec = jax.ShapeDtypeStruct
Params = dict[str, jax.Array]
T = TypeVar("T")


def input_field(compare: bool = False, **kw: Any) -> Any:
  """A field that names an input node (a node or a name); only its name is compared."""
  return field(compare=compare, repr=False, hash=False if not compare else None, **kw)


@dataclass(frozen=True)
class Node:
  """Base class of every node.

  Attributes:
    name: unique within a graph; the key of the node's parameters and its ``named_scope``.
    inputs: names of the input nodes, in order (derived from the input fields).
  """

  name: str
  inputs: tuple[str, ...] = field(init=False, default=())
  refs: tuple[Node, ...] = field(init=False, default=(), compare=False, repr=False, hash=False)

  _input_fields: ClassVar[tuple[str, ...]] = ("source",)
  has_params: ClassVar[bool] = False
  keeps_state: ClassVar[bool] = False  # whether its gradient needs a gradient-state node
  accepts_state: ClassVar[bool] = False  # whether its gradient node takes one it does not need
  state_doc: ClassVar[str] = ""        # what the gradient state carries
  # The classes of its gradient node and of its gradient-state node: Gradient and GradientState
  # (below) unless the node's module names its own (MaxPool: PoolingGradient).
  gradient_class: ClassVar[type[GradientNode]]
  state_class: ClassVar[type[GradientState]]
  is_filter: ClassVar[bool] = True  # a forward (filter) node, which has a gradient node
  # Training mode (Graph.apply(..., training=True)); see forward_mode:
  has_model_state: ClassVar[bool] = False  # keeps a model state (BatchNorm's running statistics)
  uses_key: ClassVar[bool] = False         # draws random numbers in training mode (Dropout)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"a node name must be a non-empty str; got {self.name!r}.")
    names, refs = [], []
    for f in self._input_fields:
      for ref in as_refs(getattr(self, f)):
        names.append(ref_name(self.name, f, ref))
        if isinstance(ref, Node):
          refs.append(ref)
    object.__setattr__(self, "inputs", tuple(names))
    object.__setattr__(self, "refs", tuple(refs))
    self._normalize()

  def _normalize(self) -> None:
    """Checks and canonicalises the static config (lists -> tuples); raises ValueError."""

  def _set(self, attr: str, value: Any) -> None:
    object.__setattr__(self, attr, value)

  def _fail(self, msg: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"node {self.name!r} ({type(self).__name__}): {msg}")

  def _check(self, checker: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Calls one of the core's argument checkers (``jaxpool._src.windows``); its TypeError or
    ValueError is raised again naming this node."""
    try:
      return checker(*args, **kw)
    except (TypeError, ValueError) as e:
      raise self._fail(str(e), type(e)) from None

  # -- shapes and parameters -------------------------------------------------------------------

  def param_specs(self, in_specs: tuple[Spec, ...]) -> dict[str, Spec] | None:
    """The shapes of this node's parameters for these per-example input specs."""
    return None

  def init_params(self, key: jax.Array, in_specs: tuple[Spec, ...]) -> Params | None:
    return None

  def infer(self, in_specs: tuple[Spec, ...]) -> Spec:
    """The per-example output spec; raises ValueError for inputs the node cannot take."""
    self.check_inputs(in_specs)
    pspecs = self.param_specs(in_specs)
    return jax.eval_shape(lambda p, *xs: self.forward(p, xs, in_specs), pspecs, *in_specs)

  def check_inputs(self, in_specs: tuple[Spec, ...]) -> None:
    """Explicit shape checks with readable messages, run before shape inference."""

  # -- running ---------------------------------------------------------------------------------

  def forward(self, params: Params | None, xs: tuple[jax.Array, ...],
              in_specs: tuple[Spec, ...]) -> jax.Array:
    raise NotImplementedError(type(self).__name__)

  def forward_with_state(self, params: Params | None, xs: tuple[jax.Array, ...],
                         in_specs: tuple[Spec, ...]) -> tuple[jax.Array, Any]:
    """The forward pass plus what its gradient needs (the gradient state)."""
    return self.forward(params, xs, in_specs), (params if self.has_params else None)

  def state_spec(self, in_specs: tuple[Spec, ...]) -> Any:
    pspecs = self.param_specs(in_specs)
    return jax.eval_shape(lambda p, *xs: self.forward_with_state(p, xs, in_specs)[1], pspecs,
                          *in_specs)

  def backward(self, xs: tuple[jax.Array, ...], state: Any, dy: jax.Array,
               in_specs: tuple[Spec, ...], wrt: tuple[bool, ...]
               ) -> tuple[tuple[jax.Array | None, ...], Params | None]:
    """Cotangents of the inputs (``None`` where ``wrt`` is false) and of the parameters.

    The default is ``jax.vjp`` of :meth:`forward` at the source images, with the parameters the
    forward used (its gradient state) for nodes that have parameters.
    """
    params = state if self.has_params else None
    idx = [k for k, w in enumerate(wrt) if w]

    def f(p, *diff):
      full = list(xs)
      for k, v in zip(idx, diff, strict=True):
        full[k] = v
      return self.forward(p, tuple(full), in_specs)

    if params is None:
      y, vjp = jax.vjp(lambda *d: f(None, *d), *[xs[k] for k in idx])
      cts = vjp(jnp.asarray(dy).astype(y.dtype))
      dparams = None
    else:
      y, vjp = jax.vjp(f, params, *[xs[k] for k in idx])
      dparams, *cts = vjp(jnp.asarray(dy).astype(y.dtype))
    dxs: list[jax.Array | None] = [None] * len(xs)
    for k, c in zip(idx, cts, strict=True):
      dxs[k] = c
    return tuple(dxs), dparams

  # -- training mode -------------------------------------------------------------------------

  @property
  def has_modes(self) -> bool:
    """Whether training and inference differ for this node (it runs through forward_mode)."""
    return self.has_model_state or self.uses_key

  def init_model_state(self, in_specs: tuple[Spec, ...]) -> Params | None:
    """The node's model state before training (BatchNorm: running mean 0, variance 1)."""
    return None

  def forward_mode(self, params: Params | None, xs: tuple[jax.Array, ...],
                   in_specs: tuple[Spec, ...], *, state: Params | None, key: jax.Array | None,
                   training: bool) -> tuple[jax.Array, Params | None, Any]:
    """The forward pass of a node whose training and inference modes differ (:attr:`has_modes`).

    Args:
      state: the node's model state (:attr:`has_model_state`), else None.
      key: the caller's PRNG key in training mode (:attr:`uses_key`), else None; the node folds
        in its own stable value, so every node draws its own numbers.
      training: the mode.

    Returns:
      ``(y, new_state, gradient_state)``: the output, the updated model state (the same in
      inference) and what the gradient needs (None in inference: the gradient state of such a
      node exists only in training mode).
    """
    raise NotImplementedError(type(self).__name__)

  # -- MPS's gradient API ----------------------------------------------------------------------

  def gradient_state(self, name: str | None = None) -> GradientState:
    """The gradient-state node that carries what this node's forward keeps for its gradient."""
    return self.state_class(name or f"{self.name}.state", self)

  def gradient_filter(self, source_gradient: Ref | Sequence[Ref] | None = None, *,
                      state: Ref | None = None, name: str | None = None,
                      wrt: Sequence[bool] | None = None) -> GradientNode:
    """This node's gradient node, as MPS's ``gradientFilter(withSource:)``.

    Args:
      source_gradient: the node(s) giving the cotangent of this node's output (summed if
        several; a gradient node contributes its cotangent for this node). ``None`` only for a
        scalar output such as a loss (the seed 1).
      state: this node's gradient-state node (required where :attr:`keeps_state`); made here if
        omitted and needed.
      name: defaults to ``"<name>.grad"``.
      wrt: which inputs to differentiate (default: every float input).
    """
    if state is None and self.keeps_state:
      state = self.gradient_state()
    return self.gradient_class(name or f"{self.name}.grad", self, source_gradient,
                               self.refs_or_names(), state,
                               wrt=None if wrt is None else check_bools(self, "wrt", wrt))

  def refs_or_names(self) -> tuple[Ref, ...]:
    """The inputs as node objects where known, else as names."""
    by_name = {r.name: r for r in self.refs}
    return tuple(by_name.get(n, n) for n in self.inputs)

  def describe(self) -> str:
    """A short description of the op for summaries and pictures."""
    return type(self).__name__


def as_refs(value: Any) -> tuple[Any, ...]:
  if value is None:
    return ()
  if isinstance(value, (Node, str)):
    return (value,)
  if isinstance(value, (tuple, list)):
    return tuple(value)
  return (value,)


def ref_name(owner: str, field_name: str, ref: Any) -> str:
  if isinstance(ref, Node):
    return ref.name
  if isinstance(ref, str) and ref:
    return ref
  raise TypeError(f"node {owner!r}: {field_name} must be a node or a node name; got {ref!r}.")


def check_bools(node: Node, name: str, value: Any) -> tuple[bool, ...]:
  """A sequence of bools (``wrt``), as a tuple; anything else is a TypeError naming ``node``."""
  try:
    items = tuple(value)
  except TypeError:
    raise node._fail(f"{name} must be a sequence of bools; got {value!r}.", TypeError) from None
  if not all(isinstance(w, (bool, np.bool_)) for w in items):
    raise node._fail(f"{name} must be a sequence of bools; got {value!r}.", TypeError)
  return tuple(bool(w) for w in items)


# ----------------------------------------------------------------------------- gradient nodes


class Cotangents(NamedTuple):
  """The value of a gradient node.

  Attributes:
    inputs: one cotangent per input of the forward node, ``None`` where not differentiated.
    params: the cotangents of the forward node's parameters (same structure), or ``None``.
  """

  inputs: tuple[jax.Array | None, ...]
  params: dict[str, jax.Array] | None


@dataclass(frozen=True)
class GradientState(Node):
  """What a forward node keeps for its gradient (MPS's ``MPSNNGradientStateNode``).

  Build it with ``forward.gradient_state()``. Its only input is its forward node
  (``forward_node``), which produces its value; see ``forward.state_doc`` for what it carries
  (a pooling node's that needs none, ``AvgPool``'s and ``L2Pool``'s, carries ``None``: MPS's
  pooling gradient takes a state for every pooling type).
  """

  forward_node: Node = input_field(compare=True)
  _input_fields: ClassVar[tuple[str, ...]] = ("forward_node",)
  is_filter: ClassVar[bool] = False

  def _normalize(self):
    if not isinstance(self.forward_node, Node) or not self.forward_node.is_filter:
      raise self._fail(f"forward_node must be a forward filter node; got "
                       f"{self.forward_node!r}.", TypeError)
    if not (self.forward_node.keeps_state or self.forward_node.accepts_state):
      raise self._fail(f"{type(self.forward_node).__name__} {self.forward_node.name!r} keeps no "
                       "gradient state (its gradient needs only its source images).")

  def infer_in_graph(self, specs: dict[str, Any], nodes: dict[str, Node]) -> Any:
    fwd = nodes[self.forward_node.name]
    if fwd != self.forward_node:
      raise self._fail(f"the graph's node {fwd.name!r} is not the forward node this state was "
                       "built from.")
    return self.forward_node.state_spec(tuple(specs[i] for i in self.forward_node.inputs))

  def describe(self):
    return f"GradientState ({self.forward_node.state_doc})"


@dataclass(frozen=True)
class GradientNode(Node):
  """The gradient of one forward node (MPS's ``MPSNNGradientFilterNode``).

  Attributes:
    forward_node: the forward node; its config (window, strides, padding...) is the
      gradient's. (Not ``forward``, which is every node's forward method.)
    source_gradient: node(s) giving the cotangent of the forward output (summed in order); a
      gradient node contributes its cotangent for ``forward``. Empty for a scalar forward
      output (a loss): the seed is 1.
    source_image: the forward node's inputs, in order (MPS's ``sourceImage``).
    gradient_state: the forward node's :class:`GradientState` (where it keeps one).
    wrt: which forward inputs to differentiate; default every float input.
  """

  # _normalize rejects anything but a forward node, the None default included, so a built
  # gradient node always holds one.
  forward_node: Node = field(default=None, repr=False)  # type: ignore[assignment]
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
  is_filter: ClassVar[bool] = False

  def _normalize(self):
    fwd = self.forward_node
    if not isinstance(fwd, Node) or not fwd.is_filter:
      raise self._fail(f"forward_node must be a forward filter node; got {fwd!r}.", TypeError)
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
    if isinstance(st, GradientState) and st.forward_node.name != fwd.name:
      raise self._fail(f"gradient_state {st.name!r} belongs to forward node "
                       f"{st.forward_node.name!r}, not to {fwd.name!r}.")
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
    fwd = self.forward_node
    if fwd.name in nodes and nodes[fwd.name] != fwd:
      raise self._fail(f"the graph's node {fwd.name!r} is not the forward node this gradient "
                       "was built from.")
    if self.state is not None:
      st = nodes[self.state]
      if not isinstance(st, GradientState) or st.forward_node.name != fwd.name:
        owner = st.forward_node.name if isinstance(st, GradientState) else "no forward node"
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
        slots = [k for k, i in enumerate(node.forward_node.inputs) if i == fwd.name]
        wrt = node.resolved_wrt(tuple(specs[i] for i in node.source_images))
        if not slots or not any(wrt[k] for k in slots):
          raise self._fail(f"source gradient {s!r} (the gradient of {node.forward_node.name!r}) "
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
        parts = [v.inputs[k] for k, i in enumerate(node.forward_node.inputs)
                 if i == self.forward_node.name and v.inputs[k] is not None]
      else:
        parts = [v]
      for p in parts:
        total = p if total is None else total + p
    if total is None:  # a scalar output: d out / d out = 1
      out = self.forward_node.infer(in_specs)
      if self.forward_node.name in values:
        # (full_like of the loss itself, so that inside shard_map the seed varies as it does)
        total = jax.lax.full_like(values[self.forward_node.name], 1, out.dtype)
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
    dxs, dparams = self.forward_node.backward(xs, state, dy, in_specs, self.resolved_wrt(in_specs))
    return Cotangents(tuple(dxs), dparams)

  def describe(self):
    return f"{type(self.forward_node).__name__}Gradient"


@dataclass(frozen=True)
class Gradient(GradientNode):
  """The gradient of any other node (dense, activation, flatten, add, loss): ``jax.vjp`` of its
  forward at the source images."""


# Every node's default gradient classes (a class cannot name its subclasses in its own body).
Node.gradient_class = Gradient
Node.state_class = GradientState
