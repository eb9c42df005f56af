"""Probe: what the average-pool gradient kernel's zero-sign select costs on a GPU.

Since commit 39977fa the average-pool backward kernel (``triton_backward.py``) ends each phase's
sum with a select that makes a zero sum ``+0.0`` wherever the sum skipped a tap, as the XLA
path's gradient is. This times the kernel as it is against the kernel as it was before that
commit (``--before REV``, default ``39977fa^``, read with ``git show``; or the path of a copy of
that file), on the benchmark's average-pool cases, rounds alternating, and checks that the two
agree except in zero signs. Prints a table and writes ``--out`` (JSON). Needs a GPU.

  PYTHONPATH=$PWD python benchmarks/probes/avg_grad_select_gpu.py --out avg_select.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAXPOOL_TUNE", "cached")
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.windows import make_geometry  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from separable_gpu import median_ms  # noqa: E402

CASES = [
    ("128x112x112x64 3x3/s2/p1", (128, 112, 112, 64), 3, 2, 1),
    ("64x224x224x64 2x2/s2", (64, 224, 224, 64), 2, 2, 0),
    ("16x16x56x56x64 3x3x3/s2/p1", (16, 16, 56, 56, 64), 3, 2, 1),
    ("2x128x128x128x32 3x3x3/s2/p1", (2, 128, 128, 128, 32), 3, 2, 1),
]


def _kernel_before(rev: str):
  """``backward_kernel`` of ``triton_backward.py`` at git revision ``rev`` (or of the copy of
  that file at the path ``rev``, where the machine has no ``.git``)."""
  path = rev
  if not os.path.isfile(rev):
    src = subprocess.run(["git", "show", f"{rev}:jaxpool/_src/pallas/triton_backward.py"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    path = os.path.join("/tmp", "jaxpool_triton_backward_before.py")
    with open(path, "w") as f:
      f.write(src)
  spec = importlib.util.spec_from_file_location("jaxpool_triton_backward_before", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.backward_kernel


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--before", default="39977fa^")
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  kernels = {"now": pk.backward_kernel, "before": _kernel_before(a.before)}
  rows = []
  for name, shape, k, s, p in CASES:
    n = len(shape) - 2
    geom = make_geometry(shape, (k,) * n, (s,) * n, ((p, p),) * n, (1,) * n, False,
                         "channels_last")
    for dtype in (jnp.float32, jnp.bfloat16):
      dy = jax.random.normal(jax.random.key(0), geom.output_shape(shape), jnp.float32)
      dy = dy.astype(dtype)
      fns, outs = {}, {}
      for label, kernel in kernels.items():
        pk.backward_kernel = kernel  # (read when the call is traced)
        fn = jax.jit(functools.partial(pk.avg_backward, in_shape=shape, geom=geom,
                                       interpret=False, count_include_pad=True,
                                       divisor_override=None))
        outs[label] = np.asarray(fn(dy).astype(jnp.float32))
        fns[label] = fn
      pk.backward_kernel = kernels["now"]
      same = bool(np.array_equal(outs["now"], outs["before"]))
      ms = {label: [] for label in fns}
      for _ in range(2):
        for label, fn in fns.items():
          ms[label].append(median_ms(fn, dy, reps=15))
      row = dict(case=name, dtype=jnp.dtype(dtype).name, equal_values=same,
                 **{f"{label}_ms": min(v) for label, v in ms.items()})
      row["now_over_before"] = row["now_ms"] / row["before_ms"]
      rows.append(row)
      print(f"{name:30s} {row['dtype']:9s} before {row['before_ms']:.4f} ms  now "
            f"{row['now_ms']:.4f} ms  ({row['now_over_before']:.3f}x time)  values equal {same}",
            flush=True)
  if a.out:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "before": a.before, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
  main()
