"""What the max-pool backward's memory pattern alone costs on a GPU: a floor for the kernel.

The backward of a 3x3/s2 max pool over 128x112x112x64 (channels_last) reads the cotangent and
the winning taps (output-sized) and writes the input-sized gradient. This script times Pallas
Triton kernels that move the same bytes with the backward's grid and tiles but (next to) no
arithmetic, against the real kernel, each as a fraction of a 1 GiB copy's bandwidth:

- ``write_only``: each program writes its ``2 x 2`` block of gradient tiles (zeros), reads
  nothing;
- ``read1_write4``: each program reads one cotangent tile and one taps tile, and writes each of
  its four gradient tiles as ``where(taps == phase, dy, 0)``;
- ``read4_write4``: as the kernel reads: the four (cotangent, taps) tiles at offsets
  ``(0 or -1, 0 or -1)`` (clamped at the edges), each gradient tile a select of one of them;
- ``kernel``: ``triton.max_backward`` itself;
- ``... cols first``: the same, the grid's first dim running over a row's column blocks first
  (consecutive programs write consecutive blocks of a row: the kernels' order,
  ``triton_tile.program``); without it the rows run first (the kernels' earlier order). The
  ``kernel`` row runs the kernels' order.

``--dtypes bfloat16,float32``; ``--launch 8,64,4`` (``bw, bl, num_warps``; default: the
kernel's heuristic). Prints a table and saves ``benchmarks/results/bwd_floor_gpu.json``. Needs a
GPU.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("JAXPOOL_TUNE", "off")
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import config  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.pallas.tuning import tuner as tuning  # noqa: E402
from jaxpool._src.pallas.triton.tile import load, plgpu  # noqa: E402

SHAPE = (128, 112, 112, 64)


def _arg(name, default):
  return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _time(fn, *args):
  """Median ms of 30 samples of at least 5 ms of calls (the tuner's timer)."""
  return tuning.time_ms(fn, args, samples=30, sample_ms=5.0)


def _kernel(*refs, bw, bl, reads, Ho, Wo, cols_first):
  """One program: input rows ``2 mh + (0, 1)``, phase columns ``m`` of the block (with
  ``cols_first`` the column blocks of a row are consecutive programs)."""
  if reads:
    idx_ref, dy_ref, dx_ref = refs
  else:
    (dx_ref,) = refs
  if cols_first:
    ncb = pl.cdiv(Wo, bw)
    row, cb = pl.program_id(0) // ncb, pl.program_id(0) % ncb
  else:
    row, cb = pl.program_id(0), pl.program_id(1)
  b, mh = row // Ho, row % Ho
  m = cb * bw + jnp.arange(bw, dtype=jnp.int32)
  lanes = pl.ds(pl.program_id(2) * bl, bl)
  tiles = {}
  for qh, qw in ((-1, -1), (-1, 0), (0, -1), (0, 0))[-reads:] if reads else ():
    oh = jnp.clip(mh + qh, 0, Ho - 1)
    ow = jnp.clip(m + qw, 0, Wo - 1)
    tiles[(qh, qw)] = (load(idx_ref, (b, oh, ow, lanes)), load(dy_ref, (b, oh, ow, lanes)))
  for rh in range(2):
    for rw in range(2):
      if not reads:
        val = jnp.zeros((bw, bl), dx_ref.dtype)
      else:
        it, dyt = tiles[list(tiles)[(rh * 2 + rw) % len(tiles)]]
        val = jnp.where(it == rh * 2 + rw, dyt, jnp.zeros((), dyt.dtype))
      plgpu.store(dx_ref.at[b, 2 * mh + rh, 2 * m + rw, lanes], val)


def floor_call(reads, idx, dy, bw, bl, warps, cols_first=False):
  n, ho, wo, c = dy.shape
  kernel = functools.partial(_kernel, bw=bw, bl=bl, reads=reads, Ho=ho, Wo=wo,
                             cols_first=cols_first)
  grid = ((n * ho * pl.cdiv(wo, bw), 1, pl.cdiv(c, bl)) if cols_first else
          (n * ho, pl.cdiv(wo, bw), pl.cdiv(c, bl)))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(SHAPE, dy.dtype), grid=grid,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      name="floor")(*((idx, dy) if reads else ()))


def main():
  copy = jax.jit(lambda a: a + 1)
  big = jnp.zeros((2**28,), jnp.float32)
  copy_gbs = 2 * big.nbytes / _time(copy, big) / 1e6
  print(f"copy bandwidth: {copy_gbs:.0f} GB/s")
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  rows = []
  for dtype in _arg("--dtypes", "bfloat16,float32").split(","):
    x = jax.random.normal(jax.random.key(0), SHAPE, jnp.float32).astype(dtype)
    _, taps = pk.max_forward_taps(x, geom, interpret=False)
    dy = jax.random.normal(jax.random.key(1), taps.shape, jnp.float32).astype(dtype)
    launch = (tuple(int(v) for v in _arg("--launch", "").split(",")) if "--launch" in sys.argv
              else config.launch_config(SHAPE[2] // 2, SHAPE[3], np.dtype(dtype).itemsize, True))
    nbytes = x.nbytes + dy.nbytes + taps.nbytes
    fns = {
        "write_only": jax.jit(lambda i, d, c=launch: floor_call(0, i, d, *c)),
        "read1_write4": jax.jit(lambda i, d, c=launch: floor_call(1, i, d, *c)),
        "read4_write4": jax.jit(lambda i, d, c=launch: floor_call(4, i, d, *c)),
        "read1_write4 cols first": jax.jit(lambda i, d, c=launch: floor_call(1, i, d, *c, True)),
        "read4_write4 cols first": jax.jit(lambda i, d, c=launch: floor_call(4, i, d, *c, True)),
        "kernel": jax.jit(lambda i, d, c=launch: pk._backward_call((i, d), SHAPE, geom, "max",
                                                                   False, launch=c)),
    }
    times = {k: [] for k in fns}
    for _ in range(3):  # rounds, alternating the variants
      for k, f in fns.items():
        times[k].append(_time(f, taps, dy))
    for k in fns:
      ms = min(times[k])
      moved = x.nbytes if k == "write_only" else nbytes
      row = dict(dtype=dtype, variant=k, launch=launch, ms=ms,
                 of_copy=moved / ms / 1e6 / copy_gbs)
      rows.append(row)
      print(f"{dtype:9s} {k:24s} {launch} {ms:.4f} ms  {row['of_copy']:.2f} of copy", flush=True)
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                      "bwd_floor_gpu.json")
  with open(path, "w") as f:
    json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), copy_gbs=copy_gbs,
                   rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
