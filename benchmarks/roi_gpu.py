"""ROI align on Mask R-CNN's shapes: jaxpool against a plain ``jnp`` version and torchvision.

FPN levels P2-P5 of a batch of 2 images of 800x1216 (maps 200x304 ... 25x38), 256 channels, 512
regions per image, output 7x7 (box head) and 14x14 (mask head), ``sampling_ratio=2``,
``aligned=True``, float32 and bfloat16; the boxes spread over the levels by
``MultiScaleRoIAlign``'s mapping. For each case:

- ``fwd`` and ``fwd+dx`` (the forward and the feature gradient, ``jax.vjp``) of
  ``jaxpool.multi_scale_roi_align`` by default (``jaxpool``: on an NVIDIA GPU the Pallas Triton
  kernels, ``jaxpool_default_backend`` says which) and on the XLA path (``jaxpool_xla``,
  ``implementation="xla"``), and how far apart the two are; of the plain ``jnp`` baseline
  below (bilinear gathers of the four corners from the levels' concatenated table, the gradient
  by JAX's autodiff: a scatter-add); and of torchvision's CUDA ``MultiScaleRoIAlign`` (NCHW)
  where torch imports with CUDA;
- the fraction of the copy bandwidth (``x + 1`` over 1 GiB, bytes read plus written) over the
  bytes each pass must move: ``fwd`` reads the features once and writes the outputs
  (``|x| + |y|``); ``fwd+dx`` adds reading the cotangent and writing the feature gradient
  (``2 |x| + 2 |y|``);
- peak memory: XLA's compiled memory analysis (arguments + outputs + temporaries) over the
  arguments and outputs;
- the same bits over 10 runs of ``fwd+dx`` (and how many of torchvision's 10 backward runs differ
  from its first);
- ``fwd+dx+dboxes`` (the forward, the feature gradient and the box gradient: ``jax.vjp`` with
  respect to the features and the boxes) for ``jaxpool`` (on an NVIDIA GPU every part on the
  kernels) and ``jaxpool_xla``: time, fraction of the copy bandwidth (over ``2 |x| + 2 |y|``,
  as ``fwd+dx``: the box gradient adds reads of what ``fwd+dx`` reads), peak memory, the same
  bits over 10 runs, and how far apart the two box gradients are.

Writes ``benchmarks/results/roi_gpu_<device>.json`` at the end, and after each case the cases
so far to ``build/benchmarks/roi_gpu_<device>_partial.json`` (``meta.complete`` false).
``--quick`` runs small shapes (on a CPU too) and writes
``build/benchmarks/roi_gpu_<device>_quick.json``.

    python benchmarks/roi_gpu.py            # on the GPU machine
    python benchmarks/roi_gpu.py --quick    # anywhere, a minute
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxpool  # noqa: E402
from jaxpool._src import dispatch  # noqa: E402
from jaxpool._src.roi.plan import AlignConfig, Level  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_path import SCRATCH, device_tag, result_path  # noqa: E402
from timing import median_ms_per_call  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
STRIDES = (4, 8, 16, 32)
RUNS_SAME_BITS = 10


# ----------------------------------------------------------------------------- the baseline


def plain_multi_scale_roi_align(features, boxes, scales, output_size, sampling_ratio, aligned):
  """ROI align in plain ``jnp`` (the baseline): torchvision's level mapping and bilinear
  sampling, each box's four corners gathered from the levels' concatenated pixel table; JAX
  differentiates it (its feature gradient is a scatter-add). Channels last; ``boxes`` ``(K, 5)``.
  """
  C = features[0].shape[-1]
  table = jnp.concatenate([f.reshape(-1, C) for f in features])
  sizes = [f.shape for f in features]
  offsets = np.cumsum([0] + [n * h * w for n, h, w, _ in sizes])[:-1]
  img = boxes[:, 0].astype(jnp.int32)
  xy = boxes[:, 1:]
  k_min, k_max = -math.log2(scales[0]), -math.log2(scales[-1])
  area = (xy[:, 2] - xy[:, 0]) * (xy[:, 3] - xy[:, 1])
  lvl = jnp.clip(jnp.floor(4 + jnp.log2(jnp.sqrt(area) / 224) + 1e-6), k_min, k_max)
  lvl = (lvl - k_min).astype(jnp.int32)
  pick = lambda vals, dt: jnp.asarray(vals, dt)[lvl]
  scale = pick(scales, jnp.float32)
  H = pick([s[1] for s in sizes], jnp.int32)
  W = pick([s[2] for s in sizes], jnp.int32)
  base = pick(offsets, jnp.int32) + img * H * W
  off = 0.5 if aligned else 0.0
  ph, pw = output_size
  g = sampling_ratio

  def axis(lo, hi, n, size):
    start, roi = lo * scale - off, (hi - lo) * scale
    bin_size = roi / n
    t = (jnp.arange(n)[:, None] + (jnp.arange(g)[None, :] + 0.5) / g).reshape(-1)  # (n*g,)
    pos = start[:, None] + t[None, :] * bin_size[:, None]
    sz = size[:, None].astype(jnp.float32)
    valid = (pos >= -1) & (pos <= sz)
    pos = jnp.clip(pos, 0, sz - 1)
    low = jnp.floor(pos).astype(jnp.int32)
    high = jnp.minimum(low + 1, size[:, None] - 1)
    frac = pos - low
    return low, high, frac, valid

  yl, yh, fy, vy = axis(xy[:, 1], xy[:, 3], ph, H)  # (K, ph*g)
  xl, xh, fx, vx = axis(xy[:, 0], xy[:, 2], pw, W)

  def corner(r, c):
    idx = base[:, None, None] + r[:, :, None] * W[:, None, None] + c[:, None, :]
    return table[idx].astype(jnp.float32)  # (K, ph*g, pw*g, C)

  wy0, wy1 = (1 - fy) * vy, fy * vy
  wx0, wx1 = (1 - fx) * vx, fx * vx
  val = (corner(yl, xl) * (wy0[:, :, None] * wx0[:, None, :])[..., None]
         + corner(yl, xh) * (wy0[:, :, None] * wx1[:, None, :])[..., None]
         + corner(yh, xl) * (wy1[:, :, None] * wx0[:, None, :])[..., None]
         + corner(yh, xh) * (wy1[:, :, None] * wx1[:, None, :])[..., None])
  K = boxes.shape[0]
  val = val.reshape(K, ph, g, pw, g, C).mean(axis=(2, 4))
  return val.astype(features[0].dtype)


# ----------------------------------------------------------------------------- timing


def time_jax(fn, args, reps):
  out = [None]

  def call():
    out[0] = fn(*args)

  return median_ms_per_call(call, lambda: jax.block_until_ready(out[0]), reps)


def copy_bandwidth(n, reps):
  x = jnp.ones((n,), jnp.float32)
  ms = time_jax(jax.jit(lambda a: a + 1), (x,), reps)
  return 2 * x.size * 4 / ms / 1e6


def peak_ratio(fn, args):
  """(arguments + outputs + temporaries) / (arguments + outputs) of the compiled ``fn``."""
  m = jax.jit(fn).lower(*args).compile().memory_analysis()
  if m is None:
    return None
  io = m.argument_size_in_bytes + m.output_size_in_bytes
  return (io + m.temp_size_in_bytes) / io, (io + m.temp_size_in_bytes)


def same_bits(fn, args, runs):
  first = jax.tree.map(np.asarray, fn(*args))
  for _ in range(runs - 1):
    again = jax.tree.map(np.asarray, fn(*args))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
      if a.tobytes() != b.tobytes():
        return False
  return True


# ----------------------------------------------------------------------------- the cases


# Mask R-CNN's shapes (the issue's): FPN P2-P5 of 2 images of 800x1216, 256 channels, 512 regions
# an image, the box head's 7x7 and the mask head's 14x14 grids, 10 samples a timing. Also
# benchmarks/roi_tiles_gpu.py's.
MASK_RCNN = dict(batch=2, image=(800, 1216), channels=256, per_image=512,
                 sizes=[(7, 7), (14, 14)], reps=10)


def make_case(rng, batch, image, channels, per_image, dtype):
  h, w = image
  feats = [rng.standard_normal((batch, h // s, w // s, channels)).astype(np.float32)
           for s in STRIDES]
  side = np.exp(rng.uniform(np.log(16), np.log(min(h, w)), (batch * per_image, 2)))
  x1 = rng.uniform(0, w - side[:, 0])
  y1 = rng.uniform(0, h - side[:, 1])
  img = np.repeat(np.arange(batch), per_image)
  boxes = np.stack([img, x1, y1, x1 + side[:, 0], y1 + side[:, 1]], 1).astype(np.float32)
  return [jnp.asarray(f, dtype) for f in feats], jnp.asarray(boxes)


def torch_rows(feats, boxes, image, output_size, reps):
  try:
    import torch
    from torchvision.ops import MultiScaleRoIAlign
  except ImportError as e:
    return {"skipped": f"torchvision does not import: {e}"}
  if not torch.cuda.is_available():
    return {"skipped": "torch has no CUDA device"}
  dt = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}[feats[0].dtype.type]
  tf = {f"p{i}": torch.tensor(np.asarray(f.astype(jnp.float32)), device="cuda").permute(
      0, 3, 1, 2).contiguous().to(dt).requires_grad_(True) for i, f in enumerate(feats)}
  b = np.asarray(boxes)
  # (torchvision's kernels take boxes of the features' dtype)
  tb = [torch.tensor(b[b[:, 0] == i, 1:], device="cuda").to(dt)
        for i in range(feats[0].shape[0])]
  layer = MultiScaleRoIAlign(list(tf), output_size, 2)  # (torchvision's layer: aligned=False)
  shapes = [image] * feats[0].shape[0]
  sync = torch.cuda.synchronize
  out = {}
  out["fwd_ms"] = median_ms_per_call(lambda: layer(tf, tb, shapes), sync, reps)
  y = layer(tf, tb, shapes)
  dy = torch.randn_like(y)

  def fwd_bwd():
    for t in tf.values():
      t.grad = None
    layer(tf, tb, shapes).backward(dy)

  out["fwd+dx_ms"] = median_ms_per_call(fwd_bwd, sync, reps)
  fwd_bwd()
  first = [t.grad.clone() for t in tf.values()]
  differ = 0
  for _ in range(RUNS_SAME_BITS - 1):
    fwd_bwd()
    differ += any(not torch.equal(a, t.grad) for a, t in zip(first, tf.values()))
  out["backward_runs_differing_from_the_first"] = f"{differ} of {RUNS_SAME_BITS - 1}"
  out["note"] = "aligned=False (MultiScaleRoIAlign's fixed setting), NCHW"
  return out


def _config(feats, output_size):
  """The static configuration of the benchmark's call, for the registry's choice."""
  levels, offset = [], 0
  for f, s in zip(feats, STRIDES):
    levels.append(Level(f.shape[0], f.shape[1], f.shape[2], 1.0 / s, offset))
    offset += f.shape[0] * f.shape[1] * f.shape[2]
  return AlignConfig(tuple(output_size), tuple(levels), 2, (2, 2), True, "avg")


def run_case(feats, boxes, image, output_size, copy_gbs, reps):
  scales = tuple(1.0 / s for s in STRIDES)
  batch = feats[0].shape[0]
  shapes = [image] * batch
  ours = lambda fs, b: jaxpool.multi_scale_roi_align(fs, b, shapes, output_size,
                                                     sampling_ratio=2, aligned=True)
  on_xla = lambda fs, b: jaxpool.multi_scale_roi_align(fs, b, shapes, output_size,
                                                       sampling_ratio=2, aligned=True,
                                                       implementation="xla")
  plain = lambda fs, b: plain_multi_scale_roi_align(fs, b, scales, output_size, 2, True)
  y = jax.jit(ours)(feats, boxes)
  dy = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape), y.dtype)
  nx = sum(f.size * f.dtype.itemsize for f in feats)
  ny = y.size * y.dtype.itemsize
  bytes_moved = {"fwd": nx + ny, "fwd+dx": 2 * nx + 2 * ny, "fwd+dx+dboxes": 2 * nx + 2 * ny}
  rows = {"jaxpool_default_backend": dispatch.choose(
      "roi_align", None, feats[0], None,
      config=_config(feats, output_size)).label}
  grads = {}
  for name, f in (("jaxpool", ours), ("jaxpool_xla", on_xla), ("plain_jnp", plain)):
    fwd = jax.jit(f)

    def fwd_dx(fs, b, g, f=f):
      out, vjp = jax.vjp(lambda v: f(v, b), fs)
      return out, vjp(g)[0]

    fb = jax.jit(fwd_dx)
    r = {}
    for key, fn, args in (("fwd", fwd, (feats, boxes)), ("fwd+dx", fb, (feats, boxes, dy))):
      ms = time_jax(fn, args, reps)
      peak = peak_ratio(fn, args)
      r[key] = {"ms": ms, "GBps": bytes_moved[key] / ms / 1e6,
                "of_copy": bytes_moved[key] / ms / 1e6 / copy_gbs,
                "peak_over_io": None if peak is None else peak[0],
                "peak_bytes": None if peak is None else peak[1]}
    r["same_bits_10_runs"] = same_bits(fb, (feats, boxes, dy), RUNS_SAME_BITS)
    if name != "plain_jnp":  # (the box gradient: the kernels' and the XLA path's)
      def fwd_dx_db(fs, b, g, f=f):
        out, vjp = jax.vjp(f, fs, b)
        return (out, *vjp(g))

      fbb = jax.jit(fwd_dx_db)
      args = (feats, boxes, dy)
      ms = time_jax(fbb, args, reps)
      peak = peak_ratio(fbb, args)
      key = "fwd+dx+dboxes"
      r[key] = {"ms": ms, "GBps": bytes_moved[key] / ms / 1e6,
                "of_copy": bytes_moved[key] / ms / 1e6 / copy_gbs,
                "peak_over_io": None if peak is None else peak[0],
                "peak_bytes": None if peak is None else peak[1],
                "same_bits_10_runs": same_bits(fbb, args, RUNS_SAME_BITS)}
      grads[name + "_dboxes"] = fbb(*args)[2]
    rows[name] = r
    grads[name] = fb(feats, boxes, dy)
  yp = jax.jit(plain)(feats, boxes)
  (yd, gd), (yx, gx) = grads["jaxpool"], grads["jaxpool_xla"]
  rows["max_abs_diff_default_vs_xla"] = {
      "y": float(jnp.max(jnp.abs(yd.astype(jnp.float32) - yx.astype(jnp.float32)))),
      "dx": max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(gd, gx))}
  rows["max_abs_diff_vs_plain"] = float(jnp.max(jnp.abs(y.astype(jnp.float32)
                                                        - yp.astype(jnp.float32))))
  try:
    rows["torchvision"] = torch_rows(feats, boxes, image, output_size, reps)
  except (RuntimeError, NotImplementedError) as e:  # (its CUDA roi_align has no bfloat16)
    rows["torchvision"] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
  rows["speedup_fwd+dx_vs_plain"] = (rows["plain_jnp"]["fwd+dx"]["ms"]
                                     / rows["jaxpool"]["fwd+dx"]["ms"])
  rows["speedup_fwd+dx_vs_xla_path"] = (rows["jaxpool_xla"]["fwd+dx"]["ms"]
                                        / rows["jaxpool"]["fwd+dx"]["ms"])
  rows["speedup_fwd+dx+dboxes_vs_xla_path"] = (rows["jaxpool_xla"]["fwd+dx+dboxes"]["ms"]
                                               / rows["jaxpool"]["fwd+dx+dboxes"]["ms"])
  rows["max_abs_diff_dboxes_default_vs_xla"] = float(jnp.max(jnp.abs(
      grads["jaxpool_dboxes"] - grads["jaxpool_xla_dboxes"])))
  return rows


def print_box_table(results):
  """The box gradient's table (ms): forward + feature gradient, and with the box gradient, for
  the default path and the XLA path."""
  print("| dtype, grid | jaxpool fwd+dx | jaxpool fwd+dx+dboxes | XLA path fwd+dx | "
        "XLA path fwd+dx+dboxes |")
  print("| --- | --- | --- | --- | --- |")
  for c in results:
    r = c["rows"]
    j, x = r["jaxpool"], r["jaxpool_xla"]
    grid = "x".join(map(str, c["output_size"]))
    print(f"| {c['dtype']}, {grid} | {j['fwd+dx']['ms']:.3f} | {j['fwd+dx+dboxes']['ms']:.3f} "
          f"| {x['fwd+dx']['ms']:.3f} | {x['fwd+dx+dboxes']['ms']:.3f} |")


QUICK = dict(batch=1, image=(128, 192), channels=8, per_image=16, sizes=[(7, 7)], reps=3)


def cli(doc: str, parser=None):
  """``(args, device, case)`` of a ROI benchmark's command line (``--quick``: small shapes,
  :data:`QUICK`, else :data:`MASK_RCNN`; ``--out``)."""
  ap = parser or argparse.ArgumentParser(description=doc.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small shapes, any device")
  ap.add_argument("--out", help="the JSON's path (default: benchmarks/results/...)")
  args = ap.parse_args()
  return args, jax.devices()[0], QUICK if args.quick else MASK_RCNN


def main():
  args, dev, case = cli(__doc__)
  batch, image, channels, per_image, sizes, reps = (
      case[k] for k in ("batch", "image", "channels", "per_image", "sizes", "reps"))
  dtypes = [jnp.float32] if args.quick else [jnp.float32, jnp.bfloat16]
  copy_n = (4 if args.quick else 256) * 1024 * 1024
  copy_gbs = copy_bandwidth(copy_n, reps)
  print(f"{dev.device_kind}: copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
  rng = np.random.default_rng(0)
  results = []
  path = args.out or result_path(__file__, device_tag(dev.device_kind), quick=args.quick)
  partial = os.path.join(SCRATCH, os.path.basename(path).replace(".json", "_partial.json"))
  meta = {"device": dev.device_kind, "jax": jax.__version__, "copy_GBps": copy_gbs,
          "bytes": "fwd: |features| + |y|; fwd+dx: 2 |features| + 2 |y|",
          "bytes_fwd+dx+dboxes": "2 |features| + 2 |y| (as fwd+dx)", "peak": PEAK}
  for dtype in dtypes:
    feats, boxes = make_case(rng, batch, image, channels, per_image, dtype)
    for out in sizes:
      rows = run_case(feats, boxes, image, out, copy_gbs, reps)
      case = {"dtype": jnp.dtype(dtype).name, "output_size": list(out), "batch": batch,
              "image": list(image), "channels": channels, "regions": batch * per_image,
              "rows": rows}
      results.append(case)
      # (After each case, to a scratch file beside it: a run cut short keeps what it
      # measured, and the results file holds only complete runs.)
      save(partial, {**meta, "complete": False}, results)
      j, p, xp = rows["jaxpool"], rows["plain_jnp"], rows["jaxpool_xla"]
      print(f"{case['dtype']:9s} {out}: jaxpool ({rows['jaxpool_default_backend']}) "
            f"fwd {j['fwd']['ms']:.3f} ms "
            f"({j['fwd']['of_copy']:.2f} of copy), fwd+dx {j['fwd+dx']['ms']:.3f} ms "
            f"({j['fwd+dx']['of_copy']:.2f}); plain jnp fwd+dx {p['fwd+dx']['ms']:.3f} ms "
            f"(x{rows['speedup_fwd+dx_vs_plain']:.1f}); XLA path fwd {xp['fwd']['ms']:.3f}, "
            f"fwd+dx {xp['fwd+dx']['ms']:.3f} ms; default vs XLA "
            f"{rows['max_abs_diff_default_vs_xla']}; peak/io {j['fwd+dx']['peak_over_io']}; "
            f"same bits {j['same_bits_10_runs']} (plain {p['same_bits_10_runs']}); "
            f"torchvision {rows['torchvision']}", flush=True)
      jb, xb = j["fwd+dx+dboxes"], xp["fwd+dx+dboxes"]
      print(f"{'':9s} {out}: with the box gradient (fwd+dx+dboxes): jaxpool {jb['ms']:.3f} ms "
            f"({jb['of_copy']:.2f} of copy, peak/io {jb['peak_over_io']}, same bits "
            f"{jb['same_bits_10_runs']}), XLA path {xb['ms']:.3f} ms "
            f"(x{rows['speedup_fwd+dx+dboxes_vs_xla_path']:.1f}); dboxes default vs XLA "
            f"{rows['max_abs_diff_dboxes_default_vs_xla']:.3g}", flush=True)
  print_box_table(results)
  save(path, {**meta, "complete": True}, results)


PEAK = "XLA memory analysis: (arguments + outputs + temporaries) / (arguments + outputs)"


def save(path, meta, results):
  """The results' JSON: ``{"meta": meta, "cases": results}``."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  # (Written beside it, then renamed: a run killed while writing leaves the file it had.)
  with open(path + ".tmp", "w") as f:
    json.dump({"meta": meta, "cases": results}, f, indent=1)
  os.replace(path + ".tmp", path)
  print("wrote", path)


if __name__ == "__main__":
  main()
