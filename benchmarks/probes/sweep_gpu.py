"""Launch-configuration sweep for the Triton kernels (column block, channel block, warps).

Run on a GPU machine from the repository root::

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/probes/sweep_gpu.py \
    [--out DIR]

For each case of ``benchmarks/pooling_gpu.py`` and each kernel (forward, forward with argmax, max
backward), it times every ``(bw, bc, num_warps)`` in the grid below with the timer of
``pooling_gpu.py`` (fewer samples) and prints the fraction of the copy bandwidth; the table it saves
(``sweep.json``) is what the default launch heuristic in ``config.launch_config`` was chosen from
(see ``NOTES.md``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pooling_gpu as bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402

COLS = (8, 16, 32, 64)
WARPS = (2, 4, 8)
COLS_FIRST = (16, 32, 64, 128)  # channels_first: columns, and columns x planes
TILES = (512, 1024, 2048)


def _fwd(x, *, geom, cfg, argmax):
  return pk._window_call(x, geom, "argmax" if argmax else "max", False, launch=cfg)


def _bwd(idx, dy, *, shape, geom, cfg):
  return pk._backward_call((idx, dy), shape, geom, "max", False, launch=cfg)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--only", default="", help="run the cases whose name contains this")
  args = ap.parse_args()
  bench.REPS = 10
  copy = bench.copy_bandwidth()
  print(f"copy {copy:.0f} GB/s", flush=True)
  rows = []
  cases = [(c, dtype) for c in bench.CASES for dtype in c[-1] if args.only in c[0]]
  for (name, shape, window, strides, padding, data_format, _), dtype in cases:
    dt = jnp.dtype(dtype)
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dt)
    geom = windows.make_geometry(shape, window, strides, padding, data_format=data_format)
    y, idx = pk.max_forward_taps(x, geom, interpret=False)
    dy = jax.random.normal(jax.random.key(1), y.shape, jnp.float32).astype(dt)
    nx, ny, ni = x.size * dt.itemsize, y.size * dt.itemsize, idx.size
    if data_format == "channels_last":
      configs = list(itertools.product(COLS, (shape[-1],), WARPS))
    else:
      configs = [(bw, t // bw, w) for bw in COLS_FIRST for t in TILES for w in (4, 8)
                 if t // bw >= 1]
    for kernel, cfg in itertools.product(("fwd", "fwd_argmax", "bwd"), configs):
      if kernel == "bwd":
        fn = jax.jit(functools.partial(_bwd, shape=shape, geom=geom, cfg=cfg))
        argv, nbytes = (idx, dy), nx + ny + ni
      else:
        fn = jax.jit(functools.partial(_fwd, geom=geom, cfg=cfg, argmax=kernel != "fwd"))
        argv, nbytes = (x,), nx + ny + (ni if kernel != "fwd" else 0)
      try:
        ms = bench.time_jax(fn, *argv)
      except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
        print(f"{name} {dtype} {kernel} {cfg}: {type(e).__name__}", flush=True)
        continue
      frac = nbytes / ms / 1e6 / copy
      rows.append(dict(case=name, dtype=dtype, kernel=kernel, bw=cfg[0], bc=cfg[1],
                       warps=cfg[2], ms=ms, of_copy=frac))
    for kernel in ("fwd", "fwd_argmax", "bwd"):
      sel = [r for r in rows if r["case"] == name and r["dtype"] == dtype
             and r["kernel"] == kernel]
      best = sorted(sel, key=lambda r: r["ms"])[:3]
      print(f"{name:26s} {dtype:8s} {kernel:10s} " + "  ".join(
          f"({r['bw']},{r['bc']},{r['warps']}) {r['ms']:.3f} {r['of_copy']:.2f}" for r in best),
          flush=True)
  with open(os.path.join(args.out, "sweep.json"), "w") as f:
    json.dump({"copy_gbs": copy, "jax": jax.__version__, "device": str(jax.devices()[0]),
               "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
