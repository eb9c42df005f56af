"""Global and adaptive pooling against the plain JAX/XLA alternatives, side by side in one run.

Usage, from the repository root, on whatever backend JAX finds (CPU, GPU)::

  PYTHONPATH=$PWD python benchmarks/global_adaptive.py [--quick] [--repeats N] [--inner N]
      [--in-jit K]

Compared, each as an inference forward and as forward+backward (``jax.vjp``: ``y`` and ``dx``
both returned, so neither pass is dead code):

* ``global_avg_pool`` vs ``x.mean(axis=(1, 2))`` and ``global_max_pool`` vs
  ``x.max(axis=(1, 2))`` (JAX's autodiff: ties share the gradient), float32 and bfloat16;
* ``adaptive_avg_pool`` / ``adaptive_max_pool`` on evenly dividing sizes vs the fixed-window
  ``avg_pool`` / ``max_pool`` with the same output (window = stride = ``L // O``), and for bins
  of 8x8 the reshape-and-reduce stages forced, against the same fixed-window op (to place
  ``FIXED_WINDOW_MAX_TAPS``);
* adaptive pooling on sizes that do not divide (13x13 -> 7x7, and 5x5 -> 7x7, larger than the
  input) vs a ``lax.reduce_window`` formulation: one reduce-window per distinct bin shape
  (stride 1), gathered at the bins' starts and selected.

Timer: a sample runs the op ``--inner`` times back to back (default 10 on an accelerator, 1 on
a CPU), then ``block_until_ready``, divided by the count; after two warm-up calls (which
compile), samples are taken in three rounds that visit every contender of a row in turn (a change
of load on a shared machine meets both), and the median is reported. Arrays are jit arguments;
values are distinct within each (n, c) plane (no ties: both sides' gradients agree, and are
compared).

``--in-jit K`` times the global rows only, each timed call running K calls chained in one jit
(:func:`chained`): the GPU's time per call, where the host-timed calls are bound by launching
them (128x7x7x2048 fits in an H100's 50 MB L2 cache; a call takes about 0.1 ms).

Prints a table and saves it as JSON:
``benchmarks/results/global_adaptive_<device>[_in_jit<K>].json`` (``global_adaptive_h100.json``
on an H100); ``--quick`` runs go to ``build/benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool._src import adaptive, adaptive_plan, adaptive_xla  # noqa: E402
from jaxpool._src.backend import Op  # noqa: E402
from result_path import device_tag, result_path  # noqa: E402



# ----------------------------------------------------------------------------- timing


def time_all(calls: dict, repeats: int, inner: int) -> dict:
  """Median ms per call of each ``name: (fn, args)``, the contenders sampled in turn."""
  for fn, args in calls.values():
    for _ in range(2):
      jax.block_until_ready(fn(*args))
  times: dict[str, list[float]] = {name: [] for name in calls}
  rounds = 3
  for _ in range(rounds):
    for name, (fn, args) in calls.items():
      jax.block_until_ready(fn(*args))
      for _ in range(max(1, -(-repeats // rounds))):
        t0 = time.perf_counter()
        for _ in range(inner):
          out = fn(*args)
        jax.block_until_ready(out)
        times[name].append((time.perf_counter() - t0) * 1e3 / inner)
  return {name: statistics.median(v) for name, v in times.items()}


def chained(step, k: int):
  """``k`` calls of ``step`` (returning an array or a tuple of arrays, its first argument an
  array) in one jit, each reading the last one's result: every argument plus ``0 *`` the first
  element of the last output, which XLA fuses into the readers and cannot fold away (``0 * x``
  is NaN for an infinite ``x``). Nothing is computed once for all, and one launch from the host
  runs them all: the time over ``k`` is the GPU's time for one call inside a bigger program (a
  training step), without the host's cost of launching each call."""
  def run(*args):
    out = None
    for _ in range(k):
      out = step(*args)
      c = jax.tree.leaves(out)[-1].reshape(-1)[0] * 0
      args = tuple(a + c.astype(a.dtype) for a in args)
    return out
  return jax.jit(run)


