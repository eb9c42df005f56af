"""jaxpool.optimize on one GPU: ReLU -> max pool, and unmodified Flax / Equinox training steps.

Run on a GPU machine from the repository root::

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/optimize_gpu.py
  PYTHONPATH=$PWD python3 benchmarks/optimize_gpu.py --quick     # tiny shapes, a CPU, < 2 min

Two parts:

* **ReLU -> max pool**, 3x3/s2/p1 on 128x112x112x64 (float32 and bfloat16), forward and
  forward + backward (``jax.vjp`` with a random cotangent), for: XLA (``lax.reduce_window`` after
  ``jax.nn.relu``, its gradient ``select_and_scatter_add``); jaxpool's pool alone (no ReLU, the
  floor); jaxpool's pool after the ReLU; the ReLU folded after jaxpool's pool (``activation=
  "relu"`` where ``jaxpool.max_pool`` takes it, else ``relu(max_pool(x))``); and
  ``jaxpool.optimize`` of the XLA code. Each jaxpool row's gradient is compared with XLA's.
* **Training steps** of unmodified models with and without ``jaxpool.optimize``: Flax VGG-16
  at 224x224 (bfloat16 batch 64, float32 batch 32), the Equinox CNN of examples/equinox_cnn.py
  (128x3x112x112) and a 3-D CNN on video clips (8x16x112x112x3: conv3d + ReLU + 3-D max pools).
  The Flax models also run with every max pool replaced by a strided slice (``no_pool``: the
  same shapes at next to no cost): ``base / no_pool`` bounds the speed-up that any pooling,
  however fast, could give that step. Each runs in a fresh subprocess, so the peak device
  memory it reports (``memory_stats()["peak_bytes_in_use"]``; none on a CPU) is that step's
  alone.

Timer: jit, two warm-up calls (the first compiles), then each sample runs the function and blocks
until the device is done (``block_until_ready``); the median of the samples is reported (for the
pools, each sample is ``INNER`` calls back to back). Arrays are jit arguments, never closed over.
The table goes to stdout, the numbers to ``--out`` or
``benchmarks/results/optimize_gpu_<device>.json`` (``optimize_gpu_h100.json`` on an H100; with
``--quick``, under ``build/benchmarks/``).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool._src.pallas.tuning import tuner  # noqa: E402
from result_path import device_tag, result_path  # noqa: E402

# Step cases: name -> (full config, quick config).
STEPS = {
    "flax_vgg16_bf16_b64": (dict(model="vgg16", batch=64, size=224, dtype="bfloat16"),
                            dict(model="vgg_small", batch=4, size=32, dtype="bfloat16")),
    "flax_vgg16_f32_b32": (dict(model="vgg16", batch=32, size=224, dtype="float32"),
                           dict(model="vgg_small", batch=4, size=32, dtype="float32")),
    "equinox_cnn_f32_b128": (dict(model="equinox", batch=128, size=112, width=64,
                                  dtype="float32"),
                             dict(model="equinox", batch=4, size=32, width=8, dtype="float32")),
    "video3d_f32_b8": (dict(model="video3d", batch=8, frames=16, size=112, dtype="float32"),
                       dict(model="video3d", batch=2, frames=4, size=16, dtype="float32")),
}


def timed(fn, *args, reps: int, inner: int = 1) -> float:
  """Median milliseconds of ``inner`` calls of ``fn(*args)``, after two warm-up calls."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  return 1e3 * statistics.median(samples)


# ----------------------------------------------------------------------------- ReLU -> pool


def pool_variants() -> dict:
  window, strides, pads = (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0))
  jp = functools.partial(jaxpool.max_pool, window_shape=(3, 3), strides=(2, 2), padding=1)
  fused = "activation" in inspect.signature(jaxpool.max_pool).parameters

  def xla(x):
    return lax.reduce_window(jax.nn.relu(x), -jnp.inf, lax.max, window, strides, pads)

  def folded(x):
    return jp(x, activation="relu") if fused else jax.nn.relu(jp(x))
  return {
      "xla: relu -> reduce_window": xla,
      "xla: pool alone": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, pads),
      "jaxpool: pool alone": jp,
      "jaxpool: relu -> pool": lambda x: jp(jax.nn.relu(x)),
      ("jaxpool: pool, activation='relu'" if fused else "jaxpool: pool -> relu"): folded,
      "jaxpool.optimize(xla)": jaxpool.optimize(xla),
  }


