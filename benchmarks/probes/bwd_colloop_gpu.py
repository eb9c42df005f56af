"""Probe: the 2-D channels_last max-pool backward with a loop over columns, each cotangent
(and taps) tile loaded once a program.

The library's backward (``triton_backward.py``) loads, for a block of ``s_h x s_w`` input rows
and columns, the cotangent tiles of every window offset the block reads: for 3x3/s2 four
tiles (offsets ``(0|1, 0|1)``) for one block, each read again by the neighbouring blocks. Here a
program covers ``bh`` blocks in height and a strip of ``L`` steps in width: at step ``c`` its
columns are ``m = k * L + c`` for ``k < K`` (a ``(K, bl)`` tile, ``K`` columns ``L`` apart), and
the tiles that the next step reads at offset ``q - 1`` are passed on to it, so each cotangent
tile is loaded once and a program reads ``(bh + 1) x (L + 1)`` tiles for ``bh x L`` blocks.
The same taps summed in the same order as the library's kernel: the same bits (checked).

``--runs "bf16:K,L,bh,bl,warps;..."`` times each launch side by side with the library's table
launch (and ``--lib`` launches) in interleaved rounds and prints fractions of the copy
bandwidth (bytes ``dy + taps + dx``). Needs a GPU (``--interpret`` checks bits on a CPU on a
small case).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAXPOOL_TUNE", "cached")
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas import triton as pk  # noqa: E402
from jaxpool._src.pallas.triton_tile import Tile, both_paths, load, split  # noqa: E402


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def programs(g, K, L, bh):
  """A batch's blocks of ``bh`` phase rows, and the strips of ``K * L`` phase columns."""
  H, W = g.in_spatial[1:]
  return _cdiv(_cdiv(H, g.strides[1]), bh), _cdiv(_cdiv(W, g.strides[2]), K * L)


def colloop_kernel(idx_ref, dy_ref, dx_ref, *, g, K, L, bh, bl, lanes, interpret):
  (_, H, W), (_, Ho, Wo) = g.in_spatial, g.out_spatial
  sh, sw = g.strides[1], g.strides[2]
  n_rows, n_strips = programs(g, K, L, bh)
  pid = pl.program_id(0)
  row, strip, lb = split(pid, (n_strips, _cdiv(lanes, bl)))
  b, mb = split(row, (n_rows,))
  mh0 = mb * bh
  tile = Tile(K, lanes, bl, interpret, True, lb)
  dtype = dy_ref.dtype
  zero = jnp.zeros(tile.shape, dtype)
  ks = jnp.arange(K, dtype=jnp.int32)
  base = strip * (K * L)
  # The plan: for each phase (rh, rw), its taps (t, qh, qw) in ascending offset order (the
  # library's descending tap order).
  plan = {}
  for rh in range(sh):
    for rw in range(sw):
      taps = [(i * g.window[2] + j, qh, qw) for i, qh in windows.phase_taps(g, 1, rh)
              for j, qw in windows.phase_taps(g, 2, rw)]
      plan[rh, rw] = sorted(taps, key=lambda t: (t[1], t[2]))
  qhs = sorted({q for taps in plan.values() for _, q, _ in taps})
  qws = sorted({q for taps in plan.values() for _, _, q in taps})
  assert qhs[0] >= 0 and qws[0] >= 0, (qhs, qws)
  row_offsets = range(bh + qhs[-1])  # window rows mh0 + r the program reads
  every = all(len(t) == g.window[1] * g.window[2] for t in plan.values())

  def body(edge):
    def tile_at(r, x):
      oh = mh0 + r
      ow = base + ks * L + x
      # Columns past the end: masked unless every strip's columns are known to be real.
      mask = None if n_strips == 1 and (K - 1) * L + x < Wo else ow < Wo
      if edge:
        mask = (mask & (oh < Ho)) if mask is not None else jnp.broadcast_to(oh < Ho, (K,))
      owc = jnp.minimum(ow, Wo - 1)
      ohc = jnp.minimum(oh, Ho - 1)
      where = tile.index(b, 0, ohc, owc)
      m2 = None if mask is None else tile.cols_of(mask)
      dyt = load(dy_ref, where, m2, None if m2 is None else np.array(0, dtype))
      it = load(idx_ref, where, m2, None if m2 is None else np.array(-1, idx_ref.dtype))
      return dyt, it

    have = {}
    for c in range(L):
      for r in row_offsets:
        for qw in qws:
          if (r, c + qw) not in have:
            have[r, c + qw] = tile_at(r, c + qw)
      m = base + ks * L + c
      for kh in range(bh):
        for (rh, rw), taps in plan.items():
          acc = None
          for t, qh, qw in taps:
            dyt, it = have[kh + qh, c + qw]
            term = jnp.where(it == t, dyt, np.array(0, dtype))
            if acc is None:
              acc = term if every else jnp.where(term == 0, zero, term)
            else:
              acc = acc + term
          if acc is None:
            acc = zero
          h = (mh0 + kh) * sh + rh
          w = m * sw + rw
          mask = None if n_strips == 1 and ((K - 1) * L + c) * sw + rw < W else w < W
          if edge:
            real = jnp.broadcast_to(h < H, (K,))
            mask = real if mask is None else mask & real
          # (interpret mode: the stores past the end are dropped)
          tile.store(dx_ref, tile.index(b, 0, h, w), acc.astype(dtype), mask)
      for r in row_offsets:  # (what the next step does not read)
        have.pop((r, c), None)

  interior = (mh0 + bh - 1 + qhs[-1] < Ho) & ((mh0 + bh) * sh <= H)
  both_paths(interior, body)


