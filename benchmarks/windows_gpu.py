"""Max pooling with small to large windows: jaxpool over ``lax.reduce_window``, cell by cell.

Run on a GPU machine from the repository root, in parts (each adds its rows to the same JSON
file; the whole sweep takes about 10 minutes of GPU time, the issue's budget is 20)::

  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
  python3 benchmarks/windows_gpu.py --parts 2d_float32               # ~140 s
  python3 benchmarks/windows_gpu.py --parts 2d_bfloat16              # 139 s (H200, 29 Nov)
  python3 benchmarks/windows_gpu.py --parts 3d_float32,3d_bfloat16   # ~150 s
  python3 benchmarks/windows_gpu.py --parts spp                      # 40 s (H200, 29 Nov)
  python3 benchmarks/windows_gpu.py --parts 3d_target,sppf           # ~90 s

``--strides`` and ``--windows`` measure only some cells of the sweep parts again, each kept in
its place in the file (the other cells stay): the cells of stride equal to the window, say::

  python3 benchmarks/windows_gpu.py --parts 2d_float32,2d_bfloat16,3d_float32,3d_bfloat16 \
      --strides k

The time of a part: about 10 s to start (JAX, the copy bandwidth), about 0.6 s to compile each
timed function (4 a cell), and per function and round 13 calls to warm up plus ``--reps``
samples of at least 5 ms and at least ``--inner`` calls each: a function of T ms costs
``rounds * (13 T + reps * max(5, inner * T))`` ms. Measured on the H200 (29 Nov): the bfloat16
2-D sweep 139 s (136 functions; by the formula 47 s of it timing, reruns included, so about
0.6 s a function compiling), the SPP part 40 s (32 functions, 15 s timing). Estimated: the 2-D
float32 part like the bfloat16 one; the 3-D parts 16 cells each (64 functions, about 40 s
compiling, 20-40 s timing: XLA's 3-D gradient at stride 1 should take a few ms a call);
``3d_target`` and ``sppf`` 8 functions each, a few seconds each to compile (XLA autotunes the
SPPF step's convolutions), about 15 s timing (XLA's 7x7x7 gradient, some 15 ms a call in
bfloat16 by the SPP rows' scaling, dominates).
Cheaper: ``--rounds 1`` halves the timing (not the compiles), ``--reps 9 --inner 3`` cuts the
samples of slow functions by about 5x; a cell below 0.95x is still rerun. Several parts in one
command share the start; the file is saved after each part, so a run cut short (``timeout``)
keeps the parts it finished.

The sweep (docs/large-windows.md): 2-D windows k x k for k in {1, 2, 3, 5, 7, 9, 13, 17, 25,
31} on (16, 64, 64, 128) and 3-D windows k x k x k for k in {2, 3, 5, 7, 9} on (2, 32, 32, 32,
64), strides {1, 2, k // 2, k}, ``"SAME"`` padding, float32 and bfloat16; each cell times the
forward and the forward + gradient (``dy`` given; ``y`` and ``dx`` both returned) of
``jaxpool.max_pool`` (``implementation=None``: the Pallas kernels up to 32 taps on an NVIDIA
GPU, beyond them a dim at a time) and of ``lax.reduce_window`` (whose gradient is XLA's
``select_and_scatter``). The two run in interleaved rounds (``--rounds``, default 2; each
round's time is the median of ``--reps`` samples, default 15, of ``pooling_gpu.py``'s timer:
samples of at least 5 ms of calls); a cell below 0.95x is rerun once more before it counts, and
the best median of each side is kept. The same rule times every row of the other parts.

The ``spp`` part: the SPP block of YOLOv3-SPP on (16, 40, 40, 512), windows 5, 9 and 13, stride
1, ``"SAME"``, float32 and bfloat16, each pool alone and the block (the three pools and the
concatenation), forward and forward + gradient, with the byte floor: forward ``x`` read and
``y`` written; forward + gradient ``x`` read, ``y`` and the taps written, ``dy`` and the taps
read, ``dx`` written; as a fraction of a copy at the device's copy bandwidth (``x + 1`` on
1 GiB; ``of_floor`` = floor time / measured time).

The ``3d_target`` part: a 7x7x7 stride-1 ``"SAME"`` max pool on (2, 64, 64, 64, 32), float32
and bfloat16, forward and forward + gradient against ``lax.reduce_window`` (and
``select_and_scatter``), with the same byte floors (the issue's target: forward + gradient at
least 5x XLA).

The ``sppf`` part: a YOLOv5-style SPPF block's training step on (16, 40, 40, 512): a 1x1
convolution C -> C/2 (bias, SiLU: YOLOv5's Conv with its BatchNorm folded in), three chained
5x5 stride-1 ``"SAME"`` max pools, the concatenation of the four tensors (2C), a 1x1
convolution 2C -> C (bias, SiLU), the mean square of the output as the loss. ``fwd`` is the
jitted loss, ``fwd_grad`` the jitted ``value_and_grad`` with respect to the parameters and the
input, as ``models_gpu.py`` times a training step; the parameters are float32, cast to the
row's dtype (float32 or bfloat16) inside the step, the input is in that dtype. The same model
runs with ``jaxpool.max_pool`` and with ``lax.reduce_window`` as its pool (the row keeps both
losses).

``JAXPOOL_TUNE`` is the library's default, ``model`` (the shipped tables, else the launch
model: what a user's call gets), unless set; each part records the mode it ran with
(``meta["part_seconds"][part]["tune"]``). The sweep's cells committed for the H200 were
measured with ``cached`` (the tables, else the heuristic's launch), the ``spp`` rows with
``model``. Prints a table and saves
``benchmarks/results/windows_gpu_<device>.json`` (``h200`` for an NVIDIA H200; ``--out``
overrides): ``cells`` (the sweep, by part), ``spp``, ``3d_target`` and ``sppf`` (rows), and
``meta`` (the last run's settings; ``part_seconds``: each part's seconds, the start not
counted, and its timer settings, kept across runs). ``--quick``:
tiny shapes, one window a part, strides 1 and k, float32 only outside the sweep, few samples,
no copy bandwidth (the byte floors are NaN), saved under ``build/benchmarks/``: a smoke run on
a CPU. ``docs/make_figures.py`` draws the sweep's heat map from the JSON
(docs/img/windows_sweep_h200.png).

The sweep's cells are ``jaxpool.optimize``'s measurements on this GPU: after a run, regenerate
its cost table (``jaxpool/_src/optimize/cost_tables/<device kind>.json``; a test fails until
it is) with ``python -m jaxpool._src.optimize.cost_table benchmarks/results/windows_gpu_h200.json``
(docs/optimize.md, "Measured tables").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jaxpool  # noqa: E402
import pooling_gpu  # noqa: E402
from jaxpool._src import dispatch  # noqa: E402
from jaxpool._src.windows import make_geometry, taps_dtype  # noqa: E402
from result_path import device_tag, result_path  # noqa: E402

WINDOWS_2D = (1, 2, 3, 5, 7, 9, 13, 17, 25, 31)
WINDOWS_3D = (2, 3, 5, 7, 9)
SHAPE_2D = (16, 64, 64, 128)
SHAPE_3D = (2, 32, 32, 32, 64)
SPP_SHAPE = (16, 40, 40, 512)
SPP_WINDOWS = (5, 9, 13)
TARGET_3D_SHAPE = (2, 64, 64, 64, 32)
TARGET_3D_WINDOW = 7
SPPF_SHAPE = (16, 40, 40, 512)
SPPF_WINDOW = 5
# The targets: forward + gradient at least 5x XLA (3-D); a training step faster (SPPF).
TARGET_SPEEDUP = {"3d_target": 5.0, "sppf": 1.0}
DTYPES = ("float32", "bfloat16")
SWEEP_PARTS = tuple(f"{n}d_{dt}" for n in (2, 3) for dt in DTYPES)
ROW_PARTS = ("spp", "3d_target", "sppf")  # (each a list of rows under its own key)
PARTS = SWEEP_PARTS + ROW_PARTS
SLOWER = 0.95  # a cell below this ratio is rerun once before it counts
QUICK = False  # (--quick: strides 1 and k only, float32 only in the row parts)
# (--windows, --strides: only these cells of the sweep parts; None: every cell)
PICK: tuple[frozenset[int], tuple[str, ...]] | None = None


def strides_for(k: int) -> list[int]:
  """{1, 2, k // 2, k}, each once, at least 1 (with ``--quick``: {1, k})."""
  return sorted({max(1, s) for s in ((1, k) if QUICK else (1, 2, k // 2, k))})


def picked(k: int, s: int) -> bool:
  """Whether the cell of window ``k`` and stride ``s`` runs (``--windows``, ``--strides``:
  each stride selector an int, ``k`` or ``k//2``)."""
  if PICK is None:
    return True
  windows, strides = PICK
  stride_of = {"k": k, "k//2": max(1, k // 2)}
  return ((not windows or k in windows)
          and (not strides or any(stride_of.get(sel, None) == s
                                  or (sel.isdigit() and int(sel) == s) for sel in strides)))


def xla_max(x, window, strides):
  """``lax.reduce_window`` max pooling, channels_last, ``"SAME"`` padding (the padding
  jaxpool resolves)."""
  geom = make_geometry(x.shape, window, strides, "SAME")
  nd = x.ndim
  return lax.reduce_window(x, np.array(-np.inf, x.dtype), lax.max,
                           geom.full_dims(nd, window, 1), geom.full_dims(nd, strides, 1),
                           geom.full_dims(nd, geom.full_padding, (0, 0)))


def jaxpool_max(x, window, strides):
  return jaxpool.max_pool(x, window, strides, "SAME")


def with_grad(f):
  """``(x, dy) -> (y, dx)``: the forward and its gradient for ``dy``, one jit."""
  def run(x, dy):
    y, vjp = jax.vjp(f, x)
    return y, vjp(dy)[0]
  return jax.jit(run)


def served_by(x, window, strides) -> str:
  geom = make_geometry(x.shape, window, strides, "SAME")
  return dispatch.choose(dispatch.Op.MAX_POOL, None, x, geom).label


def interleaved(fns: dict, args: dict, rounds: int) -> dict[str, float]:
  """The best of ``rounds`` medians of each function, the functions alternating."""
  best = {name: math.inf for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      best[name] = min(best[name], pooling_gpu.time_jax(fn, *args[name]))
  return best


def time_cell(x, dy, window, strides, rounds: int) -> dict:
  """One cell: forward and forward + gradient of jaxpool and of XLA (``timed``)."""
  return timed_pair(lambda a: jaxpool_max(a, window, strides),
                    lambda a: xla_max(a, window, strides), x, dy, rounds)


def timed_pair(jp_fn, xla_fn, x, dy, rounds: int) -> dict:
  """``jp_fn`` and ``xla_fn`` (``x -> y``), forward and forward + gradient for ``dy``."""
  fns = {"jaxpool_fwd": jax.jit(jp_fn), "xla_fwd": jax.jit(xla_fn),
         "jaxpool_fwd_grad": with_grad(jp_fn), "xla_fwd_grad": with_grad(xla_fn)}
  args = {"jaxpool_fwd": (x,), "xla_fwd": (x,), "jaxpool_fwd_grad": (x, dy),
          "xla_fwd_grad": (x, dy)}
  return timed(fns, args, rounds)


def timed(fns: dict, args: dict, rounds: int) -> dict:
  """Times ``fns`` (``jaxpool_fwd``, ``xla_fwd``, ``jaxpool_fwd_grad``, ``xla_fwd_grad``) on
  their ``args`` in interleaved rounds; a mode below ``SLOWER`` runs its pair's rounds again and
  keeps each side's best. ``speedup`` is XLA's time over jaxpool's (above 1: jaxpool faster)."""
  ms = interleaved(fns, args, rounds)
  reran = []
  for mode in ("fwd", "fwd_grad"):
    if ms[f"xla_{mode}"] / ms[f"jaxpool_{mode}"] < SLOWER:  # rerun before it counts
      pair = {k: fns[k] for k in (f"jaxpool_{mode}", f"xla_{mode}")}
      again = interleaved(pair, args, rounds)
      for k, v in again.items():
        ms[k] = min(ms[k], v)
      reran.append(mode)
  return {"ms": ms, "reran": reran,
          "speedup": {m: ms[f"xla_{m}"] / ms[f"jaxpool_{m}"] for m in ("fwd", "fwd_grad")}}


def sweep(part: str, shape, windows, rounds: int) -> list[dict]:
  n = int(part[0])
  dtype = jnp.dtype(part.split("_", 1)[1])
  key = jax.random.key(n)
  x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
  rows = []
  for k in windows:
    for s in strides_for(k):
      if not picked(k, s):
        continue
      window, strides = (k,) * n, (s,) * n
      out_shape = make_geometry(shape, window, strides, "SAME").output_shape(shape)
      dy = jax.random.normal(jax.random.fold_in(key, k * 100 + s), out_shape,
                             jnp.float32).astype(dtype)
      cell = time_cell(x, dy, window, strides, rounds)
      cell.update(part=part, shape=list(shape), dtype=str(dtype), window=list(window),
                  strides=list(strides), taps=k ** n, served_by=served_by(x, window, strides))
      rows.append(cell)
      sp = cell["speedup"]
      print(f"{part:12s} {'x'.join(map(str, window)):>8s} /s{s:<3d} {cell['served_by']:14s} "
            f"fwd {cell['ms']['jaxpool_fwd']:8.3f} ms vs {cell['ms']['xla_fwd']:8.3f} "
            f"({sp['fwd']:5.2f}x)  fwd+grad {cell['ms']['jaxpool_fwd_grad']:8.3f} vs "
            f"{cell['ms']['xla_fwd_grad']:8.3f} ({sp['fwd_grad']:5.2f}x)"
            + (f"  reran {','.join(cell['reran'])}" if cell["reran"] else ""), flush=True)
  return rows


def floor_row(x, windows, timing: dict, copy_gbs: float) -> dict:
  """The byte floors of ``len(windows)`` stride-1 ``"SAME"`` pools of ``x`` (module docstring),
  with ``timing`` (``timed``'s) and the fraction of its floor each of jaxpool's times reaches."""
  nx = x.nbytes
  # per pool: x read, y written; + taps written; dy, taps read; dx written
  ntaps = sum(x.size * np.dtype(taps_dtype(math.prod(w))).itemsize for w in windows)
  fwd_bytes = nx + len(windows) * nx
  grad_bytes = fwd_bytes + ntaps + len(windows) * nx + ntaps + nx
  floor = {"fwd": fwd_bytes / copy_gbs / 1e6, "fwd_grad": grad_bytes / copy_gbs / 1e6}
  ms = timing["ms"]
  return {"dtype": str(x.dtype), "shape": list(x.shape), **timing,
          "bytes": {"fwd": fwd_bytes, "fwd_grad": grad_bytes}, "floor_ms": floor,
          "of_floor": {m: floor[m] / ms[f"jaxpool_{m}"] for m in floor}}


def print_floor_row(part: str, row: dict) -> None:
  ms, sp, floor, of = row["ms"], row["speedup"], row["floor_ms"], row["of_floor"]
  print(f"{part} {row['dtype']:9s} {row['case']:10s} fwd {ms['jaxpool_fwd']:7.3f} ms (XLA "
        f"{ms['xla_fwd']:7.3f}, {sp['fwd']:5.2f}x; floor {floor['fwd']:.3f}, {of['fwd']:.2f} of "
        f"it)  fwd+grad {ms['jaxpool_fwd_grad']:7.3f} ms (XLA {ms['xla_fwd_grad']:7.3f}, "
        f"{sp['fwd_grad']:5.2f}x; floor {floor['fwd_grad']:.3f}, {of['fwd_grad']:.2f} of it)"
        + (f"  reran {','.join(row['reran'])}" if row["reran"] else ""), flush=True)


def row_dtypes() -> tuple[str, ...]:
  return DTYPES[:1] if QUICK else DTYPES


def spp(shape, windows, copy_gbs: float, rounds: int) -> list[dict]:
  """Each SPP pool alone and the block, with their byte floors (module docstring)."""
  rows = []
  for dt in row_dtypes():
    dtype = jnp.dtype(dt)
    x = jax.random.normal(jax.random.key(7), shape, jnp.float32).astype(dtype)
    dy = jax.random.normal(jax.random.key(8), shape, jnp.float32).astype(dtype)
    cases = [(f"pool {k}x{k}", lambda a, k=k: jaxpool_max(a, (k, k), (1, 1)),
              lambda a, k=k: xla_max(a, (k, k), (1, 1)), [k]) for k in windows]
    block = lambda pool: (lambda a: jnp.concatenate(
        [a] + [pool(a, (k, k), (1, 1)) for k in windows], axis=-1))
    cases.append(("SPP block", block(jaxpool_max), block(xla_max), list(windows)))
    for name, jp_fn, xla_fn, ks in cases:
      block_dy = dy if len(ks) == 1 else jnp.concatenate([dy] * (len(ks) + 1), axis=-1)
      timing = timed_pair(jp_fn, xla_fn, x, block_dy, rounds)
      row = {"case": name, **floor_row(x, [(k, k) for k in ks], timing, copy_gbs)}
      rows.append(row)
      print_floor_row("spp", row)
  return rows


def target_3d(shape, k: int, copy_gbs: float, rounds: int) -> list[dict]:
  """The issue's 3-D target: a k x k x k stride-1 ``"SAME"`` max pool, with its byte floor."""
  window, strides = (k,) * 3, (1,) * 3
  rows = []
  for dt in row_dtypes():
    dtype = jnp.dtype(dt)
    x = jax.random.normal(jax.random.key(9), shape, jnp.float32).astype(dtype)
    dy = jax.random.normal(jax.random.key(10), shape, jnp.float32).astype(dtype)
    timing = timed_pair(lambda a: jaxpool_max(a, window, strides),
                        lambda a: xla_max(a, window, strides), x, dy, rounds)
    row = {"case": f"pool {k}x{k}x{k}", "window": list(window), "strides": list(strides),
           "served_by": served_by(x, window, strides), **floor_row(x, [window], timing, copy_gbs),
           "target": target("3d_target", timing)}
    rows.append(row)
    print_floor_row("3d_target", row)
    print(f"  target: forward + gradient at least {TARGET_SPEEDUP['3d_target']}x XLA: "
          f"{'met' if row['target']['met'] else 'NOT met'}", flush=True)
  return rows


def target(part: str, timing: dict) -> dict:
  """Whether ``timing``'s forward + gradient meets the part's ``TARGET_SPEEDUP``."""
  return {"fwd_grad_speedup_at_least": TARGET_SPEEDUP[part],
          "met": timing["speedup"]["fwd_grad"] >= TARGET_SPEEDUP[part]}


def sppf_params(key, channels: int) -> dict:
  """The SPPF block's two 1x1 convolutions (HWIO) and biases, float32."""
  hidden = channels // 2
  k1, k2, k3, k4 = jax.random.split(key, 4)
  return {"w1": jax.random.normal(k1, (1, 1, channels, hidden)) / math.sqrt(channels),
          "b1": 0.1 * jax.random.normal(k2, (hidden,)),
          "w2": jax.random.normal(k3, (1, 1, 4 * hidden, channels)) / math.sqrt(4 * hidden),
          "b2": 0.1 * jax.random.normal(k4, (channels,))}


def sppf_loss(pool, k: int):
  """``(params, x) -> loss`` of YOLOv5's SPPF block with ``pool`` as its k x k stride-1 max
  pool; computes in ``x``'s dtype, the loss in float32."""
  def conv(h, w, b):  # YOLOv5's Conv: a convolution, its BatchNorm (folded: a bias) and SiLU
    y = lax.conv_general_dilated(h, w.astype(h.dtype), (1, 1), "VALID",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.silu(y + b.astype(h.dtype).reshape(1, 1, 1, -1))

  def loss(params, x):
    h = conv(x, params["w1"], params["b1"])
    p1 = pool(h, (k, k), (1, 1))
    p2 = pool(p1, (k, k), (1, 1))
    p3 = pool(p2, (k, k), (1, 1))
    y = conv(jnp.concatenate([h, p1, p2, p3], axis=-1), params["w2"], params["b2"])
    return jnp.mean(jnp.square(y.astype(jnp.float32)))
  return loss


def sppf(shape, k: int, rounds: int) -> list[dict]:
  """The SPPF block's training step with jaxpool's and XLA's pools (module docstring)."""
  rows = []
  params = sppf_params(jax.random.key(11), shape[-1])
  for dt in row_dtypes():
    x = jax.random.normal(jax.random.key(12), shape, jnp.float32).astype(dt)
    losses = {"jaxpool": sppf_loss(jaxpool_max, k), "xla": sppf_loss(xla_max, k)}
    fns, args = {}, {}
    for side, loss in losses.items():
      fns[f"{side}_fwd"] = jax.jit(loss)
      fns[f"{side}_fwd_grad"] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
      args[f"{side}_fwd"] = args[f"{side}_fwd_grad"] = (params, x)
    timing = timed(fns, args, rounds)
    row = {"case": "SPPF step", "dtype": dt, "shape": list(shape), "window": [k, k],
           **timing, "target": target("sppf", timing),
           "loss": {side: float(fns[f"{side}_fwd"](params, x)) for side in losses}}
    rows.append(row)
    ms, sp = row["ms"], row["speedup"]
    print(f"sppf {dt:9s} {k}x{k} x3  forward {ms['jaxpool_fwd']:7.3f} ms (XLA "
          f"{ms['xla_fwd']:7.3f}, {sp['fwd']:5.2f}x)  training step {ms['jaxpool_fwd_grad']:7.3f}"
          f" ms (XLA {ms['xla_fwd_grad']:7.3f}, {sp['fwd_grad']:5.2f}x)  loss "
          f"{row['loss']['jaxpool']:.6g} (XLA {row['loss']['xla']:.6g})"
          + (f"  reran {','.join(row['reran'])}" if row["reran"] else "")
          + f"; target (faster than XLA's step) {'met' if row['target']['met'] else 'NOT met'}",
          flush=True)
  return rows


def summary(cells: list[dict]) -> None:
  for mode in ("fwd", "fwd_grad"):
    ranked = sorted(cells, key=lambda c: c["speedup"][mode])
    below = [c for c in ranked if c["speedup"][mode] < SLOWER]
    print(f"{mode}: {len(below)} of {len(cells)} cells below {SLOWER}x XLA; lowest: "
          + ", ".join(f"{c['part']} {'x'.join(map(str, c['window']))}/s{c['strides'][0]} "
                      f"{c['speedup'][mode]:.2f}x" for c in ranked[:5]))


def tune_mode() -> str:
  """How the kernels' launches are chosen in this run (``JAXPOOL_TUNE``, resolved)."""
  from jaxpool._src.pallas.tuning import tuner
  return tuner.mode()


def main(argv=None, *, defaults=None) -> int:
  """Runs the sweep with ``JAXPOOL_TUNE`` as set (unset: the library's default, ``model``)."""
  return _main(argv, defaults)


def _main(argv, defaults) -> int:
  d = dict(windows_2d=WINDOWS_2D, windows_3d=WINDOWS_3D, shape_2d=SHAPE_2D, shape_3d=SHAPE_3D,
           spp_shape=SPP_SHAPE, spp_windows=SPP_WINDOWS, target_3d_shape=TARGET_3D_SHAPE,
           target_3d_window=TARGET_3D_WINDOW, sppf_shape=SPPF_SHAPE, sppf_window=SPPF_WINDOW,
           script="windows_gpu")
  d.update(defaults or {})
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--parts", default=",".join(PARTS),
                  help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
  ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds a cell")
  ap.add_argument("--reps", type=int, default=15, help="samples a median (each at least 5 ms "
                  "of calls and --inner calls)")
  ap.add_argument("--inner", type=int, default=pooling_gpu.INNER,
                  help="at least this many calls a sample (default %(default)s; 3 makes the "
                  "slow functions' samples cheaper)")
  ap.add_argument("--in-jit", type=int, default=0, metavar="K",
                  help="time K calls inside one jit (on K copies of the inputs), divided by K: "
                  "cells of tens of microseconds measured without the per-call dispatch")
  ap.add_argument("--quick", action="store_true", help="tiny shapes, few windows and samples")
  ap.add_argument("--windows", default="", help="comma-separated windows k: only their cells "
                  "of the sweep parts (the file's other cells are kept)")
  ap.add_argument("--strides", default="", help="comma-separated strides, each an int, k or "
                  "k//2 (e.g. k: the cells of stride equal to the window): only those cells of "
                  "the sweep parts (the file's other cells are kept)")
  ap.add_argument("--out", default=None, help="the JSON file (default: benchmarks/results/"
                  f"{d['script']}_<device>.json); cells of other parts already there are kept")
  a = ap.parse_args(argv)
  parts = [p for p in a.parts.split(",") if p]
  bad = [p for p in parts if p not in PARTS]
  if bad or not parts:
    ap.error(f"unknown parts {bad}; choose from {', '.join(PARTS)}")
  if a.in_jit < 0:
    ap.error(f"--in-jit must be at least 0, got {a.in_jit}")
  if min(a.rounds, a.reps, a.inner) < 1:
    ap.error(f"--rounds, --reps and --inner must be at least 1, got {a.rounds}, {a.reps} and "
             f"{a.inner}")
  pooling_gpu.REPS, pooling_gpu.INNER = a.reps, a.inner
  global QUICK, PICK
  QUICK = a.quick
  strides = tuple(t.strip() for t in a.strides.split(",") if t.strip())
  bad = [t for t in strides if t not in ("k", "k//2") and not t.isdigit()]
  if bad or not all(t.strip().isdigit() for t in a.windows.split(",") if t.strip()):
    ap.error(f"--strides takes ints, k or k//2 and --windows ints; got {a.strides!r} and "
             f"{a.windows!r}")
  windows = frozenset(int(t) for t in a.windows.split(",") if t.strip())
  PICK = (windows, strides) if windows or strides else None
  if a.quick:
    d.update(windows_2d=(7,), windows_3d=(4,), shape_2d=(2, 12, 12, 4),
             shape_3d=(1, 6, 6, 6, 2), spp_shape=(1, 13, 13, 4), spp_windows=(5, 9),
             target_3d_shape=(1, 8, 8, 8, 2), sppf_shape=(1, 8, 8, 8))
    pooling_gpu.REPS, pooling_gpu.SAMPLE_MS, pooling_gpu.INNER = 3, 0.0, 2
    a.rounds = 1
  dev = jax.devices()[0]
  out = a.out or result_path(d["script"], device_tag(dev.device_kind), quick=a.quick)
  print(f"device {dev.device_kind}; jax {jax.__version__}; JAXPOOL_TUNE={tune_mode()}; "
        f"parts {parts}", flush=True)
  copy_gbs = pooling_gpu.copy_bandwidth() if not a.quick else float("nan")
  if not a.quick:
    print(f"copy bandwidth (x + 1, 1 GiB f32, read + write): {copy_gbs:.0f} GB/s", flush=True)
  pooling_gpu.IN_JIT = a.in_jit  # (after the copy bandwidth: 1 GiB, one call a sample)
  result: dict = {"cells": [], **{part: [] for part in ROW_PARTS}}
  if os.path.exists(out):
    with open(out) as f:
      result.update(json.load(f))
  part_seconds = dict(result.get("meta", {}).get("part_seconds", {}))
  timer = (f"best of {a.rounds} interleaved rounds, each the median of {pooling_gpu.REPS} "
           f"samples of at least {pooling_gpu.INNER} calls (pooling_gpu.time_jax); rows below "
           f"{SLOWER}x rerun once"
           + (f"; each call {a.in_jit} calls in one jit, time divided by {a.in_jit}"
              if a.in_jit else ""))
  t0 = time.time()
  for part in parts:  # (the file is saved after each part: a run cut short keeps those done)
    t_part = time.time()
    if part == "spp":
      result["spp"] = spp(d["spp_shape"], d["spp_windows"], copy_gbs, a.rounds)
    elif part == "3d_target":
      result[part] = target_3d(d["target_3d_shape"], d["target_3d_window"], copy_gbs, a.rounds)
    elif part == "sppf":
      result[part] = sppf(d["sppf_shape"], d["sppf_window"], a.rounds)
    else:
      n = int(part[0])
      cells = sweep(part, d[f"shape_{n}d"], d[f"windows_{n}d"], a.rounds)
      key = lambda c: (c["part"], tuple(c["window"]), tuple(c["strides"]))
      new = {key(c): c for c in cells}
      old = [c for c in result["cells"] if c["part"] != part
             or not picked(c["window"][0], c["strides"][0]) or key(c) in new]
      # (a cell measured again keeps its place; the part's other cells stay unless dropped)
      result["cells"] = [new.pop(key(c), c) for c in old] + list(new.values())
    part_seconds[part] = {"seconds": round(time.time() - t_part, 1), "timer": timer,
                          "time": time.strftime("%Y-%m-%d %H:%M:%S"), "tune": tune_mode()}
    print(f"{part}: {part_seconds[part]['seconds']} s", flush=True)
    result["meta"] = {"device": dev.device_kind, "jax": jax.__version__, "copy_GBps": copy_gbs,
                      "tune": tune_mode(), "quick": a.quick,
                      "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "seconds_this_run": round(time.time() - t0, 1),
                      "timer": timer, "part_seconds": part_seconds}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f, indent=1)
  if result["cells"]:
    summary(result["cells"])
  print(f"saved {out}")
  if not a.quick and result["cells"]:
    print(f"now regenerate jaxpool.optimize's cost table: python -m "
          f"jaxpool._src.optimize.cost_table {os.path.relpath(out, ROOT)}")
  return 0

if __name__ == "__main__":
  sys.exit(main())