def distinct_data(shape, dtype) -> jax.Array:
  """``(N, H, W, C)`` data whose values are distinct within each (n, c) plane (no ties, so both
  sides' max gradients agree): an affine permutation of ``0 .. H*W - 1`` per plane, as float32
  integers, or for bfloat16 as consecutive bit patterns from 1.0 up."""
  n, h, w, c = shape
  size = h * w
  pos = lax.broadcasted_iota(jnp.int32, shape, 1) * w + lax.broadcasted_iota(jnp.int32, shape, 2)
  offset = jax.random.randint(jax.random.key(0), (n, 1, 1, c), 0, size)
  mult = next(p for p in (7919, 7907, 7901) if size % p)  # a prime not dividing the plane size
  rank = (pos * mult + offset) % size
  if jnp.dtype(dtype) == jnp.bfloat16:
    return lax.bitcast_convert_type((rank + 0x3F80).astype(jnp.uint16), jnp.bfloat16)
  return (rank - size // 2).astype(dtype)


# ----------------------------------------------------------------------------- baselines


def reduce_window_adaptive(x: jax.Array, out: tuple[int, int], kind: str) -> jax.Array:
  """Adaptive pooling of ``(N, H, W, C)`` from ``lax.reduce_window``: for each distinct bin
  shape ``(lh, lw)``, one stride-1 reduce-window, gathered at the bins' starts, selected where
  the bins have that shape (JAX differentiates it by itself)."""
  per_dim = [adaptive_plan.bins(L, o) for L, o in zip(x.shape[1:3], out, strict=True)]
  lens = [e - s for s, e in per_dim]
  acc = jnp.float32 if kind == "avg" and x.dtype.itemsize < 4 else x.dtype
  xa = x.astype(acc)
  init = np.array(-np.inf if kind == "max" else 0, acc)
  op = lax.max if kind == "max" else lax.add
  y = None
  for lh in np.unique(lens[0]):
    for lw in np.unique(lens[1]):
      r = lax.reduce_window(xa, init, op, (1, int(lh), int(lw), 1), (1, 1, 1, 1), "VALID")
      r = jnp.take(r, np.minimum(per_dim[0][0], r.shape[1] - 1), axis=1)
      r = jnp.take(r, np.minimum(per_dim[1][0], r.shape[2] - 1), axis=2)
      mask = ((lens[0] == lh)[:, None] & (lens[1] == lw)[None, :])[None, :, :, None]
      y = r if y is None else jnp.where(mask, r, y)
  assert y is not None
  if kind == "avg":
    y = y / (lens[0][:, None] * lens[1][None, :])[None, :, :, None].astype(acc)
  return y.astype(x.dtype)


# ----------------------------------------------------------------------------- one row


def compare(group: str, case: str, x: jax.Array, base_name: str, base, ours_name: str, ours,
            repeats: int, inner: int, route: str = "", chain: int = 0) -> dict:
  print(f"  timing {group} {case} {jnp.dtype(x.dtype).name} {route}", file=sys.stderr,
        flush=True)
  y = jax.eval_shape(ours, x)
  dy = jax.random.normal(jax.random.key(1), y.shape, y.dtype)

  def fwd(f):
    return jax.jit(f)

  def fwd_bwd(f):
    def run(a, g):
      y, vjp = jax.vjp(f, a)
      return y, vjp(g)[0]
    return jax.jit(run)

  timed = (lambda f: chained(f, chain)) if chain else (lambda f: f)
  t = time_all({
      "base_fwd": (timed(fwd(base)), (x,)),
      "ours_fwd": (timed(fwd(ours)), (x,)),
      "base_fwd_bwd": (timed(fwd_bwd(base)), (x, dy)),
      "ours_fwd_bwd": (timed(fwd_bwd(ours)), (x, dy)),
  }, repeats, inner)
  if chain:
    t = {k: v / chain for k, v in t.items()}
  yb, gb = fwd_bwd(base)(x, dy)
  yo, go = fwd_bwd(ours)(x, dy)
  f32 = lambda a: np.asarray(a, np.float32)

  def close(a, b):  # to a few units in the last place of the larger values (sums round)
    eps = 2e-2 if x.dtype.itemsize < 4 else 1e-5
    return np.allclose(f32(a), f32(b), rtol=eps, atol=eps * max(1.0, np.abs(f32(b)).max()))

  same = bool(close(yo, yb) and close(go, gb))
  return dict(group=group, case=case, dtype=jnp.dtype(x.dtype).name, shape=list(x.shape),
              base=base_name, ours=ours_name, route=route, same_result=same,
              **{k: round(v, 4) for k, v in t.items()})


# ----------------------------------------------------------------------------- cases


def shape_str(shape) -> str:
  return "x".join(map(str, shape))


def global_rows(shapes, dtypes, repeats, inner, chain=0):
  rows = []
  for shape in shapes:
    for dtype in dtypes:
      x = distinct_data(shape, dtype)
      rows.append(compare("global", f"avg {shape_str(shape)}", x, "x.mean(axis=(1,2))",
                          lambda v: v.mean(axis=(1, 2)), "global_avg_pool",
                          jaxpool.global_avg_pool, repeats, inner, chain=chain))
      rows.append(compare("global", f"max {shape_str(shape)}", x, "x.max(axis=(1,2))",
                          lambda v: v.max(axis=(1, 2)), "global_max_pool",
                          jaxpool.global_max_pool, repeats, inner, chain=chain))
  return rows


def adaptive_rows(divisible, large, other, dtypes, repeats, inner):
  rows = []
  for (shape, out), dtypes_here in ((divisible, dtypes), (large, dtypes[:1])):
    w = tuple(L // o for L, o in zip(shape[1:3], out, strict=True))
    plan = adaptive_plan.Plan(tuple(shape[1:3]), out, True)
    name = f"{shape_str(shape)} -> {out[0]}x{out[1]}"
    for dtype in dtypes_here:
      x = distinct_data(shape, dtype)
      route = adaptive._route(plan, x, Op.MAX_POOL)
      fixed_avg = lambda v, w=w: jaxpool.avg_pool(v, w, w)
      fixed_max = lambda v, w=w: jaxpool.max_pool(v, w, w)
      rows.append(compare("adaptive", f"avg {name}", x, f"avg_pool {w[0]}x{w[1]}/s{w[0]}",
                          fixed_avg, "adaptive_avg_pool",
                          lambda v, out=out: jaxpool.adaptive_avg_pool(v, out), repeats, inner,
                          route))
      rows.append(compare("adaptive", f"max {name}", x, f"max_pool {w[0]}x{w[1]}/s{w[0]}",
                          fixed_max, "adaptive_max_pool",
                          lambda v, out=out: jaxpool.adaptive_max_pool(v, out), repeats, inner,
                          route))
      if route != "stages":  # the same sizes through the stages, forced: where is the break-even?
        rows.append(compare("adaptive", f"avg {name}", x, f"avg_pool {w[0]}x{w[1]}/s{w[0]}",
                            fixed_avg, "adaptive_avg_pool",
                            lambda v, plan=plan: adaptive_xla.adaptive_avg_jit(v, plan), repeats,
                            inner, "stages (forced)"))
        rows.append(compare("adaptive", f"max {name}", x, f"max_pool {w[0]}x{w[1]}/s{w[0]}",
                            fixed_max, "adaptive_max_pool",
                            lambda v, plan=plan: adaptive_xla.adaptive_max_jit(v, plan), repeats,
                            inner, "stages (forced)"))
  for shape, out in other:
    plan = adaptive_plan.Plan(tuple(shape[1:3]), out, True)
    name = f"{shape_str(shape)} -> {out[0]}x{out[1]}"
    for dtype in dtypes:
      x = distinct_data(shape, dtype)
      for kind in ("avg", "max"):
        ours = getattr(jaxpool, f"adaptive_{kind}_pool")
        rows.append(compare("adaptive", f"{kind} {name}", x, "reduce_window per bin shape",
                            lambda v, out=out, kind=kind: reduce_window_adaptive(v, out, kind),
                            f"adaptive_{kind}_pool", lambda v, out=out, ours=ours: ours(v, out),
                            repeats, inner, adaptive._route(plan, x, Op.MAX_POOL)))
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small shapes, fewer samples (CPU)")
  ap.add_argument("--repeats", type=int, default=None, help="samples per contender")
  ap.add_argument("--inner", type=int, default=None, help="calls per sample")
  ap.add_argument("--in-jit", type=int, default=0, metavar="K",
                  help="the global rows only, each call K chained calls in one jit (the GPU's "
                       "time per call, without the host's launch cost; see chained)")
  args = ap.parse_args()
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  repeats = args.repeats or (5 if args.quick else (9 if on_cpu else 30))
  inner = args.inner or (1 if on_cpu else 10)
  dtypes = (jnp.float32, jnp.bfloat16)
  if args.quick:
    global_shapes = [(32, 7, 7, 512), (8, 56, 56, 64)]
    divisible, large = ((16, 14, 14, 128), (7, 7)), ((4, 32, 32, 32), (4, 4))
    other = [((16, 13, 13, 128), (7, 7)), ((8, 5, 5, 64), (7, 7))]
  else:
    global_shapes = [(128, 7, 7, 2048), (64, 56, 56, 256)]
    divisible, large = ((128, 14, 14, 512), (7, 7)), ((64, 56, 56, 256), (7, 7))
    other = [((128, 13, 13, 512), (7, 7)), ((32, 5, 5, 256), (7, 7))]

  t0 = time.perf_counter()
  rows = global_rows(global_shapes, dtypes, repeats, inner, args.in_jit)
  # (--quick: the adaptive rows in float32 only, to stay near a minute on a 2-core CPU.)
  if not args.in_jit:
    rows += adaptive_rows(divisible, large, other, dtypes[:1] if args.quick else dtypes,
                          repeats, inner)
  elapsed = time.perf_counter() - t0

  device = jax.devices()[0].device_kind
  cpu = platform.processor() or platform.machine()
  print(f"jaxpool global/adaptive benchmark: jax {jax.__version__}, backend {backend} "
        f"({device}; host {cpu}, {os.cpu_count()} cores); median of {repeats} samples of "
        f"{inner} call(s); ms per call"
        + (f" (each call {args.in_jit} chained in one jit)" if args.in_jit else ""))
  head = (f"{'case':30} {'dtype':8} {'baseline':28} {'route':15} {'fwd base/ours':>17} "
          f"{'x':>5} {'fwd+bwd base/ours':>19} {'x':>5} same")
  print(head)
  print("-" * len(head))
  for r in rows:
    print(f"{r['case']:30} {r['dtype']:8} {r['base']:28} {r['route'] or '-':15} "
          f"{r['base_fwd']:8.3f}/{r['ours_fwd']:8.3f} {r['base_fwd'] / r['ours_fwd']:5.2f} "
          f"{r['base_fwd_bwd']:9.3f}/{r['ours_fwd_bwd']:9.3f} "
          f"{r['base_fwd_bwd'] / r['ours_fwd_bwd']:5.2f} {r['same_result']}")
  print("(x: baseline time over jaxpool's, higher is better; same: outputs and gradients agree; "
        "route: how the adaptive call ran: fixed = max_pool/avg_pool, stages = gathers or "
        "reshapes and reductions, global = one reduction)")
  print(f"total {elapsed:.1f} s")
  tag = device_tag(device) + (f"_in_jit{args.in_jit}" if args.in_jit else "")
  path = result_path(__file__, tag, quick=args.quick)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dict(jax=jax.__version__, backend=backend, device=device, cores=os.cpu_count(),
                   repeats=repeats, inner=inner, rows=rows), f, indent=1)
  print(f"saved {os.path.relpath(path)}")


if __name__ == "__main__":
  main()
