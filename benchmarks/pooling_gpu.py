"""Pooling on one GPU: XLA, jaxpool (XLA and Pallas paths) and PyTorch cuDNN, side by side.

Run on a GPU machine from the repository root::

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/pooling_gpu.py \\
      [--json PATH]

Timer: each sample runs the op back to back, then blocks until the device is done
(``block_until_ready`` / ``torch.cuda.synchronize``); the sample is the elapsed wall time over the
calls. A sample makes at least ``INNER`` calls and about ``SAMPLE_MS`` of them (the calls are
counted from the time of ``INNER`` warm-up calls), so that the wait before a sample's first call
costs every op about the same share: with a fixed 10 calls, a 0.1 ms op lost 10-20% of its
bandwidth to it, and a plain copy of 0.23 GB measured 0.81-0.91 of the 1 GiB copy's
(docs/design/measuring.md). ``--inner 10`` times 10 calls a sample whatever they last (the
earlier timer).
After warm-up (which also compiles), the median of ``REPS`` samples is reported. Every op gets its
arrays as jit arguments (no closed-over constants) and random, non-zero data. ``--cases a,b``:
only the cases whose name contains ``a`` or ``b``.

Bytes: each row counts what the op must read and write once: forward ``x + y`` (``+ argmax`` when
it writes one), backward ``dy + argmax + dx`` (for XLA's select_and_scatter, which recomputes the
argmax from ``x``: ``x + dy + dx``), forward plus backward the sum of the two. GB/s is those bytes
over the time; "of copy" divides by the bandwidth of a device-to-device pass (``x + 1`` on a
1 GiB float32 array, read + write) timed by the same timer in the same run. Each case's
``copy_same_bytes`` row is that pass over the forward's bytes (``x + y``): what a plain copy of
that size reaches with this timer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool._src import settings, windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.pallas.tuning import tuner as tuning  # noqa: E402
from result_path import device_tag, result_path  # noqa: E402

INNER = 10
SAMPLE_MS = 5.0  # (0 with --inner: INNER calls a sample)
REPS = 30
NO_TORCH = False  # (--no-torch)
IN_JIT = 0  # (--in-jit K: K calls a jit)
# The Pallas kernels' rows (each one kernel); the summary lists those below 0.8 of copy.
KERNELS = ("pallas_fwd", "pallas_fwd_argmax", "pallas_bwd", "pallas_avg_fwd")
CASES = [
    # name, shape, window, strides, padding, data_format, dtypes
    ("128x112x112x64 3x3/s2/p1", (128, 112, 112, 64), (3, 3), (2, 2), 1, "channels_last",
     ("float32", "bfloat16")),
    ("64x224x224x64 2x2/s2", (64, 224, 224, 64), (2, 2), (2, 2), 0, "channels_last",
     ("float32", "bfloat16")),
    # The first case's data in NCHW, and a 3-D (video) pool in NDHWC.
    ("128x64x112x112 NCHW 3x3/s2/p1", (128, 64, 112, 112), (3, 3), (2, 2), 1, "channels_first",
     ("float32",)),
    ("16x16x56x56x64 3x3x3/s2/p1", (16, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1,
     "channels_last", ("float32",)),
]


def _median_ms(call, sync) -> float:
  """The median over ``REPS`` samples of ``call``'s time (ms), after warm-up."""
  for _ in range(3):
    call()
  sync()
  t0 = time.perf_counter()
  for _ in range(INNER):
    call()
  sync()
  each = (time.perf_counter() - t0) / INNER
  calls = max(INNER, math.ceil(SAMPLE_MS / 1e3 / max(each, 1e-6)))
  samples = []
  for _ in range(REPS):
    t0 = time.perf_counter()
    for _ in range(calls):
      call()
    sync()
    samples.append((time.perf_counter() - t0) / calls)
  return statistics.median(samples) * 1e3


def time_jax(fn, *args) -> float:
  """The median time of ``fn(*args)`` (ms); with ``IN_JIT = K``, of ``K`` calls inside one jit
  on ``K`` copies of ``args``, divided by ``K``."""
  if IN_JIT:
    copies = [jax.tree.map(jnp.copy, args) for _ in range(IN_JIT)]
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    return _time_calls(many, copies) / IN_JIT
  return _time_calls(fn, *args)


def _time_calls(fn, *args) -> float:
  last: list = [None]

  def call():
    last[0] = fn(*args)

  return _median_ms(call, lambda: jax.block_until_ready(last[0]))


