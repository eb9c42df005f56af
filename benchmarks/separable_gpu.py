"""The max-pool forward over blocks of output rows a program, against the one-row kernel.

The max-pool forward kernel (``jaxpool/_src/pallas/triton/max.py``) computes one output row a
program and takes every window's maximum over all its taps: 27 loads and 27 maxima an output
element for a 3x3x3 window. A maximum is separable: the maximum over a window is the maximum
over its planes of the maxima over their rows of the maxima over each row's column taps.
``triton/rows.py``'s kernel (this probe's own until the tuner offered it) covers ``rd x rh``
output rows a program, reduces each input row it reads over its column taps once (shared by
the output rows whose windows hold that row), then the rows of each plane, then the planes:
for 3x3x3/s2 and ``rd x rh = 2 x 4``, about 17 loads and 22 maxima an output element.

Without the taps the maximum's bits do not depend on the order (PTX's ``max.NaN.f32`` is
commutative, its NaN result canonical), so its results must equal the one-row kernel's bit for
bit; the probe checks that, then times both, rounds alternating. (The ``kernel`` row is the
package's own launch: with ``JAXPOOL_TUNE=cached`` the shipped table's, which on an H200 is a
block of rows for these cases; ``1,1,...`` shapes give the one-row kernel at their tile.)

``--cases`` picks cases by name; ``--shapes "rd,rh,bw,warps[,bl];..."`` the launches (``bl``:
lanes, default whole channel rows up to 256 bytes; ``1,1,...``: the one-row kernel at that
tile); ``--rounds`` (default 2) rounds of 15 samples each; ``--taps``: the forward with the
taps (the maxima's bits compared; the taps in the tests). Prints a table; saves
``benchmarks/results/separable_gpu.json`` (``--out``). Needs a GPU (``--interpret`` checks the
bits on a CPU, small shapes). Why a maintainer runs it: whether sharing a window's row maxima
between output rows pays on a GPU (it lost on an H100 and won within the tile's limits on an
H200; docs/design/row-blocks.md), the question large windows ask again.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAXPOOL_TUNE", "cached")
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.pallas.tuning import tuner as tuning  # noqa: E402
from jaxpool._src.windows import make_geometry, taps_dtype  # noqa: E402

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


def separable_max(x, k, s, p, rd, rh, bw, warps, bl=None, interpret=False, mode="max"):
  """The max pool of ``x`` (channels_last, window ``k``, stride ``s``, symmetric padding ``p``,
  each one int) over blocks of ``rd x rh`` output rows: ``triton/rows.py``'s kernel (1 x 1:
  the one-row kernel)."""
  n = x.ndim - 2
  geom = make_geometry(x.shape, (k,) * n, (s,) * n, ((p, p),) * n, (1,) * n, False,
                       "channels_last")
  bl = bl or min(x.shape[-1], 64 if x.dtype.itemsize == 4 else 128)
  return pk._window_call(x, geom, mode, interpret, launch=(bw, bl, warps, rd, rh))[0]


def reference(x, k, s, p, interpret, mode="max"):
  n = x.ndim - 2
  geom = make_geometry(x.shape, (k,) * n, (s,) * n, ((p, p),) * n, (1,) * n, False,
                       "channels_last")
  return pk._window_call(x, geom, mode, interpret)[0]


def median_ms(fn, x, reps=30):
  """The median of ``reps`` samples of about 5 ms each (the tuner's timer)."""
  return tuning.time_ms(fn, (x,), samples=reps)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", default="")
  ap.add_argument("--shapes", default="1,1,16,8;1,2,16,8;1,4,16,8;2,2,16,8;2,4,16,8;2,4,8,4;"
                  "1,4,8,4;2,2,8,4")
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--rounds", type=int, default=2, help="rounds of 15 samples, alternating")
  ap.add_argument("--taps", action="store_true", help="the forward with the taps (the "
                  "maxima's bits and time; the taps are compared in the tests)")
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
    mode = "argmax" if a.taps else "max"
    ref = reference(x, k, s, p, a.interpret, mode)
    nbytes = x.nbytes + ref.nbytes
    if a.taps:  # (the taps' bytes, written too)
      nbytes += ref.size * jnp.dtype(taps_dtype(k ** (x.ndim - 2))).itemsize
    row = {"case": name, "bytes": nbytes}
    fns = {"kernel": jax.jit(functools.partial(reference, k=k, s=s, p=p, interpret=a.interpret,
                                               mode=mode))}
    for sh in shapes:
      if sh[0] > 1 and len(shape) < 5:
        continue  # (one plane: more planes a program only repeats the work)
      label = "sep {}x{} bw{} w{}".format(*sh) + (f" bl{sh[4]}" if len(sh) > 4 else "")
      fns[label] = jax.jit(functools.partial(
          separable_max, k=k, s=s, p=p, rd=sh[0], rh=sh[1], bw=sh[2], warps=sh[3],
          bl=sh[4] if len(sh) > 4 else None, interpret=a.interpret, mode=mode))
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
      for _ in range(a.rounds):  # rounds alternate the variants
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
