"""The launch model: a launch for a kernel that no cache entry or shipped table names, chosen
without tuning (``JAXPOOL_TUNE=model``, the default).

The data are tuning reports (``python -m jaxpool.tune --json``: every candidate's time for each
key tuned), kept in the package as *observations* (``tuning/observations.json``, made by
:func:`observations_from_report`; rebuild it with ``python -m jaxpool._src.pallas.tuning.model``,
:func:`main`): for each GPU kind and key, each candidate's time over the key's best, by the
candidate's *form*, its launch relative to the key's heuristic (:func:`form`: the log2 steps of
its columns, lanes and warps, and its block of rows).

:func:`scores` rates each form by how much faster or slower than the heuristic it ran on
observed keys like this one, at :data:`LEVELS` of likeness, broadest first: the same pass
(forward or backward) and layout; and the same number of spatial dimensions; and the same
window, strides and dilation; and the same GPU kind. A level's mean (the log time over the
best, capped at :data:`CAP`, less the heuristic's) is pulled towards the broader level's by
:data:`WEIGHT` observations' worth, so a level with few observations changes little and a
form never observed keeps the heuristic's rating, 0. :func:`choose` takes the candidate whose
form rates least, the heuristic unless another rates :data:`MARGIN` (1%) below it. How close
this comes to a tuned launch, on keys and geometries held out of the fit
(:func:`cross_validate`): docs/tuning.md.
"""

from __future__ import annotations

import collections
import functools
import importlib.resources
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxpool._src import settings
from jaxpool._src.pallas.triton.config import Launch

