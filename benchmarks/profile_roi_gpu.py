"""ROI align's forward + feature gradient on Mask R-CNN's shapes (``roi_gpu.py``'s), called a few
times, for a profiler: every kernel of the step (the Pallas kernels and XLA's own).

Run under Nsight Compute on a GPU machine from the repository root, e.g.::

  ncu --csv --metrics gpu__time_duration.sum,launch__registers_per_thread \\
    python3 benchmarks/profile_roi_gpu.py [--dtypes bfloat16] [--sizes 7] [--calls 2]

The first call compiles; read the last call's rows (each call's kernels in launch order).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import roi_gpu  # noqa: E402

import jaxpool  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--sizes", default="7,14")
  ap.add_argument("--calls", type=int, default=2)
  args = ap.parse_args()
  case = roi_gpu.MASK_RCNN
  shapes = [case["image"]] * case["batch"]
  for name in args.dtypes.split(","):
    rng = np.random.default_rng(0)
    feats, boxes = roi_gpu.make_case(rng, case["batch"], case["image"], case["channels"],
                                     case["per_image"], jnp.dtype(name))
    for size in (int(s) for s in args.sizes.split(",")):
      def fwd_dx(fs, b, g, size=size):
        f = lambda v: jaxpool.multi_scale_roi_align(v, b, shapes, (size, size),
                                                    sampling_ratio=2, aligned=True)
        out, vjp = jax.vjp(f, fs)
        return out, vjp(g)[0]

      fn = jax.jit(fwd_dx)
      y = jax.eval_shape(fn, feats, boxes, jnp.zeros((boxes.shape[0], size, size,
                                                      case["channels"]), feats[0].dtype))[0]
      dy = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape), y.dtype)
      for _ in range(args.calls):
        jax.block_until_ready(fn(feats, boxes, dy))
      print(f"{name} {size}x{size}: {args.calls} calls", flush=True)


if __name__ == "__main__":
  main()
