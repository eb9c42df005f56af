"""How long the kernels' launch tuning takes where it happens in a model: inside a ``jit`` compile.

The tuner (``jaxpool/_src/pallas/tuning.py``) tunes a kernel the first time a program holding
it is compiled, for a key that neither the disk cache nor the shipped table holds. This script
compiles the gradient of one max pool (VGG16's first, bfloat16, batch 64 by default) with
``JAXPOOL_TUNE=auto`` and an empty cache folder, in a child process with a time limit, and
prints the compile's seconds and the tuner's records (source, seconds, per key): a compile that
hangs shows as a timeout, one that tunes as the seconds it took. Run on a GPU machine::

  PYTHONPATH=$PWD python3 benchmarks/probes/tune_in_jit_gpu.py --timeout 120
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time
import jax, jax.numpy as jnp
import jaxpool
from jaxpool._src.pallas.tuning import tuner as tuning
shape = tuple(int(n) for n in sys.argv[1].split("x"))
x = jnp.ones(shape, jnp.bfloat16)
loss = lambda v: jaxpool.max_pool(v, (2, 2), (2, 2)).astype(jnp.float32).sum()
print("device", jax.devices()[0].device_kind, "tune mode", tuning.mode(), flush=True)
t0 = time.perf_counter()
compiled = jax.jit(jax.grad(loss)).lower(x).compile()
print(f"compile with tuning: {time.perf_counter() - t0:.1f} s", flush=True)
for r in tuning.report():
  print(f"  {r.key}: {r.source}, {r.seconds:.1f} s, launch {r.launch}", flush=True)
t0 = time.perf_counter()
jax.block_until_ready(compiled(x))
print(f"first run: {time.perf_counter() - t0:.2f} s", flush=True)
"""


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="64x224x224x64", help="NHWC, 'x'-separated")
  parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the child")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as cache:
    env = dict(os.environ, JAXPOOL_TUNE="auto", JAXPOOL_CACHE_DIR=cache,
               XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, args.shape], env=env,
                            start_new_session=True)
    try:
      code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      proc.wait()
      print(f"TIMED OUT after {args.timeout:.0f} s (the compile with tuning did not finish)",
            flush=True)
      return 1
  print(f"child exit {code} after {time.perf_counter() - t0:.1f} s", flush=True)
  return code


if __name__ == "__main__":
  sys.exit(main())
