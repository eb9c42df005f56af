"""The report of :func:`jaxpool.optimize`: what was replaced, what was left alone and why."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys

from jaxpool._src.optimize import _jax_private

# jaxpool's own directory: its frames are never the user's.
JAXPOOL_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


@dataclasses.dataclass(frozen=True)
class Finding:
  """One pooling-related equation that :func:`optimize` saw.

  Attributes:
    where: the chain of calls that holds it, e.g. ``"loss/scan/jit(block)"``.
    op: the JAX primitive, e.g. ``"reduce_window_max"``.
    replaced: whether it now runs as jaxpool.
    detail: what it became (``replaced``) or why it was left alone.
    source: the user's source line that produced it, as JAX records it.
    cost: for a recognised site that the cost decision left to XLA, why (else ``""``).
    layer: the layer that made it, where the trace knows it (the name stack of JAX's
      ``named_scope``: a Flax linen module path such as ``"Net/block1"``, a Keras layer's
      name, Equinox's ``"eqx.nn.MaxPool2d"``), transformations such as ``jvp(...)`` removed.
  """

  where: str
  op: str
  replaced: bool
  detail: str
  source: str = ""
  cost: str = ""
  layer: str = ""


@dataclasses.dataclass(frozen=True)
class OptimizeReport:
  """What :func:`optimize` replaced in one traced call, and what it left alone and why.

  ``str(report)`` is a table, one line per finding.
  """

  function: str
  findings: tuple[Finding, ...]

  @property
  def replaced(self) -> tuple[Finding, ...]:
    return tuple(f for f in self.findings if f.replaced)

  @property
  def left_alone(self) -> tuple[Finding, ...]:
    """Everything not replaced: not recognised, or recognised and left to XLA."""
    return tuple(f for f in self.findings if not f.replaced)

  @property
  def left_to_xla(self) -> tuple[Finding, ...]:
    """The recognised sites that the cost decision left to XLA."""
    return tuple(f for f in self.findings if f.cost)

  def __str__(self) -> str:
    kept = len(self.left_to_xla)
    lines = [f"jaxpool.optimize({self.function}): {len(self.replaced)} replaced, "
             f"{len(self.left_alone)} left alone"
             + (f" ({kept} of them left to XLA by the cost decision)" if kept else "")]
    for f in self.findings:
      tag = "replaced   " if f.replaced else ("left to XLA" if f.cost else "left alone ")
      where = "; ".join(p for p in (f"layer {f.layer}" if f.layer else "", f.source) if p)
      src = f"  [{where}]" if where else ""
      lines.append(f"  {tag}  {f.where}: {f.op} -> {f.detail}{src}")
    return "\n".join(lines)


LIBRARIES = ("jax", "jaxlib", "jaxpool", "flax", "keras", "equinox", "optax")
"""Packages whose frames are never the user's own code."""


@functools.cache
def _library_dirs(loaded: frozenset[str]) -> tuple[str, ...]:
  dirs = [JAXPOOL_DIR]
  for name in sorted(loaded):
    file = getattr(sys.modules.get(name), "__file__", None)
    if file:
      dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
  return tuple(dirs)


def _is_library(file_name: str) -> bool:
  loaded = frozenset(n for n in LIBRARIES if n in sys.modules)
  path = os.path.abspath(file_name)
  return any(path.startswith(d) for d in _library_dirs(loaded))


def source_line(eqn) -> str:
  """The first frame of the user's own code that made ``eqn``: not JAX's, jaxpool's, Flax's,
  Keras's or Equinox's, and not another installed package's where there is one (else the first
  frame outside those libraries, else the innermost frame)."""
  try:
    frames = list(_jax_private.user_frames(eqn.source_info.traceback))
  except Exception:  # noqa: BLE001  (a report line, never an error)
    return ""
  frames = [f for f in frames if not f.file_name.startswith(JAXPOOL_DIR)]
  if not frames:
    return ""
  outside = [f for f in frames if not _is_library(f.file_name)]
  # The user's own code, before other installed packages (a model zoo's module).
  own = [f for f in outside if "site-packages" not in f.file_name
         and "dist-packages" not in f.file_name]
  f = (own or outside or frames)[0]
  return f"{f.file_name}:{f.start_line} ({f.function_name})"


_JAX_SCOPES = frozenset({"rematted_computation"})  # scopes that JAX's transformations add
_TRANSFORM = re.compile(r"^[\w-]+\((.*)\)$")


def layer(eqn, scope: str = "") -> str:
  """The layer path of ``eqn`` (``scope``: that of the equations that hold its jaxpr)."""
  outer = [p for p in scope.split("/") if p]
  parts: list[str] = []
  for name in str(eqn.source_info.name_stack).split("/"):
    while (m := _TRANSFORM.match(name)) is not None:
      name = m.group(1)  # jvp(eqx.nn.MaxPool2d) -> eqx.nn.MaxPool2d
    if name and name not in _JAX_SCOPES and (not parts or parts[-1] != name):
      parts.append(name)  # (transpose(jvp(Net))/jvp(Net) is one layer, Net)
  if parts[:len(outer)] != outer:  # a sub-jaxpr's names may already hold the outer ones
    parts = outer + parts[1:] if parts[:1] == outer[-1:] else outer + parts
  return "/".join(parts)