OBSERVATIONS = "observations.json"
HEURISTIC = "+0+0+0"  # the heuristic's own form
CAP = math.log(1.5)  # a candidate's log time over the best counts as at most this
WEIGHT = 3.0  # how many observations a level's mean is pulled towards the broader level's with
MARGIN = math.log(1.01)  # how much faster than the heuristic's another form must rate
# The levels of likeness, broadest first: the parts of a key (:func:`_parts`) and the GPU kind
# ("device") that an observed key shares with the key chosen for.
LEVELS = (("pass", "layout"), ("pass", "layout", "dims"),
          ("pass", "layout", "dims", "geometry"), ("pass", "layout", "dims", "geometry", "device"))


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
  each candidate's form to ``log(time / best)`` (the heuristic is a row's first candidate).
  Rows with fewer than two timed candidates tell nothing and are left out."""
  device = str(report.get("env", {}).get("device_kind", ""))
  out = []
  for row in report.get("rows", []):
    times = {k: float(v) for k, v in (row.get("times_ms") or {}).items() if v and v > 0}
    if not row.get("key") or len(times) < 2:
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


def _shipped_data() -> dict[str, Any]:
  try:
    path = importlib.resources.files(__package__).joinpath(OBSERVATIONS)
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  return data if isinstance(data, dict) else {}


@functools.lru_cache(maxsize=1)
def shipped_observations() -> tuple[dict[str, Any], ...]:
  """The observations shipped with the package (none where the file cannot be read)."""
  return tuple(_shipped_data().get("observations", []))


_GEOMETRY = re.compile(r"k([\dx]+)s([\dx]+)d([\dx]+)")


@functools.lru_cache(maxsize=4096)
def _parts(key: str) -> dict[str, Any]:
  """A key's parts that :data:`LEVELS` compare: its pass ("fwd", "bwd"), op, dtype, layout,
  ``geometry`` (window, strides and dilation, e.g. "k1x3x3s1x2x2d1x1x1") and ``dims``: how many
  spatial dimensions (1 to 3, counted from the last) the window, strides or dilation span."""
  op, dtype, layout, geometry = key.split("|")[:4]
  m = _GEOMETRY.match(geometry)
  if m is None:
    raise ValueError(f"not a tuning key's geometry: {geometry!r} (key {key!r})")
  spans = [any(int(v.split("x")[i]) > 1 for v in m.groups()) for i in range(3)]
  dims = 3 - spans.index(True) if any(spans) else 1
  return {"pass": op.rsplit("_", 1)[-1], "op": op, "dtype": dtype, "layout": layout,
          "geometry": m.group(0), "dims": dims}


def scores(key: str, device_kind: str,
           observations: Iterable[Mapping[str, Any]] | None = None) -> dict[str, float]:
  """Each form's rating for ``key`` on ``device_kind`` from ``observations`` (default the
  shipped ones): its capped log time over the best less the heuristic's, averaged at each of
  :data:`LEVELS` in turn, each level's mean pulled towards the broader one's with
  :data:`WEIGHT` observations' worth. Lower runs faster; 0 is the heuristic's (and an
  unobserved form's) rating."""
  obs = shipped_observations() if observations is None else observations
  if settings.get("tune_table") == "foreign":  # (as a GPU without a table: not its own data)
    obs = [o for o in obs if o["device"] != device_kind]
  mine = {**_parts(key), "device": device_kind}
  theirs = [({**_parts(o["key"]), "device": o["device"]}, o["times"]) for o in obs]
  score: dict[str, float] = {}
  for level in LEVELS:
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for parts, times in theirs:
      if any(parts[f] != mine[f] for f in level):
        continue
      base = min(float(times.get(HEURISTIC, 0.0)), CAP)
      for f, t in times.items():
        total[f] += min(float(t), CAP) - base
        count[f] += 1
    score = {f: (total.get(f, 0.0) + WEIGHT * score.get(f, 0.0)) / (count.get(f, 0) + WEIGHT)
             for f in {*score, *total}}
  return score


def _pick(forms: Sequence[str], score: Mapping[str, float]) -> int:
  """The index of the form in ``forms`` that rates least, another than the heuristic's only
  where it rates :data:`MARGIN` below it (the earlier on ties)."""
  return min(range(len(forms)), key=lambda i: (
      score.get(forms[i], 0.0) + (0.0 if forms[i] == HEURISTIC else MARGIN), i))


def choose(key: str, device_kind: str, heuristic: Launch, cands: Sequence[Launch],
           observations: Iterable[Mapping[str, Any]] | None = None) -> Launch:
  """The model's launch for ``key`` among ``cands`` (the tuner's candidates, the heuristic
  first): the one whose form rates least (:func:`scores`), the heuristic unless another form
  rates :data:`MARGIN` (1%) faster; so the heuristic where no observation favours another."""
  score = scores(key, device_kind, observations)
  order = list(dict.fromkeys([Launch.of(heuristic), *map(Launch.of, cands)]))
  return order[_pick([form(c, heuristic) for c in order], score)]


# ------------------------------------------------------------------ how well it chooses


def held_out_group(kind: str, observation: Mapping[str, Any]) -> str:
  """What :func:`cross_validate` holds out together: ``"key"``, one key on every GPU;
  ``"geometry"``, every key of one layout, window, strides and dilation (every op, dtype, size
  and GPU): a geometry the data do not hold, as a new shape usually is; ``"gpu"``, every key
  of one GPU kind: a GPU the data do not hold (``JAXPOOL_TUNE_TABLE=foreign``)."""
  if kind == "key":
    return observation["key"]
  if kind == "gpu":
    return observation["device"]
  if kind == "geometry":
    parts = _parts(observation["key"])
    return f"{parts['layout']}|{parts['geometry']}"
  raise ValueError(f"held out must be 'key', 'geometry' or 'gpu', got {kind!r}")


def cross_validate(observations: Sequence[Mapping[str, Any]], held_out: str = "geometry"
                   ) -> list[dict[str, Any]]:
  """Each observation chosen for with its group (:func:`held_out_group`) left out of the fit:
  ``{"device", "key", "model", "heuristic"}``, the time over the key's best of the model's
  choice among the key's candidates and of the heuristic's."""
  groups = [held_out_group(held_out, o) for o in observations]
  out = []
  for o, g in zip(observations, groups, strict=True):
    fit = [p for p, h in zip(observations, groups, strict=True) if h != g]
    score = scores(o["key"], o["device"], fit)
    times = o["times"]
    forms = sorted(times, key=lambda f: (f != HEURISTIC, f))
    chosen = forms[_pick(forms, score)]
    out.append({"device": o["device"], "key": o["key"], "model": math.exp(times[chosen]),
                "heuristic": math.exp(times[HEURISTIC])})
  return out


def summary(results: Sequence[Mapping[str, Any]], within: float = 1.05
            ) -> dict[str, dict[str, float]]:
  """:func:`cross_validate`'s results by GPU: how many keys, how many the model's choice and
  the heuristic bring within ``within`` of the best, and their mean times over the best."""
  out: dict[str, dict[str, float]] = {}
  for device in dict.fromkeys(r["device"] for r in results):
    rs = [r for r in results if r["device"] == device]
    out[device] = {"keys": len(rs),
                   "model_within": sum(r["model"] <= within for r in rs),
                   "heuristic_within": sum(r["heuristic"] <= within for r in rs),
                   "model_mean": sum(r["model"] for r in rs) / len(rs),
                   "heuristic_mean": sum(r["heuristic"] for r in rs) / len(rs)}
  return out


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m jaxpool._src.pallas.tuning.model [REPORT ...]``: rebuilds the shipped
  observations from tuning reports (default: those the shipped file was made from, under
  ``benchmarks/results/``; run from the repository's root), then prints how the model chooses
  on keys, geometries and GPUs held out of the fit."""
  import argparse  # (only here: the package's import stays lean)
  ap = argparse.ArgumentParser(prog="python -m jaxpool._src.pallas.tuning.model",
                               description=main.__doc__.split("\n")[0] if main.__doc__ else "")
  ap.add_argument("reports", nargs="*", help="tuning reports (python -m jaxpool.tune --json)")
  ap.add_argument("--out", default=None, help="where to write (default: the shipped file)")
  ap.add_argument("--check", action="store_true", help="only print the cross-validation")
  args = ap.parse_args(argv)
  out = args.out or str(importlib.resources.files(__package__).joinpath(OBSERVATIONS))
  if not args.check:
    reports = args.reports or [os.path.join("benchmarks", "results", name)
                               for name in _shipped_data().get("from", [])]
    if not reports:
      ap.error("no reports given, and the shipped observations name none")
    n = write_observations(reports, out)
    print(f"{out}: {n} observations from {', '.join(reports)}")
  with open(out, encoding="utf-8") as f:
    obs = json.load(f)["observations"]
  print("held out  GPU                        keys  model within 5%  heuristic within 5%  "
        "mean over best (model, heuristic)")
  for kind in ("key", "geometry", "gpu"):
    for device, s in summary(cross_validate(obs, kind)).items():
      print(f"{kind:9s} {device:26s} {s['keys']:4d}  {s['model_within']:4d} "
            f"({s['model_within'] / s['keys']:4.0%})      {s['heuristic_within']:4d} "
            f"({s['heuristic_within'] / s['keys']:4.0%})          "
            f"{s['model_mean']:.3f}, {s['heuristic_mean']:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
