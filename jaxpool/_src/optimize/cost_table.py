"""The measured cost tables: jaxpool's max pool against XLA's, per geometry class, per GPU kind.

A table is ``cost_tables/<device kind>.json`` beside this module (``NVIDIA_H200.json``),
shipped with the package. It is generated, never written by hand, from the results of the
window sweep (``benchmarks/windows_gpu.py``) on that kind of GPU::

  python -m jaxpool._src.optimize.cost_table benchmarks/results/windows_gpu_h200.json

which reads the results file and (re)writes the table of the device kind it names. Each cell
is a geometry class (the number of spatial dims, the dtype, the window and the strides per dim)
with its two measured ratios, XLA's time over jaxpool's (above 1: jaxpool faster) for the
forward and for the forward + gradient, as the sweep measured them (``implementation=None``).
The table names its source: the results file, the script, the device kind and the date.
``tests/optimize/test_cost_table.py`` regenerates each table from its results file and fails
when they differ (a rerun of the sweep without the command above).

:func:`nearest` picks the cell that :func:`jaxpool.optimize`'s cost model
(``cost.default_cost``) reads for a site; the model decides what a ratio means.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.resources
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from jaxpool._src.xla_taps import SEPARABLE_TAPS

FORMAT = 1
TABLES = "cost_tables"  # the shipped tables: a package folder beside this module
SCRIPT = "benchmarks/windows_gpu.py"
PASSES = ("fwd", "fwd_grad")
PASS_NAMES = {"fwd": "forward", "fwd_grad": "forward+gradient"}


@dataclasses.dataclass(frozen=True)
class Cell:
  """One measured geometry class and its ratios (XLA's time over jaxpool's)."""

  nspatial: int
  dtype: str
  window: tuple[int, ...]
  strides: tuple[int, ...]
  fwd: float
  fwd_grad: float

  @property
  def name(self) -> str:
    """``"13x13/s13"`` (``"13x13/s2x1"`` where the strides differ per dim)."""
    return geometry_name(self.window, self.strides)


@dataclasses.dataclass(frozen=True)
class Table:
  """A device kind's cells and where they come from."""

  device_kind: str
  results: str  # the results file, relative to the repository
  script: str
  date: str  # the day of the run (YYYY-MM-DD)
  cells: tuple[Cell, ...]

  @property
  def source(self) -> str:
    """``"benchmarks/windows_gpu.py, 2026-11-29"``: what a reason cites."""
    return f"{self.script}, {self.date}"


def geometry_name(window: Sequence[int], strides: Sequence[int]) -> str:
  w = "x".join(map(str, window))
  s = str(strides[0]) if len(set(strides)) == 1 else "x".join(map(str, strides))
  return f"{w}/s{s}"


def table_name(device_kind: str) -> str:
  """The table's file name for a device kind: ``"NVIDIA H200"`` -> ``NVIDIA_H200.json`` (the
  launch tables' rule)."""
  return re.sub(r"[^A-Za-z0-9]+", "_", device_kind).strip("_") + ".json"


# ----------------------------------------------------------------------------- generating


def build(results: dict[str, Any], results_path: str) -> dict[str, Any]:
  """The table (a JSON object) of a ``windows_gpu.py`` results object read from
  ``results_path`` (a path relative to the repository, as the table cites it).

  Raises:
    ValueError: the results are a ``--quick`` smoke run, name no device or hold no cells.
  """
  meta = results.get("meta") or {}
  if meta.get("quick"):
    raise ValueError(f"{results_path} is a --quick smoke run, not a measurement")
  kind = str(meta.get("device") or "")
  if not kind or kind.lower() == "cpu":
    raise ValueError(f"{results_path} names no GPU (meta.device {kind!r})")
  cells = []
  for c in results.get("cells") or []:
    window, strides = [int(v) for v in c["window"]], [int(v) for v in c["strides"]]
    cells.append({"nspatial": len(window), "dtype": str(c["dtype"]), "window": window,
                  "strides": strides,
                  **{p: round(float(c["speedup"][p]), 3) for p in PASSES}})
  if not cells:
    raise ValueError(f"{results_path} holds no cells of the sweep")
  cells.sort(key=lambda c: (c["nspatial"], c["dtype"], c["window"], c["strides"]))
  date = str(meta.get("time", ""))[:10]
  try:
    datetime.date.fromisoformat(date)
  except ValueError:
    raise ValueError(f"{results_path} has no date of its run (meta.time "
                     f"{meta.get('time')!r})") from None
  return {"format": FORMAT, "device_kind": kind, "results": results_path, "script": SCRIPT,
          "date": date, "jax": str(meta.get("jax", "")), "timer": str(meta.get("timer", "")),
          "ratio": "XLA's time over jaxpool's (above 1: jaxpool faster); implementation=None",
          "cells": cells}


