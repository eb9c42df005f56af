"""Probe: a separable max-pool forward over several output rows a program, against the kernel.

The max-pool forward kernel (``jaxpool/_src/pallas/triton_max.py``) computes one output row a
program and takes every window's maximum over all its taps: 27 loads and 27 maxima an output
element for a 3x3x3 window. A maximum is separable: the maximum over a window is the maximum
over its planes of the maxima over their rows of the maxima over each row's column taps. This
probe's kernel covers ``rd x rh`` output rows a program, reduces each input row it reads over
its column taps once (shared by the output rows whose windows hold that row), then the rows of
each plane, then the planes: for 3x3x3/s2 and ``rd x rh = 2 x 4``, about 17 loads and 22 maxima
an output element.

Without the taps the maximum's bits do not depend on the order (PTX's ``max.NaN.f32`` is
commutative, its NaN result canonical), so the probe's results must equal the kernel's bit for
bit; the probe checks that, then times both, rounds alternating. Edges: every index is clamped
into the input (with dilation 1 a clamped tap reads a tap of its own window, which cannot
change the maximum), so there is one code path.

Only what the probe needs: channels_last, dilation 1, the maximum without its taps, every
window holding at least one real element. ``--cases`` picks cases by name; ``--shapes
"rd,rh,bw,warps;..."`` the separable launches. Prints a table; saves
``benchmarks/results/separable_gpu.json``. Needs a GPU (``--interpret`` checks the bits on a
CPU, small shapes).
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
from jaxpool._src.pallas import triton as pk  # noqa: E402
from jaxpool._src.pallas import tuning  # noqa: E402
from jaxpool._src.pallas.triton_max import nan_max  # noqa: E402
from jaxpool._src.pallas.triton_tile import Tile, load, split  # noqa: E402
from jaxpool._src.windows import make_geometry  # noqa: E402

CASES = [
    ("16x16x56x56x64 3x3x3/s2/p1 f32", (16, 16, 56, 56, 64), 3, 2, 1, jnp.float32),
    ("128x112x112x64 3x3/s2/p1 bf16", (128, 112, 112, 64), 3, 2, 1, jnp.bfloat16),
    ("128x112x112x64 3x3/s2/p1 f32", (128, 112, 112, 64), 3, 2, 1, jnp.float32),
]
SMALL = [
    ("2x7x9x11x8 3x3x3/s2/p1 f32", (2, 7, 9, 11, 8), 3, 2, 1, jnp.float32),
    ("2x10x12x16 3x3/s2/p1 bf16", (2, 10, 12, 16), 3, 2, 1, jnp.bfloat16),
    ("1x6x7x5x4 2x2x2/s1/p0 f32", (1, 6, 7, 5, 4), 2, 1, 0, jnp.float32),
]


def _sep_kernel(x_ref, o_ref, *, k, s, p, ins, outs, rd, rh, bw, bl, lanes, form, interpret):
  (D, H, W), (Do, Ho, Wo) = ins, outs
  nd, nh = -(-Do // rd), -(-Ho // rh)
  # Programs in memory order (as the kernels': triton_tile.program): lane blocks, then column
  # blocks, then row blocks.
  blocks, cb, lb = split(pl.program_id(0), (pl.cdiv(Wo, bw), pl.cdiv(lanes, bl)))
  b, dblk, hblk = split(blocks, (nd, nh))
  tile = Tile(bw, lanes, bl, interpret, True, lb)
  wo = cb * bw + jnp.arange(bw, dtype=jnp.int32)
  col_mask = wo < Wo
  wo = jnp.minimum(wo, Wo - 1)
  cols = [jnp.clip(wo * s[2] - p[2] + j, 0, W - 1) for j in range(k[2])]
  d0, h0 = dblk * rd * s[0] - p[0], hblk * rh * s[1] - p[1]
  planes, rows = (rd - 1) * s[0] + k[0], (rh - 1) * s[1] + k[1]
  cmp_t = jnp.float32
  acc = [[None] * rh for _ in range(rd)]
  for a in range(planes):
    d = jnp.clip(d0 + a, 0, D - 1)
    hm = [None] * rh
    for t in range(rows):
      h = jnp.clip(h0 + t, 0, H - 1)
      wm = None
      for c in cols:
        v = load(x_ref, tile.index(b, d, h, c)).astype(cmp_t)
        wm = nan_max(v, v, form) if wm is None else nan_max(wm, v, form)
      for r in range(rh):
        if 0 <= t - r * s[1] < k[1]:
          hm[r] = wm if hm[r] is None else nan_max(hm[r], wm, form)
    for q in range(rd):
      if 0 <= a - q * s[0] < k[0]:
        for r in range(rh):
          acc[q][r] = hm[r] if acc[q][r] is None else nan_max(acc[q][r], hm[r], form)
  for q in range(rd):
    for r in range(rh):
      do, ho = dblk * rd + q, hblk * rh + r
      ok = col_mask & (do < Do) & (ho < Ho)
      at = tile.index(b, jnp.minimum(do, Do - 1), jnp.minimum(ho, Ho - 1), wo)
      val = acc[q][r].astype(o_ref.dtype)
      if interpret:  # (unmasked stores: a row past the end rewrites the last row's values)
        val = jnp.where((do < Do) & (ho < Ho), val, load(o_ref, at))
      tile.store(o_ref, at, val, ok)


def separable_max(x, k, s, p, rd, rh, bw, warps, bl=None, interpret=False):
  """The max pool of ``x`` (channels_last, 1-3 spatial dims, window ``k``, stride ``s``,
  symmetric padding ``p``, all per dim or one int) by the separable kernel."""
  nsp = x.ndim - 2
  lift = lambda v: (1,) * (3 - nsp) + ((v,) * nsp if isinstance(v, int) else tuple(v))  # noqa: E731
  k, s, p = lift(k), lift(s), tuple(0 for _ in range(3 - nsp)) + lift(p)[3 - nsp:]
  ins = (1,) * (3 - nsp) + tuple(x.shape[1:-1])
  outs = tuple((n + 2 * pp - kk) // ss + 1 for n, kk, ss, pp in zip(ins, k, s, p))
  B, C = x.shape[0], x.shape[-1]
  x5 = x.reshape(B, *ins, C)
  bl = bl or min(C, 64 if x.dtype.itemsize == 4 else 128)
  grid = (B * -(-outs[0] // rd) * -(-outs[1] // rh) * pl.cdiv(outs[2], bw) * pl.cdiv(C, bl),)
  form = "beats" if interpret else "ptx"
  kern = functools.partial(_sep_kernel, k=k, s=s, p=p, ins=ins, outs=outs, rd=rd, rh=rh, bw=bw,
                           bl=bl, lanes=C, form=form, interpret=interpret)
  kw = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    kw["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=1)
  y = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((B, *outs, C), x.dtype), grid=grid,
                     interpret=interpret, name="separable_max_fwd", **kw)(x5)
  return y.reshape(x.shape[0], *outs[3 - nsp:], C)


def reference(x, k, s, p, interpret):
  n = x.ndim - 2
  geom = make_geometry(x.shape, (k,) * n, (s,) * n, ((p, p),) * n, (1,) * n, False,
                       "channels_last")
  return pk.max_forward(x, geom, interpret=interpret)


def median_ms(fn, x, reps=30):
  """The median of ``reps`` samples of about 5 ms each (the tuner's timer)."""
  return tuning.time_ms(fn, (x,), samples=reps)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", default="")
  ap.add_argument("--shapes", default="1,1,16,8;1,2,16,8;1,4,16,8;2,2,16,8;2,4,16,8;2,4,8,4;"
                  "1,4,8,4;2,2,8,4")
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                "separable_gpu.json"))
  a = ap.parse_args()
  cases = SMALL if a.interpret else CASES
  cases = [c for c in cases if not a.cases or any(n in c[0] for n in a.cases.split(","))]
  shapes = [tuple(int(v) for v in sh.split(",")) for sh in a.shapes.split(";") if sh]
  rows, copy_bw = [], None
  if not a.interpret:
    big = jnp.ones((1 << 28,), jnp.float32)
    ms = median_ms(jax.jit(lambda v: v + 1), big)
    copy_bw = 2 * big.nbytes / ms / 1e6
    print(f"copy {copy_bw:.0f} GB/s, {jax.devices()[0].device_kind}", flush=True)
  for name, shape, k, s, p, dtype in cases:
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    if a.interpret:  # ties, signed zeros and NaN
      x = jnp.round(x * 2) / 2
      x = x.at[(0,) * x.ndim].set(jnp.nan).at[(0,) * (x.ndim - 1) + (1,)].set(-0.0)
    ref = reference(x, k, s, p, a.interpret)
    nbytes = x.nbytes + ref.nbytes
    row = {"case": name, "bytes": nbytes}
    fns = {"kernel": jax.jit(functools.partial(reference, k=k, s=s, p=p, interpret=a.interpret))}
    for sh in shapes:
      if sh[0] > 1 and len(shape) < 5:
        continue  # (one plane: more planes a program only repeats the work)
      label = "sep {}x{} bw{} w{}".format(*sh) + (f" bl{sh[4]}" if len(sh) > 4 else "")
      fns[label] = jax.jit(functools.partial(
          separable_max, k=k, s=s, p=p, rd=sh[0], rh=sh[1], bw=sh[2], warps=sh[3],
          bl=sh[4] if len(sh) > 4 else None, interpret=a.interpret))
    for label, fn in fns.items():
      y = fn(x)
      same = bool(jnp.all(jax.lax.bitcast_convert_type(y, jnp.uint16 if dtype == jnp.bfloat16
                                                       else jnp.uint32)
                          == jax.lax.bitcast_convert_type(ref, jnp.uint16 if dtype ==
                                                          jnp.bfloat16 else jnp.uint32)))
      row[label] = {"bit_equal": same}
      if not same:
        print(f"{name} {label}: NOT bit-equal", flush=True)
    if not a.interpret:
      for _ in range(2):  # rounds alternate the variants
        for label, fn in fns.items():
          ms = median_ms(fn, x, reps=15)
          row[label].setdefault("ms", []).append(ms)
      for label in fns:
        ms = min(row[label]["ms"])
        row[label]["of_copy"] = nbytes / ms / 1e6 / copy_bw
        print(f"{name:34s} {label:22s} {ms:.4f} ms {row[label]['of_copy']:.2f} of copy "
              f"{'' if row[label]['bit_equal'] else 'NOT EQUAL'}", flush=True)
    rows.append(row)
  print(json.dumps([{r["case"]: {k: v.get("bit_equal") for k, v in r.items()
                                 if isinstance(v, dict)}} for r in rows]))
  if not a.interpret:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "copy_GBps": copy_bw, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
  main()
