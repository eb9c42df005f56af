"""The first call of a new shape, and the steady speed of its default launch (issue 48).

20 max-pool cases that no shipped table names (random sizes, windows 2-5, strides 1-3,
float32/bfloat16/float16, 1-D to 3-D, both layouts; a fixed seed), each in a NEW PROCESS with
an EMPTY tuning cache (``JAXPOOL_CACHE_DIR`` a fresh folder), for ``jax.jit(jax.value_and_grad(
loss))`` of ``jaxpool.max_pool``:

1. the first call's time and its parts, against ``implementation="xla"``'s (also in a process
   of its own): importing jax and the device, importing the Pallas kernels, tracing and
   lowering, compiling (XLA's compile, the Triton kernels' included), and running once. The
   parts are taken with JAX's ahead-of-time steps (``lower``, ``compile``), which together do
   what a first call does; the overhead over XLA is split into the Pallas import, the kernel
   compile (the difference in lowering and compiling) and the rest;
2. the steady time of the default launch (the shipped table, else the launch model) against a
   tuned one (``jaxpool.tune.pretune`` in the same process, then compiled again): interleaved
   rounds, the median of each.

Saves ``benchmarks/results/first_call_gpu_<device>.json`` (``--quick``: a smoke run on any
backend, saved under build/benchmarks/) and prints a table. On one H200 it takes about 5-7
minutes (``--max-cases``, ``--tune-budget-s`` and ``--deadline-s`` cap it)::

  python benchmarks/first_call_gpu.py
  python benchmarks/first_call_gpu.py --quick   # a CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from result_path import device_tag, result_path  # noqa: E402

SEED = 48
# The geometries (window, strides, dims) of the shipped tables' keys: left out of the cases.
TABLE_GEOMETRIES = {((3, 3), (2, 2)), ((2, 2), (2, 2)), ((3, 3, 3), (2, 2, 2))}
DTYPES = ("float32", "bfloat16", "float16")


def make_cases(n: int, seed: int = SEED, small: bool = False) -> list[dict]:
  """``n`` random cases: ``shape, window, strides, padding, data_format, dtype``."""
  rng = random.Random(seed)
  cases: list[dict] = []
  while len(cases) < n:
    dims = rng.choice((1, 2, 2, 3))
    window = tuple(rng.randint(2, 5) for _ in range(dims))
    strides = tuple(rng.randint(1, 3) for _ in range(dims))
    if (window, strides) in TABLE_GEOMETRIES:
      continue
    if small:
      spatial = [rng.randint(6, 12) for _ in range(dims)]
      batch, channels = rng.randint(1, 2), rng.randint(2, 8)
    else:  # (about 2^22 to 2^25 input elements: a layer of a model, not a toy)
      side = {1: (512, 8192), 2: (16, 160), 3: (8, 40)}[dims]
      spatial = [rng.randint(*side) for _ in range(dims)]
      channels = rng.choice((3, 16, 24, 40, 64, 96, 128, 200, 256))
      per = channels
      for s in spatial:
        per *= s
      batch = max(1, min(128, rng.randint(2**22, 2**25) // per))
    layout = rng.choice(("channels_last", "channels_first"))
    shape = ((batch, *spatial, channels) if layout == "channels_last"
             else (batch, channels, *spatial))
    cases.append({"shape": shape, "window": window, "strides": strides,
                  "padding": rng.choice((0, 1)) if min(window) > 2 else 0,
                  "data_format": layout, "dtype": rng.choice(DTYPES)})
  return cases


# ----------------------------------------------------------------------------- the child


def child(spec: dict, implementation: str, tune: bool, rounds: int) -> dict:
  """One case in this (new) process; returns its times in seconds (steady times in ms)."""
  t0 = time.perf_counter()
  import jax
  import jax.numpy as jnp
  jax.devices()
  t_jax = time.perf_counter() - t0
  t0 = time.perf_counter()
  import jaxpool
  if implementation != "xla":
    from jaxpool._src.pallas import ops  # noqa: F401  (what the first Pallas call imports)
  t_import = time.perf_counter() - t0
  kw = dict(window_shape=tuple(spec["window"]), strides=tuple(spec["strides"]),
            padding=spec["padding"], data_format=spec["data_format"])
  impl = None if implementation == "default" else implementation

  def loss(x):
    return jnp.sum(jaxpool.max_pool(x, **kw, implementation=impl).astype(jnp.float32) ** 2)

  step = jax.value_and_grad(loss)
  x = jax.random.normal(jax.random.key(0), tuple(spec["shape"]), jnp.float32).astype(
      spec["dtype"])
  jax.block_until_ready(x)
  t0 = time.perf_counter()
  lowered = jax.jit(step).lower(x)
  t_lower = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  t_compile = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(x))
  t_run = time.perf_counter() - t0
  out = {"jax_import_s": t_jax, "import_s": t_import, "lower_s": t_lower,
         "compile_s": t_compile, "run_s": t_run,
         "first_call_s": t_import + t_lower + t_compile + t_run}
  if implementation == "default":
    from jaxpool._src.pallas.tuning import tuner as tuning
    out["launches"] = {r.key: [tuning.launch_name(r.launch), r.source]
                       for r in tuning.report()}  # (empty: the call ran on XLA)
  if tune:
    from jaxpool import tune as jaxpool_tune
    from jaxpool._src.pallas.tuning import tuner as tuning
    t0 = time.perf_counter()
    records = jaxpool_tune.pretune(step, x)
    out["pretune_s"] = time.perf_counter() - t0
    out["tuned"] = {r.key: [tuning.launch_name(r.launch), r.source] for r in records}
    tuned = jax.jit(step).lower(x).compile()
    default_ms, tuned_ms = [], []
    for _ in range(rounds):  # (interleaved: a clock or a neighbour favours neither)
      default_ms.append(_sample_ms(compiled, x))
      tuned_ms.append(_sample_ms(tuned, x))
    out["default_ms"] = statistics.median(default_ms)
    out["tuned_ms"] = statistics.median(tuned_ms)
  return out


def _sample_ms(fn, x, sample_s: float = 0.01) -> float:
  import jax
  jax.block_until_ready(fn(x))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(x))
  calls = max(1, int(sample_s / max(time.perf_counter() - t0, 1e-6)))
  t0 = time.perf_counter()
  out = None
  for _ in range(calls):
    out = fn(x)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls * 1e3


def run_child(spec: dict, implementation: str, tune: bool, rounds: int,
              env_extra: dict) -> dict:
  with tempfile.TemporaryDirectory(prefix="jaxpool-first-call-") as cache:
    env = dict(os.environ, JAXPOOL_CACHE_DIR=cache, **env_extra)
    env.pop("JAXPOOL_TUNE", None)  # (the default mode: what a user gets)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec),
           "--implementation", implementation, "--rounds", str(rounds)]
    if tune:
      cmd.append("--tune")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
  if proc.returncode != 0:
    return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
            f"exit {proc.returncode}", "process_s": wall}
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  res["process_s"] = wall
  return res


# ----------------------------------------------------------------------------- the parent


def taps(spec: dict) -> int:
  n = 1
  for w in spec["window"]:
    n *= w
  return n


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--cases", type=int, default=20, help="how many cases (default 20)")
  ap.add_argument("--max-cases", type=int, default=None, help="run only the first N cases")
  ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
  ap.add_argument("--tune-budget-s", type=float, default=4.0,
                  help="JAXPOOL_TUNE_BUDGET_S for pretune, seconds a kernel (default 4)")
  ap.add_argument("--deadline-s", type=float, default=380.0,
                  help="start no new case after this many seconds (default 380)")
  ap.add_argument("--no-tune", action="store_true", help="first calls only (no pretune)")
  ap.add_argument("--quick", action="store_true",
                  help="a smoke run: 2 small cases, 2 rounds, any backend")
  ap.add_argument("--json", default=None, help="where to save (default: result_path)")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--implementation", default="default", help=argparse.SUPPRESS)
  ap.add_argument("--tune", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print(json.dumps(child(json.loads(args.child), args.implementation, args.tune,
                           args.rounds)))
    return 0
  n = 2 if args.quick else args.cases
  cases = make_cases(n, small=args.quick)[:args.max_cases]
  rounds = 2 if args.quick else args.rounds
  env_extra = {"JAXPOOL_TUNE_BUDGET_S": str(args.tune_budget_s)}
  import jax
  kind = jax.devices()[0].device_kind
  backend = jax.default_backend()
  if backend == "cpu" and not args.quick:
    ap.error("this benchmark needs a GPU (--quick runs a smoke test on a CPU)")
  print(f"device {kind}; jax {jax.__version__}; {len(cases)} cases, each in new processes "
        f"with an empty cache", flush=True)
  # An installed package has its bytecode (pip compiles it); a checkout run with
  # PYTHONDONTWRITEBYTECODE=1 would compile jaxpool's sources in every child, which a user's
  # first call does not pay: compile them once, here.
  compileall.compile_dir(os.path.join(os.path.dirname(HERE), "jaxpool"), quiet=1)
  start = time.perf_counter()
  rows = []
  for i, spec in enumerate(cases):
    if time.perf_counter() - start > args.deadline_s:
      print(f"deadline: {len(cases) - i} cases left out", flush=True)
      break
    xla = run_child(spec, "xla", False, rounds, env_extra)
    mine = run_child(spec, "default", not args.no_tune and backend != "cpu", rounds, env_extra)
    row = {"case": spec, "taps": taps(spec), "xla": xla, "default": mine}
    if "error" not in xla and "error" not in mine:
      row["overhead_s"] = mine["first_call_s"] - xla["first_call_s"]
      row["parts_s"] = {
          "pallas_import": mine["import_s"] - xla["import_s"],
          "kernel_compile": (mine["lower_s"] + mine["compile_s"])
          - (xla["lower_s"] + xla["compile_s"]),
          "other": mine["run_s"] - xla["run_s"]}
      if "tuned_ms" in mine:
        row["default_over_tuned"] = mine["default_ms"] / mine["tuned_ms"]
    rows.append(row)
    _print_row(i, row)
  summary = _summary(rows)
  print(json.dumps(summary, indent=1))
  path = args.json or result_path(__file__, device_tag(kind), quick=args.quick)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"device_kind": kind, "jax": jax.__version__, "seed": SEED,
               "tune_budget_s": args.tune_budget_s, "rounds": rounds, "summary": summary,
               "rows": rows}, f, indent=1)
  print(f"saved {path} ({time.perf_counter() - start:.0f} s)")
  return 0


def _print_row(i: int, row: dict) -> None:
  c = row["case"]
  name = (f"{'x'.join(map(str, c['shape']))} {'x'.join(map(str, c['window']))}/"
          f"s{'x'.join(map(str, c['strides']))} {c['dtype']} {c['data_format']}")
  if "overhead_s" not in row:
    print(f"{i:2d} {name}: failed: {row['xla'].get('error') or row['default'].get('error')}",
          flush=True)
    return
  p = row["parts_s"]
  steady = (f"; steady default/tuned {row['default_over_tuned']:.3f}"
            if "default_over_tuned" in row else "")
  if not row["default"].get("launches"):
    name += " [no Pallas kernel: XLA]"
  print(f"{i:2d} {name} ({row['taps']} taps): first call xla {row['xla']['first_call_s']:.2f} s,"
        f" default {row['default']['first_call_s']:.2f} s (+{row['overhead_s']:.2f}: import "
        f"{p['pallas_import']:.2f}, kernels {p['kernel_compile']:.2f}, other {p['other']:.2f})"
        f"{steady}", flush=True)


def _summary(rows: list[dict]) -> dict:
  ok = [r for r in rows if "overhead_s" in r]
  small = [r for r in ok if r["taps"] <= 9]
  steady = [r["default_over_tuned"] for r in ok if "default_over_tuned" in r]
  return {
      "cases": len(rows), "failed": len(rows) - len(ok),
      "max_overhead_s_up_to_9_taps": max((r["overhead_s"] for r in small), default=None),
      "cases_up_to_9_taps_over_0.5_s": sum(r["overhead_s"] > 0.5 for r in small),
      "overhead_s_over_9_taps": [round(r["overhead_s"], 2) for r in ok if r["taps"] > 9],
      "max_default_over_tuned": max(steady, default=None),
      "cases_default_over_tuned_above_1.05": sum(s > 1.05 for s in steady),
  }


if __name__ == "__main__":
  sys.exit(main())
