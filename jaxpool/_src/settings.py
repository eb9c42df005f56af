"""jaxpool's settings in one place: every ``JAXPOOL_*`` environment variable and kernel setting,
with its type, default and meaning (:data:`SETTINGS`), read with :func:`get`.

A setting's value is, in this order: an override (:func:`override`, a context manager for tests,
benchmarks and ``jaxpool.tune``), its environment variable, its default. Values are read when
they are used, never cached, so a change takes effect at the next read; but when that read is
depends on the setting (its ``read``):

- ``"call"``: read at each call of the function that uses it (eagerly, or when a ``jit`` traces
  the call).
- ``"trace"``: read while a kernel is traced. A program already traced (a ``jax.jit`` function
  called before) keeps the value it was traced with until it is traced again
  (``jax.clear_caches()``, or a new shape).

A bad value raises a ``ValueError`` naming the setting (its environment variable) and the value,
when it is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SETTINGS", "Setting", "get", "override", "overrides", "table"]


@dataclasses.dataclass(frozen=True)
class Setting:
  """One setting: ``name`` (what :func:`get` and :func:`override` take), its environment
  variable (None for kernel settings that only an override changes), its type and default,
  when it is read (``"call"`` or ``"trace"``) and what it does."""

  name: str
  env: str | None
  type: str
  default: Any
  read: str
  doc: str
  parse: Callable[[str, Any], Any]  # (the label for errors, the raw value) -> the value


def _label(s: Setting) -> str:
  return s.env or s.name


def _choice(choices: tuple[str, ...], aliases: dict[str, str] | None = None,
            allow_unset: bool = False) -> Callable[[str, Any], Any]:
  aliases = aliases or {}

  def parse(label: str, raw: Any) -> Any:
    name = str(raw).strip().lower()
    name = aliases.get(name, name)
    if allow_unset and name == "":
      return None
    if name not in choices:
      extra = " (or " + "/".join(sorted(k for k in aliases if k)) + ")" if aliases else ""
      raise ValueError(f"{label} must be one of {choices}{extra}, got {raw!r}")
    return name
  return parse


def _positive(kind: type) -> Callable[[str, Any], Any]:
  def parse(label: str, raw: Any) -> Any:
    try:
      value = kind(str(raw).strip()) if isinstance(raw, str) else kind(raw)
    except (TypeError, ValueError):
      value = None
    if kind is int and isinstance(raw, float) and not raw.is_integer():
      value = None  # (2.5 candidates is no count)
    if (value is None or isinstance(raw, bool) or not math.isfinite(value) or value <= 0):
      raise ValueError(f"{label} must be a positive, finite {kind.__name__}, got {raw!r}")
    return value
  return parse


def _path(label: str, raw: Any) -> Any:
  if raw is None:
    return None
  if not isinstance(raw, (str, os.PathLike)):
    raise ValueError(f"{label} must be a folder path, got {raw!r}")
  text = os.fspath(raw).strip()
  return os.path.expanduser(text) if text else None


def _bool(label: str, raw: Any) -> Any:
  if isinstance(raw, bool):
    return raw
  name = str(raw).strip().lower()
  if name in ("1", "true", "on", "yes"):
    return True
  if name in ("0", "false", "off", "no"):
    return False
  raise ValueError(f"{label} must be True or False (or 1/0, on/off), got {raw!r}")


TUNE_MODES = ("model", "auto", "cached", "off")
_TUNE_ALIASES = {"": "model", "1": "auto", "on": "auto", "true": "auto", "0": "off",
                 "false": "off", "no": "off"}

SETTINGS: dict[str, Setting] = {s.name: s for s in [
    Setting("tune", "JAXPOOL_TUNE", "str", "model", "trace",
            "How a GPU kernel's launch is chosen. ``model`` (default): the tuning cache, the "
            "table shipped for this GPU, else the launch model; never tunes. ``auto`` (also "
            "``1``/``on``): the same, but a kernel none of those holds is tuned when first "
            "traced (seconds). ``cached``: the cache and the table, else the heuristic. ``off`` "
            "(``0``): the heuristic only.",
            _choice(TUNE_MODES, _TUNE_ALIASES)),
    Setting("tune_table", "JAXPOOL_TUNE_TABLE", "str", "on", "trace",
            "``on``: use the table shipped for this GPU. ``off``: hide it (the cache, else the "
            "launch model). ``foreign``: hide it and this GPU's tuning data from the launch "
            "model too, as a GPU that ships none gets (benchmarks measure the model so).",
            _choice(("on", "off", "foreign"), {"1": "on", "0": "off"})),
    Setting("tune_budget_s", "JAXPOOL_TUNE_BUDGET_S", "float", 10.0, "trace",
            "The most seconds one kernel's tuning takes.", _positive(float)),
    Setting("tune_max_candidates", "JAXPOOL_TUNE_MAX_CANDIDATES", "int", 6, "trace",
            "The most one-row launches tried a kernel (the forwards also try up to 10 blocks "
            "or loops of rows, the backwards up to 5).", _positive(int)),
    Setting("tune_threads", "JAXPOOL_TUNE_THREADS", "int", None, "trace",
            "Threads that compile a kernel's candidates (default: the CPUs, at most 8).",
            lambda label, raw: None if raw is None else _positive(int)(label, raw)),
    Setting("cache_dir", "JAXPOOL_CACHE_DIR", "path", None, "trace",
            "The tuning cache's folder (default ``$XDG_CACHE_HOME/jaxpool``, else "
            "``~/.cache/jaxpool``); read when the process's tuner first needs it.", _path),
    Setting("implementation", "JAXPOOL_IMPLEMENTATION", "str", None, "call",
            "``xla`` makes ``implementation=None`` mean XLA everywhere; unset (or ``auto``): "
            "the first backend that serves the call.",
            _choice(("xla",), {"auto": ""}, allow_unset=True)),
    Setting("pallas_backend", "JAXPOOL_PALLAS_BACKEND", "str", None, "call",
            "Which Pallas kernels run: ``tpu`` or ``triton`` (default: ``tpu`` on a TPU, else "
            "``triton``; on a CPU, ``tpu`` runs the TPU kernels in the TPU interpreter).",
            _choice(("triton", "tpu"), allow_unset=True)),
    Setting("nan_max", None, "str", "auto", "trace",
            "How the Triton max kernel takes its running maximum: ``auto`` (PTX's "
            "``max.NaN.f32`` where it serves, else ``beats``), ``beats`` or ``canonical`` "
            "(``beats`` with PTX's NaN results: how interpret-mode tests check the compiled "
            "kernels' bits).", _choice(("auto", "beats", "canonical"))),
    Setting("packed_select", None, "bool", True, "trace",
            "Whether the Triton max backward of 16-bit floats selects two lanes an instruction "
            "where it can (the same bits either way).", _bool),
]}

# Overrides by name. A plain dict, shared by every thread (the tuner traces candidates in
# threads); tests may also ``monkeypatch.setitem(settings.overrides, name, value)``.
overrides: dict[str, Any] = {}
_LOCK = threading.Lock()


def _setting(name: str) -> Setting:
  if name not in SETTINGS:
    raise ValueError(f"no jaxpool setting is named {name!r}; the settings are "
                     f"{sorted(SETTINGS)}")
  return SETTINGS[name]


def get(name: str) -> Any:
  """The value of setting ``name``: its override, else its environment variable (unset or
  empty: the default), else its default; checked (``ValueError`` naming it)."""
  s = _setting(name)
  if name in overrides:
    value = overrides[name]
    return s.default if value is None else s.parse(_label(s), value)
  raw = os.environ.get(s.env, "") if s.env else ""
  return s.parse(_label(s), raw) if raw.strip() else s.default


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
  """Sets settings inside the block (every thread), whatever the environment says: e.g.
  ``with settings.override(tune="cached", nan_max="beats"): ...``. Each value is checked on
  entry. A setting read at trace time keeps, in a program traced inside the block, the value
  it had there."""
  for name, value in values.items():
    s = _setting(name)
    if value is not None:
      s.parse(_label(s), value)
  missing = object()
  with _LOCK:
    previous = {name: overrides.get(name, missing) for name in values}
    overrides.update(values)
  try:
    yield
  finally:
    with _LOCK:  # (each key back to its own value: other blocks' keys are left as they are)
      for name, value in previous.items():
        if value is missing:
          overrides.pop(name, None)
        else:
          overrides[name] = value


def table() -> str:
  """The settings as a Markdown table (docs/tuning.md shows it; a test keeps the two equal)."""
  lines = ["| setting | environment variable | type | default | read at | what it does |",
           "|---|---|---|---|---|---|"]
  for s in SETTINGS.values():
    default = "unset" if s.default is None else f"`{s.default}`"
    env = f"`{s.env}`" if s.env else "(override only)"
    lines.append(f"| `{s.name}` | {env} | {s.type} | {default} | {s.read} | {s.doc} |")
  return "\n".join(lines)
