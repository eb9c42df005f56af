"""The GPU kernels' program order in whole training steps: ``jaxpool.optimize`` of unmodified
Flax steps (VGG-16 bfloat16 batch 64, float32 batch 32; the 3-D video CNN of
``benchmarks/optimize_gpu.py``) with the programs numbered in memory order (the kernels' order,
``triton_tile.program``) and rows first (their earlier order), side by side in one process:
each order's step is traced with that order set, and the timing rounds alternate the two.
Prints a table and saves ``benchmarks/results/order_steps_gpu.json``. Needs a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]
import flax_vgg  # noqa: E402
import optax  # noqa: E402
import optimize_gpu  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool._src.pallas.triton import tile as triton_tile  # noqa: E402

CASES = ("flax_vgg16_bf16_b64", "flax_vgg16_f32_b32", "video3d_f32_b8")


def build(name: str):
  cfg = optimize_gpu.STEPS[name][0]
  dtype = jnp.dtype(cfg["dtype"])
  if cfg["model"] == "video3d":
    model = optimize_gpu.video_model(dtype)
    shape = (cfg["batch"], cfg["frames"], cfg["size"], cfg["size"], 3)
  else:
    model = flax_vgg.VGG(flax_vgg.VGG16, 4096, 1000, dtype)
    shape = (cfg["batch"], cfg["size"], cfg["size"], 3)
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, cfg["batch"]), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), images)
  optimizer = optax.sgd(0.01, momentum=0.9)
  return model, optimizer, params, optimizer.init(params), images, labels


def main():
  rows = []
  for name in CASES:
    model, optimizer, params, opt_state, images, labels = build(name)
    steps, losses = {}, {}
    for order in ("memory", "rows"):
      triton_tile.ORDER = order  # (read while the step is traced, on its first call)
      step = flax_vgg.make_step(jaxpool.optimize(model.apply), optimizer)
      losses[order] = float(jax.block_until_ready(step(params, opt_state, images, labels)[2]))
      steps[order] = step
    triton_tile.ORDER = "memory"
    times = {k: [] for k in steps}
    for _ in range(5):  # rounds, alternating the orders
      for order, step in steps.items():
        state = (params, opt_state)
        jax.block_until_ready(step(*state, images, labels))
        t0 = time.perf_counter()
        for _ in range(10):
          out = step(*state, images, labels)
          state = out[:2]
        jax.block_until_ready(out)
        times[order].append((time.perf_counter() - t0) / 10 * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    row = dict(case=name, memory_ms=ms["memory"], rows_ms=ms["rows"],
               speedup=ms["rows"] / ms["memory"], loss_memory=losses["memory"],
               loss_rows=losses["rows"])
    rows.append(row)
    print(f"{name:22s} memory order {ms['memory']:.2f} ms  rows first {ms['rows']:.2f} ms  "
          f"({row['speedup']:.3f}x)  losses {losses['memory']:.6f} / {losses['rows']:.6f}",
          flush=True)
  path = os.path.join(ROOT, "benchmarks", "results", "order_steps_gpu.json")
  with open(path, "w") as f:
    json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind), rows=rows),
              f, indent=1)


if __name__ == "__main__":
  main()
