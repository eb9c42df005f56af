"""How a :class:`~jaxpool._src.graph.graph.Graph` is put together from its output nodes: the
nodes collected by walking back their inputs, ordered topologically (a cycle is an error naming
it), and each node's per-example output spec inferred from its inputs'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxpool._src.graph.base import GradientNode, Node


def collect(outs: Sequence[Node]) -> dict[str, Node]:
  """Every node ``outs`` reach through their inputs, by name (two different nodes of one name
  are an error)."""
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


def toposort(outs: Sequence[Node], by_name: dict[str, Node]) -> list[Node]:
  """The nodes ``outs`` need, each after its inputs (depth first, inputs in order)."""
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


def infer(n: Node, specs: dict[str, Any], by_name: dict[str, Node]) -> Any:
  """Node ``n``'s output spec from its inputs' ``specs``; an error names the node."""
  try:
    if hasattr(n, "infer_in_graph"):
      return n.infer_in_graph(specs, by_name)
    return n.infer(tuple(specs[i] for i in n.inputs))
  except (TypeError, ValueError) as e:  # e.g. a shape that lax rejects: name the node
    if str(e).startswith(f"node {n.name!r}"):
      raise
    raise ValueError(f"node {n.name!r} ({type(n).__name__}): {e}") from e

