"""Any kernel of ``pooling_gpu.py``'s cases at any launch configurations, side by side.

``--runs "case:op=bw,bl,w[,rd,rh][~];... case:op=..."``: for each case (a short name
below) and op (``max_fwd``, ``argmax_fwd``, ``avg_fwd`` with the padding counted, ``max_bwd``,
``avg_bwd``), times each launch in ``--rounds`` interleaved rounds (each launch's fastest
round kept, the tuner's timer), checks that every launch gives the first one's bits, and
prints each launch's time and fraction of the copy bandwidth (bytes counted as
``pooling_gpu.py`` counts them: forward ``x + y`` (+ the taps), backward ``dy`` (+ the taps)
``+ dx``; the copy ``x + 1`` over 1 GiB read and written). A trailing ``~``: the max
backward's selects one lane at a time (the ``packed_select`` setting off). Saves
``benchmarks/results/launches_gpu.json`` (``--out``). Needs a GPU. Why a maintainer runs it:
before offering a launch to the tuner, to see it against the table's launch in one process
(the same launch moves by a few percent between processes); docs/design/launches.md.

Example (the 3-D forward at the table's launch and in tiles of 4 columns)::

  python3 benchmarks/launches_gpu.py --runs "3d_f32:max_fwd=16,64,8,0,2;4,32,1,0,2"
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAXPOOL_TUNE", "off")
from jaxpool._src import settings, windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.pallas.tuning import tuner as tuning  # noqa: E402

CASES = {  # name: (shape, window, strides, padding, data_format, dtype)
    "2d_f32": ((128, 112, 112, 64), (3, 3), (2, 2), 1, "channels_last", "float32"),
    "2d_bf16": ((128, 112, 112, 64), (3, 3), (2, 2), 1, "channels_last", "bfloat16"),
    "2d_nchw": ((128, 64, 112, 112), (3, 3), (2, 2), 1, "channels_first", "float32"),
    "3d_f32": ((16, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1, "channels_last", "float32"),
}


def _parse(text: str) -> tuple[int, ...]:
  return tuple(int(v) for v in text.split(","))


def _parse_select(text: str) -> tuple[tuple[int, ...], bool]:
  """``bw,bl,w[,rd,rh][~]``: a launch and whether the max backward selects two lanes at a time
  (no ``~``)."""
  return _parse(text.rstrip("~")), not text.endswith("~")


def _call(op, geom, shape, launch, *ops):
  kind = op[:-4]
  if op.endswith("_fwd"):
    return pk._window_call(ops[0], geom, kind, False, include_pad=True, launch=launch)
  return pk._backward_call(ops, shape, geom, kind, False, include_pad=True, launch=launch)


def _copy_ms(nbytes: int) -> float:
  """A copy moving ``nbytes`` (``x + 1``: half of them read, half written)."""
  x = jnp.zeros((nbytes // 8,), jnp.float32)
  return tuning.time_ms(jax.jit(lambda v: v + 1), (x,), samples=15)


def fastest_in_rounds(fns: dict, args: tuple, rounds: int, samples: int) -> dict:
  """Each of ``fns``' fastest time (ms) over ``rounds`` rounds of the tuner's timer
  (``samples`` a round), each round starting one function later."""
  order = list(fns)
  best = {k: float("inf") for k in order}
  for r in range(rounds):
    for k in order[r % len(order):] + order[:r % len(order)]:
      best[k] = min(best[k], tuning.time_ms(fns[k], args, samples=samples))
  return best


def _operands(op, shape, geom, dtype):
  rng = np.random.default_rng(0)
  out_shape = geom.output_shape(shape)
  n_taps = geom.lift(3).num_taps
  if op.endswith("_fwd"):
    return (jnp.asarray(rng.normal(size=shape), dtype),)
  dyn = rng.normal(size=out_shape)
  dyn[rng.random(out_shape) < 0.05] = 0.0  # (zeros of both signs: the backward's rule for them)
  dyn[rng.random(out_shape) < 0.05] = -0.0
  dy = jnp.asarray(dyn, dtype)
  if op == "avg_bwd":
    return (dy,)
  return (jnp.asarray(rng.integers(-1, n_taps, out_shape), windows.taps_dtype(n_taps)), dy)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", required=True)
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--samples", type=int, default=3,
                  help="samples of the tuner's timer a launch a round (the tuner takes 1)")
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                "launches_gpu.json"))
  args = ap.parse_args()
  copy_gbs = (1 << 31) / _copy_ms(1 << 31) / 1e6
  dev = jax.devices()[0].device_kind
  print(f"device {dev}; jax {jax.__version__}; copy {copy_gbs:.0f} GB/s", flush=True)
  results = {"device": dev, "copy_gbs": copy_gbs, "runs": []}
  for run in args.runs.split():
    head, launches_text = run.split("=")
    name, op = head.split(":")
    shape, window, strides, padding, fmt, dtype = CASES[name]
    geom = windows.make_geometry(shape, window, strides, padding, data_format=fmt)
    ops = _operands(op, shape, geom, dtype)
    launches = [_parse_select(t) for t in launches_text.split(";")]  # (launch, packed)
    fns, outs = {}, {}
    for key in launches:
      fns[key] = jax.jit(functools.partial(_call, op, geom, shape, key[0]))
      with settings.override(packed_select=key[1]):  # (read while the first call traces)
        outs[key] = jax.block_until_ready(fns[key](*ops))
    nbytes = sum(o.nbytes for o in ops) + sum(o.nbytes for o in jax.tree.leaves(
        outs[launches[0]]))
    want = [np.asarray(o) for o in jax.tree.leaves(outs[launches[0]])]
    same = {lc: all(np.array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8))
                    for a, b in zip(jax.tree.leaves(o), want, strict=True))
            for lc, o in outs.items()}
    del outs
    best = fastest_in_rounds(fns, ops, args.rounds, samples=args.samples)
    print(f"\n{name} {op} {shape} {dtype} {fmt}: {nbytes / 1e6:.0f} MB", flush=True)
    rows = []
    for key in sorted(launches, key=lambda key: best[key]):
      frac = nbytes / best[key] / 1e6 / copy_gbs
      label = "x".join(map(str, key[0])) + ("" if key[1] else "~")
      print(f"  {label:16s} {best[key]:.4f} ms  {frac:.3f} of copy"
            f"{'' if same[key] else '  OTHER BITS'}", flush=True)
      rows.append({"launch": list(key[0]), "packed_select": key[1],
                   "ms": best[key], "of_copy": frac, "same_bits": same[key]})
    results["runs"].append({"case": name, "op": op, "shape": list(shape), "dtype": dtype,
                            "layout": fmt, "bytes": nbytes, "launches": rows})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
