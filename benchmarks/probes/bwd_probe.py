"""What the max-backward probes (``bwd_colloop_gpu.py``, ``bwd_mosaic_gpu.py``) share: their
cases and inputs, the input phases' tap order, and the command line that checks each variant's
bits against the library's kernel and times them side by side.

Each probe's ``--runs "case:a,b,...;case:..."`` lists its own variants (the numbers are the
probe's parameters), ``--lib "case:bw,bl,w[,bd,bh];..."`` launches of the library's kernel; the
library's kernel at the launch the tuner gives (``table``, its launch printed) is the reference
for the bits and is always timed. ``--interpret`` checks bits only, on a CPU: pass the small
cases (``small``, ``odd``). Fractions of the copy bandwidth count ``dy + taps + dx`` and a copy
as ``launches_gpu.py``'s (``x + 1`` over 1 GiB).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAXPOOL_TUNE", "cached")
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from launches_gpu import _copy_ms, _parse, fastest_in_rounds  # noqa: E402

CASES = {  # 3x3/s2/p1, channels_last
    "bf16": ((128, 112, 112, 64), "bfloat16"),
    "f32": ((128, 112, 112, 64), "float32"),
    "small": ((2, 16, 16, 64), "bfloat16"),
    "odd": ((2, 13, 17, 16), "float32"),
}


def plan(g) -> dict[tuple[int, int], tuple[list[tuple[int, int, int]], bool]]:
  """For each input phase ``(rh, rw)`` of the 2-D geometry ``g`` (lifted to 3-D): its taps
  ``(t, qh, qw)`` in ascending offset order (the library's descending tap order), and whether
  it visits every tap of the window (where it does not, the library's sum takes ``+0.0`` for
  a first term of zero: the XLA path adds a zero for each tap it skips)."""
  out = {}
  for rh in range(g.strides[1]):
    for rw in range(g.strides[2]):
      taps = [(i * g.window[2] + j, qh, qw) for i, qh in windows.phase_taps(g, 1, rh)
              for j, qw in windows.phase_taps(g, 2, rw)]
      out[rh, rw] = (sorted(taps, key=lambda t: (t[1], t[2])),
                     len(taps) == g.window[1] * g.window[2])
  return out


def offsets(phases) -> tuple[list[int], list[int]]:
  """The window offsets ``q`` in height and in width that :func:`plan`'s phases read, ascending
  (all at least 0: a block reads its own windows and later ones)."""
  qhs = sorted({q for taps, _ in phases.values() for _, q, _ in taps})
  qws = sorted({q for taps, _ in phases.values() for _, _, q in taps})
  assert qhs[0] >= 0 and qws[0] >= 0, (qhs, qws)
  return qhs, qws


def phase_sum(terms, every: bool, zero):
  """The library's sum of a phase's terms (in order): the first one's zero as ``+0.0`` unless
  the phase visits every tap, then added one by one in the cotangents' dtype."""
  acc = None
  for term in terms:
    if acc is None:
      acc = term if every else jnp.where(term == 0, zero, term)
    else:
      acc = acc + term
  return zero if acc is None else acc


def operands(shape, geom, dtype, seed=0):
  """Taps in ``[-1, n)`` and cotangents: normal, and (30%) small integers of either sign,
  so that ties of values and zeros of both signs occur."""
  rng = np.random.default_rng(seed)
  out_shape = geom.output_shape(shape)
  n_taps = geom.lift(3).num_taps
  dy = jnp.asarray(rng.normal(size=out_shape), dtype)
  ints = jnp.asarray(rng.integers(-2, 3, out_shape), dtype)
  signs = jnp.asarray(np.where(rng.random(out_shape) < 0.5, -1.0, 1.0), dtype)
  dy = jnp.where(jnp.asarray(rng.random(out_shape) < 0.3), ints * signs, dy)
  idx = jnp.asarray(rng.integers(-1, n_taps, out_shape), windows.taps_dtype(n_taps))
  return idx, dy


def main(name: str, make: Callable[..., Callable], default_runs: str, default_lib: str,
         doc: str) -> None:
  """The probes' command line: ``make(params, shape=, geom=, interpret=)`` gives the jitted
  ``(taps, dy) -> dx`` of one variant of ``--runs``."""
  ap = argparse.ArgumentParser(description=doc.splitlines()[0])
  ap.add_argument("--runs", default=default_runs)
  ap.add_argument("--lib", default=default_lib)
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--samples", type=int, default=5)
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                f"bwd_{name}_gpu.json"))
  a = ap.parse_args()
  by_case: dict = {}
  for text, kind in [(s, name) for s in a.runs.split(";")] + \
                    [(s, "lib") for s in (a.lib.split(";") if a.lib else [])]:
    case, params = text.split(":")
    by_case.setdefault(case, {name: [], "lib": []})[kind].append(_parse(params))
  copy_gbs = None if a.interpret else (1 << 31) / _copy_ms(1 << 31) / 1e6
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "copy_gbs": copy_gbs, "rounds": a.rounds, "samples": a.samples, "cases": {}}
  for case, runs in by_case.items():
    shape, dtype = CASES[case]
    geom = windows.make_geometry(shape, (3, 3), (2, 2), 1, data_format="channels_last")
    idx, dy = operands(shape, geom, dtype)

    def library(i, d, launch=None, shape=shape, geom=geom):
      return pk._backward_call((i, d), shape, geom, "max", a.interpret, launch=launch)

    table = pk.launch_for("max_bwd", shape, jnp.dtype(dtype), geom, interpret=a.interpret)
    fns = {"table " + "x".join(map(str, table)): jax.jit(library)}
    for launch in runs["lib"]:
      fns["lib " + "x".join(map(str, launch))] = jax.jit(functools.partial(library,
                                                                          launch=launch))
    for params in runs[name]:
      fns[name + " " + "x".join(map(str, params))] = make(params, shape=shape, geom=geom,
                                                           interpret=a.interpret)
    view = np.uint16 if dtype == "bfloat16" else np.uint32
    ref = np.asarray(next(iter(fns.values()))(idx, dy)).view(view)
    same = {}
    for k, f in list(fns.items()):
      try:
        got = np.asarray(f(idx, dy)).view(view)
      except Exception as e:  # (a variant that fails to lower or run: reported, not timed)
        print(f"{case} {k}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
        del fns[k]
        continue
      same[k] = bool(np.array_equal(got, ref))
      print(f"{case} {k}: bits {'equal' if same[k] else 'DIFFER'}"
            + ("" if same[k] else f" ({int((got != ref).sum())} of {ref.size})"), flush=True)
    if a.interpret:
      continue
    nbytes = idx.nbytes + dy.nbytes + int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    best = fastest_in_rounds(fns, (idx, dy), a.rounds, a.samples)
    results["cases"][case] = {k: {"ms": v, "of_copy": nbytes / v / 1e6 / copy_gbs,
                                  "bits_equal": same[k]} for k, v in best.items()}
    for k, v in best.items():
      print(f"{case:5s} {k:26s} {v:.4f} ms  {nbytes / v / 1e6 / copy_gbs:.3f} of copy",
            flush=True)
  if results["cases"]:
    with open(a.out, "w") as f:
      json.dump(results, f, indent=1)