def colloop_backward(taps, dy, in_shape, geom, *, K, L, bh, bl, warps, interpret=False):
  g = geom.lift(3)
  assert g.channels_last and g.in_spatial[0] == 1
  ops = [pk._view(o, g.out_spatial, True) for o in (taps, dy)]
  lanes, nb = ops[0].shape[-1], ops[0].shape[0]
  n_rows, n_strips = programs(g, K, L, bh)
  grid = (nb * n_rows * n_strips * _cdiv(lanes, bl),)
  shape5 = pk._view_shape(in_shape, g.in_spatial, True)
  kernel = functools.partial(colloop_kernel, g=g, K=K, L=L, bh=bh, bl=bl, lanes=lanes,
                             interpret=interpret)
  dx = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape5, dy.dtype), grid=grid,
                      interpret=interpret, name="jaxpool_max_pool_bwd_colloop",
                      **pk._call_kwargs(interpret, warps))(*ops)
  return dx.reshape(in_shape)


CASES = {
    "bf16": ((128, 112, 112, 64), "bfloat16"),
    "f32": ((128, 112, 112, 64), "float32"),
    "small": ((2, 14, 18, 16), "bfloat16"),
    "odd": ((2, 13, 17, 16), "float32"),
}


def operands(shape, geom, dtype, seed=0):
  rng = np.random.default_rng(seed)
  out_shape = geom.output_shape(shape)
  n_taps = geom.lift(3).num_taps
  dy = jnp.asarray(rng.normal(size=out_shape), dtype)
  # Tie-rich cotangents too: small integers, with zeros of both signs.
  dy = jnp.where(jnp.asarray(rng.random(out_shape) < 0.3), jnp.asarray(
      rng.integers(-2, 3, out_shape), dtype) * jnp.asarray(-0.0 if seed % 2 else 1.0, dtype), dy)
  idx = jnp.asarray(rng.integers(-1, n_taps, out_shape), windows.taps_dtype(n_taps))
  return idx, dy


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--runs", default="bf16:8,7,2,64,2;bf16:8,7,1,64,2")
  ap.add_argument("--lib", default="bf16:4,64,1,1,2;bf16:8,64,2,1,2")
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--samples", type=int, default=15)
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/bwd_colloop_gpu.json"))
  a = ap.parse_args()
  by_case = {}
  for spec in a.runs.split(";"):
    case, launch = spec.split(":")
    by_case.setdefault(case, {"colloop": [], "lib": []})["colloop"].append(
        tuple(int(v) for v in launch.split(",")))
  for spec in a.lib.split(";") if a.lib else []:
    case, launch = spec.split(":")
    by_case.setdefault(case, {"colloop": [], "lib": []})["lib"].append(
        tuple(int(v) for v in launch.split(",")))
  results = {}
  for case, runs in by_case.items():
    shape, dtype = CASES[case]
    geom = windows.make_geometry(shape, (3, 3), (2, 2), 1, data_format="channels_last")
    idx, dy = operands(shape, geom, dtype)
    def library(i, d, launch=None, shape=shape, geom=geom):
      return pk._backward_call((i, d), shape, geom, "max", a.interpret, launch=launch)

    fns = {"table": jax.jit(library)}
    for launch in runs["lib"]:
      fns["lib " + "x".join(map(str, launch))] = jax.jit(functools.partial(library,
                                                                          launch=launch))
    for K, L, bh, bl, w in runs["colloop"]:
      fns[f"loop {K}x{L}x{bh}x{bl}x{w}"] = jax.jit(functools.partial(
          colloop_backward, in_shape=shape, geom=geom, K=K, L=L, bh=bh, bl=bl, warps=w,
          interpret=a.interpret))
    ref = np.asarray(fns["table"](idx, dy).view(np.uint16 if dtype == "bfloat16"
                                                  else np.uint32))
    same = {}
    for k, f in fns.items():
      got = np.asarray(f(idx, dy).view(ref.dtype))
      same[k] = bool(np.array_equal(got, ref))
      print(f"{case} {k}: bits {'equal' if same[k] else 'DIFFER'}"
            + ("" if same[k] else f" ({int((got != ref).sum())} of {ref.size})"), flush=True)
    if a.interpret:
      continue
    from launches_gpu import _copy_ms, fastest_in_rounds
    nbytes = idx.nbytes + dy.nbytes + int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    copy = _copy_ms(2 ** 30) / 2 ** 30
    best = fastest_in_rounds(fns, (idx, dy), a.rounds, a.samples)
    results[case] = {k: {"ms": v, "of_copy": copy * nbytes / v, "bits_equal": same[k]}
                     for k, v in best.items()}
    for k, v in best.items():
      print(f"{case:5s} {k:24s} {v:.4f} ms  {copy * nbytes / v:.3f} of copy", flush=True)
  if results:
    with open(a.out, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
