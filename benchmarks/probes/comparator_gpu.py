"""What the max kernels' running maximum costs: the forward and backward kernels with each form.

The kernels keep a running maximum in ``dtypes.beats``' order (NaN above every number, ``+0.0``
above ``-0.0``, the first of equal values) and take a tap where its bits change. This script
times the Triton kernels (forward with and without the taps; the backward, which reads the
taps, as a control; the average-pooling forward) on the cases of ``benchmarks/pooling_gpu.py`` with
each form of that maximum (``config.NAN_MAX``):

- ``ptx``: the kernels' default on an NVIDIA GPU for float32 comparisons (16-bit floats are
  compared in float32): PTX's ``max.NaN.f32``, one instruction a tap;
- ``beats``: ``dtypes.beats`` and a select a tap (the default elsewhere);
- ``canonical``: ``beats`` with NaN results made canonical, as PTX's are;
- ``previous``: with ``--previous REV``, the kernels of ``jaxpool/_src/pallas/triton.py`` as
  they were at git revision ``REV`` (needs the repository's ``.git``; or ``REV`` is the path of
  a copy of that file), side by side.

(Until run 29 the kernels kept a comparison a tap with a rule for signed zeros in one of several
forms; this script timed those: ``raw/comparator_v9.log`` to ``comparator_v26.log``,
NOTES.md.)

Rounds alternate the variants, so drifting clocks affect them alike. ``--cases a,b`` runs the
cases whose name contains ``a`` or ``b``; ``--variants ptx,beats`` the variants named;
``--inner N`` times N calls a sample (default 10); ``--launch 8,64,4`` runs every kernel with
that ``(bw, bl, num_warps)``; ``--launches "8;64;2/16;64;4"`` adds a variant of the default
kernels for each such configuration. Each case also times a copy of its forward's bytes, and
XLA's repeat of the cotangent to the input's size (the backward's kind of pass: read an
output, write an input). Prints a table and saves ``benchmarks/results/comparator_gpu.json``.
Needs a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# The variants run the launch configurations they name (or the heuristic), not the tuner's
# (docs/tuning.md), unless JAXPOOL_TUNE is set.
os.environ.setdefault("JAXPOOL_TUNE", "off")
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import config  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.pallas.triton import tile as triton_tile  # noqa: E402


def _module(setting: str):
  """The module that holds ``setting``."""
  return triton_tile if setting == "ORDER" else config

CASES = [
    ("128x112x112x64 3x3/s2/p1 bf16", (128, 112, 112, 64), (3, 3), (2, 2), 1,
     "channels_last", jnp.bfloat16),
    ("128x112x112x64 3x3/s2/p1 f32", (128, 112, 112, 64), (3, 3), (2, 2), 1,
     "channels_last", jnp.float32),
    ("128x64x112x112 NCHW 3x3/s2/p1 f32", (128, 64, 112, 112), (3, 3), (2, 2), 1,
     "channels_first", jnp.float32),
    ("16x16x56x56x64 3x3x3/s2/p1 f32", (16, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1,
     "channels_last", jnp.float32),
    # Twins of two cases above with no window reaching past the input (one more input row and
    # column, no padding, the same output): what the kernels' edge programs cost.
    ("16x17x57x57x64 3x3x3/s2/p0 f32, no edges", (16, 17, 57, 57, 64), (3, 3, 3), (2, 2, 2), 0,
     "channels_last", jnp.float32),
    ("128x64x113x113 NCHW 3x3/s2/p0 f32, no edges", (128, 64, 113, 113), (3, 3), (2, 2), 0,
     "channels_first", jnp.float32),
    # Zeros everywhere: every value -0.0 or below, half of them -0.0 and a few +0.0 (the worst
    # case of the deferred rule, which scanned such tiles twice).
    ("128x112x112x64 3x3/s2/p1 bf16, zero maxima", (128, 112, 112, 64), (3, 3), (2, 2), 1,
     "channels_last", jnp.bfloat16),
]


# name: the settings of jaxpool._src.pallas.triton it runs with (the rest at their defaults).
VARIANTS = {
    "ptx": dict(NAN_MAX="auto"),
    "beats": dict(NAN_MAX="beats"),
    "canonical": dict(NAN_MAX="canonical"),
    # The programs numbered rows first (then column blocks, then lane blocks): the kernels'
    # order before the memory order (CHANGELOG; triton_tile.ORDER)
    "rows_first": dict(ORDER="rows"),
}
SETTINGS = ("NAN_MAX", "launch_config", "ORDER")


def _previous(rev: str):
  """``triton.py`` as it was at git revision ``rev`` (or the copy of it at the path ``rev``,
  where the machine's checkout lacks the commit), imported as a module of its own."""
  import importlib.util
  import subprocess
  path = rev
  if not os.path.isfile(rev):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = subprocess.run(["git", "show", f"{rev}:jaxpool/_src/pallas/triton.py"], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join("/tmp", f"jaxpool_triton_{rev}.py")
    with open(path, "w") as f:
      f.write(src)
  spec = importlib.util.spec_from_file_location("jaxpool_triton_previous", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _arg(name, default):
  """``--name a,b``: the cases whose name contains one of a, b (or the variants named)."""
  if name in sys.argv:
    return sys.argv[sys.argv.index(name) + 1].split(",")
  return default


def _time(fn, x, reps=20, inner=None):
  inner = inner or int(_arg("--inner", ["10"])[0])
  jax.block_until_ready(fn(x))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(x)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  return statistics.median(samples) * 1e3


def main():
  cases = [c for c in CASES if any(p in c[0] for p in _arg("--cases", [""]))]
  # --launch bw,bl,warps: every kernel with that launch configuration instead of the default
  launch = tuple(int(v) for v in _arg("--launch", [])) or None
  variants = {v: (pk, VARIANTS[v]) for v in _arg("--variants", list(VARIANTS))}
  # --launches "8;64;2/16;64;4": the default kernels with each launch configuration, as variants
  for cfg in (c for arg in _arg("--launches", []) for c in arg.split("/")):
    fixed = tuple(int(v) for v in cfg.split(";"))
    variants[f"launch {cfg}"] = (pk, dict(launch_config=lambda *_, c=fixed: c))
  for rev in _arg("--previous", []):
    variants[f"previous {os.path.basename(rev)}"] = (_previous(rev), {})
  if launch:
    for mod, _ in variants.values():
      mod.launch_config = lambda *_: launch
  copy = jax.jit(lambda a: a + 1)
  big = jnp.zeros((2**28,), jnp.float32)
  copy_gbs = 2 * big.nbytes / _time(copy, big) / 1e6
  print(f"copy bandwidth: {copy_gbs:.0f} GB/s")
  rows, same_size, write_heavy = [], {}, {}
  defaults = {k: getattr(_module(k), k) for k in SETTINGS}
  for name, shape, window, strides, padding, fmt, dtype in cases:
    r = np.random.default_rng(0)
    x = r.standard_normal(shape, np.float32)
    if name.endswith("zero maxima"):
      u = r.random(shape, np.float32)
      x = np.where(u < 0.5, np.float32(-0.0), np.where(u < 0.52, np.float32(0.0), -abs(x)))
    x = jnp.asarray(x, dtype)
    geom = windows.make_geometry(shape, window, strides, padding, data_format=fmt)
    out = geom.output_shape(shape)
    n_out = int(np.prod(out))
    bytes_fwd = x.nbytes + n_out * x.dtype.itemsize
    bytes_taps = bytes_fwd + n_out
    _, taps0 = pk.max_forward_taps(x, geom, interpret=False)
    dy = jnp.asarray(r.standard_normal(out, np.float32), dtype)
    bytes_bwd = x.nbytes + dy.nbytes + n_out
    times = {v: {"fwd": [], "fwd_taps": [], "bwd": [], "avg": []} for v in variants}
    # Each variant's kernels are traced (with the module's settings of that variant) on their
    # first call, in the first round; later rounds reuse them.
    fns = {v: (jax.jit(lambda a, g=geom, m=mod: m.max_forward(a, g, interpret=False)),
               jax.jit(lambda a, g=geom, m=mod: m.max_forward_taps(a, g, interpret=False)),
               jax.jit(lambda t, d, g=geom, s=shape, m=mod: m.max_backward(t, d, s, g,
                                                                            interpret=False)),
               jax.jit(lambda a, g=geom, m=mod: m.avg_forward(
                   a, g, interpret=False, count_include_pad=True, divisor_override=None)))
           for v, (mod, _) in variants.items()}
    for _ in range(3):  # rounds, alternating the variants
      for v, (_, settings) in variants.items():
        for k, val in {**defaults, **settings}.items():
          setattr(_module(k), k, val)
        fwd, taps, bwd, avg = fns[v]
        times[v]["fwd"].append(_time(fwd, x))
        times[v]["fwd_taps"].append(_time(taps, x))
        times[v]["bwd"].append(_time(lambda d, b=bwd, i=taps0: b(i, d), dy))
        times[v]["avg"].append(_time(avg, x))
    for k, val in defaults.items():
      setattr(_module(k), k, val)
    # The same pass at this case's size: what a 0.1 ms call's launch and tail leave of the copy
    # bandwidth (measured on 1 GiB) with this timer.
    small = jnp.zeros((bytes_fwd // 8,), jnp.float32)
    same_size[name] = 2 * small.nbytes / min(_time(copy, small) for _ in range(3)) / 1e6 / copy_gbs
    print(f"{name[:44]:44s} a copy of the forward's bytes: {same_size[name]:.2f} of copy")
    # The backward's kind of pass in XLA: read an output-sized array, write an input-sized one
    # (each element repeated along the strided dims; the taps' bytes aside).
    axes = [ax for ax in range(1, len(shape)) if fmt == "channels_first" or ax < len(shape) - 1]
    if fmt == "channels_first":
      axes = axes[1:]

    def spread(d, axes=tuple(axes), strides=strides):
      for ax, st in zip(axes, strides):
        d = jnp.repeat(d, st, axis=ax)
      return d

    spread_fn = jax.jit(spread)
    if spread_fn.eval_shape(dy).shape == tuple(shape):
      write_heavy[name] = ((dy.nbytes + x.nbytes) / min(_time(spread_fn, dy) for _ in range(3))
                           / 1e6 / copy_gbs)
      print(f"{name[:44]:44s} XLA's repeat of dy to x's size (read dy, write x): "
            f"{write_heavy[name]:.2f} of copy")
    for v in variants:
      f, t, bw, a = (min(times[v][k]) for k in ("fwd", "fwd_taps", "bwd", "avg"))
      row = dict(case=name, variant=v, fwd_ms=f, fwd_taps_ms=t, bwd_ms=bw, avg_fwd_ms=a,
                 avg_fwd_of_copy=bytes_fwd / a / 1e6 / copy_gbs,
                 fwd_of_copy=bytes_fwd / f / 1e6 / copy_gbs,
                 fwd_taps_of_copy=bytes_taps / t / 1e6 / copy_gbs,
                 bwd_of_copy=bytes_bwd / bw / 1e6 / copy_gbs)
      rows.append(row)
      print(f"{name[:44]:44s} {v[:16]:16s} fwd {f:.3f} ms ({row['fwd_of_copy']:.2f} of copy)  "
            f"fwd+taps {t:.3f} ({row['fwd_taps_of_copy']:.2f})  "
            f"bwd {bw:.3f} ({row['bwd_of_copy']:.2f})  avg fwd {a:.3f} "
            f"({row['avg_fwd_of_copy']:.2f})", flush=True)
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                      "comparator_gpu.json")
  with open(path, "w") as f:
    json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), copy_gbs=copy_gbs,
                   same_size_copy_of_copy=same_size,
                   write_heavy_of_copy=write_heavy, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
