"""The graph module's training graph against ``jax.grad`` of the same graph, on one device.

Run from the repository root (a GPU machine; ``--quick`` for a small CPU smoke run)::

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/graph_gpu.py

The network is VGG-style: two conv3x3 + BatchNorm + ReLU blocks per stage, a 2x2/s2 max pool after
each stage, three stages, then a dense classifier and a softmax cross-entropy loss. One training
step's loss and gradients (and the new BatchNorm statistics) are computed three ways:

* ``jax.value_and_grad``: of ``Graph(loss).apply(params, state=, training=True, ...)`` with the
  graph's rewrite passes off (``passes=()``): what a user would write without the training graph;
* ``training graph``: ``training_graph(loss).run(params, state=, ...)`` with the passes off: the
  explicit gradient nodes (the max pools keep their 1-byte taps and call
  ``jaxpool.max_pool_grad_from_taps``);
* ``training graph + rewrites``: the same with the default passes (each ReLU read only by a max
  pool moves after it, fused into the pool).

Each is jitted; the median of ``--reps`` samples of ``--inner`` back-to-back steps is reported,
with the peak device memory of a fresh process for each (``memory_stats()``; none on a CPU).
Results: ``benchmarks/results/graph_gpu_<device>.json`` (``graph_gpu_h100.json`` on an H100);
``--quick`` runs go to ``build/benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpool import graph as jg  # noqa: E402
from result_path import device_tag, result_path  # noqa: E402

VARIANTS = ("value_and_grad", "training graph", "training graph + rewrites")


def network(size: int, widths: tuple[int, ...], classes: int, passes):
  image = jg.Input("image", shape=(size, size, 3))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = image
  for i, w in enumerate(widths):
    for j in range(2):
      x = jg.Conv(f"conv{i}_{j}", x, features=w, use_bias=False)
      x = jg.BatchNorm(f"bn{i}_{j}", x)
      x = jg.ReLU(f"relu{i}_{j}", x)
    x = jg.MaxPool(f"pool{i}", x, window=(2, 2))
  logits = jg.Dense("logits", x, features=classes)
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)
  kw = {} if passes is None else dict(passes=passes)
  return jg.Graph(loss, **kw), loss


def make_step(variant: str, size: int, widths, classes: int):
  if variant == "value_and_grad":
    g, _ = network(size, widths, classes, passes=())

    def step(params, state, images, labels):
      def f(p):
        return g.apply(p, state=state, training=True, image=images, label=labels)
      (loss, new_state), grads = jax.value_and_grad(f, has_aux=True)(params)
      return loss, grads, new_state
    return g, jax.jit(step)
  g, loss = network(size, widths, classes, passes=() if variant == "training graph" else None)
  train = jg.training_graph(g)

  def step(params, state, images, labels):
    return train.run(params, state=state, image=images, label=labels)
  return g, jax.jit(step)


def child(variant: str, quick: bool, reps: int, inner: int) -> dict:
  size, widths, batch = (16, (8, 16), 4) if quick else (112, (64, 128, 256), 64)
  classes = 10
  g, step = make_step(variant, size, widths, classes)
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, classes, batch), jnp.int32)
  params = g.init(jax.random.key(0))
  state = g.init_state()
  t0 = time.perf_counter()
  loss, grads, new_state = jax.block_until_ready(step(params, state, images, labels))
  compile_s = time.perf_counter() - t0
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = step(params, state, images, labels)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) * 1e3 / inner)
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  flat = jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(grads)])
  return dict(variant=variant, step_ms=statistics.median(samples), first_step_s=compile_s,
              loss=float(loss), grad_norm=float(jnp.linalg.norm(flat)),
              peak_mib=None if peak is None else peak / 2**20,
              config=dict(size=size, widths=widths, batch=batch))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  reps = args.reps or (3 if args.quick else 20)
  inner = 1 if args.quick else 5
  if args.child:
    print(json.dumps(child(args.child, args.quick, reps, inner)), flush=True)
    return
  rows = []
  for variant in VARIANTS:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--reps", str(reps)]
    proc = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
      rows.append(dict(variant=variant, error=(proc.stderr or proc.stdout)[-2000:]))
      print(f"{variant}: FAILED\n{rows[-1]['error']}", flush=True)
      continue
    rows.append(json.loads(lines[-1]))
  base = next((r["step_ms"] for r in rows if r["variant"] == "value_and_grad" and "step_ms" in r),
              None)
  print(f"\ntraining step of a VGG-style graph with BatchNorm on {jax.devices()[0].device_kind}")
  print(f"{'variant':<28} {'step ms':>8} {'vs value_and_grad':>18} {'peak MiB':>9} "
        f"{'loss':>9} {'|grad|':>10}")
  for r in rows:
    if "step_ms" not in r:
      print(f"{r['variant']:<28} failed")
      continue
    speed = f"{base / r['step_ms']:.2f}x" if base else "-"
    peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
    print(f"{r['variant']:<28} {r['step_ms']:8.2f} {speed:>18} {peak:>9} {r['loss']:9.5f} "
          f"{r['grad_norm']:10.5f}")
  path = result_path(__file__, device_tag(jax.devices()[0].device_kind), quick=args.quick)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
              indent=1)
  print("saved", path)
  sys.exit(1 if any("error" in r for r in rows) else 0)


if __name__ == "__main__":
  main()
