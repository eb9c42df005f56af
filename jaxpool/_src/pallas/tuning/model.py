"""The launch model: a launch for a kernel that no cache entry or shipped table names, chosen
without tuning (``JAXPOOL_TUNE=model``, the default).

The data are tuning reports (``python -m jaxpool.tune --json``: every candidate's time for each
key tuned), kept in the package as *observations* (``tuning/observations.json``, made by
:func:`observations_from_report`): for each GPU kind and key, each candidate's time over the
key's best, by the candidate's *form*, its launch relative to the key's heuristic
(:func:`form`: the log2 steps of its columns, lanes and warps, and its block of rows).

:func:`choose` widens the shipped tables to geometry classes: a key's neighbours are the
observed keys of the same pass (forward or backward), layout, window, strides and dilation (any
columns, lanes, size, dtype or GPU), the nearest of them weighted by what else they share (the
GPU kind counts twice, the op and the dtype once); among the key's own candidates it picks the
form with the least mean log time over the best across those neighbours (shrunk towards
:data:`PRIOR` for forms seen rarely). Without neighbours it keeps the heuristic. How close this
comes to a tuned launch, on keys held out of the fit: docs/tuning.md.
"""

from __future__ import annotations

import collections
import functools
import importlib.resources
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxpool._src import settings
from jaxpool._src.pallas.triton.config import Launch

OBSERVATIONS = "observations.json"
PRIOR = 0.03  # the log time over the best that a form observed once is pulled towards
WEIGHT = 1.0  # how many observations of PRIOR a form's mean is shrunk with


def form(launch: Launch | Sequence[int], heuristic: Launch | Sequence[int]) -> str:
  """``launch`` relative to ``heuristic``: ``"+0-1+0"`` (half the lanes), ``"+0+0+0/1x2"``
  (the heuristic's tile in blocks of 1 x 2 rows)."""
  steps = "".join(f"{round(math.log2(a / b)):+d}" for a, b in zip(launch[:3], heuristic[:3],
                                                                        strict=True))
  return steps + (f"/{launch[3]}x{launch[4]}" if len(launch) == 5 else "")


def _parse(name: str) -> tuple[int, ...]:
  return tuple(int(v) for v in name.split("x"))


def observations_from_report(report: Mapping[str, Any]) -> list[dict[str, Any]]:
  """A tuning report's rows as observations: ``{"device", "key", "times"}``, ``times`` mapping
  each candidate's form to ``log(time / best)`` (the heuristic is a row's first candidate)."""
  device = str(report.get("env", {}).get("device_kind", ""))
  out = []
  for row in report.get("rows", []):
    times = {k: float(v) for k, v in (row.get("times_ms") or {}).items() if v and v > 0}
    if not row.get("key") or not times:
      continue
    heuristic = _parse(next(iter(times)))
    best = min(times.values())
    out.append({"device": device, "key": row["key"],
                "times": {form(_parse(n), heuristic): round(math.log(t / best), 5)
                          for n, t in times.items()}})
  return out


def write_observations(reports: Sequence[str], path: str) -> int:
  """Writes the observations of the tuning reports at ``reports`` (JSON files of
  ``python -m jaxpool.tune --json``) to ``path`` (the shipped file:
  ``tuning/observations.json``); returns how many."""
  obs = []
  sources = []
  for report in reports:
    with open(report, encoding="utf-8") as f:
      obs += observations_from_report(json.load(f))
    sources.append(report.replace("\\", "/").split("/")[-1])
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"from": sources, "observations": obs}, f, indent=0, sort_keys=True)
    f.write("\n")
  return len(obs)


@functools.lru_cache(maxsize=1)
def shipped_observations() -> tuple[dict[str, Any], ...]:
  """The observations shipped with the package (none where the file cannot be read)."""
  try:
    path = importlib.resources.files(__package__).joinpath(OBSERVATIONS)
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return ()
  return tuple(data.get("observations", [])) if isinstance(data, dict) else ()


def _parts(key: str) -> dict[str, str]:
  op, dtype, layout, geometry = key.split("|")[:4]
  return {"pass": op.rsplit("_", 1)[-1], "op": op, "dtype": dtype, "layout": layout,
          "window": geometry.split("w", 1)[0]}


def _affinity(a: Mapping[str, str], b: Mapping[str, str], same_device: bool) -> int | None:
  """How near an observed key is (None: not a neighbour)."""
  if any(a[f] != b[f] for f in ("pass", "layout", "window")):
    return None
  return 2 * same_device + (a["op"] == b["op"]) + (a["dtype"] == b["dtype"])


def scores(key: str, device_kind: str,
           observations: Iterable[Mapping[str, Any]] | None = None) -> dict[str, float]:
  """Each form's score for ``key`` on ``device_kind`` (lower is faster), from its nearest
  neighbours among ``observations`` (default the shipped ones); empty without neighbours."""
  obs = shipped_observations() if observations is None else observations
  if settings.get("tune_table") == "foreign":  # (as a GPU without a table: not its own data)
    obs = [o for o in obs if o["device"] != device_kind]
  mine = _parts(key)
  near = []
  for o in obs:
    a = _affinity(mine, _parts(o["key"]), o["device"] == device_kind)
    if a is not None:
      near.append((a, o))
  if not near:
    return {}
  top = max(a for a, _ in near)
  acc: dict[str, list[float]] = collections.defaultdict(list)
  for a, o in near:
    if a >= top - 1:
      for f, t in o["times"].items():
        acc[f].append(float(t))
  return {f: (sum(v) + PRIOR * WEIGHT) / (len(v) + WEIGHT) for f, v in acc.items()}


def choose(key: str, device_kind: str, heuristic: Launch, cands: Sequence[Launch],
           observations: Iterable[Mapping[str, Any]] | None = None) -> Launch:
  """The model's launch for ``key`` among ``cands`` (the tuner's candidates, the heuristic
  first): the one whose form scores least (:func:`scores`; on ties the earlier); the heuristic
  where no neighbour was observed."""
  score = scores(key, device_kind, observations)
  if not score:
    return Launch.of(heuristic)
  order = list(dict.fromkeys([Launch.of(heuristic), *map(Launch.of, cands)]))
  return min(order, key=lambda c: (score.get(form(c, heuristic), PRIOR), order.index(c)))