def time_torch(fn) -> float:
  import torch
  return _median_ms(fn, torch.cuda.synchronize)


def copy_bandwidth() -> float:
  """GB/s of ``x + 1`` over a 1 GiB float32 array, counting bytes read plus written."""
  x = jax.random.normal(jax.random.key(0), (256 * 1024 * 1024,), jnp.float32)
  ms = time_jax(jax.jit(lambda a: a + 1), x)
  return 2 * x.size * 4 / ms / 1e6


def torch_available() -> bool:
  import importlib.util
  return importlib.util.find_spec("torch") is not None


def torch_case(shape, window, strides, padding, dtype, data_format):
  """PyTorch's max pooling (cuDNN or its own kernels) on the same layout in memory."""
  try:
    import torch
    import torch.nn.functional as F
  except ImportError:
    return None
  tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  pool = {2: F.max_pool2d, 3: F.max_pool3d}.get(len(window))
  if pool is None:
    return None
  if data_format == "channels_last":
    n, *spatial, c = shape
    fmt = torch.channels_last if len(window) == 2 else torch.channels_last_3d
    x = torch.randn(n, c, *spatial, device="cuda", dtype=tdt).to(memory_format=fmt)
  else:
    fmt = torch.contiguous_format
    x = torch.randn(*shape, device="cuda", dtype=tdt)
  x.requires_grad_(True)
  y0 = pool(x, window, strides, padding)
  dy = torch.randn_like(y0).contiguous(memory_format=fmt)

  def fwd_bwd():
    x.grad = None
    y = pool(x, window, strides, padding)
    y.backward(dy)

  def fwd():
    with torch.no_grad():
      pool(x, window, strides, padding)

  out = {"torch_fwd": time_torch(fwd), "torch_fwd_bwd": time_torch(fwd_bwd)}
  return out


# The kernels each Pallas row runs.
ROW_KERNELS = {
    "pallas_fwd": ("max_fwd",), "pallas_fwd_argmax": ("argmax_fwd",), "pallas_bwd": ("max_bwd",),
    "pallas_fwd_bwd": ("argmax_fwd", "max_bwd"), "pallas_avg_fwd": ("avg_fwd",),
    "pallas_avg_fwd_bwd": ("avg_fwd", "avg_bwd"),
}


def launches(shape, dtype, geom) -> dict[str, str]:
  """Each kernel's launch configuration on this case, ``bw x bl x num_warps[ x rd x rh]
  (source)`` (``rd x rh``: the max forward's block of output rows, where it has one): the
  source is where the tuner first found it (tuned, cache, table, heuristic)."""
  out = {}
  records = tuning.default_tuner().records
  for op in pk.OPS:
    n0 = len(records)
    # (the average pools here count the padding, as avg_pool does by default)
    launch = pk.launch_for(op, shape, dtype, geom, interpret=False, include_pad=True)
    key = records[-1].key if len(records) > n0 else None  # (none: JAXPOOL_TUNE=off)
    first = next((r for r in records if r.key == key and r.source != "memory"), None)
    source = first.source if first else ("heuristic" if key is None else "memory")
    out[op] = f"{tuning.launch_name(launch)} ({source})"
  return out


