"""Probe: where the data-parallel VGG-16 step's time goes on several GPUs.

The step of ``benchmarks/multi_gpu.py``'s VGG part (Flax VGG-16, bfloat16, 64 images a GPU,
SGD with momentum, batch split on an Auto mesh), plain or through ``jaxpool.optimize``: its
median time, then a profile of five steps (``jax.profiler``) and, per GPU and step, the time
its kernels keep it busy, the time of the collectives (NCCL kernels), how much of that overlaps
other kernels, and the time from the last collective's start to the end of the step. Set
``XLA_FLAGS`` to compare XLA's schedulers. Prints one JSON line per variant; ``--out`` appends
them to a file::

  PYTHONPATH=$PWD python benchmarks/probes/vgg_overlap_gpu.py --variants plain,optimize
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import jaxpool  # noqa: E402


def build(variant: str, per: int, small: bool):
  import flax_vgg
  import optax
  n = jax.device_count()
  model, images, labels, params = flax_vgg.benchmark_setup(per * n, small=small)
  optimizer = optax.sgd(0.01, momentum=0.9)
  apply = model.apply if variant == "plain" else jaxpool.optimize(model.apply)

  def loss(p, x, y):
    logits = apply(p, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(p, s, x, y):
    value, grads = jax.value_and_grad(loss)(p, x, y)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  m = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,))
  rep, data = NamedSharding(m, P()), NamedSharding(m, P("d"))
  args = (jax.device_put(params, rep), jax.device_put(optimizer.init(params), rep),
          jax.device_put(images, data), jax.device_put(labels, data))
  return jax.jit(step), args


def median_ms(fn, args, reps: int = 20) -> float:
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples) * 1e3


def _union(intervals):
  """Total length of the union of ``(start, end)`` intervals, and the merged intervals."""
  merged = []
  for s, e in sorted(intervals):
    if merged and s <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], e)
    else:
      merged.append([s, e])
  return sum(e - s for s, e in merged), merged


def _overlap(a, merged_b):
  """Length of interval list ``a`` covered by the merged, sorted intervals ``merged_b``."""
  total = 0.0
  for s, e in a:
    for bs, be in merged_b:
      if be <= s:
        continue
      if bs >= e:
        break
      total += min(e, be) - max(s, bs)
  return total


def profile(fn, args, steps: int = 5, top: int = 0) -> dict:
  """Per GPU and call of ``fn``: busy, compute and collective time and their overlap (ms),
  and with ``top`` the ``top`` kernel names that take longest (ms a call)."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp()
  jax.profiler.start_trace(folder)
  for _ in range(steps):
    jax.block_until_ready(fn(*args))
  jax.profiler.stop_trace()
  path = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)[0]
  events = json.load(gzip.open(path))["traceEvents"]
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  per_dev = collections.defaultdict(lambda: {"nccl": [], "other": []})
  kernels = collections.defaultdict(collections.Counter)
  for e in events:
    name = names.get(e.get("pid"), "")
    if e.get("ph") != "X" or "GPU" not in name or "dur" not in e:
      continue
    kind = "nccl" if "nccl" in e["name"].lower() else "other"
    per_dev[name][kind].append((e["ts"], e["ts"] + e["dur"]))
    kernels[name][e["name"][:80]] += e["dur"]
  out = {}
  for dev, kinds in sorted(per_dev.items()):
    busy, _ = _union(kinds["nccl"] + kinds["other"])
    compute, merged_other = _union(kinds["other"])
    nccl, _ = _union(kinds["nccl"])
    hidden = _overlap(_union(kinds["nccl"])[1], merged_other)
    out[dev] = {k: round(v / steps / 1e3, 3) for k, v in dict(
        busy_ms=busy, compute_ms=compute, nccl_ms=nccl, nccl_overlapped_ms=hidden).items()}
    out[dev]["nccl_kernels_per_step"] = len(kinds["nccl"]) / steps
    if top:
      out[dev]["top_kernels_ms"] = {k: round(v / steps / 1e3, 4)
                                    for k, v in kernels[dev].most_common(top)}
  return out


def emit(row: dict, out: str) -> None:
  """Prints ``row`` as one JSON line, and appends it to the file ``out`` (if given)."""
  print(json.dumps(row), flush=True)
  if out:
    with open(out, "a") as f:
      f.write(json.dumps(row) + "\n")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variants", default="plain,optimize")
  ap.add_argument("--per-gpu", type=int, default=64)
  ap.add_argument("--smoke", action="store_true", help="a small VGG on whatever devices")
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  for variant in a.variants.split(","):
    fn, args = build(variant, 2 if a.smoke else a.per_gpu, a.smoke)
    row = dict(variant=variant, devices=jax.device_count(),
               device=jax.devices()[0].device_kind, xla_flags=os.environ.get("XLA_FLAGS", ""),
               ms=median_ms(fn, args, 3 if a.smoke else 20), profile=profile(fn, args))
    emit(row, a.out)


if __name__ == "__main__":
  main()
