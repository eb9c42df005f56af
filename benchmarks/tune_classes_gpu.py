"""Tuning data for the launch model: every candidate's time on geometry classes no table names.

The launch model (``jaxpool/_src/pallas/tuning/model.py``) chooses a launch for an untuned key
from the tuning reports of keys like it. The shipped tables cover four geometries; this script
tunes more: the pooling layers of the model zoo (``benchmarks/models_gpu.py``: stride-1 and
overlapping windows, 1-D and 3-D pools, SPPF's 5x5) and random max-pool shapes drawn as
``first_call_gpu.py`` draws its cases, but from another seed, so that the cases that benchmark
checks stay out of the fit. Windows of more than 32 taps are left out (no kernel serves them).

Run on a GPU machine from the repository root (a few minutes)::

  python3 benchmarks/tune_classes_gpu.py            # tunes, saves the report
  python3 benchmarks/tune_classes_gpu.py --add      # tunes only the cases the saved report
                                                    # lacks, adds their rows to it
  python3 -m jaxpool._src.pallas.tuning.model benchmarks/results/tune_*.json
                                                    # rebuilds observations.json from the
                                                    # reports, prints the cross-validation

Saves ``benchmarks/results/tune_classes_<device>.json``, a ``python -m jaxpool.tune --json``
report (rows with every candidate's time); ``--print`` lists the cases and stops.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

SEED = 4848  # (first_call_gpu.py's cases use 48)
RANDOM_CASES = 36
MAX_TAPS = 32

# (shape, window, strides, padding, layout, dtypes, ops): the zoo's pooling layers.
ZOO = [
    ((32, 56, 56, 256), (3, 3), (1, 1), 1, "channels_last", ("bfloat16", "float32"), "all"),
    ((32, 35, 35, 192), (3, 3), (2, 2), 0, "channels_last", ("bfloat16",), "all"),
    ((16, 40, 40, 512), (5, 5), (1, 1), 2, "channels_last", ("bfloat16", "float32"), "max"),
    ((64, 56, 56, 128), (2, 2), (2, 2), 0, "channels_first", ("float32", "bfloat16"), "all"),
    ((32, 128, 56, 56), (3, 3), (1, 1), 1, "channels_first", ("float32",), "max"),
    ((64, 4096, 128), (2,), (2,), 0, "channels_last", ("float32", "bfloat16"), "all"),
    ((64, 4096, 128), (3,), (1,), 1, "channels_last", ("float32",), "max"),
    ((4, 32, 64, 64, 32), (2, 2, 2), (2, 2, 2), 0, "channels_last", ("float32", "bfloat16"),
     "all"),
    ((4, 32, 64, 64, 32), (3, 3, 3), (1, 1, 1), 1, "channels_last", ("float32",), "max"),
]
OPS = {"all": "max_fwd,argmax_fwd,max_bwd,avg_fwd,avg_bwd", "max": "argmax_fwd,max_bwd"}


def cases(random_cases: int = RANDOM_CASES) -> list[tuple[str, str]]:
  """``(case, ops)`` for ``python -m jaxpool.tune --case CASE --ops OPS``: the zoo's, then
  ``random_cases`` random ones (the first ones whatever the count: a longer list extends a
  shorter one)."""
  import first_call_gpu  # (its case generator: the same distribution, another seed)
  out = []
  for shape, window, strides, padding, layout, dtypes, ops in ZOO:
    out.append((":".join(("x".join(map(str, shape)), "x".join(map(str, window)),
                          "x".join(map(str, strides)), str(padding), ",".join(dtypes), layout)),
                OPS[ops]))
  drawn = [c for c in first_call_gpu.make_cases(3 * random_cases, seed=SEED)
           if math.prod(c["window"]) <= MAX_TAPS][:random_cases]
  for c in drawn:
    out.append((":".join(("x".join(map(str, c["shape"])), "x".join(map(str, c["window"])),
                          "x".join(map(str, c["strides"])), str(c["padding"]), c["dtype"],
                          c["data_format"])), OPS["max"]))
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--print", action="store_true", help="list the cases and stop")
  ap.add_argument("--budget-s", type=float, default=3.0, help="tuning budget a kernel (s)")
  ap.add_argument("--out", default=None, help="the report's path")
  ap.add_argument("--add", action="store_true",
                  help="tune only the cases the report at --out lacks and add their rows to it")
  ap.add_argument("--random-cases", type=int, default=RANDOM_CASES,
                  help=f"how many random shapes (default {RANDOM_CASES})")
  args = ap.parse_args()
  todo = cases(args.random_cases)
  if args.print:
    for case, ops in todo:
      print(case, ops)
    return 0
  import jax

  from jaxpool import tune
  from result_path import device_tag, result_path
  # (tune_classes_<device>.json: the name the shipped observations cite, not the script's
  # stem, which result_path would give)
  out = args.out or result_path("tune_classes.py", device_tag(jax.devices()[0].device_kind))
  merged: dict = {"rows": [], "seconds": 0.0}
  if args.add and os.path.exists(out):
    with open(out, encoding="utf-8") as f:
      merged = json.load(f)
    done = {row.get("case") for row in merged.get("rows", [])}
    todo = [(case, ops) for case, ops in todo if case not in done]
    print(f"{len(done)} cases in {out}; tuning {len(todo)} more")
  argv = ["--retune", "--budget-s", str(args.budget_s), "--json", out]
  # (one call a set of ops: the CLI takes one --ops for all its cases)
  groups: dict[str, list[str]] = {}
  for case, ops in todo:
    groups.setdefault(ops, []).append(case)
  reports = []
  for ops, group in groups.items():
    part = f"{out}.{len(reports)}"
    rc = tune.main([*argv[:-1], part, "--ops", ops, *(a for c in group for a in ("--case", c))])
    if rc:
      return rc
    reports.append(part)
  for part in reports:
    with open(part, encoding="utf-8") as f:
      rep = json.load(f)
    merged["env"] = rep.get("env")
    merged["rows"] += rep.get("rows", [])
    merged["seconds"] += float(rep.get("seconds", 0.0))
    os.remove(part)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(merged, f, indent=1)
    f.write("\n")
  print(f"{len(merged['rows'])} rows in {merged['seconds']:.0f} s -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
