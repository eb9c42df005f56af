"""The report of :func:`jaxpool.optimize`: what was replaced, what was left alone and why."""

from __future__ import annotations

import dataclasses
import os

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
  """

  where: str
  op: str
  replaced: bool
  detail: str
  source: str = ""
  cost: str = ""


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
      tag = "replaced  " if f.replaced else ("left to XLA" if f.cost else "left alone")
      src = f"  [{f.source}]" if f.source else ""
      lines.append(f"  {tag}  {f.where}: {f.op} -> {f.detail}{src}")
    return "\n".join(lines)


def source_line(eqn) -> str:
  """The line of the user's own code that made ``eqn`` (not Flax's or Equinox's)."""
  try:
    frames = list(_jax_private.user_frames(eqn.source_info.traceback))
  except Exception:  # noqa: BLE001  (a report line, never an error)
    return ""
  frames = [f for f in frames if not f.file_name.startswith(JAXPOOL_DIR)]
  own = [f for f in frames if "site-packages" not in f.file_name
         and "dist-packages" not in f.file_name]
  if not frames:
    return ""
  f = (own or frames)[0]
  return f"{f.file_name}:{f.start_line} ({f.function_name})"
