"""Training graphs: :func:`training_graph` derives, from a scalar loss's forward graph, each
node's gradient (and gradient-state) node, and :class:`TrainingGraph` runs the result as
``(loss, grads)`` and as an optax step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpool._src.graph.base import Cotangents, GradientNode, GradientState, Node
from jaxpool._src.graph.graph import Graph, Params, State
from jaxpool._src.graph.inputs import Input
from jaxpool._src.graph.passes import DEFAULT_PASSES, Pass


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

