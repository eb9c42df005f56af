"""How long the Triton max-pool kernels take to compile and run, by window size (a GPU).

Default: for each square window (stride = window, 64x56x56x256 float32), times the first call
(trace, lowering, Triton's compile and one run) and a later call of the forward, the forward
with taps and the backward kernel, each in its own jit. Prints one line per kernel as it goes::

  python3 benchmarks/compile_gpu.py 4 5 7 8

``--first-call``: a user's first training call of a stride-1 "same" max pool (SPP's shape,
(16, 40, 40, 512) bfloat16) for each window, each in a NEW PROCESS: ``jax.jit(jax.value_and_grad
(loss))`` lowered and compiled, jaxpool (``implementation=None``: windows of more than 32 taps
run the kernels a dim at a time) against ``implementation="xla"``; the compile time of a large
window follows its largest dim, not its taps::

  python3 benchmarks/compile_gpu.py --first-call 3 5 9 13 31

which saves ``benchmarks/results/compile_gpu_<device>.json`` (``result_path.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

SPP_SHAPE = (16, 40, 40, 512)


def kernels(ks: list[int]) -> None:
  import jax
  import jax.numpy as jnp

  from jaxpool._src import windows
  from jaxpool._src.pallas.triton import ops as pk
  shape = (64, 56, 56, 256)
  for k in ks or [4, 5, 7, 8]:
    geom = windows.make_geometry(shape, (k, k), (k, k), 0)
    x = jnp.ones(shape, jnp.float32)
    y, taps = jax.jit(lambda a, g=geom: pk.max_forward_taps(a, g, interpret=False))(x)
    for name, fn, args in [
        ("fwd", lambda a, g=geom: pk.max_forward(a, g, interpret=False), (x,)),
        ("fwd_taps", lambda a, g=geom: pk.max_forward_taps(a, g, interpret=False), (x,)),
        ("bwd", lambda i, d, g=geom: pk.max_backward(i, d, shape, g, interpret=False),
         (taps, y))]:
      f = jax.jit(fn)
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      first = time.perf_counter() - t0
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      print(f"{k}x{k} ({k * k} taps) {name}: first call {first:.1f} s, then "
            f"{(time.perf_counter() - t0) * 1e3:.3f} ms", flush=True)


def first_call_child(k: int, implementation: str) -> dict:
  """One window's first training call in this (new) process: seconds to lower and compile."""
  import jax
  import jax.numpy as jnp

  import jaxpool
  impl = None if implementation == "default" else implementation

  def loss(x):
    y = jaxpool.max_pool(x, (k, k), (1, 1), "SAME", implementation=impl)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  x = jnp.zeros(SPP_SHAPE, jnp.bfloat16)
  t0 = time.perf_counter()
  lowered = jax.jit(jax.value_and_grad(loss)).lower(x)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  jax.block_until_ready(compiled(x))
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "run_s": time.perf_counter() - t2}


def first_calls(ks: list[int]) -> None:
  import jax

  from result_path import device_tag, result_path
  kind = jax.devices()[0].device_kind
  print(f"first training call, stride 1 'same', {SPP_SHAPE} bfloat16, each in a new process")
  rows = []
  for k in ks or [3, 5, 9, 13, 31]:
    row = {}
    for impl in ("xla", "default"):
      cmd = [sys.executable, os.path.abspath(__file__), "--child", str(k), impl]
      out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
      row[impl] = json.loads(out.strip().splitlines()[-1])
    t = {i: r["lower_s"] + r["compile_s"] for i, r in row.items()}
    print(f"{k}x{k} ({k * k} taps): jaxpool lower {row['default']['lower_s']:.2f} s + compile "
          f"{row['default']['compile_s']:.2f} s = {t['default']:.2f} s; XLA {t['xla']:.2f} s",
          flush=True)
    rows.append({"window": [k, k], "jaxpool": row["default"], "xla": row["xla"]})
  path = result_path(__file__, device_tag(kind))
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"device_kind": kind, "jax": jax.__version__, "shape": SPP_SHAPE,
               "dtype": "bfloat16", "rows": rows}, f, indent=1)
  print(f"saved {path}")


if __name__ == "__main__":
  args = sys.argv[1:]
  if args[:1] == ["--child"]:
    print(json.dumps(first_call_child(int(args[1]), args[2])))
  elif args[:1] == ["--first-call"]:
    first_calls([int(a) for a in args[1:]])
  else:
    kernels([int(a) for a in args])
