"""The average pool's gradient split along depth over 2 GPUs, against one GPU.

A 3x3x3/s2/p1 average pool on 2 x S^3 x 32 (float32 and bfloat16), its gradient chained ten to a
jitted program (the launch paid once, as in a training step), on one GPU and with the volume
split along depth over two (an Auto mesh). ``count_include_pad=True`` runs each device's part
in place as one program on every device; ``count_include_pad=False`` (a padding row does not
count, so a neighbour's rows cannot stand as padding) takes a branch per device on a copy of
its block: the same kernels, the two ways of splitting them. Prints one JSON line a case (per
gradient milliseconds, bits equal to one GPU, the conditionals and collective-permutes in the
compiled program) and writes them to ``--out``::

  PYTHONPATH=$PWD python benchmarks/probes/avg_depth_gpu.py --out avg_depth.json
  # a smoke run on 2 CPU devices (XLA's path there, not the kernels)
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      PYTHONPATH=$PWD python benchmarks/probes/avg_depth_gpu.py --size 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpool

CHAIN = 10


def timed(f, *args) -> float:
  """Median milliseconds of one gradient: a program of ``CHAIN`` of them, over 15 samples."""
  for _ in range(2):
    jax.block_until_ready(f(*args))
  samples = []
  for _ in range(15):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    samples.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(samples) / CHAIN


def run(size: int) -> list[dict]:
  mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(0)
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((2, size, size, size, 32 if size > 16 else 2)), dtype)
    for include_pad in (True, False):
      kw = dict(window_shape=(3, 3, 3), strides=(2, 2, 2), padding=1,
                count_include_pad=include_pad)
      y_shape = jax.eval_shape(lambda v, kw=kw: jaxpool.avg_pool(v, **kw), x).shape
      dys = [jnp.asarray(rng.standard_normal(y_shape), dtype) for _ in range(CHAIN)]

      def chain(v, ds, kw=kw):
        # Each call its own cotangent, every gradient returned: the average pool's gradient
        # never reads its input, so XLA would otherwise merge or drop the calls.
        outs = []
        for d in ds:
          v = jax.vjp(lambda u: jaxpool.avg_pool(u, **kw), v)[1](d)[0]
          outs.append(v)
        return outs

      one = jax.devices()[0]
      whole = (jax.device_put(x, one), [jax.device_put(d, one) for d in dys])
      split = NamedSharding(mesh, P(None, "d"))
      parts = (jax.device_put(x, split), [jax.device_put(d, split) for d in dys])
      c1 = jax.jit(chain).lower(*whole).compile()
      c2 = jax.jit(chain).lower(*parts).compile()
      r1 = np.asarray(c1(*whole)[-1].astype(jnp.float32))
      r2 = np.asarray(c2(*parts)[-1].astype(jnp.float32))
      text = c2.as_text()
      row = dict(dtype=jnp.dtype(dtype).name, count_include_pad=include_pad,
                 one_gpu_ms=timed(c1, *whole), depth_ms=timed(c2, *parts),
                 equal=bool(np.array_equal(r1, r2)), conditionals=text.count(" conditional("),
                 permutes=text.count("collective-permute-start("))
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", type=int, default=128, help="the volume's side S")
  p.add_argument("--out", default="")
  a = p.parse_args()
  rows = run(a.size)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, devices=jax.device_count(),
                     jax=jax.__version__, size=a.size, chain=CHAIN, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