def pool_rows(quick: bool, reps: int, inner: int) -> list[dict]:
  shape = (4, 28, 28, 16) if quick else (128, 112, 112, 64)
  rows = []
  for dtype in ("float32", "bfloat16"):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    variants = pool_variants()
    vjps, ref_dx = {}, None
    for name, f in variants.items():
      fwd = jax.jit(f)
      y = fwd(x)
      dy = jnp.asarray(rng.standard_normal(y.shape), dtype)
      vjp = jax.jit(lambda x, dy, f=f: jax.vjp(f, x)[1](dy)[0])
      vjps[name] = vjp
      dx = vjp(x, dy)
      row = dict(case=f"{'x'.join(map(str, shape))} 3x3/s2/p1", dtype=dtype, variant=name,
                 fwd_ms=timed(fwd, x, reps=reps, inner=inner),
                 fwd_bwd_ms=timed(vjp, x, dy, reps=reps, inner=inner))
      if name.startswith("xla: relu"):
        ref_dx = (dy, dx)
      elif "relu" in name or "optimize" in name:
        dy0, dx0 = ref_dx
        got = vjps[name](x, dy0)
        row["max_abs_dx_diff_vs_xla"] = float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                                              - dx0.astype(jnp.float32))))
      rows.append(row)
      print(f"  {row['case']} {dtype:8s} {name:34s} fwd {row['fwd_ms']:8.3f} ms  "
            f"fwd+bwd {row['fwd_bwd_ms']:8.3f} ms", flush=True)
  return rows


# ----------------------------------------------------------------------------- training steps


def video_model(dtype):
  import flax.linen as nn

  class Video3D(nn.Module):
    """conv3d 3x3x3 + ReLU stacks with 3-D max pools, a global average pool, a classifier."""

    @nn.compact
    def __call__(self, x):  # x: (batch, frames, H, W, 3)
      x = x.astype(dtype)
      x = nn.relu(nn.Conv(64, (3, 3, 3), padding="SAME", dtype=dtype)(x))
      x = nn.max_pool(x, (1, 3, 3), (1, 2, 2), "SAME")        # space only, as C3D's first pool
      x = nn.relu(nn.Conv(128, (3, 3, 3), padding="SAME", dtype=dtype)(x))
      x = nn.max_pool(x, (2, 2, 2), (2, 2, 2))
      x = nn.relu(nn.Conv(128, (3, 3, 3), padding="SAME", dtype=dtype)(x))
      x = nn.max_pool(x, (2, 2, 2), (2, 2, 2))
      x = x.mean(axis=(1, 2, 3))
      return nn.Dense(10, dtype=dtype)(x).astype(jnp.float32)
  return Video3D()


def run_step_case(name: str, variant: str, quick: bool, reps: int) -> dict:
  """One training step case in this process: median step time, loss, peak memory."""
  import optax
  cfg = STEPS[name][1 if quick else 0]
  dtype = jnp.dtype(cfg["dtype"])
  rng = np.random.default_rng(0)
  optimizer = optax.sgd(0.01, momentum=0.9)
  impl = None
  if cfg["model"] == "equinox":
    import equinox as eqx
    import equinox_cnn
    model = equinox_cnn.CNN(cfg["size"], cfg["width"], 10, jax.random.key(0))
    loss = equinox_cnn.loss_fn
    if variant == "optimize":
      loss = jaxpool.optimize(loss, implementation=impl)
    step = equinox_cnn.make_step(loss, optimizer)
    params = model
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    images = jnp.asarray(rng.standard_normal((cfg["batch"], 3, cfg["size"], cfg["size"])),
                         jnp.float32)
  else:
    import flax_vgg
    if cfg["model"] == "video3d":
      model = video_model(dtype)
      shape = (cfg["batch"], cfg["frames"], cfg["size"], cfg["size"], 3)
      classes = 10
    else:
      vgg = cfg["model"] == "vgg16"
      model = flax_vgg.VGG(flax_vgg.VGG16 if vgg else flax_vgg.SMALL, 4096 if vgg else 128,
                           1000 if vgg else 10, dtype)
      shape = (cfg["batch"], cfg["size"], cfg["size"], 3)
      classes = model.classes
    images = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    if variant == "no_pool":
      # The floor: every max pool replaced by a strided slice (the same shapes, next to no
      # cost), so base / no_pool bounds what any pooling can gain in this step.
      import flax.linen as nn
      nn.max_pool = flax_vgg.strided_slice_pool  # this child process only
    params = jax.jit(model.init)(jax.random.key(0), images)
    apply = model.apply
    if variant == "optimize":
      apply = jaxpool.optimize(apply, implementation=impl)
    step = flax_vgg.make_step(apply, optimizer)
    opt_state = optimizer.init(params)
  labels = jnp.asarray(rng.integers(0, 10 if cfg["model"] != "vgg16" else classes,
                                    cfg["batch"]), jnp.int32)
  t0 = time.perf_counter()
  state = step(params, opt_state, images, labels)
  loss0 = float(jax.block_until_ready(state[2]))
  compile_s = time.perf_counter() - t0
  box = [state]

  def one():
    box[0] = step(box[0][0], box[0][1], images, labels)
    return box[0][2]
  ms = timed(one, reps=reps)
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return dict(case=name, variant=variant, config=cfg, step_ms=ms, first_loss=loss0,
              first_step_s=compile_s,
              peak_mib=None if peak is None else peak / 2**20)


