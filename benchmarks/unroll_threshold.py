"""Where the XLA path should stop unrolling a window's taps: compile and run time of both forms.

For windows of 9 to 256 taps, times ``jax.jit(jax.grad(max_pool))`` (and the avg pool gradient)
on the default backend twice: with every tap unrolled into straight-line code and with the tap
loop. Prints a table and saves ``benchmarks/results/unroll_threshold_<backend>.json``.

  python benchmarks/unroll_threshold.py            # (16, 56, 56, 64) float32
  python benchmarks/unroll_threshold.py --quick    # smaller input, fewer sizes
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxpool
from jaxpool._src import xla_taps


def _time(fn, *args, samples=5):
  times = []
  for _ in range(samples):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(x, k: int, unrolled: bool, op: str):
  """(compile seconds, run seconds) of the gradient of a k x k, stride-2 pool of ``x``."""
  saved = xla_taps.UNROLL_TAPS, xla_taps.UNROLL_SUM_TAPS
  xla_taps.UNROLL_TAPS = xla_taps.UNROLL_SUM_TAPS = 10**9 if unrolled else 0
  jax.clear_caches()  # the ops are jitted per configuration: retrace them with this setting
  try:
    pool = getattr(jaxpool, op)
    f = jax.jit(jax.grad(lambda v: pool(v, (k, k), strides=(2, 2), padding=k // 2,
                                        implementation="xla").sum()))
    start = time.perf_counter()
    compiled = f.lower(x).compile()
    compile_s = time.perf_counter() - start
    return compile_s, _time(compiled, x)
  finally:
    xla_taps.UNROLL_TAPS, xla_taps.UNROLL_SUM_TAPS = saved


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  shape = (4, 32, 32, 32) if args.quick else (16, 56, 56, 64)
  sizes = (3, 6, 9, 12) if args.quick else (3, 5, 7, 8, 9, 10, 12, 16)
  x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
  rows = []
  print(f"backend {jax.default_backend()}, x {shape} float32, k x k window, stride 2, "
        f"padding k//2; gradient under jit")
  print(f"{'op':<9}{'taps':>6}{'compile unrolled':>18}{'compile loop':>14}"
        f"{'run unrolled ms':>17}{'run loop ms':>13}")
  for op in ("max_pool", "avg_pool"):
    for k in sizes:
      cu, ru = measure(x, k, True, op)
      cl, rl = measure(x, k, False, op)
      rows.append(dict(op=op, taps=k * k, compile_unrolled_s=cu, compile_loop_s=cl,
                       run_unrolled_ms=ru * 1e3, run_loop_ms=rl * 1e3))
      print(f"{op:<9}{k * k:>6}{cu:>17.2f}s{cl:>13.2f}s{ru * 1e3:>17.1f}{rl * 1e3:>13.1f}")
  results = pathlib.Path(__file__).parent / "results"  # benchmarks/results
  out = results / f"unroll_threshold_{jax.default_backend()}.json"
  out.write_text(json.dumps(dict(backend=jax.default_backend(), shape=shape, jax=jax.__version__,
                                 threshold=xla_taps.UNROLL_TAPS,
                                 sum_threshold=xla_taps.UNROLL_SUM_TAPS, rows=rows), indent=1))
  print(f"saved {out}")


if __name__ == "__main__":
  main()