def dumps(table: dict[str, Any]) -> str:
  """The table as its file holds it: a line a cell."""
  head = {k: v for k, v in table.items() if k != "cells"}
  lines = [json.dumps(head, indent=1)[:-2] + ',\n "cells": [']
  lines += [" " + json.dumps(c) + ("," if i < len(table["cells"]) - 1 else "")
            for i, c in enumerate(table["cells"])]
  return "\n".join(lines) + "\n ]\n}\n"


def tables_dir() -> str:
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), TABLES)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m jaxpool._src.optimize.cost_table RESULTS.json [--out FILE]``."""
  import argparse
  ap = argparse.ArgumentParser(
      prog="python -m jaxpool._src.optimize.cost_table",
      description="Regenerates a GPU kind's cost table from benchmarks/windows_gpu.py results.")
  ap.add_argument("results", help="benchmarks/results/windows_gpu_<device>.json")
  ap.add_argument("--out", default=None, help="the table (default: jaxpool/_src/optimize/"
                  f"{TABLES}/<device kind>.json)")
  a = ap.parse_args(argv)
  with open(a.results) as f:
    results = json.load(f)
  rel = os.path.relpath(os.path.abspath(a.results), repository_root()).replace(os.sep, "/")
  table = build(results, rel)
  out = a.out or os.path.join(tables_dir(), table_name(table["device_kind"]))
  with open(out, "w") as f:
    f.write(dumps(table))
  print(f"{out}: {len(table['cells'])} cells of {table['device_kind']} ({rel}, {table['date']})")
  return 0


def repository_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))


# ----------------------------------------------------------------------------- reading


def parse(text: str, where: str) -> Table:
  """A table from its file's text (``where`` names it in errors)."""
  try:
    raw = json.loads(text)
    if raw.get("format") != FORMAT:
      raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT}")
    cells = tuple(Cell(int(c["nspatial"]), str(c["dtype"]), tuple(map(int, c["window"])),
                       tuple(map(int, c["strides"])), float(c["fwd"]), float(c["fwd_grad"]))
                  for c in raw["cells"])
    datetime.date.fromisoformat(raw["date"])
    return Table(str(raw["device_kind"]), str(raw["results"]), str(raw["script"]),
                 str(raw["date"]), cells)
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"the cost table {where} cannot be read: {e}") from e


@functools.cache
def load(device_kind: str) -> Table | None:
  """The shipped table of ``device_kind``, or None where none ships."""
  path = importlib.resources.files(__package__).joinpath(TABLES, table_name(device_kind))
  try:
    text = path.read_text()
  except (FileNotFoundError, OSError):
    return None
  return parse(text, f"{TABLES}/{table_name(device_kind)}")


def form(window: Sequence[int]) -> str:
  """Which of jaxpool's forms runs a window: ``"separable"`` beyond ``SEPARABLE_TAPS`` taps,
  else ``"direct"`` (the kernels on an NVIDIA GPU)."""
  return "separable" if math.prod(window) > SEPARABLE_TAPS else "direct"


def distance(cell: Cell, window: Sequence[int], strides: Sequence[int]) -> float:
  """How far a cell is from a geometry: per dim, the distance of the window sizes and of the
  strides relative to the window, each on a log scale (0: the same class)."""
  d = 0.0
  for k, s, ck, cs in zip(window, strides, cell.window, cell.strides, strict=True):
    d += abs(math.log(k / ck)) + abs(math.log((s / k) / (cs / ck)))
  return d


def nearest(table: Table, dtype: str, window: Sequence[int],
            strides: Sequence[int]) -> Cell | None:
  """The measured cell nearest to a geometry: the same number of spatial dims, the same dtype
  and the same form (:func:`form`), then the least :func:`distance` (the first in the table on
  a tie); None where no cell qualifies."""
  same = [c for c in table.cells
          if c.nspatial == len(window) and c.dtype == dtype and form(c.window) == form(window)]
  if not same:
    return None
  return min(same, key=lambda c: distance(c, window, strides))


if __name__ == "__main__":
  sys.exit(main())
