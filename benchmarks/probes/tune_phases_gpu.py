"""Where a kernel's tuning time goes: the heuristic's compile, the other candidates' compiles,
the random inputs and the timing rounds, for each kernel of one case tuned from an empty cache.

  python benchmarks/probes/tune_phases_gpu.py [--shape 128x112x112x64] [--budget-s 12]

Prints one line a kernel; needs an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax.numpy as jnp

from jaxpool._src import windows
from jaxpool._src.pallas.triton import ops as triton
from jaxpool._src.pallas.tuning import tuner as tuning


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="128x112x112x64")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--budget-s", type=float, default=12.0)
  a = ap.parse_args()
  os.environ[tuning.BUDGET_ENV] = str(a.budget_s)
  os.environ.pop(tuning.TUNE_ENV, None)
  shape = tuple(int(n) for n in a.shape.split("x"))
  geom = windows.make_geometry(shape, (3,) * (len(shape) - 2), (2,) * (len(shape) - 2), 1)
  phases: dict[str, float] = {}

  class Timed(tuning.Tuner):
    def tune(self, key, heuristic, cands, trial, *, budget=None):
      def compile_(launch):
        t0 = time.perf_counter()
        out = trial.compile(launch)
        name = "compile_heuristic" if launch == heuristic else "compile_other_max"
        phases[name] = max(phases.get(name, 0.0), time.perf_counter() - t0)
        return out

      def args():
        t0 = time.perf_counter()
        out = trial.args()
        phases["args"] = time.perf_counter() - t0
        return out

      t0 = time.perf_counter()
      rec = super().tune(key, heuristic, cands, tuning.Trial(compile_, args), budget=budget)
      phases["total"] = time.perf_counter() - t0
      return rec

  with tempfile.TemporaryDirectory() as cache:
    tuner = Timed(cache=cache, table={}, fresh=True)
    with tuning.using(tuner):
      for op in triton.OPS:
        phases.clear()
        t0 = time.perf_counter()
        launch = triton.launch_for(op, shape, jnp.dtype(a.dtype), geom, interpret=False)
        rec = tuner.records[-1]
        print(f"{op:11s} {tuning.launch_name(launch):14s} timed {len(rec.times_ms)} "
              f"call {time.perf_counter() - t0:5.1f} s | "
              + " ".join(f"{k} {v:5.2f}" for k, v in phases.items()), flush=True)


if __name__ == "__main__":
  main()
