"""Graph rewrites: passes that :class:`~jaxpool.graph.Graph` applies to its nodes before it runs.

MPSNNGraph folds a neuron into the filter before it; here a pass is a plain function

    ``pass_(nodes, outputs) -> (new_nodes, notes)``

from the nodes in topological order and the names of the graph's outputs to the rewritten nodes
(still in topological order) and a list of human-readable notes, one per rewrite, which
``Graph.summary()`` prints. A pass must keep every value the graph's outputs depend on bit for
bit, the gradients included, and keep the names of the nodes it changes (parameters are keyed by
name); it may remove a node that nothing but the rewritten node reads and that is not an output.
:func:`rebind` rebuilds the nodes after a changed one so that they hold the new node objects.

``Graph(outputs)`` applies :data:`DEFAULT_PASSES`; ``Graph(outputs, passes=())`` none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxpool._src import relu_fold
from jaxpool._src.graph.activation import Activation
from jaxpool._src.graph.base import GradientNode, GradientState, Node
from jaxpool._src.graph.pooling import MaxPool

Notes = list[str]
Pass = Callable[[tuple[Node, ...], tuple[str, ...]], tuple[tuple[Node, ...], Notes]]


def rebind(nodes: Sequence[Node], changed: dict[str, Node]) -> tuple[Node, ...]:
  """``nodes`` with ``changed`` (by name) put in, and every node that holds one of the replaced
  node objects (as an input, or as the ``forward_node`` of a gradient node) rebuilt to hold the new
  one, in order, so that the graph's nodes form one consistent set of objects."""
  new = dict(changed)
  out = []
  for n in nodes:
    n = new.get(n.name, n)
    updates = {}
    for f in dataclasses.fields(n):
      if not f.init:
        continue
      value = getattr(n, f.name)
      swapped = _swap(value, new)
      if swapped is not value:
        updates[f.name] = swapped
    if updates:
      n = dataclasses.replace(n, **updates)
      new[n.name] = n
    out.append(n)
  return tuple(out)


def _swap(value: Any, new: dict[str, Node]) -> Any:
  """``value`` with any node object whose name is in ``new`` replaced (itself if none is)."""
  if isinstance(value, Node):
    repl = new.get(value.name)
    return repl if repl is not None and repl is not value else value
  if isinstance(value, (tuple, list)) and any(isinstance(v, Node) for v in value):
    items = [_swap(v, new) for v in value]
    if all(a is b for a, b in zip(items, value, strict=True)):
      return value
    return type(value)(items)
  return value


def fold_relu_into_max_pool(nodes: tuple[Node, ...], outputs: tuple[str, ...]
                            ) -> tuple[tuple[Node, ...], Notes]:
  """A ReLU whose only reader is a max pool is folded into the pool (the core's fused
  ``activation="relu"``): ``max_pool(relu(x)) == relu(max_pool(x))``, and the core's fused
  gradient equals the unfused one bit for bit.

  Folded only where the ReLU is an ``Activation`` with ``fn="relu"``, is not a graph output and
  is read by nothing but one :class:`MaxPool` (or :class:`DilatedMaxPool`) that has no activation
  of its own and no gradient or gradient-state node in the graph (a hand-built gradient of the
  pool reads the ReLU's output). The pool keeps its name and reads the ReLU's source; the ReLU is
  no longer a node.
  """
  readers: dict[str, list[Node]] = {n.name: [] for n in nodes}
  has_gradient: set[str] = set()
  for n in nodes:
    for i in n.inputs:
      readers.setdefault(i, []).append(n)
    if isinstance(n, GradientNode):
      has_gradient.add(n.forward_node.name)
    if isinstance(n, GradientState):
      has_gradient.add(n.forward_node.name)
  by_name = {n.name: n for n in nodes}
  changed: dict[str, Node] = {}
  removed: set[str] = set()
  notes: Notes = []
  for n in nodes:
    if not (isinstance(n, MaxPool) and n.activation is None and n.name not in has_gradient):
      continue
    relu = by_name.get(n.inputs[0])
    if not isinstance(relu, Activation):
      continue
    fold = relu_fold.fold(relu.fn, only_reader=[r.name for r in readers[relu.name]] == [n.name],
                          is_output=relu.name in outputs)
    if isinstance(fold, str) or fold.fused is None:  # the node folds only into activation=
      continue
    changed[n.name] = dataclasses.replace(n, source=relu.source, activation=fold.fused)
    removed.add(relu.name)
    notes.append(f"{relu.name} -> {n.name}: ReLU folded into the max pool (activation='relu'); "
                 f"{n.name} reads {relu.inputs[0]}")
  if not changed:
    return nodes, notes
  return rebind([n for n in nodes if n.name not in removed], changed), notes


DEFAULT_PASSES: tuple[Pass, ...] = (fold_relu_into_max_pool,)
"""The passes that ``Graph(outputs)`` applies: ``(fold_relu_into_max_pool,)``."""


def run_passes(nodes: tuple[Node, ...], outputs: tuple[str, ...], passes: Sequence[Pass]
               ) -> tuple[tuple[Node, ...], tuple[str, ...]]:
  """Applies ``passes`` in order; returns the nodes and every pass's notes."""
  notes: list[str] = []
  for p in passes:
    if not callable(p):
      raise TypeError(f"passes must be functions (nodes, outputs) -> (nodes, notes); got {p!r}.")
    nodes, more = p(nodes, outputs)
    nodes = tuple(nodes)
    notes.extend(more)
  return nodes, tuple(notes)