def run_case(name, shape, window, strides, padding, data_format, dtype, copy_gbs):
  dt = jnp.dtype(dtype)
  kx, kd = jax.random.split(jax.random.key(hash((name, dtype)) % 2**31))
  x = jax.random.normal(kx, shape, jnp.float32).astype(dt)
  geom = windows.make_geometry(shape, window, strides, padding, data_format=data_format)
  out_shape = geom.output_shape(shape)
  dy = jax.random.normal(kd, out_shape, jnp.float32).astype(dt)
  nd = len(shape)
  pad_cfg = geom.full_dims(nd, geom.full_padding, (0, 0))
  kw = dict(window_shape=window, strides=strides, padding=padding, data_format=data_format)

  def xla_fwd(a):
    return lax.reduce_window(a, np.array(-np.inf, a.dtype), lax.max,
                             geom.full_dims(nd, window, 1), geom.full_dims(nd, strides, 1),
                             pad_cfg)

  xla_vjp = jax.jit(lambda a: jax.vjp(xla_fwd, a)[1])(x)
  idx = jax.jit(lambda a: pk.max_forward_taps(a, geom, interpret=False)[1])(x)

  def vjp_of(f):  # forward and backward: y and dx both returned, so neither pass is elided
    def run(a, g):
      y, vjp = jax.vjp(f, a)
      return y, vjp(g)[0]
    return jax.jit(run)

  mp = lambda impl: (lambda a: jaxpool.max_pool(a, **kw, implementation=impl))
  ap = lambda impl: (lambda a: jaxpool.avg_pool(a, **kw, implementation=impl))
  isz = dt.itemsize
  nx, ny = x.size * isz, dy.size * isz
  ni = idx.size * idx.dtype.itemsize
  rows = {}

  def row(key, ms, nbytes):
    rows[key] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                 "of_copy": nbytes / ms / 1e6 / copy_gbs}

  blank = jnp.zeros(((nx + ny) // 8,), jnp.float32)  # (read and written: the forward's bytes)
  row("copy_same_bytes", time_jax(jax.jit(lambda a: a + 1), blank), 2 * blank.nbytes)
  del blank
  row("xla_fwd", time_jax(jax.jit(xla_fwd), x), nx + ny)
  row("xla_bwd", time_jax(jax.jit(lambda v, g: v(g)[0]), xla_vjp, dy), nx + ny + nx)
  row("jaxpool_xla_fwd_bwd", time_jax(vjp_of(mp("xla")), x, dy), nx + ny + ni + ni + ny + nx)
  row("pallas_fwd", time_jax(jax.jit(lambda a: pk.max_forward(a, geom, interpret=False)), x),
      nx + ny)
  row("pallas_fwd_argmax",
      time_jax(jax.jit(lambda a: pk.max_forward_taps(a, geom, interpret=False)), x),
      nx + ny + ni)
  row("pallas_bwd",
      time_jax(jax.jit(lambda i, g: pk.max_backward(i, g, shape, geom, interpret=False)), idx, dy),
      ni + ny + nx)
  row("pallas_fwd_bwd", time_jax(vjp_of(mp("pallas")), x, dy), nx + ny + ni + ni + ny + nx)
  row("xla_avg_fwd", time_jax(jax.jit(ap("xla")), x), nx + ny)
  row("pallas_avg_fwd", time_jax(jax.jit(ap("pallas")), x), nx + ny)
  row("xla_avg_fwd_bwd", time_jax(vjp_of(ap("xla")), x, dy), nx + ny + ny + nx)
  row("pallas_avg_fwd_bwd", time_jax(vjp_of(ap("pallas")), x, dy), nx + ny + ny + nx)
  configs = launches(shape, dt, geom)
  for key, ops in ROW_KERNELS.items():
    rows[key]["launch"] = {op: configs[op] for op in ops}
  # Same bits as the XLA path, checked here on the benchmark's own data.
  same = bool(jnp.array_equal(vjp_of(mp("pallas"))(x, dy)[1], vjp_of(mp("xla"))(x, dy)[1]))
  del x, dy, idx, xla_vjp
  r = {k: v["ms"] for k, v in rows.items()}
  ratios = {
      "bwd_speedup_vs_xla": r["xla_bwd"] / r["pallas_bwd"],
      "fwd_bwd_speedup_vs_torch": None,  # (add_torch)
      "fwd_bwd_speedup_vs_jaxpool_xla": r["jaxpool_xla_fwd_bwd"] / r["pallas_fwd_bwd"],
      "avg_speedup_vs_xla": r["xla_avg_fwd_bwd"] / r["pallas_avg_fwd_bwd"],
  }
  return {"case": name, "dtype": dtype, "rows": rows, "ratios": ratios, "launch": configs,
          "grad_bits_equal_xla_path": same, "bytes": {"x": nx, "y": ny}}


def torch_rows(path: str, cases) -> None:
  """PyTorch's rows of ``cases``, timed in a process of their own, saved to ``path``.

  (With PyTorch's cached memory in the process, the JAX ops timed after it ran up to 15%
  slower: docs/design/measuring.md.)"""
  out = {}
  for name, shape, window, strides, padding, data_format, dtypes in cases:
    for dtype in dtypes:
      out[f"{name}|{dtype}"] = torch_case(shape, window, strides,
                                          padding if isinstance(padding, int) else 0, dtype,
                                          data_format)
  import torch
  out["version"] = torch.__version__
  with open(path, "w") as f:
    json.dump(out, f)


def add_torch(res, t) -> None:
  """Adds PyTorch's rows ``t`` (ms) to a case's result."""
  nx, ny, copy_gbs = res["bytes"]["x"], res["bytes"]["y"], res["copy_GBps"]
  for key, nbytes in (("torch_fwd", nx + ny), ("torch_fwd_bwd", nx + ny + ny + nx)):
    ms = t[key]
    res["rows"][key] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                        "of_copy": nbytes / ms / 1e6 / copy_gbs}
  res["ratios"]["fwd_bwd_speedup_vs_torch"] = (t["torch_fwd_bwd"]
                                               / res["rows"]["pallas_fwd_bwd"]["ms"])


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = ["xla_fwd", "pallas_fwd", "xla_bwd", "pallas_bwd", "torch_fwd_bwd",
          "jaxpool_xla_fwd_bwd", "pallas_fwd_bwd", "xla_avg_fwd_bwd", "pallas_avg_fwd_bwd"]
  fig, ax = plt.subplots(figsize=(12, 5))
  width = 0.8 / len(results)
  for n, res in enumerate(results):
    vals = [res["rows"].get(k, {}).get("ms", np.nan) for k in keys]
    ax.bar(np.arange(len(keys)) + n * width, vals, width, label=f"{res['case']} {res['dtype']}")
  ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2)
  ax.set_xticklabels(keys, rotation=30, ha="right")
  ax.set_ylabel("ms (median)")
  ax.set_title(f"Max/avg pooling on {jax.devices()[0].device_kind}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  ap = argparse.ArgumentParser()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ap.add_argument("--json", default=None,
                  help="the JSON file (default: benchmarks/results/pooling_gpu_<gpu>.json, "
                       "pooling_gpu_h200.json on an H200)")
  ap.add_argument("--png", default=os.path.join(root, "docs/img/bench_gpu.png"))
  ap.add_argument("--inner", type=int, default=None,
                  help="calls a sample, whatever they last (default: at least INNER calls "
                       "and SAMPLE_MS of them)")
  ap.add_argument("--cases", default="",
                  help="only the cases whose name contains one of these (comma-separated)")
  ap.add_argument("--no-torch", action="store_true", help="leave PyTorch's rows out")
  ap.add_argument("--in-jit", type=int, default=0, metavar="K",
                  help="time K calls inside one jit, each on its own copy of the arguments "
                       "(the GPU's time of the op inside a jitted step; PyTorch's rows left "
                       "out)")
  ap.add_argument("--table", choices=("on", "off", "foreign"), default="on",
                  help="off: hide the shipped table, with an empty tuning cache and the default "
                       "mode (the launch model alone); foreign: hide this GPU's tuning data from "
                       "the model too (what a GPU without a table gets); saved beside the "
                       "default result as pooling_gpu_<gpu>_table_<off|foreign>.json")
  ap.add_argument("--no-table", dest="table", action="store_const", const="off",
                  help="the same as --table off")
  ap.add_argument("--torch-rows", default=None, help=argparse.SUPPRESS)  # (the child process)
  args = ap.parse_args()
  if args.table != "on":  # (before the tuner is first used: it reads these then)
    os.environ["JAXPOOL_TUNE_TABLE"] = args.table
    os.environ["JAXPOOL_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpool-no-table-")
    os.environ.pop("JAXPOOL_TUNE", None)
  cases = [c for c in CASES if any(w in c[0] for w in args.cases.split(","))]
  global INNER, SAMPLE_MS, NO_TORCH, IN_JIT
  if args.in_jit < 0:
    ap.error(f"--in-jit must be at least 0, got {args.in_jit}")
  IN_JIT = args.in_jit
  NO_TORCH = args.no_torch or bool(IN_JIT)
  if args.inner is not None:
    if args.inner < 1:
      ap.error(f"--inner must be at least 1, got {args.inner}")
    INNER, SAMPLE_MS = args.inner, 0.0
  if args.torch_rows:
    torch_rows(args.torch_rows, cases)
    return
  dev = jax.devices()[0]
  print(f"device {dev.device_kind}; jax {jax.__version__}; python {platform.python_version()}")
  print(f"launch configurations: {tuning.TUNE_ENV}={tuning.mode()}, shipped table "
        f"{settings.get('tune_table')}, cache "
        f"{tuning.cache_dir()}, shipped table entries for this device: "
        f"{len(tuning.shipped_table(dev.device_kind))}", flush=True)
  copy_gbs = copy_bandwidth()
  print(f"copy bandwidth (x + 1, 1 GiB f32, read + write): {copy_gbs:.0f} GB/s", flush=True)
  results = []
  for name, shape, window, strides, padding, data_format, dtypes in cases:
    for dtype in dtypes:
      res = run_case(name, shape, window, strides, padding, data_format, dtype, copy_gbs)
      res["copy_GBps"] = copy_gbs
      results.append(res)
  torch_version = None
  if not NO_TORCH and torch_available():
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    timer = ["--inner", str(args.inner)] if args.inner is not None else []
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-rows", path,
                            "--cases", args.cases, *timer])
    if child.returncode == 0:
      with open(path) as f:
        torch_times = json.load(f)
      for res in results:
        t = torch_times.get(f"{res['case']}|{res['dtype']}")
        if t is not None:
          add_torch(res, t)
      torch_version = torch_times.get("version")
    else:
      print(f"PyTorch's rows failed (exit {child.returncode}); left out", flush=True)
    os.remove(path)
  for res in results:
    print(f"\n{res['case']} {res['dtype']}  (grad bits == jaxpool XLA path: "
          f"{res['grad_bits_equal_xla_path']})")
    print(f"  {'row':24s} {'ms':>8s} {'GB/s':>8s} {'of copy':>8s}")
    for k, v in res["rows"].items():
      launch = " ".join(f"{op} {c}" for op, c in v.get("launch", {}).items())
      print(f"  {k:24s} {v['ms']:8.3f} {v['GBps']:8.0f} {v['of_copy']:8.2f}  {launch}")
    print("  " + ", ".join(f"{k}={v:.2f}" for k, v in res["ratios"].items() if v is not None),
          flush=True)
  meta = {"device": dev.device_kind, "jax": jax.__version__, "copy_GBps": copy_gbs,
          "timer": f"median of {REPS} samples, each at least {INNER} calls and {SAMPLE_MS} ms "
                   "of calls, then block_until_ready"
                   + (f"; each call {IN_JIT} calls in one jit, time divided by {IN_JIT}"
                      if IN_JIT else ""),
          "in_jit": IN_JIT,
          "time": time.strftime("%Y-%m-%d %H:%M:%S"), "tuning": tuning.mode(),
          "tuning_seconds": sum(r.seconds for r in tuning.report() if r.source == "tuned")}
  if torch_version:
    meta["torch"] = torch_version
  args.json = args.json or result_path(__file__, device_tag(jax.devices()[0].device_kind))
  if args.table != "on" and args.json.endswith(".json"):
    args.json = args.json[:-5] + f"_table_{args.table}.json"
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  with open(args.json, "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=1)
  try:
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    plot(results, args.png)
  except Exception as e:  # the numbers matter more than the picture
    print("plot failed:", e)
  print("\nsummary (ms): case dtype | xla_bwd pallas_bwd (x) | torch_fb pallas_fb (x) | "
        "fwd/fwd+taps/bwd/avg fwd of copy (a copy of the forward's bytes) | avg xla pallas")
  below = []
  for res in results:
    r, q = res["rows"], res["ratios"]
    tfb = r.get("torch_fwd_bwd", {}).get("ms", float("nan"))
    kernels = "/".join(f"{r[k]['of_copy']:.2f}" for k in KERNELS)
    print(f"{res['case'][:14]} {res['dtype'][:4]} | {r['xla_bwd']['ms']:.3f} "
          f"{r['pallas_bwd']['ms']:.3f} ({q['bwd_speedup_vs_xla']:.1f}x) | {tfb:.3f} "
          f"{r['pallas_fwd_bwd']['ms']:.3f} ({q['fwd_bwd_speedup_vs_torch'] or float('nan'):.1f}x)"
          f" | {kernels} ({r['copy_same_bytes']['of_copy']:.2f}) | "
          f"{r['xla_avg_fwd_bwd']['ms']:.3f} {r['pallas_avg_fwd_bwd']['ms']:.3f}")
    below += [f"{res['case']} {res['dtype']} {k} {r[k]['of_copy']:.2f}" for k in KERNELS
              if r[k]["of_copy"] < 0.8]
  print(f"kernels below 0.8 of copy: {len(below)} of {len(KERNELS) * len(results)}"
        + "".join(f"\n  {b}" for b in below))
  under = [f"{res['case']} {res['dtype']} {k} {res['rows'][k]['of_copy']:.2f}"
           for res in results for k in KERNELS if res["rows"][k]["of_copy"] < 0.85]
  print(f"kernels below 0.85 of copy: {len(under)} of {len(KERNELS) * len(results)}"
        + "".join(f"\n  {b}" for b in under))
  tuned = [r for r in tuning.report() if r.source == "tuned"]
  print(f"tuned in this run: {len(tuned)} kernels, {sum(r.seconds for r in tuned):.1f} s")


if __name__ == "__main__":
  main()
