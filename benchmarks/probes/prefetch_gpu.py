"""Probe: programs that loop over several tiles, loading the next tile's inputs before they
finish the current one (a prefetch into registers), against the kernels' one tile a program.

Two patterns, on ``pooling_gpu.py``'s cases that an H200 runs below 0.85 of copy:

- ``bwd``: the max-pool backward's memory pattern (``bwd_floor_gpu.py``'s ``read4_write4``,
  3x3/s2/p1 over 128x112x112x64, channels_last): each tile reads four (cotangent, taps) tiles
  and writes four gradient tiles. ``tile``: one tile a program (the kernels' grid, memory
  order); ``loop G``: ``G`` programs an SM, each looping over every ``G * SMs``-th tile;
  ``prefetch G``: the same, loading the next tile before storing the current one;
  ``... evict``: the stores with ``eviction_policy="evict_first"``. The ``kernel`` row is
  ``triton.max_backward`` at the same launch.
- ``fwd3``: the 3-D max forward (3x3x3/s2/p1 over 16x16x56x56x64 f32). A program covers
  ``rh`` output rows of one batch's plane-column and loops over the output planes: each input
  plane's rows are reduced over their column taps and rows once, and the last plane of one
  output plane's window (the first of the next's) is carried, so each input plane is read once
  (the kernels read it for 1.5 output planes on average). ``prefetch``: the next two planes
  are loaded before the current ones are reduced. Bit-equal to the kernel (checked). The
  ``kernel`` row is the package's launch (``JAXPOOL_TUNE=cached``: the shipped table's).

``--parts bwd,fwd3``; ``--dtypes`` (bwd); ``--launch 8,64,2`` (bwd: ``bw, bl, num_warps``;
default the H200 table's); ``--shapes "rh,bw,bl,warps;..."`` (fwd3); ``--rounds`` (default 3).
``--interpret`` checks the fwd3 kernel's bits on a CPU (small shapes). Prints a table; saves
``benchmarks/results/prefetch_gpu.json`` (``--out``). Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAXPOOL_TUNE", "cached")
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.pallas.tuning import tuner as tuning  # noqa: E402
from jaxpool._src.pallas.triton.max import nan_max  # noqa: E402
from jaxpool._src.pallas.triton.tile import load, plgpu  # noqa: E402

SHAPE2 = (128, 112, 112, 64)
SHAPE3 = (16, 16, 56, 56, 64)
TABLE_BWD = {"bfloat16": "8,64,2", "float32": "8,64,4"}  # the H200 table's (and H100's f32)


def _ms(fn, *args):
  return tuning.time_ms(fn, args, samples=15)


def _sms() -> int:
  return int(getattr(jax.devices()[0], "core_count", 132))


def _store(ref, idx, val, mask=None, evict=None):
  if plgpu is None or not hasattr(plgpu, "store"):  # pragma: no cover - interpret only
    ref[idx] = val
    return
  plgpu.store(ref.at[idx], val, mask=mask, eviction_policy=evict)


# ------------------------------------------------------------------ the backward's pattern


def _bwd_kernel(idx_ref, dy_ref, dx_ref, *, bw, bl, Ho, Wo, T, G, mode, evict):
  ncb = Wo // bw
  lanes = pl.ds(0, bl)

  def where(t):
    row, cb = t // ncb, t % ncb
    return row // Ho, row % Ho, cb * bw + jnp.arange(bw, dtype=jnp.int32)

  def loads(t):
    b, mh, m = where(t)
    out = []
    for qh, qw in ((-1, -1), (-1, 0), (0, -1), (0, 0)):
      oh, ow = jnp.clip(mh + qh, 0, Ho - 1), jnp.clip(m + qw, 0, Wo - 1)
      out += [load(idx_ref, (b, oh, ow, lanes)), load(dy_ref, (b, oh, ow, lanes))]
    return tuple(out)

  def stores(t, tiles):
    b, mh, m = where(t)
    for rh in range(2):
      for rw in range(2):
        p = rh * 2 + rw
        it, dyt = tiles[2 * p], tiles[2 * p + 1]
        val = jnp.where(it == p, dyt, jnp.zeros((), dyt.dtype))
        _store(dx_ref, (b, 2 * mh + rh, 2 * m + rw, lanes), val, evict=evict)

  pid = pl.program_id(0)
  if mode == "tile":
    stores(pid, loads(pid))
    return
  n_iter = (T - 1 - pid) // G + 1
  if mode == "loop":
    def body(i, c):
      t = pid + i * G
      stores(t, loads(t))
      return c
    jax.lax.fori_loop(0, n_iter, body, jnp.int32(0))
  else:
    def body(i, cur):
      t = pid + i * G
      nxt = loads(jnp.minimum(t + G, T - 1))
      stores(t, cur)
      return nxt
    jax.lax.fori_loop(0, n_iter, body, loads(pid))


def bwd_call(idx, dy, bw, bl, warps, mode="tile", per_sm=0, evict=None):
  n, ho, wo, c = dy.shape
  assert wo % bw == 0 and c == bl, (wo, bw, c, bl)
  T = n * ho * (wo // bw)
  G = T if mode == "tile" else min(T, per_sm * _sms())
  kernel = functools.partial(_bwd_kernel, bw=bw, bl=bl, Ho=ho, Wo=wo, T=T, G=G, mode=mode,
                             evict=evict)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(SHAPE2, dy.dtype), grid=(G,),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      name="prefetch_bwd")(idx, dy)


def run_bwd(a, copy_gbs, rows):
  geom = windows.make_geometry(SHAPE2, (3, 3), (2, 2), 1)
  for dtype in a.dtypes.split(","):
    x = jax.random.normal(jax.random.key(0), SHAPE2, jnp.float32).astype(dtype)
    _, taps = pk.max_forward_taps(x, geom, interpret=False)
    dy = jax.random.normal(jax.random.key(1), taps.shape, jnp.float32).astype(dtype)
    launch = tuple(int(v) for v in (a.launch or TABLE_BWD[dtype]).split(","))
    nbytes = x.nbytes + dy.nbytes + taps.nbytes
    fns = {"kernel": jax.jit(lambda i, d, c=launch: pk._backward_call(
        (i, d), SHAPE2, geom, "max", False, launch=c)),
           "tile": jax.jit(lambda i, d, c=launch: bwd_call(i, d, *c))}
    for g in (4, 8, 16):
      for mode in ("loop", "prefetch"):
        fns[f"{mode} {g}"] = jax.jit(lambda i, d, c=launch, m=mode, g=g: bwd_call(
            i, d, *c, mode=m, per_sm=g))
    fns["tile evict"] = jax.jit(lambda i, d, c=launch: bwd_call(i, d, *c, evict="evict_first"))
    fns["prefetch 8 evict"] = jax.jit(lambda i, d, c=launch: bwd_call(
        i, d, *c, mode="prefetch", per_sm=8, evict="evict_first"))
    _time_all(f"bwd {dtype} {launch}", fns, (taps, dy), nbytes, copy_gbs, a.rounds, rows)


# ------------------------------------------------------------ the 3-D forward, plane loop


def _fwd3_kernel(x_ref, o_ref, *, bw, bl, rh, prefetch, form, interpret):
  N, D, H, W, C = x_ref.shape
  _, Do, Ho, Wo, _ = o_ref.shape
  nlb, ncb, nhb = C // bl, pl.cdiv(Wo, bw), pl.cdiv(Ho, rh)
  pid = pl.program_id(0)
  lb, cb, row = pid % nlb, (pid // nlb) % ncb, pid // (nlb * ncb)
  b, hb = row // nhb, row % nhb
  lane = (pl.ds(lb * bl, bl) if not interpret
          else (lb * bl + jnp.arange(bl, dtype=jnp.int32))[None, :])
  raw_wo = cb * bw + jnp.arange(bw, dtype=jnp.int32)
  wo = jnp.minimum(raw_wo, Wo - 1)
  cols = [jnp.clip(wo * 2 - 1 + j, 0, W - 1) for j in range(3)]
  if interpret:
    cols = [c[:, None] for c in cols]
  hs = [jnp.clip(hb * rh * 2 - 1 + t, 0, H - 1) for t in range(2 * rh + 1)]

  def mx(u, v):
    return nan_max(u, v, form)

  def plane_loads(d):
    d = jnp.clip(d, 0, D - 1)
    return [[load(x_ref, (b, d, h, c, lane)) for c in cols] for h in hs]

  def reduce(vals):
    wm = [mx(mx(v[0], v[1]), v[2]) for v in vals]
    return [mx(mx(wm[2 * r], wm[2 * r + 1]), wm[2 * r + 2]) for r in range(rh)]

  def finish(do, prev, p0, p1):
    for r in range(rh):
      ho = hb * rh + r
      val = mx(mx(prev[r], p0[r]), p1[r])
      at = (b, do, jnp.minimum(ho, Ho - 1), wo if not interpret else wo[:, None], lane)
      if interpret:
        pl.when(ho < Ho)(lambda at=at, val=val: o_ref.__setitem__(at, val))
      else:
        _store(o_ref, at, val, (raw_wo < Wo)[:, None] & (ho < Ho))
    return p1

  prev0 = reduce(plane_loads(jnp.int32(-1)))
  if not prefetch:
    def body(do, prev):
      return finish(do, prev, reduce(plane_loads(2 * do)), reduce(plane_loads(2 * do + 1)))
    jax.lax.fori_loop(0, Do, body, prev0)
  else:
    def body(do, carry):
      prev, cur0, cur1 = carry
      nxt0, nxt1 = plane_loads(2 * do + 2), plane_loads(2 * do + 3)
      return finish(do, prev, reduce(cur0), reduce(cur1)), nxt0, nxt1
    jax.lax.fori_loop(0, Do, body, (prev0, plane_loads(jnp.int32(0)), plane_loads(jnp.int32(1))))


def fwd3_call(x, rh, bw, bl, warps, prefetch, interpret=False):
  N, D, H, W, C = x.shape
  Do, Ho, Wo = (D + 1) // 2, (H + 1) // 2, (W + 1) // 2  # 3/s2/p1
  grid = N * pl.cdiv(Ho, rh) * pl.cdiv(Wo, bw) * (C // bl)
  form = "beats" if interpret else "ptx"
  kernel = functools.partial(_fwd3_kernel, bw=bw, bl=bl, rh=rh, prefetch=prefetch, form=form,
                             interpret=interpret)
  params = None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=1)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((N, Do, Ho, Wo, C), x.dtype), grid=(grid,),
      compiler_params=params, interpret=interpret, name="prefetch_fwd3")(x)


def run_fwd3(a, copy_gbs, rows):
  shape = (2, 7, 9, 11, 8) if a.interpret else SHAPE3
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
  if a.interpret:  # ties, signed zeros and NaN
    x = jnp.round(x * 2) / 2
    x = x.at[0, 0, 0, 0, 0].set(jnp.nan).at[0, 0, 0, 1, 0].set(-0.0)
  geom = windows.make_geometry(shape, (3, 3, 3), (2, 2, 2), 1)
  ref_fn = jax.jit(lambda v: pk._window_call(v, geom, "max", a.interpret)[0])
  ref = ref_fn(x)
  fns = {"kernel": ref_fn}
  for sh in a.shapes.split(";"):
    rh, bw, bl, warps = (int(v) for v in sh.split(","))
    if a.interpret:
      bl = min(bl, shape[-1])
    for pre in (False, True):
      fns[f"rh{rh} bw{bw} bl{bl} w{warps}{' prefetch' if pre else ''}"] = jax.jit(
          functools.partial(fwd3_call, rh=rh, bw=bw, bl=bl, warps=warps, prefetch=pre,
                            interpret=a.interpret))
  for label, fn in fns.items():
    same = bool(jnp.all(jax.lax.bitcast_convert_type(fn(x), jnp.uint32)
                        == jax.lax.bitcast_convert_type(ref, jnp.uint32)))
    print(f"fwd3 {label}: bit-equal {same}", flush=True)
  if not a.interpret:
    _time_all("fwd3 f32", fns, (x,), x.nbytes + ref.nbytes, copy_gbs, a.rounds, rows)


def _time_all(case, fns, args, nbytes, copy_gbs, n_rounds, rows):
  times = {k: [] for k in fns}
  for _ in range(n_rounds):  # rounds, alternating the variants
    for k, f in fns.items():
      times[k].append(_ms(f, *args))
  for k in fns:
    ms = min(times[k])
    row = dict(case=case, variant=k, ms=ms, of_copy=nbytes / ms / 1e6 / copy_gbs,
               samples=times[k])
    rows.append(row)
    print(f"{case:26s} {k:30s} {ms:.4f} ms  {row['of_copy']:.3f} of copy", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--parts", default="bwd,fwd3")
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--launch", default="")
  ap.add_argument("--shapes", default="1,8,64,4;1,8,32,4;2,8,64,4;2,8,32,4;2,16,64,8;"
                  "4,8,64,4;1,16,64,4")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                "prefetch_gpu.json"))
  a = ap.parse_args()
  rows: list[dict] = []
  copy_gbs = None
  if not a.interpret:
    big = jnp.zeros((1 << 28,), jnp.float32)
    copy_gbs = 2 * big.nbytes / _ms(jax.jit(lambda v: v + 1), big) / 1e6
    print(f"copy {copy_gbs:.0f} GB/s, {jax.devices()[0].device_kind}, {_sms()} SMs", flush=True)
  parts = a.parts.split(",")
  if "bwd" in parts and not a.interpret:
    run_bwd(a, copy_gbs, rows)
  if "fwd3" in parts:
    run_fwd3(a, copy_gbs, rows)
  if not a.interpret:
    with open(a.out, "w") as f:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                     copy_gbs=copy_gbs, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
