"""Probe: the backward kernels over blocks of rows (launch ``bw, bl, warps, bd, bh``) against one
block a program, on ``pooling_gpu.py``'s backward cases that an H200 ran below 0.85 of copy.

Times the max-pool backward (``triton._backward_call``) of each case at every launch of its
list (``--launches "case=bw,bl,w[,bd,bh];..."`` adds some), in ``--rounds`` interleaved rounds
(each launch's fastest round kept), and a copy of the kernel's bytes (read and written) for
scale. Prints, per case, each launch's time and its fraction of the copy bandwidth (512 MiB
read and written, as ``pooling_gpu.py`` measures it);
saves ``benchmarks/results/bwd_blocks_gpu.json`` (``--out``). Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAXPOOL_TUNE", "off")
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.windows import taps_dtype  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launches_gpu import _copy_ms, _parse, fastest_in_rounds  # noqa: E402

CASES = {
    "2d_bf16": ((128, 112, 112, 64), 2, "channels_last", "bfloat16"),
    "2d_nchw": ((128, 64, 112, 112), 2, "channels_first", "float32"),
    "3d_f32": ((16, 16, 56, 56, 64), 3, "channels_last", "float32"),
}
LAUNCHES = {
    "2d_bf16": ["8,64,2", "8,64,1", "4,64,1", "4,64,2", "16,64,2", "8,32,1", "8,64,2,1,2",
                "8,64,1,1,2", "4,64,2,1,2", "4,64,1,1,2", "8,64,2,1,4", "4,64,1,1,4",
                "8,32,2,1,2"],
    "2d_nchw": ["64,8,8", "64,8,8,1,4", "64,8,4,1,4", "64,4,4,1,4", "64,4,2,1,4", "32,8,4,1,4",
                "64,8,8,1,2", "64,16,8,1,4"],
    "3d_f32": ["16,64,8", "16,32,8,2,1", "16,32,4,2,1", "8,64,4,2,1", "8,32,4,2,2",
               "16,32,8,2,2", "16,64,8,2,1", "8,64,8", "8,32,4,1,2", "8,32,2,2,1"],
}


def _backward(taps, dy, *, shape, geom, launch):
  return pk._backward_call((taps, dy), shape, geom, "max", False, launch=launch)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default=",".join(CASES))
  ap.add_argument("--launches", default="")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                "bwd_blocks_gpu.json"))
  args = ap.parse_args()
  extra: dict[str, list[str]] = {}
  for item in filter(None, args.launches.split(";")):
    name, launch = item.split("=")
    extra.setdefault(name, []).append(launch)
  copy_gbs = (1 << 30) / _copy_ms(1 << 30) / 1e6  # (512 MiB f32 read and written)
  print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; copy {copy_gbs:.0f} GB/s")
  results = {"device": jax.devices()[0].device_kind, "copy_gbs": copy_gbs, "cases": {}}
  for name in args.cases.split(","):
    shape, n, fmt, dtype = CASES[name]
    geom = windows.make_geometry(shape, (3,) * n, (2,) * n, 1, None, False, fmt)
    out_shape = geom.output_shape(shape)
    rng = np.random.default_rng(0)
    taps = jnp.asarray(rng.integers(-1, 3 ** n, out_shape), taps_dtype(3 ** n))
    dy = jnp.asarray(rng.normal(size=out_shape), dtype)
    nbytes = taps.nbytes + dy.nbytes + math.prod(shape) * dy.dtype.itemsize
    launches = [_parse(t) for t in LAUNCHES[name] + extra.get(name, [])]
    fns = {lc: jax.jit(functools.partial(_backward, shape=shape, geom=geom, launch=lc))
           for lc in launches}
    want = np.asarray(fns[launches[0]](taps, dy))
    for lc, fn in fns.items():  # (every launch the same bits)
      got = np.asarray(fn(taps, dy))
      assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), lc
    best = fastest_in_rounds(fns, (taps, dy), args.rounds, samples=5)
    same_size = nbytes / _copy_ms(nbytes) / 1e6 / copy_gbs
    print(f"\n{name} {shape} {dtype} {fmt}: {nbytes / 1e6:.0f} MB; a copy of as many bytes "
          f"{same_size:.2f} of copy")
    rows = []
    for lc in sorted(launches, key=lambda lc: best[lc]):
      frac = nbytes / best[lc] / 1e6 / copy_gbs
      print(f"  {'x'.join(map(str, lc)):14s} {best[lc]:.4f} ms  {frac:.3f} of copy")
      rows.append({"launch": list(lc), "ms": best[lc], "of_copy": frac})
    results["cases"][name] = {"shape": list(shape), "dtype": dtype, "layout": fmt,
                              "bytes": nbytes, "same_size_copy": same_size, "launches": rows}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
