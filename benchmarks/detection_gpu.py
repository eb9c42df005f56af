"""A detection head's training step with each ROI align: jaxpool's default, its XLA path, plain jnp.

Mask R-CNN's box head on Mask R-CNN's shapes (the FPN levels P2-P5 of 2 images of 800x1216, 256
channels, 512 regions per image, as ``roi_gpu.py``): ``multi_scale_roi_align`` to 7x7
(``sampling_ratio=2``, ``aligned=True``), two fully connected layers of 1,024 with ReLU, a class
layer (91 classes) and a box layer (4 per class); the loss is the cross-entropy on random labels
plus a smooth L1 on random box targets. One training step is ``jax.value_and_grad`` of the loss
with respect to the head's parameters and the feature maps (the backbone's gradient starts there;
the boxes are proposals, not trained: ``stop_gradient``, as torchvision), under one ``jit``, with
the ROI align of:

- ``jaxpool``: ``jaxpool.multi_scale_roi_align`` by default (on an NVIDIA GPU the Pallas Triton
  kernels);
- ``jaxpool_xla``: the same with ``implementation="xla"``;
- ``plain_jnp``: ``roi_gpu.py``'s plain ``jnp`` version (bilinear gathers, JAX's autodiff).

Also the step with the pooling's output replaced by zeros of its shape (``no_pooling``): what the
rest of the step costs. float32 and bfloat16 (parameters and activations; the loss in float32).
Writes ``benchmarks/results/detection_gpu_<device>.json``; ``--quick``: small shapes, anywhere.

    python benchmarks/detection_gpu.py
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxpool  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_path import device_tag, result_path  # noqa: E402
from roi_gpu import (STRIDES, cli, make_case, plain_multi_scale_roi_align,  # noqa: E402
                     save, time_jax)

CLASSES = 91
HIDDEN = 1024


def init_head(rng, channels, grid, dtype, hidden=HIDDEN):
  def dense(n_in, n_out):
    w = rng.standard_normal((n_in, n_out)).astype(np.float32) / np.sqrt(n_in)
    return jnp.asarray(w, dtype), jnp.zeros((n_out,), dtype)

  return {"fc6": dense(channels * grid * grid, hidden), "fc7": dense(hidden, hidden),
          "cls": dense(hidden, CLASSES), "box": dense(hidden, 4 * CLASSES)}


def head_loss(params, pooled, labels, targets):
  h = pooled.reshape(pooled.shape[0], -1)
  for name in ("fc6", "fc7"):
    w, b = params[name]
    h = jax.nn.relu(h @ w + b)
  logits = (h @ params["cls"][0] + params["cls"][1]).astype(jnp.float32)
  deltas = (h @ params["box"][0] + params["box"][1]).astype(jnp.float32)
  ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))
  mine = jnp.take_along_axis(deltas.reshape(-1, CLASSES, 4), labels[:, None, None], axis=1)
  err = jnp.abs(mine[:, 0] - targets)
  smooth = jnp.where(err < 1.0, 0.5 * err * err, err - 0.5)
  return ce + jnp.mean(smooth)


def step_fn(pool):
  """One training step: the loss and its gradient for the parameters and the feature maps."""
  def loss(params, feats, boxes, labels, targets):
    return head_loss(params, pool(feats, jax.lax.stop_gradient(boxes)), labels, targets)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main():
  args, dev, case = cli(__doc__)
  grid = 7
  shapes = [case["image"]] * case["batch"]
  scales = tuple(1.0 / s for s in STRIDES)
  pools = {
      "jaxpool": lambda fs, b: jaxpool.multi_scale_roi_align(
          fs, b, shapes, grid, sampling_ratio=2, aligned=True),
      "jaxpool_xla": lambda fs, b: jaxpool.multi_scale_roi_align(
          fs, b, shapes, grid, sampling_ratio=2, aligned=True, implementation="xla"),
      "plain_jnp": lambda fs, b: plain_multi_scale_roi_align(fs, b, scales, (grid, grid), 2,
                                                             True),
      "no_pooling": lambda fs, b: jnp.zeros((b.shape[0], grid, grid, fs[0].shape[-1]),
                                            fs[0].dtype) + 0 * fs[0][0, 0, 0],
  }
  rng = np.random.default_rng(0)
  results = []
  for dtype in ([jnp.float32] if args.quick else [jnp.float32, jnp.bfloat16]):
    feats, boxes = make_case(rng, case["batch"], case["image"], case["channels"],
                             case["per_image"], dtype)
    hidden = 32 if args.quick else HIDDEN
    params = init_head(rng, case["channels"], grid, dtype, hidden)
    k = boxes.shape[0]
    labels = jnp.asarray(rng.integers(0, CLASSES, k), jnp.int32)
    targets = jnp.asarray(rng.standard_normal((k, 4)), jnp.float32)
    args_ = (params, feats, boxes, labels, targets)
    rows = {}
    for name, pool in pools.items():
      fn = step_fn(pool)
      rows[name] = {"step_ms": time_jax(fn, args_, case["reps"])}
    steps = {n: r["step_ms"] for n, r in rows.items()}
    rows["speedup_vs_plain_jnp"] = steps["plain_jnp"] / steps["jaxpool"]
    rows["speedup_vs_xla_path"] = steps["jaxpool_xla"] / steps["jaxpool"]
    rows["pooling_share_of_the_step"] = (steps["jaxpool"] - steps["no_pooling"]) / steps[
        "jaxpool"]
    results.append({"dtype": jnp.dtype(dtype).name, "regions": int(k), "grid": grid,
                    "hidden": hidden, "rows": rows})
    print(f"{jnp.dtype(dtype).name:9s} training step (ms): "
          + ", ".join(f"{n} {v:.3f}" for n, v in steps.items())
          + f"; x{rows['speedup_vs_plain_jnp']:.2f} plain jnp, "
          f"x{rows['speedup_vs_xla_path']:.1f} XLA path", flush=True)
  save(args.out or result_path(__file__, device_tag(dev.device_kind), quick=args.quick),
       {"device": dev.device_kind, "jax": jax.__version__,
        "step": "value_and_grad of the box head's loss w.r.t. the parameters and the feature "
                "maps, one jit; median of samples of back-to-back calls"}, results)


if __name__ == "__main__":
  main()
