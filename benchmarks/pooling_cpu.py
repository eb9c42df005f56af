"""CPU benchmark of the functional core against XLA's own pooling, in one run.

Times, on this machine: XLA's forward (``lax.reduce_window``), XLA's backward
(``jax.vjp`` of it: select_and_scatter) and forward+backward, against jaxpool's
``max_pool`` (XLA path) forward for inference, backward, and forward+backward; also avg pooling.
Prints a table (shape, dtype, ms, ratio) and saves it as JSON: by default
``benchmarks/results/pooling_cpu.json`` (the committed run that README.md and docs/benchmarks.md
quote), ``build/benchmarks/pooling_cpu_quick.json`` with ``--quick``, or ``--out PATH``
(``make demo`` writes under ``build/``, never over the committed file).

Usage: python benchmarks/pooling_cpu.py [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpool
from result_path import result_path

ROUNDS = 3  # timeit_all measures the contenders in rounds of three


def timed_calls(repeats: int) -> int:
  """How many calls of each contender ``timeit_all`` times for ``repeats``."""
  return ROUNDS * max(1, repeats // ROUNDS)


def timeit_all(calls: dict, repeats: int) -> dict:
  """Median wall time in ms of each ``fn(*args)``: per call, two warm-up runs, then ``repeats``
  timed runs back to back; the calls are measured one after another, in rounds of three, so
  that a change of load on this shared machine meets every contender."""
  for fn, args in calls.values():
    for _ in range(2):
      jax.block_until_ready(fn(*args))
  times: dict[str, list[float]] = {name: [] for name in calls}
  for _ in range(ROUNDS):
    for name, (fn, args) in calls.items():
      jax.block_until_ready(fn(*args))  # warm again after the previous contender
      for _ in range(timed_calls(repeats) // ROUNDS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[name].append((time.perf_counter() - t0) * 1e3)
  return {name: statistics.median(v) for name, v in times.items()}


def xla_max(x, window, strides, pad):
  """Flax/JAX users' max pool today: lax.reduce_window, channels_last."""
  return lax.reduce_window(x, -jnp.inf, lax.max, (1, *window, 1), (1, *strides, 1),
                           ((0, 0), *pad, (0, 0)))


def xla_avg(x, window, strides, pad):
  s = lax.reduce_window(x, 0.0, lax.add, (1, *window, 1), (1, *strides, 1),
                        ((0, 0), *pad, (0, 0)))
  return s / np.prod(window)


def case(shape, dtype, window, strides, pad, repeats):
  key = jax.random.key(0)
  # Integer-valued inputs (ties) drawn from a range, never zeros.
  x = jax.random.randint(key, shape, -50, 50).astype(dtype)
  cfg = dict(window=window, strides=strides, pad=pad)
  jp_max = lambda x: jaxpool.max_pool(x, window, strides, pad, implementation="xla")
  jp_avg = lambda x: jaxpool.avg_pool(x, window, strides, pad, implementation="xla")
  rw_max = lambda x: xla_max(x, **cfg)
  rw_avg = lambda x: xla_avg(x, **cfg)
  y = rw_max(x)
  dy = jax.random.normal(jax.random.key(1), y.shape, dtype)

  def fwd(f):
    return jax.jit(f)

  def bwd(f):
    # The backward alone: the forward's residuals are computed outside the timed call.
    _, vjp = jax.vjp(f, x)
    return jax.jit(lambda vjp, dy: vjp(dy)[0]), vjp

  def fwd_bwd(f):
    return jax.jit(lambda x, dy: jax.vjp(f, x)[1](dy)[0])

  rows = []
  for op, ours, theirs in (("max", jp_max, rw_max), ("avg", jp_avg, rw_avg)):
    fb_xla, vjp_xla = bwd(theirs)
    fb_ours, vjp_ours = bwd(ours)
    t = timeit_all({
        "xla_fwd": (fwd(theirs), (x,)),
        "jaxpool_fwd": (fwd(ours), (x,)),
        "xla_bwd": (fb_xla, (vjp_xla, dy)),
        "jaxpool_bwd": (fb_ours, (vjp_ours, dy)),
        "xla_fwd_bwd": (fwd_bwd(theirs), (x, dy)),
        "jaxpool_fwd_bwd": (fwd_bwd(ours), (x, dy)),
    }, repeats)
    # Same answer check (max: bitwise on these tie-rich inputs; avg: float rounding).
    a = fwd_bwd(ours)(x, dy)
    b = fwd_bwd(theirs)(x, dy)
    same = bool(jnp.array_equal(a, b)) if op == "max" else bool(
        jnp.allclose(a, b, rtol=1e-5, atol=1e-5))
    rows.append(dict(op=op, shape=list(shape), dtype=jnp.dtype(dtype).name, window=list(window),
                     strides=list(strides), padding=[list(p) for p in pad], same_result=same,
                     **{k: round(v, 3) for k, v in t.items()}))
  return rows


