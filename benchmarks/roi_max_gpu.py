"""ROI align's max mode on Mask R-CNN's shapes: jaxpool's kernels against its XLA path.

The shapes of ``roi_gpu.py`` (FPN P2-P5 of 2 images of 800x1216, 256 channels, 512 regions per
image, 7x7 and 14x14, ``sampling_ratio=2``, ``aligned=True``), float32 and bfloat16, with
``mode="max"`` (DirectML's ``ReductionFunction`` max; torchvision has no max mode). For the
default path (on an NVIDIA GPU the Pallas Triton kernels) and the XLA path
(``implementation="xla"``): ``fwd``, ``fwd+dx`` and ``fwd+dx+dboxes`` (``jax.vjp`` with respect to
the features, then also the boxes), each the median of samples of back-to-back calls, the
same bits over 10 runs, and the largest difference between the two paths.

Writes ``benchmarks/results/roi_max_gpu_<device>.json``; ``--quick``: small shapes, anywhere.

    python benchmarks/roi_max_gpu.py
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
from roi_gpu import cli, make_case, same_bits, save, time_jax  # noqa: E402

RUNS_SAME_BITS = 10


def run_case(feats, boxes, image, output_size, reps):
  shapes = [image] * feats[0].shape[0]
  rows, outs = {}, {}
  for name, impl in (("jaxpool", None), ("jaxpool_xla", "xla")):
    def f(fs, b, impl=impl):
      return jaxpool.multi_scale_roi_align(fs, b, shapes, output_size, sampling_ratio=2,
                                           aligned=True, mode="max", implementation=impl)

    y = jax.jit(f)(feats, boxes)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape), y.dtype)

    def fwd_dx(fs, b, g, f=f):
      out, vjp = jax.vjp(lambda v: f(v, b), fs)
      return out, vjp(g)[0]

    def fwd_dx_db(fs, b, g, f=f):
      out, vjp = jax.vjp(f, fs, b)
      return (out, *vjp(g))

    row = {}
    for part, fn, args in (("fwd", jax.jit(f), (feats, boxes)),
                           ("fwd+dx", jax.jit(fwd_dx), (feats, boxes, dy)),
                           ("fwd+dx+dboxes", jax.jit(fwd_dx_db), (feats, boxes, dy))):
      row[part] = {"ms": time_jax(fn, args, reps)}
      if part != "fwd":
        row[part]["same_bits_10_runs"] = same_bits(fn, args, RUNS_SAME_BITS)
    rows[name] = row
    outs[name] = jax.jit(fwd_dx_db)(feats, boxes, dy)
  a, b = outs["jaxpool"], outs["jaxpool_xla"]
  diff = lambda u, v: float(jnp.nanmax(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
  rows["max_abs_diff_default_vs_xla"] = {
      "y": diff(a[0], b[0]), "dx": max(diff(u, v) for u, v in zip(a[1], b[1], strict=True)),
      "dboxes": diff(a[2], b[2])}
  for part in ("fwd", "fwd+dx", "fwd+dx+dboxes"):
    rows[f"speedup_{part}_vs_xla_path"] = (rows["jaxpool_xla"][part]["ms"]
                                           / rows["jaxpool"][part]["ms"])
  return rows


def main():
  args, dev, case = cli(__doc__)
  rng = np.random.default_rng(0)
  results = []
  for dtype in ([jnp.float32] if args.quick else [jnp.float32, jnp.bfloat16]):
    feats, boxes = make_case(rng, case["batch"], case["image"], case["channels"],
                             case["per_image"], dtype)
    for out in case["sizes"]:
      rows = run_case(feats, boxes, case["image"], out, case["reps"])
      results.append({"dtype": jnp.dtype(dtype).name, "output_size": list(out),
                      "regions": int(boxes.shape[0]), "rows": rows})
      j, x = rows["jaxpool"], rows["jaxpool_xla"]
      print(f"{jnp.dtype(dtype).name:9s} {out} max mode (ms): "
            + "; ".join(f"{p} {j[p]['ms']:.3f} (XLA path {x[p]['ms']:.3f}, "
                        f"x{rows[f'speedup_{p}_vs_xla_path']:.1f})" for p in j
                        if isinstance(j[p], dict))
            + f"; same bits {j['fwd+dx+dboxes']['same_bits_10_runs']}; diff "
            f"{rows['max_abs_diff_default_vs_xla']}", flush=True)
  save(args.out or result_path(__file__, device_tag(dev.device_kind), quick=args.quick),
       {"device": dev.device_kind, "jax": jax.__version__}, results)


if __name__ == "__main__":
  main()
