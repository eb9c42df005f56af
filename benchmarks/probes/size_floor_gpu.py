"""How far the kernels below 0.85 of copy are from what their size and bytes allow, on a GPU.

``pooling_gpu.py``'s rows, with its timer and its 1 GiB copy as the reference, for:

- the two cases whose rows fall below 0.85 on an H200 (128x112x112x64 3x3/s2/p1 bfloat16,
  16x16x56x56x64 3x3x3/s2/p1 float32);
- the same inputs pooled 2x2/s2 (2x2x2/s2): the same bytes read and written by every kernel
  (the outputs and the taps have the same shapes) with no window overlapping another, so each
  kernel reads each input (or cotangent) once: the kernels' floor at that size;
- the same two cases with twice the batch: the same kernels moving twice the bytes (a copy of
  a few hundred MB reaches less of the 1 GiB copy's bandwidth than a larger one).

Run on a GPU machine from the repository root::

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/probes/size_floor_gpu.py

Prints a table (the kernels' fractions of copy, and of the copy of the forward's bytes) and
saves ``benchmarks/results/size_floor_gpu.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

import pooling_gpu as bench  # noqa: E402
from jaxpool._src.pallas.tuning import tuner as tuning  # noqa: E402

CASES = [
    # name, shape, window, strides, padding, data_format, dtype
    ("128x112x112x64 3x3/s2/p1", (128, 112, 112, 64), (3, 3), (2, 2), 1, "bfloat16"),
    ("128x112x112x64 2x2/s2", (128, 112, 112, 64), (2, 2), (2, 2), 0, "bfloat16"),
    ("256x112x112x64 3x3/s2/p1", (256, 112, 112, 64), (3, 3), (2, 2), 1, "bfloat16"),
    ("16x16x56x56x64 3x3x3/s2/p1", (16, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1, "float32"),
    ("16x16x56x56x64 2x2x2/s2", (16, 16, 56, 56, 64), (2, 2, 2), (2, 2, 2), 0, "float32"),
    ("32x16x56x56x64 3x3x3/s2/p1", (32, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1, "float32"),
]


def main():
  ap = argparse.ArgumentParser()
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  ap.add_argument("--json", default=os.path.join(root, "benchmarks/results/size_floor_gpu.json"))
  args = ap.parse_args()
  dev = jax.devices()[0]
  copy_gbs = bench.copy_bandwidth()
  print(f"device {dev.device_kind}; jax {jax.__version__}; copy {copy_gbs:.0f} GB/s; "
        f"{tuning.TUNE_ENV}={tuning.mode()}", flush=True)
  results = []
  for name, shape, window, strides, padding, dtype in CASES:
    res = bench.run_case(name, shape, window, strides, padding, "channels_last", dtype, copy_gbs)
    results.append(res)
    r = res["rows"]
    same = r["copy_same_bytes"]["of_copy"]
    print(f"{name:28s} {dtype:8s} copy of its bytes {same:.3f} | "
          + " ".join(f"{k[7:] or 'fwd'}={r[k]['of_copy']:.3f} ({r[k]['of_copy'] / same:.3f})"
                     for k in bench.KERNELS)
          + " | " + " ".join(f"{op}={c}" for op, c in res["launch"].items()
                             if op in ("max_fwd", "argmax_fwd", "max_bwd", "avg_fwd")),
          flush=True)
  tuned = [t for t in tuning.report() if t.source == "tuned"]
  meta = {"device": dev.device_kind, "jax": jax.__version__, "copy_GBps": copy_gbs,
          "time": time.strftime("%Y-%m-%d %H:%M:%S"), "tuning": tuning.mode(),
          "tuned_kernels": len(tuned), "tuning_seconds": sum(t.seconds for t in tuned)}
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  with open(args.json, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
