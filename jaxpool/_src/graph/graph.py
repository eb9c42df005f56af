"""``Graph``: a topologically ordered tuple of nodes, built from its outputs, run as pure functions.

How it is built (``building.py``), what a run checks (``run_checks.py``) and its pictures
(``drawing.py``) live beside it; training graphs, which derive from it, in ``training.py``."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxpool._src.checks import MAX_SIZE, check_bool
from jaxpool._src.graph import drawing
from jaxpool._src.graph.base import GradientNode, GradientState, Node
from jaxpool._src.graph.building import collect, infer, toposort
from jaxpool._src.graph.common import BOOL_HINT
from jaxpool._src.graph.inputs import Input
from jaxpool._src.graph.run_checks import check_inputs, check_params
from jaxpool._src.graph.passes import DEFAULT_PASSES, Pass, run_passes

Params = dict[str, dict[str, jax.Array]]
State = dict[str, dict[str, jax.Array]]  # the model state (BatchNorm's running statistics)

# Keyword arguments of apply/evaluate/run: an Input node cannot have these names.
RESERVED_INPUT_NAMES = ("state", "key", "training")


class Graph:
  """A graph of nodes (MPS's ``MPSNNGraph``), as pure functions over a parameter pytree.

  ``Graph(outputs)`` walks back from ``outputs`` (a node or a sequence of nodes), resolves inputs
  given by name, orders the nodes topologically and infers every node's per-example output shape.
  Any error is a ``ValueError`` naming the node.

  Before inferring shapes it applies its rewrite passes (``passes``, default
  :data:`~jaxpool._src.graph.passes.DEFAULT_PASSES`: a ReLU that only a max pool reads is folded
  into the pool; ``passes=()`` applies none). A node a pass removes is no longer a node of the
  graph (``node()`` and ``evaluate()`` do not know its name); the rewrites are listed in
  ``rewrites`` and at the end of ``summary()``.

  Attributes:
    nodes: the nodes in topological order (inputs first), after the rewrites.
    outputs: the names of the output nodes.
    specs: per-example ``jax.ShapeDtypeStruct`` of every node's value, by name.
    passes: the rewrite passes applied.
    rewrites: one note per rewrite the passes made, e.g.
      ``"relu1 -> pool1: ReLU folded into the max pool (activation='relu'); pool1 reads conv1"``.
    removed: the names of the nodes the rewrites removed.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxpool.graph import Conv, Input, MaxPool
    >>> x = Input("image", shape=(8, 8, 1))
    >>> y = MaxPool("pool", Conv("conv", x, features=4), window=(2, 2))
    >>> g = Graph(y)
    >>> params = g.init(jax.random.key(0))
    >>> g.apply(params, image=jnp.ones((32, 8, 8, 1))).shape     # any leading batch dims
    (32, 4, 4, 4)
  """

  def __init__(self, outputs: Node | Sequence[Node], *, passes: Sequence[Pass] = DEFAULT_PASSES):
    self._single = isinstance(outputs, Node)
    outs: tuple[Node, ...] = (outputs,) if isinstance(outputs, Node) else tuple(outputs)
    if not outs:
      raise ValueError("Graph needs at least one output node; got none.")
    for o in outs:
      if not isinstance(o, Node):
        raise TypeError(f"Graph outputs must be nodes; got {o!r}.")
    by_name = collect(outs)
    for node in by_name.values():
      for i in node.inputs:
        if i not in by_name:
          raise ValueError(f"node {node.name!r} ({type(node).__name__}): unknown input {i!r}; "
                           f"the graph has {sorted(by_name)}.")
    order = toposort(outs, by_name)
    self.outputs: tuple[str, ...] = tuple(o.name for o in outs)
    self.passes: tuple[Pass, ...] = tuple(passes)
    rewritten, self.rewrites = run_passes(tuple(order), self.outputs, self.passes)
    self.removed: tuple[str, ...] = tuple(n.name for n in order
                                          if n.name not in {m.name for m in rewritten})
    order = list(rewritten)
    self.nodes: tuple[Node, ...] = tuple(order)
    self._by_name = {n.name: n for n in order}
    self._states: dict[str, str] = {}
    for n in order:
      if isinstance(n, GradientState):
        if n.forward_node.name in self._states:
          raise ValueError(f"node {n.name!r} (GradientState): forward node {n.forward_node.name!r} "
                           f"already has the gradient state {self._states[n.forward_node.name]!r}.")
        self._states[n.forward_node.name] = n.name
    self.specs: dict[str, Any] = {}
    for n in order:
      self.specs[n.name] = infer(n, self.specs, self._by_name)
    # A parameter too large to index (int32 extents) would abort XLA when built: refuse it now.
    for name, specs in self.param_specs().items():
      for k, spec in specs.items():
        if math.prod(spec.shape) > MAX_SIZE:
          raise ValueError(
              f"node {name!r} ({type(self._by_name[name]).__name__}): parameter {k!r} would have "
              f"shape {spec.shape} ({math.prod(spec.shape)} elements); at most 2**31 - 1.")

  # -- introspection ---------------------------------------------------------------------------

  def node(self, name: str) -> Node:
    """The node called ``name``."""
    try:
      return self._by_name[name]
    except KeyError:
      if name in self.removed:
        raise KeyError(f"node {name!r} was removed by a rewrite ({'; '.join(self.rewrites)}); "
                       "build the graph with passes=() to keep it.") from None
      raise KeyError(f"no node {name!r} in this graph; it has {list(self._by_name)}.") from None

  @property
  def inputs(self) -> tuple[Input, ...]:
    """The input (image) nodes, in order."""
    return tuple(n for n in self.nodes if isinstance(n, Input))

  def param_specs(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    return self._per_node(lambda n: n.has_params and not isinstance(n, (GradientNode,
                                                                         GradientState)),
                          lambda n: n.param_specs(self._in_specs(n)),
                          "has parameters but gave no parameter specs")

  def _per_node(self, wants: Callable[[Node], bool], make: Callable[[Node], Any], fails: str
                ) -> dict[str, Any]:
    """``{name: make(node)}`` for the nodes that ``wants``; ``make`` giving None is an error."""
    out: dict[str, Any] = {}
    for n in self.nodes:
      if wants(n):
        value = make(n)
        if value is None:
          raise ValueError(f"node {n.name!r} ({type(n).__name__}) {fails}.")
        out[n.name] = value
    return out

  def num_params(self) -> int:
    return sum(math.prod(s.shape) for p in self.param_specs().values() for s in p.values())

  def __iter__(self):
    return iter(self.nodes)

  def __len__(self) -> int:
    return len(self.nodes)

  def __eq__(self, other: object) -> bool:
    return (type(self) is type(other) and self.nodes == other.nodes
            and self.outputs == other.outputs)

  def __hash__(self) -> int:
    return hash((type(self), self.nodes, self.outputs))

  def __repr__(self) -> str:
    return f"{type(self).__name__}({len(self.nodes)} nodes, outputs={self.outputs})"

  def __str__(self) -> str:
    return self.summary()

  def _in_specs(self, n: Node) -> tuple[Any, ...]:
    return tuple(self.specs[i] for i in n.inputs)

  # -- running ---------------------------------------------------------------------------------

  def init(self, key: jax.Array, **inputs: jax.typing.ArrayLike) -> Params:
    """Parameters of every node that has some, from its initializers (its "data source").

    Args:
      key: a PRNG key; each parameterised node gets its own split, in graph order.
      **inputs: optional example inputs, checked against the input nodes' shapes.

    Returns:
      ``{node_name: {"w": ..., "b": ...}}`` for every node with parameters.
    """
    if inputs:
      check_inputs(self.inputs, inputs, require_all=False)
    specs = self.param_specs()
    keys = jax.random.split(key, max(len(specs), 1))
    params: Params = {}
    for k, name in zip(keys, specs, strict=False):  # (one key, unused, where no node has any)
      node = self._by_name[name]
      p = node.init_params(k, self._in_specs(node))
      if p is None:
        raise ValueError(f"node {name!r} ({type(node).__name__}) has parameters but its "
                         "init_params gave none.")
      params[name] = p
    return params

  def init_state(self) -> State:
    """The model state before training (as Flax's ``batch_stats``, Equinox's ``State``).

    Returns:
      ``{node_name: ...}`` for every node that keeps one (``BatchNorm``:
      ``{"mean": zeros (C,), "var": ones (C,)}``, its running statistics); ``{}`` when none does.
      Pass it to :meth:`apply` as ``state=``; training returns the updated one.
    """
    return self._per_node(lambda n: n.has_model_state,
                          lambda n: n.init_model_state(self._in_specs(n)),
                          "keeps a model state but its init_model_state gave none")


  def evaluate(self, params: Params, *, state: State | None = None, key: jax.Array | None = None,
               training: bool = False, **inputs: jax.typing.ArrayLike) -> Any:
    """Runs every node; returns the value of every node by name (states and gradients too).

    Takes the same arguments as :meth:`apply` and returns ``values``, or ``(values, new_state)``
    when ``state`` is given.

    Raises:
      TypeError, ValueError: for inputs or parameters that do not fit the graph (see
        :meth:`apply`).
    """
    values, new_state = self._run(params, state, key, training, inputs)
    return values if state is None else (values, new_state)

  def _run(self, params: Params, state: State | None, key: jax.Array | None, training: Any,
           inputs: Mapping[str, Any]) -> tuple[dict[str, Any], State]:
    """The loop behind evaluate/apply/run: ``(values, new_state)``."""
    reserved = sorted(set(RESERVED_INPUT_NAMES) & {n.name for n in self.inputs})
    if reserved:
      raise ValueError(f"input node(s) {reserved}: the names {RESERVED_INPUT_NAMES} are the "
                       "keyword arguments of apply, evaluate and run; rename the Input.")
    check_bool("training", training, hint=BOOL_HINT)
    check_params(params, self.param_specs(), self._by_name)
    if state is None:
      for n in self.nodes:
        if n.has_model_state:
          raise ValueError(f"node {n.name!r} ({type(n).__name__}) keeps a model state (running "
                           "statistics): pass state= (graph.init_state() before training, then "
                           "the state that training returns).")
      state = {}
    else:
      check_params(state, jax.eval_shape(self.init_state), self._by_name, "state",
                   "init_state()")
    new_state = dict(state)
    values: dict[str, Any] = dict(check_inputs(self.inputs, inputs))
    for n in self.nodes:
      with jax.named_scope(n.name):
        if isinstance(n, (Input, GradientState)):
          continue  # given by the caller / produced by its forward node
        if isinstance(n, GradientNode):
          values[n.name] = n.evaluate(values, self._by_name, self.specs)
          continue
        xs = tuple(values[i] for i in n.inputs)
        p = params[n.name] if n.has_params else None
        if n.has_modes:  # BatchNorm, Dropout: training and inference differ
          values[n.name], s, kept = n.forward_mode(
              p, xs, self._in_specs(n), state=state[n.name] if n.has_model_state else None,
              key=key if training else None, training=bool(training))
          if n.has_model_state and s is not None:
            new_state[n.name] = s
          if n.name in self._states:
            if kept is None:
              raise ValueError(f"node {self._states[n.name]!r} (GradientState): the gradient "
                               f"state of {type(n).__name__} {n.name!r} exists in training mode "
                               "only; run with training=True (TrainingGraph.run does).")
            values[self._states[n.name]] = kept
        elif n.name in self._states:
          values[n.name], values[self._states[n.name]] = n.forward_with_state(
              p, xs, self._in_specs(n))
        else:
          values[n.name] = n.forward(p, xs, self._in_specs(n))
    return values, new_state

  def apply(self, params: Params, *, state: State | None = None, key: jax.Array | None = None,
            training: bool = False, **inputs: jax.typing.ArrayLike) -> Any:
    """Runs the graph: pure, jittable, vmappable (MPS's ``encodeBatch`` is ``jax.vmap``).

    Args:
      params: as returned by :meth:`init`.
      state: the model state (:meth:`init_state`; BatchNorm's running statistics). Required when
        the graph holds a ``BatchNorm``; when given, the result is ``(outputs, new_state)``.
      key: a PRNG key for training mode (``Dropout``; a new one each step).
      training: training mode (``BatchNorm`` normalises with the batch statistics and updates
        the running ones, ``Dropout`` drops) instead of inference mode (the default).
      **inputs: one array per input node, ``(*batch, *shape)``; the same batch dims for all.

    Returns:
      The output's value, or a tuple of them if the graph was built from a sequence; with
      ``state``, ``(that, new_state)`` (in inference mode ``new_state`` equals ``state``).

    Raises:
      TypeError, ValueError: an input of the wrong name, shape or dtype kind; ``params`` (or
        ``state``) not a dict, a node's entry or parameter missing (or unexpected), a parameter
        of the wrong shape or not a float array: the message names the node, the parameter, the
        expected and the received shape. Entries for nodes this graph lacks are ignored (and
        kept in ``new_state``). No ``state`` for a graph with a ``BatchNorm``; no ``key`` for a
        ``Dropout`` in training mode.
    """
    values, new_state = self._run(params, state, key, training, inputs)
    outs = tuple(values[o] for o in self.outputs)
    out = outs[0] if self._single else outs
    return out if state is None else (out, new_state)

  # -- printing and pictures -------------------------------------------------------------------

  def summary(self) -> str:
    """A table: each node, its op, its inputs, its per-example output shape, its parameters;
    then the rewrites the passes made, if any."""
    return drawing.summary(self)

  def to_dot(self) -> str:
    """The graph in Graphviz's DOT language: inputs as ellipses, filters as boxes, gradient
    states as notes, gradient nodes as grey boxes; edges from each input to its consumer."""
    return drawing.to_dot(self)

  def save(self, path: str | os.PathLike) -> str:
    """Writes the picture: ``.dot`` as text, ``.svg``/``.png``/``.pdf`` through Graphviz's
    ``dot`` (``RuntimeError`` if it is not installed: check :func:`has_graphviz`).

    Returns:
      the path written.
    """
    return drawing.save(self, path)
