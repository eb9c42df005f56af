"""Max pooling with small to large windows: jaxpool over ``lax.reduce_window``, cell by cell.

Run on a GPU machine from the repository root (about 20 minutes of GPU time in all; ``--parts``
runs it in pieces of a few minutes each, each adding its cells to the same JSON file)::

  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
  python3 benchmarks/windows_gpu.py --parts 2d_float32
  python3 benchmarks/windows_gpu.py --parts 2d_bfloat16
  python3 benchmarks/windows_gpu.py --parts 3d_float32,3d_bfloat16
  python3 benchmarks/windows_gpu.py --parts spp

The sweep (docs/large-windows.md): 2-D windows k x k for k in {1, 2, 3, 5, 7, 9, 13, 17, 25,
31} on (16, 64, 64, 128) and 3-D windows k x k x k for k in {2, 3, 5, 7, 9} on (2, 32, 32, 32,
64), strides {1, 2, k // 2, k}, ``"SAME"`` padding, float32 and bfloat16; each cell times the
forward and the forward + gradient (``dy`` given; ``y`` and ``dx`` both returned) of
``jaxpool.max_pool`` (``implementation=None``: the Pallas kernels up to 32 taps on an NVIDIA
GPU, the separable XLA path beyond) and of ``lax.reduce_window`` (whose gradient is XLA's
``select_and_scatter``). The two run in interleaved rounds (``--rounds``, default 2; each
round's time is the median of ``--reps`` samples, default 15, of ``pooling_gpu.py``'s timer:
samples of at least 5 ms of calls); a cell below 0.95x is rerun once more before it counts, and
the best median of each side is kept.

The ``spp`` part: the SPP block of YOLOv3-SPP on (16, 40, 40, 512), windows 5, 9 and 13, stride
1, ``"SAME"``, float32 and bfloat16, each pool alone and the block (the three pools and the
concatenation), forward and forward + gradient, with the byte floor: forward ``x`` read and
``y`` written; forward + gradient ``x`` read, ``y`` and the taps written, ``dy`` and the taps
read, ``dx`` written; as a fraction of a copy at the device's copy bandwidth (``x + 1`` on
1 GiB; ``of_floor`` = floor time / measured time).

``JAXPOOL_TUNE`` defaults to ``cached`` (the shipped launch tables). Prints a table and saves
``benchmarks/results/windows_gpu_<device>.json`` (``h200`` for an NVIDIA H200; ``--out``
overrides). ``--quick``: tiny shapes, one window a part, strides 1 and k, few samples, no
copy bandwidth (the byte floors are NaN): a smoke run on a CPU.

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
import re
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

WINDOWS_2D = (1, 2, 3, 5, 7, 9, 13, 17, 25, 31)
WINDOWS_3D = (2, 3, 5, 7, 9)
SHAPE_2D = (16, 64, 64, 128)
SHAPE_3D = (2, 32, 32, 32, 64)
SPP_SHAPE = (16, 40, 40, 512)
SPP_WINDOWS = (5, 9, 13)
DTYPES = ("float32", "bfloat16")
PARTS = tuple(f"{n}d_{dt}" for n in (2, 3) for dt in DTYPES) + ("spp",)
SLOWER = 0.95  # a cell below this ratio is rerun once before it counts
QUICK = False  # (--quick: strides 1 and k only, float32 only in the SPP part)


def strides_for(k: int) -> list[int]:
  """{1, 2, k // 2, k}, each once, at least 1 (with ``--quick``: {1, k})."""
  return sorted({max(1, s) for s in ((1, k) if QUICK else (1, 2, k // 2, k))})


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
  """One cell: forward and forward + gradient of jaxpool and of XLA; ``speedup`` is XLA's time
  over jaxpool's (above 1: jaxpool faster)."""
  fns = {
      "jaxpool_fwd": jax.jit(lambda a: jaxpool_max(a, window, strides)),
      "xla_fwd": jax.jit(lambda a: xla_max(a, window, strides)),
      "jaxpool_fwd_grad": with_grad(lambda a: jaxpool_max(a, window, strides)),
      "xla_fwd_grad": with_grad(lambda a: xla_max(a, window, strides)),
  }
  args = {"jaxpool_fwd": (x,), "xla_fwd": (x,), "jaxpool_fwd_grad": (x, dy),
          "xla_fwd_grad": (x, dy)}
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


def spp(shape, windows, copy_gbs: float, rounds: int) -> list[dict]:
  """Each SPP pool alone and the block, with their byte floors (module docstring)."""
  rows = []
  for dt in DTYPES[:1] if QUICK else DTYPES:
    dtype = jnp.dtype(dt)
    x = jax.random.normal(jax.random.key(7), shape, jnp.float32).astype(dtype)
    dy = jax.random.normal(jax.random.key(8), shape, jnp.float32).astype(dtype)
    nx = x.nbytes
    cases = [(f"pool {k}x{k}", lambda a, k=k: jaxpool_max(a, (k, k), (1, 1)),
              lambda a, k=k: xla_max(a, (k, k), (1, 1)), [k]) for k in windows]
    block = lambda pool: (lambda a: jnp.concatenate(
        [a] + [pool(a, (k, k), (1, 1)) for k in windows], axis=-1))
    cases.append(("SPP block", block(jaxpool_max), block(xla_max), list(windows)))
    for name, jp_fn, xla_fn, ks in cases:
      block_dy = dy if len(ks) == 1 else jnp.concatenate([dy] * (len(ks) + 1), axis=-1)
      fns = {"jaxpool_fwd": jax.jit(jp_fn), "xla_fwd": jax.jit(xla_fn),
             "jaxpool_fwd_grad": with_grad(jp_fn), "xla_fwd_grad": with_grad(xla_fn)}
      args = {"jaxpool_fwd": (x,), "xla_fwd": (x,), "jaxpool_fwd_grad": (x, block_dy),
              "xla_fwd_grad": (x, block_dy)}
      ms = interleaved(fns, args, rounds)
      # per pool: x read, y written; + taps written; dy, taps read; dx written
      ntaps = sum(nx // dtype.itemsize * np.dtype(taps_dtype(k * k)).itemsize for k in ks)
      fwd_bytes = nx + len(ks) * nx
      grad_bytes = fwd_bytes + ntaps + len(ks) * nx + ntaps + nx
      floor = {"fwd": fwd_bytes / copy_gbs / 1e6, "fwd_grad": grad_bytes / copy_gbs / 1e6}
      row = {"case": name, "dtype": dt, "shape": list(shape), "ms": ms,
             "bytes": {"fwd": fwd_bytes, "fwd_grad": grad_bytes}, "floor_ms": floor,
             "of_floor": {m: floor[m] / ms[f"jaxpool_{m}"] for m in floor},
             "speedup": {m: ms[f"xla_{m}"] / ms[f"jaxpool_{m}"] for m in floor}}
      rows.append(row)
      print(f"spp {dt:9s} {name:10s} fwd {ms['jaxpool_fwd']:7.3f} ms (XLA {ms['xla_fwd']:7.3f},"
            f" {row['speedup']['fwd']:5.2f}x; floor {floor['fwd']:.3f}, "
            f"{row['of_floor']['fwd']:.2f} of it)  fwd+grad {ms['jaxpool_fwd_grad']:7.3f} ms "
            f"(XLA {ms['xla_fwd_grad']:7.3f}, {row['speedup']['fwd_grad']:5.2f}x; floor "
            f"{floor['fwd_grad']:.3f}, {row['of_floor']['fwd_grad']:.2f} of it)", flush=True)
  return rows


def device_name() -> str:
  """``h200`` for "NVIDIA H200", ``cpu`` on a CPU: the device's last word, lower case."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return "cpu"
  words = re.findall(r"[A-Za-z0-9]+", dev.device_kind)
  return (words[1] if len(words) > 1 and words[0].upper() == "NVIDIA" else words[-1]).lower()


def summary(cells: list[dict]) -> None:
  for mode in ("fwd", "fwd_grad"):
    ranked = sorted(cells, key=lambda c: c["speedup"][mode])
    below = [c for c in ranked if c["speedup"][mode] < SLOWER]
    print(f"{mode}: {len(below)} of {len(cells)} cells below {SLOWER}x XLA; lowest: "
          + ", ".join(f"{c['part']} {'x'.join(map(str, c['window']))}/s{c['strides'][0]} "
                      f"{c['speedup'][mode]:.2f}x" for c in ranked[:5]))


def main(argv=None, *, defaults=None) -> int:
  """Runs the sweep; ``JAXPOOL_TUNE`` is ``cached`` for the run unless it is set (read by the
  tuner at each call; put back afterwards, for a caller in the same process)."""
  unset = "JAXPOOL_TUNE" not in os.environ
  os.environ.setdefault("JAXPOOL_TUNE", "cached")
  try:
    return _main(argv, defaults)
  finally:
    if unset:
      del os.environ["JAXPOOL_TUNE"]


def _main(argv, defaults) -> int:
  d = dict(windows_2d=WINDOWS_2D, windows_3d=WINDOWS_3D, shape_2d=SHAPE_2D, shape_3d=SHAPE_3D,
           spp_shape=SPP_SHAPE, spp_windows=SPP_WINDOWS, script="windows_gpu")
  d.update(defaults or {})
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--parts", default=",".join(PARTS),
                  help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
  ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds a cell")
  ap.add_argument("--reps", type=int, default=15, help="samples a median (each at least 5 ms "
                  "of calls and 10 calls)")
  ap.add_argument("--quick", action="store_true", help="tiny shapes, few windows and samples")
  ap.add_argument("--out", default=None, help="the JSON file (default: benchmarks/results/"
                  f"{d['script']}_<device>.json); cells of other parts already there are kept")
  a = ap.parse_args(argv)
  parts = [p for p in a.parts.split(",") if p]
  bad = [p for p in parts if p not in PARTS]
  if bad:
    ap.error(f"unknown parts {bad}; choose from {', '.join(PARTS)}")
  if a.rounds < 1 or a.reps < 1:
    ap.error(f"--rounds and --reps must be at least 1, got {a.rounds} and {a.reps}")
  pooling_gpu.REPS = a.reps
  global QUICK
  QUICK = a.quick
  if a.quick:
    d.update(windows_2d=(7,), windows_3d=(4,), shape_2d=(2, 12, 12, 4),
             shape_3d=(1, 6, 6, 6, 2), spp_shape=(1, 13, 13, 4), spp_windows=(5, 9))
    pooling_gpu.REPS, pooling_gpu.SAMPLE_MS, pooling_gpu.INNER = 3, 0.0, 2
    a.rounds = 1
  dev = jax.devices()[0]
  out = a.out or os.path.join(ROOT, "benchmarks", "results",
                              f"{d['script']}_{device_name()}"
                              f"{'_quick' if a.quick else ''}.json")
  print(f"device {dev.device_kind}; jax {jax.__version__}; JAXPOOL_TUNE="
        f"{os.environ.get('JAXPOOL_TUNE')}; parts {parts}", flush=True)
  copy_gbs = pooling_gpu.copy_bandwidth() if not a.quick else float("nan")
  if not a.quick:
    print(f"copy bandwidth (x + 1, 1 GiB f32, read + write): {copy_gbs:.0f} GB/s", flush=True)
  result = {"cells": [], "spp": []}
  if os.path.exists(out):
    with open(out) as f:
      result.update(json.load(f))
  result["cells"] = [c for c in result["cells"] if c["part"] not in parts]
  t0 = time.time()
  for part in parts:
    if part == "spp":
      result["spp"] = spp(d["spp_shape"], d["spp_windows"], copy_gbs, a.rounds)
    else:
      n = int(part[0])
      result["cells"] += sweep(part, d[f"shape_{n}d"], d[f"windows_{n}d"], a.rounds)
  result["meta"] = {"device": dev.device_kind, "jax": jax.__version__, "copy_GBps": copy_gbs,
                    "tune": os.environ.get("JAXPOOL_TUNE"), "quick": a.quick,
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "seconds_this_run": round(time.time() - t0, 1),
                    "timer": f"best of {a.rounds} interleaved rounds, each the median of "
                             f"{pooling_gpu.REPS} samples (pooling_gpu.time_jax); cells below "
                             f"{SLOWER}x rerun once"}
  if result["cells"]:
    summary(result["cells"])
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"saved {out}")
  if not a.quick and result["cells"]:
    print(f"now regenerate jaxpool.optimize's cost table: python -m "
          f"jaxpool._src.optimize.cost_table {os.path.relpath(out, ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