def step_rows(quick: bool, reps: int) -> list[dict]:
  rows = []
  for name in STEPS:
    variants = ("base", "optimize") + (() if STEPS[name][0]["model"] == "equinox"
                                       else ("no_pool",))
    for variant in variants:
      cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--variant", variant,
             "--reps", str(reps)] + (["--quick"] if quick else [])
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
      lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
      if proc.returncode != 0 or not lines:
        row = dict(case=name, variant=variant, error=(proc.stderr or proc.stdout)[-2000:])
        print(f"  {name:24s} {variant:9s} FAILED:\n{row['error']}", flush=True)
      else:
        row = json.loads(lines[-1])
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.0f} MiB"
        print(f"  {name:24s} {variant:9s} step {row['step_ms']:9.2f} ms  first loss "
              f"{row['first_loss']:.5f}  peak {peak}", flush=True)
      rows.append(row)
  return rows


def table(pools: list[dict], steps: list[dict]) -> str:
  out = ["", "ReLU -> max pool (3x3/s2/p1)", "",
         "| case | dtype | variant | fwd ms | fwd+bwd ms | vs XLA fwd+bwd | max |dx - dx_xla| |",
         "|---|---|---|---|---|---|---|"]
  base = {(r["case"], r["dtype"]): r["fwd_bwd_ms"] for r in pools
          if r["variant"].startswith("xla: relu")}
  for r in pools:
    speed = base[(r["case"], r["dtype"])] / r["fwd_bwd_ms"]
    diff = r.get("max_abs_dx_diff_vs_xla")
    out.append(f"| {r['case']} | {r['dtype']} | {r['variant']} | {r['fwd_ms']:.3f} | "
               f"{r['fwd_bwd_ms']:.3f} | {speed:.2f}x | {'' if diff is None else f'{diff:.3g}'} |")
  out += ["", "Training steps (unmodified models)", "",
          "| case | without optimize | with optimize | speed-up | pools removed: step, bound "
          "| peak MiB (without / with) | first loss (without / with) |",
          "|---|---|---|---|---|---|---|"]
  by = {(r["case"], r["variant"]): r for r in steps}
  for name in STEPS:
    a, b = by.get((name, "base"), {}), by.get((name, "optimize"), {})
    if "step_ms" not in a or "step_ms" not in b:
      out.append(f"| {name} | failed | failed | | | |")
      continue
    peak = ("-" if a["peak_mib"] is None else f"{a['peak_mib']:.0f} / {b['peak_mib']:.0f}")
    c = by.get((name, "no_pool"), {})
    floor = (f"{c['step_ms']:.2f} ms, {a['step_ms'] / c['step_ms']:.2f}x" if "step_ms" in c
             else "")
    out.append(f"| {name} | {a['step_ms']:.2f} ms | {b['step_ms']:.2f} ms | "
               f"{a['step_ms'] / b['step_ms']:.2f}x | {floor} | {peak} | "
               f"{a['first_loss']:.5f} / {b['first_loss']:.5f} |")
  return "\n".join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke run")
  parser.add_argument("--out", default=None, help="JSON path")
  parser.add_argument("--reps", type=int, default=None, help="samples per timing")
  parser.add_argument("--skip-steps", action="store_true", help="only the ReLU -> pool rows")
  parser.add_argument("--only-steps", action="store_true", help="only the training steps")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--variant", default="base", help=argparse.SUPPRESS)
  args = parser.parse_args()
  reps = args.reps or (3 if args.quick else 20)
  if args.child:
    print(json.dumps(run_step_case(args.child, args.variant, args.quick, reps)), flush=True)
    return
  dev = jax.devices()[0]
  print(f"jaxpool.optimize benchmark on {dev.device_kind} ({jax.default_backend()}), "
        f"JAX {jax.__version__}{' (quick)' if args.quick else ''}", flush=True)
  pools = [] if args.only_steps else pool_rows(args.quick, reps, 1 if args.quick else 10)
  steps = [] if args.skip_steps else step_rows(args.quick, 3 if args.quick else 10)
  print(table(pools, steps) if pools and steps else "", flush=True)
  result = dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                python=platform.python_version(), quick=args.quick, pools=pools, steps=steps,
                fused_activation="activation" in inspect.signature(
                    jaxpool.max_pool).parameters,
                tune=tuner.mode())  # (how the kernels' launches were chosen: JAXPOOL_TUNE)
  path = args.out or result_path(__file__, device_tag(dev.device_kind), quick=args.quick)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"\nwrote {path}")
  failed = [r for r in steps if "error" in r]
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