def residual_bytes(shape, window, strides, pad):
  """Bytes per output element that reverse mode keeps for jaxpool's max pool."""
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  f = lambda x: jaxpool.max_pool(x, window, strides, pad, implementation="xla")
  _, vjp = jax.vjp(f, jnp.zeros(x.shape, x.dtype))
  leaves = [a for a in jax.tree_util.tree_leaves(vjp) if hasattr(a, "dtype")]
  out = int(np.prod(jax.eval_shape(f, x).shape))
  return sum(a.size * a.dtype.itemsize for a in leaves) / out, [
      f"{a.dtype}{list(a.shape)}" for a in leaves]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="a smaller shape, fewer repeats")
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--out", default=None,
                  help="the JSON file (default: benchmarks/results/pooling_cpu.json; with "
                       "--quick, build/benchmarks/pooling_cpu_quick.json)")
  args = ap.parse_args()
  repeats = args.repeats or (5 if args.quick else 10)
  shape = (4, 56, 56, 64) if args.quick else (16, 112, 112, 64)
  cases = [(shape, jnp.float32, (3, 3), (2, 2), ((1, 1), (1, 1))),
           (shape, jnp.float32, (2, 2), (2, 2), ((0, 0), (0, 0)))]
  rows = []
  for c in cases:
    rows += case(*c, repeats=repeats)
  per_out, leaves = residual_bytes(*cases[0][:1], *cases[0][2:])

  head = (f"{'op':4} {'shape':>18} {'dtype':8} {'win/str/pad':12} {'fwd ms':>14} {'bwd ms':>15} "
          f"{'fwd+bwd ms':>15} {'bwd x':>6} {'f+b x':>6} {'fwd ratio':>9} same")
  cpu = platform.processor() or platform.machine()
  print(f"jaxpool CPU benchmark: jax {jax.__version__}, {cpu}, {os.cpu_count()} cores; "
        f"median of {timed_calls(repeats)} calls; 'xla' = lax.reduce_window and its vjp")
  print(head)
  print("-" * len(head))
  for r in rows:
    cfg = f"{r['window'][0]}x{r['window'][1]}/s{r['strides'][0]}/p{r['padding'][0][0]}"
    print(f"{r['op']:4} {'x'.join(map(str, r['shape'])):>18} {r['dtype']:8} {cfg:12} "
          f"{r['xla_fwd']:6.2f}/{r['jaxpool_fwd']:6.2f} "
          f"{r['xla_bwd']:7.2f}/{r['jaxpool_bwd']:6.2f} "
          f"{r['xla_fwd_bwd']:7.2f}/{r['jaxpool_fwd_bwd']:6.2f} "
          f"{r['xla_bwd'] / r['jaxpool_bwd']:6.1f} {r['xla_fwd_bwd'] / r['jaxpool_fwd_bwd']:6.1f} "
          f"{r['jaxpool_fwd'] / r['xla_fwd']:9.2f} {r['same_result']}")
  print("(each cell: xla/jaxpool; 'bwd x', 'f+b x': xla time over jaxpool time, higher is better;"
        " 'fwd ratio': jaxpool inference forward over lax.reduce_window, lower is better)")
  print(f"max-pool residual kept for the backward: {per_out:.2f} bytes per output element "
        f"({', '.join(leaves)})")
  path = args.out or result_path(__file__, "cpu", quick=args.quick)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dict(jax=jax.__version__, cores=os.cpu_count(), repeats=repeats,
                   timed_calls=timed_calls(repeats), rows=rows,
                   residual_bytes_per_output=per_out, residuals=leaves), f, indent=1)
  print(f"saved {os.path.relpath(path)}")


if __name__ == "__main__":
  main()
