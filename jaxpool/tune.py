"""Pre-tunes the GPU kernels' launch configurations: ``python -m jaxpool.tune``.

Tunes the kernels of given pooling calls (or of ``benchmarks/pooling_gpu.py``'s cases, ``--preset
gpu-benchmark``) on this machine's GPU and writes them to the tuning cache (see
``docs/tuning.md``), so that later programs find them instead of tuning on first use; with
``--write-table PATH`` also a table in the format the package ships
(``jaxpool/_src/pallas/tuning/launch_tables/<device kind>.json``). Examples::

  python -m jaxpool.tune --preset gpu-benchmark
  python -m jaxpool.tune --case 32x56x56x256:3x3:2x2:1:bfloat16:channels_last --ops max_fwd
  python -m jaxpool.tune --preset gpu-benchmark --retune --write-table table.json

A case is ``SHAPE:WINDOW:STRIDES:PADDING:DTYPES:LAYOUT``, each tuple written with ``x``,
``PADDING`` an int or ``VALID``/``SAME``, ``DTYPES`` comma-separated.

From Python, :func:`pretune` tunes the kernels that a function's trace calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpool._src import settings, windows
from jaxpool._src.pallas.triton import config
from jaxpool._src.pallas.triton import ops as triton
from jaxpool._src.pallas.tuning import tuner as tuning
from jaxpool._src.platforms import platform

Case = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int | str, str,
             tuple[str, ...]]

# ``benchmarks/pooling_gpu.py``'s cases (a test keeps the two lists equal).
PRESETS: dict[str, list[Case]] = {
    "gpu-benchmark": [
        ("128x112x112x64 3x3/s2/p1", (128, 112, 112, 64), (3, 3), (2, 2), 1, "channels_last",
         ("float32", "bfloat16")),
        ("64x224x224x64 2x2/s2", (64, 224, 224, 64), (2, 2), (2, 2), 0, "channels_last",
         ("float32", "bfloat16")),
        ("128x64x112x112 NCHW 3x3/s2/p1", (128, 64, 112, 112), (3, 3), (2, 2), 1,
         "channels_first", ("float32",)),
        ("16x16x56x56x64 3x3x3/s2/p1", (16, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1,
         "channels_last", ("float32",)),
    ],
}


__all__ = ["main", "pretune"]


def pretune(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[tuning.Record]:
  """Tunes the GPU kernels that ``fn(*args, **kwargs)`` calls, ahead of its first call.

  Traces and lowers ``jax.jit(fn)`` for ``args`` (arrays or ``jax.ShapeDtypeStruct`` values; it is
  not run) noting each kernel's launch key, then tunes each key that the tuning cache and the
  shipped table do not hold (a few seconds each; ``JAXPOOL_TUNE_BUDGET_S``) and writes it to
  the cache. Then clears JAX's caches (``jax.clear_caches()``), so that ``fn``'s next trace,
  in this process or any later one, takes the tuned launches (in every ``JAXPOOL_TUNE`` mode
  but ``off``, which takes the heuristic).
  Pass a function of the shapes you run, e.g. ``jax.value_and_grad(loss)``, so that the
  backward kernels are tuned too.

  Returns:
    One record a kernel: its key, launch and ``source`` ("tuned", or "cache"/"table"/"memory"
    where it was known). Empty where the kernels do not run compiled (not an NVIDIA GPU).
  """
  if config.platform() != "cuda":
    return []
  jax.clear_caches()  # (a program traced before would not ask for its launches again)
  with tuning.recording() as found, settings.override(tune="model"):
    jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
  tuner = tuning.default_tuner()
  records, seen = [], set()
  with settings.override(tune="auto"):
    for key, heuristic, cands, trial in found:
      if key.name() in seen:
        continue
      seen.add(key.name())
      t0 = time.perf_counter()
      tuner.choose(key, heuristic, cands, trial, tune=True)
      record = tuner.records[-1]
      records.append(record)
      log = tuning.log.info if record.source == "tuned" else tuning.log.debug
      log("jaxpool.tune.pretune: %s: %s (%s, %.1f s)", key.name(),
          tuning.launch_name(record.launch), record.source, time.perf_counter() - t0)
  jax.clear_caches()
  return records


def parse_case(spec: str) -> Case:
  """``SHAPE:WINDOW:STRIDES:PADDING:DTYPES:LAYOUT`` -> a case (``ValueError`` naming it)."""
  parts = spec.split(":")
  if len(parts) != 6:
    raise ValueError(f"--case must be SHAPE:WINDOW:STRIDES:PADDING:DTYPES:LAYOUT, got {spec!r}")
  try:
    tup = lambda s: tuple(int(v) for v in s.lower().split("x"))
    shape, window, strides = tup(parts[0]), tup(parts[1]), tup(parts[2])
    padding: int | str = int(parts[3]) if parts[3].strip().lstrip("-").isdigit() else parts[3]
  except ValueError:
    raise ValueError(f"--case has a non-integer size: {spec!r}") from None
  dtypes = tuple(d.strip() for d in parts[4].split(",") if d.strip())
  for d in dtypes:
    jnp.dtype(d)  # (TypeError for an unknown name)
  return (spec, shape, window, strides, padding, parts[5], dtypes)


def tune_cases(cases: Sequence[Case], ops: Sequence[str]) -> list[dict]:
  """Chooses (tuning where needed) every op's configuration of every case and dtype."""
  rows = []
  for name, shape, window, strides, padding, data_format, dtypes in cases:
    geom = windows.make_geometry(shape, window, strides, padding, data_format=data_format)
    for dtype in dtypes:
      # (the average forward for both ways of counting its divisor, which its key holds:
      # count_include_pad=True, avg_pool's default as PyTorch's and Flax's, and False)
      for op, include_pad in [(o, pad) for o in ops
                              for pad in ((True, False) if o == "avg_fwd" else (False,))]:
        tuner = tuning.default_tuner()
        n0 = len(tuner.records)
        t0 = time.perf_counter()
        launch = triton.launch_for(op, shape, jnp.dtype(dtype), geom, interpret=False,
                                   include_pad=include_pad)
        seconds = time.perf_counter() - t0
        rec = tuner.records[-1] if len(tuner.records) > n0 else None
        times = rec.times_ms if rec else {}
        rows.append({"case": name, "dtype": dtype, "op": op, "launch": list(launch),
                     "include_pad": include_pad if op == "avg_fwd" else None,
                     "key": rec.key if rec else None, "source": rec.source if rec else None,
                     # (the key's choice, which a table holds: ``launch`` where the case
                     # could not take the key's block of rows is the heuristic)
                     "chosen": list(rec.launch) if rec else list(launch),
                     "seconds": seconds, "times_ms": times})
        best = times.get(tuning.launch_name(launch))
        first = next(iter(times.values()), None)  # the heuristic is timed first
        gain = f" {first / best:.2f}x the heuristic" if best and first else ""
        counting = f" ({triton.avg_counting(include_pad, None)})" if op == "avg_fwd" else ""
        print(f"{name} {dtype} {op}{counting}: {tuning.launch_name(launch)} ({rows[-1]['source']}, "
              f"{seconds:.1f} s){gain}", flush=True)
  return rows


