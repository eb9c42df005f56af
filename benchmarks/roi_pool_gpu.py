"""roi_pool on Fast/Faster R-CNN's shapes: jaxpool's kernels against its XLA path and torchvision.

A VGG-16 conv5 map of a batch of 2 images of 800x1216 (stride 16: 50x76, 512 channels), 512
regions per image (sides from 16 pixels to the image), output 7x7, float32 and bfloat16. For
each case:

- ``fwd`` and ``fwd+dx`` (the forward and the feature gradient, ``jax.vjp``) of
  ``jaxpool.roi_pool`` by default (``jaxpool``: on an NVIDIA GPU the Pallas Triton kernels,
  ``jaxpool_default_backend`` says which) and on the XLA path (``jaxpool_xla``,
  ``implementation="xla"``), whether they agree (values and indices bit for bit, the gradient's
  largest difference); torchvision's CUDA ``roi_pool`` (NCHW) where torch imports with CUDA;
- the fraction of the copy bandwidth over the bytes each pass must move (``fwd``: ``|x| +
  |y|``, ``fwd+dx``: ``2 |x| + 2 |y|``; the indices a pass keeps are not counted);
- peak memory (XLA's compiled memory analysis over the arguments and outputs);
- the same bits over 10 runs of ``fwd+dx`` (and how many of torchvision's backward runs differ
  from its first).

Writes ``benchmarks/results/roi_pool_gpu_<device>.json``; ``--quick``: small shapes (on a CPU
too), ``build/benchmarks/roi_pool_gpu_<device>_quick.json``.

    python benchmarks/roi_pool_gpu.py            # on the GPU machine
    python benchmarks/roi_pool_gpu.py --quick    # anywhere, a minute
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxpool  # noqa: E402
from jaxpool._src import dispatch  # noqa: E402
from jaxpool._src.roi.plan import Level, PoolConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_path import device_tag, result_path  # noqa: E402
from roi_gpu import PEAK, copy_bandwidth, peak_ratio, same_bits, save, time_jax  # noqa: E402

RUNS_SAME_BITS = 10
FASTER_RCNN = dict(batch=2, image=(800, 1216), stride=16, channels=512, per_image=512,
                   output_size=(7, 7), reps=10)


def make_case(rng, batch, image, stride, channels, per_image, dtype):
  h, w = image
  x = rng.standard_normal((batch, h // stride, w // stride, channels)).astype(np.float32)
  side = np.exp(rng.uniform(np.log(16), np.log(min(h, w)), (batch * per_image, 2)))
  x1, y1 = rng.uniform(0, w - side[:, 0]), rng.uniform(0, h - side[:, 1])
  img = np.repeat(np.arange(batch), per_image)
  boxes = np.stack([img, x1, y1, x1 + side[:, 0], y1 + side[:, 1]], 1).astype(np.float32)
  return jnp.asarray(x, dtype), jnp.asarray(boxes)


def torch_rows(x, boxes, output_size, scale, reps):
  try:
    import torch
    from torchvision.ops import roi_pool as tv_roi_pool
  except ImportError as e:
    return {"skipped": f"ImportError: {e}"}
  if not torch.cuda.is_available():
    return {"skipped": "no CUDA device for torch"}
  try:
    tx = torch.tensor(np.asarray(x.astype(jnp.float32)), device="cuda").permute(0, 3, 1, 2)
    tx = tx.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[x.dtype.name])
    tx = tx.contiguous().requires_grad_(True)
    tb = torch.tensor(np.asarray(boxes), device="cuda")
    dy = torch.randn((len(boxes), tx.shape[1], *output_size), device="cuda", dtype=tx.dtype)

    def fwd():
      return tv_roi_pool(tx, tb, output_size, scale)

    def fwd_bwd():
      tx.grad = None
      fwd().backward(dy)
      return tx.grad

    def timed(fn):
      from timing import median_ms_per_call
      return median_ms_per_call(fn, torch.cuda.synchronize, reps)

    first = fwd_bwd().clone()
    differ = sum(not torch.equal(first, fwd_bwd()) for _ in range(RUNS_SAME_BITS - 1))
    return {"fwd_ms": timed(fwd), "fwd+dx_ms": timed(fwd_bwd),
            "backward_runs_differing_from_the_first": f"{differ} of {RUNS_SAME_BITS - 1}"}
  except (RuntimeError, NotImplementedError) as e:
    return {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0]}"}


def run_case(x, boxes, output_size, scale, copy_gbs, reps):
  dy = jnp.asarray(np.random.default_rng(1).standard_normal(
      (boxes.shape[0], *output_size, x.shape[-1])), x.dtype)
  y_bytes = dy.size * dy.dtype.itemsize
  x_bytes = x.size * x.dtype.itemsize
  moved = {"fwd": x_bytes + y_bytes, "fwd+dx": 2 * x_bytes + 2 * y_bytes}
  cfg = PoolConfig(output_size, Level(*x.shape[:3], scale, 0))
  rows: dict = {"jaxpool_default_backend": dispatch.choose(
      "roi_pool", None, x, None, config=cfg).label}
  outs = {}
  for name, impl in (("jaxpool", None), ("jaxpool_xla", "xla")):
    def f(v, b, impl=impl):
      return jaxpool.roi_pool(v, b, output_size, spatial_scale=scale, implementation=impl)

    def fwd_dx(v, b, d, f=f, impl=impl):
      y, vjp = jax.vjp(lambda u: f(u, b), v)
      idx = jaxpool.roi_pool(v, b, output_size, spatial_scale=scale, return_indices=True,
                             implementation=impl)[1]
      return y, idx, vjp(d)[0]

    fns = {"fwd": (jax.jit(f), (x, boxes)), "fwd+dx": (jax.jit(fwd_dx), (x, boxes, dy))}
    row = {}
    for part, (fn, args) in fns.items():
      ms = time_jax(fn, args, reps)
      peak = peak_ratio(fn, args)
      row[part] = {"ms": ms, "GBps": moved[part] / ms / 1e6,
                   "of_copy": moved[part] / ms / 1e6 / copy_gbs,
                   "peak_over_io": peak and peak[0]}
    row["same_bits_10_runs"] = same_bits(fns["fwd+dx"][0], fns["fwd+dx"][1], RUNS_SAME_BITS)
    outs[name] = fns["fwd+dx"][0](x, boxes, dy)
    rows[name] = row
  (y, idx, dx), (ry, ridx, rdx) = outs["jaxpool"], outs["jaxpool_xla"]
  rows["same_values_and_indices_as_xla"] = bool(
      np.array_equal(np.asarray(y, np.float32), np.asarray(ry, np.float32), equal_nan=True)
      and np.array_equal(idx, ridx))
  rows["max_abs_diff_dx_vs_xla"] = float(np.max(np.abs(
      np.asarray(dx, np.float32) - np.asarray(rdx, np.float32))))
  rows["speedup_fwd+dx_vs_xla_path"] = (rows["jaxpool_xla"]["fwd+dx"]["ms"]
                                        / rows["jaxpool"]["fwd+dx"]["ms"])
  rows["torchvision"] = torch_rows(x, boxes, output_size, scale, reps)
  tv = rows["torchvision"].get("fwd+dx_ms")
  if tv:
    rows["speedup_fwd+dx_vs_torchvision"] = tv / rows["jaxpool"]["fwd+dx"]["ms"]
  return rows


def time_tiles(spec, case, rng):
  """Forward + gradient (float32) with each gradient tile of ``spec``, printed."""
  from jaxpool._src.roi import triton_pool
  x, boxes = make_case(rng, case["batch"], case["image"], case["stride"], case["channels"],
                       case["per_image"], jnp.float32)
  out, scale = case["output_size"], 1.0 / case["stride"]
  dy = jnp.ones((boxes.shape[0], *out, x.shape[-1]), x.dtype)

  def fwd_dx(v, b, d):
    y, vjp = jax.vjp(lambda u: jaxpool.roi_pool(u, b, out, spatial_scale=scale), v)
    return y, vjp(d)[0]

  for tile in spec.split(","):
    rows, cols, lanes, warps, band, cband = (int(v) for v in tile.split("x"))
    (triton_pool.GRAD_ROWS, triton_pool.GRAD_COLS, triton_pool.GRAD_LANES,
     triton_pool.GRAD_WARPS, triton_pool.CELL) = rows, cols, lanes, warps, (band, cband)
    jax.clear_caches()  # (the kernels are traced again with the new tile)
    ms = time_jax(jax.jit(fwd_dx), (x, boxes, dy), case["reps"])
    print(f"tile {tile}: forward + gradient {ms:.3f} ms", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small shapes, any device")
  ap.add_argument("--out", help="the JSON's path (default: benchmarks/results/roi_pool_gpu_...)")
  ap.add_argument("--tiles", help="time forward + gradient (float32) with these gradient "
                  "tiles instead: 'rows x cols x lanes x warps x cell rows x cell columns', "
                  "comma-separated (2x4x64x1x4x32,...)")
  args = ap.parse_args()
  dev = jax.devices()[0]
  case = (dict(FASTER_RCNN, image=(128, 192), channels=8, per_image=16, reps=3)
          if args.quick else FASTER_RCNN)
  dtypes = [jnp.float32] if args.quick else [jnp.float32, jnp.bfloat16]
  copy_gbs = copy_bandwidth((4 if args.quick else 256) * 1024 * 1024, case["reps"])
  print(f"{dev.device_kind}: copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
  rng = np.random.default_rng(0)
  if args.tiles:
    return time_tiles(args.tiles, case, rng)
  results = []
  for dtype in dtypes:
    x, boxes = make_case(rng, case["batch"], case["image"], case["stride"], case["channels"],
                         case["per_image"], dtype)
    rows = run_case(x, boxes, case["output_size"], 1.0 / case["stride"], copy_gbs,
                    case["reps"])
    results.append({"dtype": jnp.dtype(dtype).name, "map": list(x.shape),
                    "output_size": list(case["output_size"]), "regions": int(boxes.shape[0]),
                    "rows": rows})
    j, xp = rows["jaxpool"], rows["jaxpool_xla"]
    print(f"{jnp.dtype(dtype).name:9s} roi_pool {tuple(x.shape)} -> {case['output_size']}: "
          f"jaxpool ({rows['jaxpool_default_backend']}) fwd {j['fwd']['ms']:.3f} ms "
          f"({j['fwd']['of_copy']:.2f} of copy), fwd+dx {j['fwd+dx']['ms']:.3f} ms "
          f"({j['fwd+dx']['of_copy']:.2f}); XLA path fwd {xp['fwd']['ms']:.3f}, fwd+dx "
          f"{xp['fwd+dx']['ms']:.3f} ms (x{rows['speedup_fwd+dx_vs_xla_path']:.1f}); same "
          f"values/indices {rows['same_values_and_indices_as_xla']}, dx diff "
          f"{rows['max_abs_diff_dx_vs_xla']:.3g}; peak/io {j['fwd+dx']['peak_over_io']}; same "
          f"bits {j['same_bits_10_runs']}; torchvision {rows['torchvision']}", flush=True)
  save(args.out or result_path(__file__, device_tag(dev.device_kind), quick=args.quick),
       {"device": dev.device_kind, "jax": jax.__version__, "copy_GBps": copy_gbs,
        "bytes": "fwd: |x| + |y|; fwd+dx: 2 |x| + 2 |y|", "peak": PEAK}, results)


if __name__ == "__main__":
  main()
