"""ROI align's per-image form on a batch-sharded mesh of every local GPU (issue 50).

Boxes per image ``(N, K, 4)`` with a mask, one feature level ``(N, 100, 152, 256)`` (Mask
R-CNN's P3 of an 800x1216 image), 512 boxes an image, 7x7, ``sampling_ratio=2``,
``aligned=True``, two images a GPU, float32 and bfloat16: forward + feature gradient + box
gradient under ``jit`` with the inputs split along the batch, on the kernels (the default on
NVIDIA GPUs: each device runs them on its images) and on the XLA path (what this call ran
before the kernels split), and the same on one GPU with its two images (the per-device work).
Each time is ``timing.median_ms_per_call`` (samples of back-to-back calls of at least 20 ms).

Run on a machine with two or more GPUs, from the repository root::

  python3 benchmarks/roi_mesh_gpu.py        # saves benchmarks/results/roi_mesh_gpu_<gpus>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

PER_DEVICE, K, H, W, C = 2, 512, 100, 152, 256


def case(rng, n, dtype):
  import numpy as np
  x = rng.standard_normal((n, H, W, C)).astype(np.float32).astype(dtype)
  xy = rng.uniform(0, 8 * W * 0.8, (n, K, 2))
  wh = rng.uniform(16, 400, (n, K, 2))
  boxes = np.concatenate([xy, xy + wh], -1).astype(np.float32)
  mask = rng.uniform(size=(n, K)) < 0.9
  g = rng.standard_normal((n, K, 7, 7, C)).astype(np.float32).astype(dtype)
  return x, boxes, mask, g


def step(impl):
  import jax
  import jax.numpy as jnp

  import jaxpool

  def run(x, boxes, mask, g):
    f = lambda v, b: jnp.sum((jaxpool.roi_align(
        v, b, (7, 7), spatial_scale=0.125, sampling_ratio=2, aligned=True, mask=mask,
        implementation=impl) * g).astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1))(x, boxes)

  return jax.jit(run)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from result_path import device_tag, result_path
  from timing import median_ms_per_call
  devices = jax.devices()
  if len(devices) < 2:
    print("needs 2 or more GPUs")
    return 1
  mesh = jax.make_mesh((len(devices),), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
  split = NamedSharding(mesh, P("b"))
  n = PER_DEVICE * len(devices)
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    rng = np.random.default_rng(0)
    host = case(rng, n, dtype)
    on_mesh = [jax.device_put(a, split) for a in host]
    alone = [jax.device_put(a[:PER_DEVICE], devices[0]) for a in host]
    row = {"dtype": jnp.dtype(dtype).name}
    for impl, name in (("pallas", "kernels"), ("xla", "xla_path")):
      fn = step(impl)
      for where, ops in (("mesh", on_mesh), ("one_gpu", alone)):
        last: list = []

        def call(fn=fn, ops=ops, last=last):
          last[:] = [fn(*ops)]

        row[f"{name}_{where}_ms"] = median_ms_per_call(
            call, lambda last=last: jax.block_until_ready(last[0]), args.reps)
      text = fn.lower(*on_mesh).compile().as_text()
      row[f"{name}_mesh_collectives"] = [op for op in ("all-gather", "all-reduce", "all-to-all",
                                                       "collective-permute") if op in text]
    row["kernels_over_xla_path_mesh"] = row["xla_path_mesh_ms"] / row["kernels_mesh_ms"]
    row["mesh_over_one_gpu_kernels"] = row["kernels_mesh_ms"] / row["kernels_one_gpu_ms"]
    rows.append(row)
    print(json.dumps(row), flush=True)
  print("| dtype | kernels, mesh | kernels, one GPU (its images) | XLA path, mesh | speed-up |")
  print("| --- | --- | --- | --- | --- |")
  for r in rows:
    print(f"| {r['dtype']} | {r['kernels_mesh_ms']:.3f} | {r['kernels_one_gpu_ms']:.3f} | "
          f"{r['xla_path_mesh_ms']:.3f} | {r['kernels_over_xla_path_mesh']:.1f}x |")
  meta = {"devices": len(devices), "device_kind": devices[0].device_kind, "jax": jax.__version__,
          "images_per_gpu": PER_DEVICE, "boxes_per_image": K, "features": [H, W, C]}
  out = args.out or result_path(__file__, device_tag(devices[0].device_kind, len(devices)))
  with open(out, "w", encoding="utf-8") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    f.write("\n")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