def table(rows: Sequence[dict], env: dict, command: str) -> dict:
  """The shipped-table JSON of ``rows`` (key -> the key's choice; a call that cannot take the
  key's block of rows runs the heuristic, which its row's ``launch`` shows)."""
  return {"format": tuning.FORMAT, "device_kind": env.get("device_kind"), "produced_by": command,
          "produced_at": time.strftime("%Y-%m-%d %H:%M:%S"), "env": env,
          "entries": {r["key"]: r.get("chosen", r["launch"]) for r in rows if r["key"]}}


def main(argv: Sequence[str] | None = None) -> int:
  """The command; returns its exit status."""
  ap = argparse.ArgumentParser(prog="python -m jaxpool.tune", description=__doc__.split("\n")[0])
  ap.add_argument("--preset", choices=sorted(PRESETS), action="append", default=[],
                  help="a named list of cases (gpu-benchmark: benchmarks/pooling_gpu.py's)")
  ap.add_argument("--case", action="append", default=[],
                  help="SHAPE:WINDOW:STRIDES:PADDING:DTYPES:LAYOUT, e.g. "
                       "32x56x56x256:3x3:2x2:1:float32,bfloat16:channels_last")
  ap.add_argument("--ops", default=",".join(triton.OPS),
                  help=f"comma-separated kernels to tune (default all: {','.join(triton.OPS)})")
  ap.add_argument("--retune", action="store_true",
                  help="tune every key again, whatever the cache and the shipped table hold")
  ap.add_argument("--budget-s", type=float, default=None,
                  help=f"seconds a key at most (default ${tuning.BUDGET_ENV} or "
                       f"{tuning.DEFAULT_BUDGET_S:g})")
  ap.add_argument("--max-candidates", type=int, default=None,
                  help=f"one-row configurations a key at most (default "
                       f"${tuning.CANDIDATES_ENV} or {tuning.DEFAULT_MAX_CANDIDATES}; the "
                       f"forwards also try up to 10 blocks or loops of rows, the backwards 5)")
  ap.add_argument("--write-table", default=None, metavar="PATH",
                  help="also write the chosen configurations as a shipped table to PATH")
  ap.add_argument("--json", default=None, metavar="PATH", help="write the report to PATH")
  args = ap.parse_args(argv)
  try:
    cases = [c for p in args.preset for c in PRESETS[p]] + [parse_case(c) for c in args.case]
  except (ValueError, TypeError) as e:
    ap.error(str(e))
  ops = [o.strip() for o in args.ops.split(",") if o.strip()]
  if not cases:
    ap.error("give --preset or --case")
  if bad := [o for o in ops if o not in triton.OPS]:
    ap.error(f"--ops must name kernels of {triton.OPS}, got {bad}")
  overrides: dict[str, Any] = {"tune": "auto"}
  if args.budget_s is not None:
    if args.budget_s <= 0:
      ap.error(f"--budget-s must be positive, got {args.budget_s}")
    overrides["tune_budget_s"] = args.budget_s
  if args.max_candidates is not None:
    if args.max_candidates < 1:
      ap.error(f"--max-candidates must be at least 1, got {args.max_candidates}")
    overrides["tune_max_candidates"] = args.max_candidates
  if platform() != "cuda":
    print(f"python -m jaxpool.tune: tuning needs an NVIDIA GPU; the default backend is "
          f"{platform()!r}", file=sys.stderr)
    return 2
  tuner = tuning.Tuner(table={} if args.retune else None, fresh=args.retune)
  t0 = time.perf_counter()
  with tuning.using(tuner), settings.override(**overrides):
    env = tuner.env
    print(f"device {env['device_kind']}; jax {env['jax']}, jaxlib {env['jaxlib']}; "
          f"cache {tuner.cache}", flush=True)
    rows = tune_cases(cases, ops)
  total = time.perf_counter() - t0
  tuned = [r for r in rows if r["source"] == "tuned"]
  print(f"{len(rows)} kernels, {len(tuned)} tuned, in {total:.1f} s "
        f"(tuning {sum(r['seconds'] for r in tuned):.1f} s)")
  command = "python -m jaxpool.tune " + " ".join(sys.argv[1:] if argv is None else argv)
  if args.write_table:
    os.makedirs(os.path.dirname(os.path.abspath(args.write_table)), exist_ok=True)
    with open(args.write_table, "w", encoding="utf-8") as f:
      json.dump(table(rows, env, command), f, indent=1, sort_keys=True)
      f.write("\n")
    print(f"table written to {args.write_table}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"env": env, "seconds": total, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
