"""The ROI align feature-gradient kernel's tile on Mask R-CNN's shapes: which tile is fastest.

``triton.py``'s gradient programs each own a tile of ``GRAD_ROWS`` pixel rows x ``GRAD_COLS``
columns x ``GRAD_LANES`` channels of one image of one level (``GRAD_WARPS`` warps), and visit
the boxes listed for their cell of ``GRAD_BAND`` rows x ``GRAD_CBAND`` columns. This script
times ``fwd`` and ``fwd+dx`` of ``jaxpool.multi_scale_roi_align`` on the kernels (interpreted
on a CPU) for a few tiles
(the shapes of ``roi_gpu.py``: FPN P2-P5 of 2 images of 800x1216, 256 channels, 512 regions
per image, 7x7 and 14x14, ``sampling_ratio=2``, ``aligned=True``, float32; ``--bfloat16``
adds bfloat16), their difference being the gradient's part, and checks that every tile gives
the same bits as the first (each pixel adds the same terms in the same order, whatever the
tile); then the forward's tile (``FWD_TILE`` elements at most, ``FWD_LANES`` channels at
most, ``NUM_WARPS``) on ``fwd`` alone.

    python benchmarks/roi_tiles_gpu.py            # on the GPU machine
    python benchmarks/roi_tiles_gpu.py --quick    # small shapes, any device

Writes ``benchmarks/results/roi_tiles_gpu_<device>.json`` (``--quick``: ``build/benchmarks``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxpool  # noqa: E402
from jaxpool._src.roi import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_path import device_tag, result_path  # noqa: E402
from roi_gpu import MASK_RCNN, make_case, time_jax  # noqa: E402

# (GRAD_ROWS, GRAD_COLS, GRAD_LANES, GRAD_WARPS, GRAD_BAND, GRAD_CBAND); the first is the
# default.
NAMES = ("GRAD_ROWS", "GRAD_COLS", "GRAD_LANES", "GRAD_WARPS", "GRAD_BAND", "GRAD_CBAND")
TILES = [tuple(getattr(triton, n) for n in NAMES),
         (2, 16, 128, 4, 4, 16), (2, 8, 128, 2, 4, 32), (2, 4, 128, 2, 4, 32),
         (2, 2, 128, 1, 4, 32), (4, 4, 64, 1, 4, 32), (4, 4, 128, 2, 4, 32), (1, 4, 128, 1, 4, 32),
         (2, 4, 256, 4, 4, 32), (2, 4, 128, 1, 2, 32), (2, 4, 128, 1, 8, 32),
         (2, 4, 128, 1, 4, 8), (2, 4, 128, 1, 4, 16), (2, 4, 128, 1, 4, 64),
         (2, 4, 128, 1, 4, 4096)]
# The forward's (FWD_TILE, FWD_LANES, NUM_WARPS) (its tile: the bins of a row x lanes, at most
# FWD_TILE elements), timed on fwd alone; the first is the default.
FWD = [(triton.FWD_TILE, triton.FWD_LANES, triton.NUM_WARPS), (2048, 256, 4), (2048, 128, 4),
       (8192, 256, 8), (4096, 256, 8), (4096, 128, 4), (1024, 64, 2), (2048, 256, 2)]
FWD_NAMES = ("FWD_TILE", "FWD_LANES", "NUM_WARPS")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small shapes, any device")
  ap.add_argument("--bfloat16", action="store_true", help="bfloat16 maps too (float32 alone "
                  "by default: the sweep takes minutes)")
  ap.add_argument("--out", help="the JSON's path (default: benchmarks/results/roi_tiles_...)")
  args = ap.parse_args()
  dev = jax.devices()[0]
  case = (dict(batch=1, image=(64, 96), channels=8, per_image=8, sizes=[(7, 7)], reps=2)
          if args.quick else MASK_RCNN)
  batch, image, channels, per_image, sizes, reps = (
      case[k] for k in ("batch", "image", "channels", "per_image", "sizes", "reps"))
  dtypes = [jnp.float32] + [jnp.bfloat16] * (args.bfloat16 and not args.quick)
  tiles, fwd_tiles = (TILES[:3], FWD[:2]) if args.quick else (TILES, FWD)
  defaults = {n: getattr(triton, n) for n in NAMES + FWD_NAMES}
  rng = np.random.default_rng(0)
  results = []
  for dtype in dtypes:
    feats, boxes = make_case(rng, batch, image, channels, per_image, dtype)
    shapes = [image] * batch
    for out in sizes:
      f = lambda fs, b, out=out, shapes=shapes: jaxpool.multi_scale_roi_align(
          fs, b, shapes, out, sampling_ratio=2, aligned=True, implementation="pallas")
      y = jax.jit(f)(feats, boxes)
      dy = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape), y.dtype)
      first, rows = None, []
      for tile in tiles:
        for n, v in zip(NAMES, tile, strict=True):
          setattr(triton, n, v)
        jax.clear_caches()  # (the kernels read the constants when traced)

        def fwd_dx(fs, b, g, f=f):
          y, vjp = jax.vjp(lambda u: f(u, b), fs)
          return y, vjp(g)[0]

        fb = jax.jit(fwd_dx)
        ms = time_jax(fb, (feats, boxes, dy), reps)
        fwd_ms = time_jax(jax.jit(f), (feats, boxes), reps)
        bits = [np.asarray(a).tobytes() for a in jax.tree.leaves(fb(feats, boxes, dy))]
        first = bits if first is None else first
        row = {"tile": dict(zip(NAMES, tile, strict=True)), "fwd_ms": fwd_ms, "fwd+dx_ms": ms,
               "dx_ms": ms - fwd_ms, "same_bits_as_the_first_tile": bits == first}
        rows.append(row)
        print(f"{jnp.dtype(dtype).name:9s} {out} {tile}: fwd {fwd_ms:.3f} ms, fwd+dx {ms:.3f} "
              f"ms, same bits {row['same_bits_as_the_first_tile']}", flush=True)
      for n, v in defaults.items():
        setattr(triton, n, v)
      fwd_rows, first = [], None
      for tile in fwd_tiles:
        for n, v in zip(FWD_NAMES, tile, strict=True):
          setattr(triton, n, v)
        jax.clear_caches()
        fwd_ms = time_jax(jax.jit(f), (feats, boxes), reps)
        bits = np.asarray(jax.jit(f)(feats, boxes)).tobytes()
        first = bits if first is None else first
        fwd_rows.append({"tile": dict(zip(FWD_NAMES, tile, strict=True)), "fwd_ms": fwd_ms,
                         "same_bits_as_the_first_tile": bits == first})
        print(f"{jnp.dtype(dtype).name:9s} {out} forward {tile}: {fwd_ms:.3f} ms, same bits "
              f"{bits == first}", flush=True)
      for n, v in defaults.items():
        setattr(triton, n, v)
      results.append({"dtype": jnp.dtype(dtype).name, "output_size": list(out), "rows": rows,
                      "forward_rows": fwd_rows})
  for n, v in defaults.items():
    setattr(triton, n, v)
  path = args.out or result_path(__file__, device_tag(dev.device_kind), quick=args.quick)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as fh:
    json.dump({"meta": {"device": dev.device_kind, "jax": jax.__version__,
                        "batch": batch, "image": list(image), "channels": channels,
                        "regions": batch * per_image}, "cases": results}, fh, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
