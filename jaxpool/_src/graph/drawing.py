"""A graph as text and as a picture: :func:`summary` (a table), :func:`to_dot` (Graphviz's DOT
language) and :func:`save` (DOT, or SVG/PNG/PDF through Graphviz's ``dot``)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any, Protocol

import jax

from jaxpool._src.graph.base import Cotangents, GradientNode, GradientState, Node
from jaxpool._src.graph.inputs import Input


class Drawable(Protocol):
  """What the pictures read of a graph (a :class:`~jaxpool._src.graph.graph.Graph` is one)."""

  nodes: tuple[Node, ...]
  outputs: tuple[str, ...]
  specs: dict[str, Any]
  rewrites: tuple[str, ...]

  def param_specs(self) -> Mapping[str, Mapping[str, jax.ShapeDtypeStruct]]: ...

  def num_params(self) -> int: ...


def summary(graph: Drawable) -> str:
  """A table: each node, its op, its inputs, its per-example output shape, its parameters;
  then the rewrites the passes made, if any."""
  pspecs = graph.param_specs()
  rows = [("#", "node", "op", "inputs", "shape", "params")]
  for k, n in enumerate(graph.nodes):
    count = sum(math.prod(s.shape) for s in pspecs.get(n.name, {}).values())
    rows.append((str(k), n.name, n.describe(), ", ".join(n.inputs) or "-",
                 shape_str(graph.specs[n.name]), f"{count:,}" if count else "-"))
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = [f"{type(graph).__name__}: {len(graph.nodes)} nodes, {graph.num_params():,} parameters, "
           f"outputs {', '.join(graph.outputs)}"]
  for r in rows:
    cells = [r[c].rjust(widths[c]) if c in (0, 5) else r[c].ljust(widths[c])
             for c in range(len(r))]
    lines.append("  ".join(cells).rstrip())
  if graph.rewrites:
    lines.append("rewrites:")
    lines.extend(f"  {note}" for note in graph.rewrites)
  return "\n".join(lines)


def to_dot(graph: Drawable) -> str:
  """The graph in Graphviz's DOT language: inputs as ellipses, filters as boxes, gradient
  states as notes, gradient nodes as grey boxes; edges from each input to its consumer."""
  lines = [f'digraph "{type(graph).__name__}" {{', "  rankdir=TB;",
           '  node [fontname="Helvetica", fontsize=10];']
  for n in graph.nodes:
    label = f"{n.name}\\n{n.describe()}\\n{shape_str(graph.specs[n.name])}"
    if isinstance(n, Input):
      style = 'shape=ellipse, style=filled, fillcolor="#dbe9f6"'
    elif isinstance(n, GradientState):
      style = 'shape=note, style=filled, fillcolor="#fff2cc"'
    elif isinstance(n, GradientNode):
      style = 'shape=box, style="rounded,filled", fillcolor="#e6e6e6"'
    else:
      style = 'shape=box, style="rounded,filled", fillcolor="#d9ead3"'
    if n.name in graph.outputs:
      style += ", penwidth=2"
    lines.append(f'  "{_esc(n.name)}" [label="{_esc(label)}", {style}];')
  for n in graph.nodes:
    for i in n.inputs:
      lines.append(f'  "{_esc(i)}" -> "{_esc(n.name)}";')
  lines.append("}")
  return "\n".join(lines) + "\n"


def save(graph: Drawable, path: str | os.PathLike) -> str:
  """Writes the picture: ``.dot`` as text, ``.svg``/``.png``/``.pdf`` through Graphviz's
  ``dot`` (``RuntimeError`` if it is not installed: check :func:`has_graphviz`).

  Returns:
    the path written.
  """
  path = os.fspath(path)
  fmt = os.path.splitext(path)[1].lstrip(".").lower()
  if fmt == "dot":
    with open(path, "w") as f:
      f.write(to_dot(graph))
    return path
  if fmt not in ("svg", "png", "pdf"):
    raise ValueError(f"path must end in .dot, .svg, .png or .pdf; got {path!r}.")
  dot = shutil.which("dot")
  if dot is None:
    raise RuntimeError("rendering needs Graphviz's `dot` on the PATH (apt install graphviz); "
                       "save a .dot file instead.")
  subprocess.run([dot, f"-T{fmt}", "-o", path], input=to_dot(graph).encode(), check=True)
  return path



def has_graphviz() -> bool:
  """Whether Graphviz's ``dot`` binary is on the PATH (needed to render SVG/PNG)."""
  return shutil.which("dot") is not None



def shape_str(spec: Any) -> str:
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
