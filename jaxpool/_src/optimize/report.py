"""The report of :func:`jaxpool.optimize`: what was replaced, what was left alone and why."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import textwrap
from collections.abc import Sequence

from jaxpool._src.optimize import _jax_private

# jaxpool's own directory: its frames are never the user's.
JAXPOOL_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


# What each equation is, in the words of the code that made it (the report's "what" column).
_WHAT = {
    "reduce_window_max": "max pool",
    "reduce_window_min": "min pool",
    "reduce_window": "lax.reduce_window",
    "reduce_window_sum": "window sum",
    "select_and_scatter_add": "max pool gradient",
    "select_and_gather_add": "max pool JVP",
    "max": "max(x, 0)",
    "custom_jvp_call": "jax.custom_jvp function",
    "custom_vjp_call": "jax.custom_vjp function",
    "while": "lax.while_loop",
    "cond": "lax.cond",
    "scan": "lax.scan",
}

WIDTH = 100
"""The columns that ``str(report)`` fits in."""


@dataclasses.dataclass(frozen=True)
class Finding:
  """One pooling-related equation that :func:`optimize` saw.

  Attributes:
    where: the chain of calls that holds it, e.g. ``"loss/scan/jit(block)"``.
    op: the JAX primitive, e.g. ``"reduce_window_max"`` (:attr:`what` says it in the user's
      words: ``"max pool"``).
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

  @property
  def what(self) -> str:
    """The equation in the words of the code that made it: ``"jax.nn.relu"``, ``"max pool"``,
    ``"max pool gradient"``, ``"average pool"``..."""
    m = re.fullmatch(r"custom_jvp_call\((relu6?)\)", self.op)
    if m:
      return f"jax.nn.{m.group(1)}"
    if self.op == "reduce_window_sum":
      if self.detail.startswith("an average pool's gradient"):
        return "average pool gradient"
      if self.replaced or self.cost:
        return "average pool"
    return _WHAT.get(self.op, self.op)

  @property
  def status(self) -> str:
    return "replaced" if self.replaced else ("left to XLA" if self.cost else "left alone")

  @property
  def at(self) -> str:
    """Where, briefly: the layer and the source file's name and line."""
    src = self.source.split(" (")[0]
    head, sep, line = src.rpartition(":")
    short = f"{os.path.basename(head)}:{line}" if sep else src
    return ", ".join(p for p in (self.layer, short) if p)


_KEEP = "\x00"  # a space that the table does not break at


def _cells(text: str, width: int) -> list[str]:
  """``text`` wrapped to ``width``, never inside a tuple within a call (``(2, 2)`` in
  ``jaxpool.max_pool(window (2, 2), ...)`` stays on one line)."""
  depth, chars = 0, []
  for c in text:
    depth += (c == "(") - (c == ")")
    chars.append(_KEEP if c == " " and depth >= 2 else c)
  # A kept run longer than a third of the column (a whole call in parentheses) may break.
  units = [u if len(u) <= width // 3 else u.replace(_KEEP, " ")
           for u in "".join(chars).split(" ")]
  lines = textwrap.wrap(" ".join(units), width, break_on_hyphens=False) or [""]
  return [line.replace(_KEEP, " ") for line in lines]


def table(rows: Sequence[Sequence[str]], widths: Sequence[int], indent: str = "  ") -> str:
  """Rows of cells as an aligned table, each cell wrapped to its column's width (the last
  column takes what ``WIDTH`` leaves)."""
  out = []
  for row in rows:
    cells = [_cells(c, w) for c, w in zip(row, widths)]
    for k in range(max(len(c) for c in cells)):
      parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)]
      out.append((indent + "  ".join(parts)).rstrip())
  return "\n".join(out)


@dataclasses.dataclass(frozen=True)
class OptimizeReport:
  """What :func:`optimize` replaced in one traced call, and what it left alone and why.

  ``str(report)`` (:meth:`table`) is an aligned table that fits 100 columns, a row a site:
  what, where, and what it became or why it was left alone. :meth:`long` gives a line a
  site with the full source paths and the chain of calls. ``notes`` say what the default cost
  model had no measurements for (``"no measurements for NVIDIA A100"``): those sites were
  decided without a measured table; both forms print them under the headline.
  """

  function: str
  findings: tuple[Finding, ...]
  notes: tuple[str, ...] = ()

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

  def _headline(self) -> str:
    kept = len(self.left_to_xla)
    head = (f"jaxpool.optimize({self.function}): {len(self.replaced)} replaced, "
            f"{len(self.left_alone)} left alone"
            + (f" ({kept} of them left to XLA by the cost decision)" if kept else ""))
    notes = [textwrap.fill(f"cost model: {n}", WIDTH, initial_indent="  ",
                           subsequent_indent="    ") for n in self.notes]
    return "\n".join([head, *notes])

  def table(self, width: int = WIDTH) -> str:
    """The report as an aligned table of ``width`` columns at most, a row a site."""
    if not self.findings:
      return self._headline()
    rows = [("", "what", "where", "became / why not")]
    rows += [(f.status, f.what, f.at, f.detail.removeprefix("left to XLA: "))
             for f in self.findings]
    w_status = max(len(r[0]) for r in rows)
    w_what = min(max(len(r[1]) for r in rows), 21)
    w_at = min(max(len(r[2]) for r in rows), 28)
    w_detail = max(width - 2 - 2 * 3 - w_status - w_what - w_at, 20)
    return self._headline() + "\n" + table(rows, (w_status, w_what, w_at, w_detail))

  def long(self) -> str:
    """The long form: a line a site, with its primitive, the chain of calls that holds it,
    its layer and the full path of its source line."""
    lines = [self._headline()]
    for f in self.findings:
      tag = "replaced   " if f.replaced else ("left to XLA" if f.cost else "left alone ")
      where = "; ".join(p for p in (f"layer {f.layer}" if f.layer else "", f.source) if p)
      src = f"  [{where}]" if where else ""
      lines.append(f"  {tag}  {f.where}: {f.op} ({f.what}) -> {f.detail}{src}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


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
