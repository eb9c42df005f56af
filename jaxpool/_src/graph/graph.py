"""``Graph``: a topologically ordered tuple of nodes, built from its outputs; ``training_graph``."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpool._src.checks import MAX_SIZE, check_bool
from jaxpool._src.graph.base import Cotangents, GradientNode, GradientState, Node
from jaxpool._src.graph.common import BOOL_HINT
from jaxpool._src.graph.inputs import Input
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
    by_name = _collect(outs)
    for node in by_name.values():
      for i in node.inputs:
        if i not in by_name:
          raise ValueError(f"node {node.name!r} ({type(node).__name__}): unknown input {i!r}; "
                           f"the graph has {sorted(by_name)}.")
    order = _toposort(outs, by_name)
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
      self.specs[n.name] = _infer(n, self.specs, self._by_name)
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
      self._check_inputs(inputs, require_all=False)
    specs = self.param_specs()
    keys = jax.random.split(key, max(len(specs), 1))
    params: Params = {}
    for k, name in zip(keys, specs):
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

  def _check_inputs(self, inputs: Mapping[str, Any], require_all: bool = True
                    ) -> dict[str, jax.Array]:
    names = {n.name: n for n in self.inputs}
    unknown = sorted(set(inputs) - set(names))
    if unknown:
      raise ValueError(f"unknown input(s) {unknown}; this graph's inputs are {sorted(names)}.")
    missing = sorted(set(names) - set(inputs))
    if require_all and missing:
      raise ValueError(f"missing input(s) {missing}; this graph's inputs are {sorted(names)}.")
    out, batch = {}, None
    for name, value in inputs.items():
      node = names[name]
      x = jnp.asarray(value)
      k = x.ndim - len(node.shape)
      if k < 0 or tuple(x.shape[k:]) != node.shape:
        raise ValueError(f"input {name!r} must have shape (*batch, *{node.shape}); got "
                         f"{tuple(x.shape)}.")
      if batch is not None and tuple(x.shape[:k]) != batch[1]:
        raise ValueError(f"inputs {batch[0]!r} and {name!r} have different batch dims: "
                         f"{batch[1]} and {tuple(x.shape[:k])}.")
      batch = batch or (name, tuple(x.shape[:k]))
      if (jnp.issubdtype(x.dtype, jnp.floating) != jnp.issubdtype(node.dtype, jnp.floating)
          and not (x.dtype == bool and not jnp.issubdtype(node.dtype, jnp.floating))):
        raise TypeError(f"input {name!r} must have a {node.dtype} dtype; got {x.dtype}.")
      out[name] = x.astype(node.dtype)
    return out

  def _check_params(self, params: Any, specs: Mapping[str, Any] | None = None,
                    what: str = "params", maker: str = "init()") -> None:
    """Checks ``params`` against :meth:`param_specs`: one entry per node with parameters,
    holding exactly that node's parameters, arrays of the expected shapes and a float dtype.
    Entries for nodes this graph does not have are ignored (a sub-graph can take the whole
    model's parameters).

    Raises:
      TypeError: ``params`` (or a node's entry) is not a dict, a parameter is not a float array.
      ValueError: a node's entry or parameter is missing, unexpected or of the wrong shape; the
        message names the node, the parameter and the expected and received shapes.
    """
    specs = self.param_specs() if specs is None else specs
    if not isinstance(params, Mapping):
      raise TypeError(f"{what} must be a dict {{node name: {{parameter name: array}}}} as "
                      f"{maker} returns ({{}} for a graph without {what}); got "
                      f"{type(params).__name__}.")
    for name, pspecs in specs.items():
      node = self._by_name[name]
      where = f"node {name!r} ({type(node).__name__})"
      want = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in pspecs.items())
      if name not in params:
        raise ValueError(f"{where}: {what} has no entry {name!r} (expected {{{want}}}); it has "
                         f"entries for {sorted(map(str, params))}. {what.capitalize()} from "
                         f"{maker} of another graph?")
      p = params[name]
      if not isinstance(p, Mapping):
        raise TypeError(f"{where}: {what}[{name!r}] must be a dict {{{want}}}; got "
                        f"{type(p).__name__}.")
      for k in pspecs:
        if k not in p:
          raise ValueError(f"{where}: {what}[{name!r}] has no parameter {k!r} (expected "
                           f"{{{want}}}); got {sorted(map(str, p))}.")
      extra = sorted(str(k) for k in p if k not in pspecs)
      if extra:
        raise ValueError(f"{where}: {what}[{name!r}] has unexpected parameter(s) {extra} "
                         f"(expected {{{want}}}; use_bias={getattr(node, 'use_bias', None)}).")
      for k, spec in pspecs.items():
        v = p[k]
        shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
        if shape is None or dtype is None:
          raise TypeError(f"{where}: parameter {k!r} must be an array of shape "
                          f"{tuple(spec.shape)}; got {type(v).__name__}.")
        if tuple(shape) != tuple(spec.shape):
          hint = (" (transposed?)" if sorted(shape) == sorted(spec.shape) and len(shape) > 1
                  else "")
          raise ValueError(f"{where}: parameter {k!r} must have shape {tuple(spec.shape)}; got "
                           f"{tuple(shape)}{hint}.")
        if not jnp.issubdtype(dtype, jnp.floating):
          raise TypeError(f"{where}: parameter {k!r} must have a float dtype ({maker} makes "
                          f"{spec.dtype}); got {dtype}.")

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
    self._check_params(params)
    if state is None:
      for n in self.nodes:
        if n.has_model_state:
          raise ValueError(f"node {n.name!r} ({type(n).__name__}) keeps a model state (running "
                           "statistics): pass state= (graph.init_state() before training, then "
                           "the state that training returns).")
      state = {}
    else:
      self._check_params(state, jax.eval_shape(self.init_state), "state", "init_state()")
    new_state = dict(state)
    values: dict[str, Any] = dict(self._check_inputs(inputs))
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
    pspecs = self.param_specs()
    rows = [("#", "node", "op", "inputs", "shape", "params")]
    for k, n in enumerate(self.nodes):
      count = sum(math.prod(s.shape) for s in pspecs.get(n.name, {}).values())
      rows.append((str(k), n.name, n.describe(), ", ".join(n.inputs) or "-",
                   _shape_str(self.specs[n.name]), f"{count:,}" if count else "-"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [f"{type(self).__name__}: {len(self.nodes)} nodes, {self.num_params():,} parameters, "
             f"outputs {', '.join(self.outputs)}"]
    for r in rows:
      cells = [r[c].rjust(widths[c]) if c in (0, 5) else r[c].ljust(widths[c])
               for c in range(len(r))]
      lines.append("  ".join(cells).rstrip())
    if self.rewrites:
      lines.append("rewrites:")
      lines.extend(f"  {note}" for note in self.rewrites)
    return "\n".join(lines)

  def to_dot(self) -> str:
    """The graph in Graphviz's DOT language: inputs as ellipses, filters as boxes, gradient
    states as notes, gradient nodes as grey boxes; edges from each input to its consumer."""
    lines = [f'digraph "{type(self).__name__}" {{', "  rankdir=TB;",
             '  node [fontname="Helvetica", fontsize=10];']
    for n in self.nodes:
      label = f"{n.name}\\n{n.describe()}\\n{_shape_str(self.specs[n.name])}"
      if isinstance(n, Input):
        style = 'shape=ellipse, style=filled, fillcolor="#dbe9f6"'
      elif isinstance(n, GradientState):
        style = 'shape=note, style=filled, fillcolor="#fff2cc"'
      elif isinstance(n, GradientNode):
        style = 'shape=box, style="rounded,filled", fillcolor="#e6e6e6"'
      else:
        style = 'shape=box, style="rounded,filled", fillcolor="#d9ead3"'
      if n.name in self.outputs:
        style += ", penwidth=2"
      lines.append(f'  "{_esc(n.name)}" [label="{_esc(label)}", {style}];')
    for n in self.nodes:
      for i in n.inputs:
        lines.append(f'  "{_esc(i)}" -> "{_esc(n.name)}";')
    lines.append("}")
    return "\n".join(lines) + "\n"

  def save(self, path: str | os.PathLike) -> str:
    """Writes the picture: ``.dot`` as text, ``.svg``/``.png``/``.pdf`` through Graphviz's
    ``dot`` (``RuntimeError`` if it is not installed: check :func:`has_graphviz`).

    Returns:
      the path written.
    """
    path = os.fspath(path)
    fmt = os.path.splitext(path)[1].lstrip(".").lower()
    if fmt == "dot":
      with open(path, "w") as f:
        f.write(self.to_dot())
      return path
    if fmt not in ("svg", "png", "pdf"):
      raise ValueError(f"path must end in .dot, .svg, .png or .pdf; got {path!r}.")
    dot = shutil.which("dot")
    if dot is None:
      raise RuntimeError("rendering needs Graphviz's `dot` on the PATH (apt install graphviz); "
                         "save a .dot file instead.")
    subprocess.run([dot, f"-T{fmt}", "-o", path], input=self.to_dot().encode(), check=True)
    return path


def has_graphviz() -> bool:
  """Whether Graphviz's ``dot`` binary is on the PATH (needed to render SVG/PNG)."""
  return shutil.which("dot") is not None


class TrainingGraph(Graph):
  """The forward graph of a loss plus, for each node, its gradient-state and gradient nodes.

  Built by :func:`training_graph`. :meth:`run` gives ``(loss, grads)`` (and the new model state
  when given one), equal to ``jax.value_and_grad`` of the forward graph's training-mode ``apply``;
  :meth:`make_step` adds an optax update.

  Attributes:
    loss: the loss node's name.
    gradients: ``{forward node name: gradient node name}``.
  """

  def __init__(self, outputs: Sequence[Node], loss: str, gradients: dict[str, str], *,
               forward: Graph | None = None):
    # The forward part comes rewritten from ``forward`` (its passes ran there): no pass again.
    super().__init__(outputs, passes=())
    if forward is not None:
      self.passes, self.rewrites, self.removed = forward.passes, forward.rewrites, forward.removed
    self.loss = loss
    self.gradients = dict(gradients)

  def run(self, params: Params, *, state: State | None = None, key: jax.Array | None = None,
          **inputs: jax.typing.ArrayLike) -> Any:
    """Runs the forward nodes in training mode, and the gradient nodes.

    Args:
      params: as returned by :meth:`init`.
      state: the model state (required with a ``BatchNorm``), as for :meth:`Graph.apply`.
      key: a PRNG key (required with a ``Dropout``); the same key gives the same masks as
        ``apply(..., key=key, training=True)``.
      **inputs: one array per input node.

    Returns:
      ``(loss, grads)``: the loss (a scalar) and the cotangent of every parameter, in the
      structure of ``params``; ``(loss, grads, new_state)`` when ``state`` is given. Equal to
      ``jax.value_and_grad`` of the forward graph's training-mode ``apply`` (with
      ``has_aux=True`` for the state).
    """
    values, new_state = self._run(params, state, key, True, inputs)
    grads = {}
    for name in self.param_specs():
      ct: Cotangents = values[self.gradients[name]]
      if ct.params is None:
        raise ValueError(f"gradient node {self.gradients[name]!r} gave no parameter cotangents "
                         f"for {name!r}.")
      grads[name] = ct.params
    loss = values[self.loss]
    return (loss, grads) if state is None else (loss, grads, new_state)

  def make_step(self, optimizer: Any) -> Callable[..., tuple[Any, ...]]:
    """The weight update (MPS's training-style data-source update) with an optax optimizer.

    Args:
      optimizer: an ``optax.GradientTransformation`` (anything with ``update(grads, opt_state,
        params)``); its state comes from ``optimizer.init(params)``.

    Returns:
      A pure function ``step(params, opt_state, *, state=None, key=None, **inputs)`` that runs
      :meth:`run` and applies the optimizer's updates (``optax.apply_updates``); it returns
      ``(params, opt_state, loss)``, or ``(params, opt_state, new_state, loss)`` when ``state``
      is given. Wrap it in ``jax.jit``.

    Raises:
      ImportError: optax is not installed (it is an optional dependency: ``jaxpool[examples]``).
      TypeError: ``optimizer`` has no ``update``.
    """
    try:
      import optax
    except ImportError as e:
      raise ImportError("TrainingGraph.make_step needs optax, an optional dependency of jaxpool: "
                        "pip install optax (or jaxpool[examples]).") from e
    if not callable(getattr(optimizer, "update", None)):
      raise TypeError("make_step needs an optax optimizer (an optax.GradientTransformation such "
                      f"as optax.adam(1e-3)); got {optimizer!r}.")

    def step(params: Params, opt_state: Any, *, state: State | None = None,
             key: jax.Array | None = None, **inputs: jax.typing.ArrayLike) -> tuple[Any, ...]:
      loss, grads, *new_state = self.run(params, state=state, key=key, **inputs)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return (params, opt_state, *new_state, loss)

    return step

  __call__ = run


def training_graph(loss: Node | Graph, *, passes: Sequence[Pass] | None = None
                   ) -> TrainingGraph:
  """The training graph of a scalar loss, built node by node (MPS's ``trainingGraph``).

  Walking the forward graph backwards, each node that depends on a parameter gets a gradient node
  (``node.gradient_filter``): its source gradient is the sum of its consumers' gradient nodes
  (the seed 1 for the loss), its source images are the node's inputs, and where the node keeps
  something for its gradient (the argmax of a max pool, the norms of an L2 pool, the weights of a
  convolution) a gradient-state node carries it. Inputs that depend on no parameter are not
  differentiated.

  The forward graph is rewritten first (``passes``, as :class:`Graph`'s), so the training graph
  runs the rewritten forward nodes and the gradients of those (a ReLU folded into a max pool
  has no gradient node of its own: the pool's gradient is the fused one).

  Args:
    loss: the loss node (scalar output), or a single-output graph of it.
    passes: the rewrite passes; default: the graph's passes if ``loss`` is a graph, else the
      default passes. ``()`` applies none.

  Returns:
    a :class:`TrainingGraph` whose :meth:`~TrainingGraph.run` gives ``(loss, grads)``.

  Raises:
    ValueError: if the loss is not a scalar or no node has parameters.
  """
  if isinstance(loss, Graph):
    if len(loss.outputs) != 1:
      raise ValueError(f"training_graph needs a single loss output; got {loss.outputs}.")
    if passes is None:
      passes = loss.passes
    loss = loss.node(loss.outputs[0])
  fwd = Graph(loss, passes=DEFAULT_PASSES if passes is None else passes)
  loss = fwd.node(loss.name)  # the rewritten graph's loss node (it holds the rewritten nodes)
  if fwd.specs[loss.name].shape != ():
    raise ValueError(f"node {loss.name!r} ({type(loss).__name__}): a loss must be a scalar; its "
                     f"output has shape {fwd.specs[loss.name].shape}.")
  trainable: dict[str, bool] = {}
  consumers: dict[str, list[str]] = {n.name: [] for n in fwd.nodes}
  for n in fwd.nodes:
    if isinstance(n, (GradientNode, GradientState)):
      raise ValueError(f"node {n.name!r}: training_graph takes a forward graph; it already holds "
                       f"the {type(n).__name__}.")
    trainable[n.name] = n.has_params or any(trainable[i] for i in n.inputs)
    for i in n.inputs:
      if n.name not in consumers[i]:
        consumers[i].append(n.name)
  if not any(n.has_params for n in fwd.nodes):
    raise ValueError(f"node {loss.name!r} ({type(loss).__name__}): nothing to train; no node of "
                     "its graph has parameters.")
  grads: dict[str, GradientNode] = {}
  for n in reversed(fwd.nodes):
    if isinstance(n, Input) or not trainable[n.name]:
      continue
    sources = tuple(grads[c] for c in consumers[n.name])
    wrt = tuple(trainable[i] and jnp.issubdtype(fwd.specs[i].dtype, jnp.floating)
                for i in n.inputs)
    grads[n.name] = n.gradient_filter(sources or None, wrt=wrt)
  outputs = [loss] + [grads[n.name] for n in fwd.nodes if n.has_params]
  return TrainingGraph(outputs, loss.name, {k: g.name for k, g in grads.items()}, forward=fwd)


# ----------------------------------------------------------------------------- helpers


def _collect(outs: Sequence[Node]) -> dict[str, Node]:
  by_name: dict[str, Node] = {}
  stack = list(reversed(outs))
  while stack:
    n = stack.pop()
    if n.name in by_name:
      if by_name[n.name] != n:
        raise ValueError(f"node {n.name!r}: two different nodes share this name "
                         f"({by_name[n.name]!r} and {n!r}).")
      continue
    by_name[n.name] = n
    stack.extend(reversed(n.refs))
    if isinstance(n, GradientNode):  # the forward node's object, for name resolution
      stack.extend(r for r in n.forward_node.refs)
  return by_name


def _toposort(outs: Sequence[Node], by_name: dict[str, Node]) -> list[Node]:
  order: list[Node] = []
  state: dict[str, int] = {}  # 1: on the stack, 2: done

  for root in outs:
    if state.get(root.name) == 2:
      continue
    stack: list[tuple[str, int]] = [(root.name, 0)]
    path: list[str] = []
    while stack:
      name, k = stack.pop()
      node = by_name[name]
      if k == 0:
        if state.get(name) == 2:
          continue
        state[name] = 1
        path.append(name)
      if k < len(node.inputs):
        stack.append((name, k + 1))
        nxt = node.inputs[k]
        if state.get(nxt) == 1:
          cycle = path[path.index(nxt):] + [nxt]
          raise ValueError(f"node {nxt!r}: the graph has a cycle: {' -> '.join(reversed(cycle))}.")
        if state.get(nxt) != 2:
          stack.append((nxt, 0))
      else:
        state[name] = 2
        path.pop()
        order.append(node)
  return order


def _infer(n: Node, specs: dict[str, Any], by_name: dict[str, Node]) -> Any:
  try:
    if hasattr(n, "infer_in_graph"):
      return n.infer_in_graph(specs, by_name)
    return n.infer(tuple(specs[i] for i in n.inputs))
  except (TypeError, ValueError) as e:  # e.g. a shape that lax rejects: name the node
    if str(e).startswith(f"node {n.name!r}"):
      raise
    raise ValueError(f"node {n.name!r} ({type(n).__name__}): {e}") from e


def _shape_str(spec: Any) -> str:
  if isinstance(spec, jax.ShapeDtypeStruct):
    return str(tuple(spec.shape))
  if isinstance(spec, Cotangents):
    shapes = [str(tuple(s.shape)) for s in spec.inputs if s is not None]
    if spec.params:
      shapes.append("+ " + ", ".join(f"d{k}" for k in spec.params))
    return " ".join(shapes) or "-"
  if spec is None:
    return "-"
  leaves = jax.tree_util.tree_leaves(spec)
  return " ".join(str(tuple(s.shape)) for s in leaves) or "-"


def _esc(s: str) -> str:
  return s.replace('"', '\\"')

