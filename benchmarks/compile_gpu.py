"""How long the Triton max-pool kernels take to compile and run, by window size (a GPU).

For each square window (stride = window, 64x56x56x256 float32), times the first call (trace,
lowering, Triton's compile and one run) and a later call of the forward, the forward with taps
and the backward kernel, each in its own jit. Prints one line per kernel as it goes.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402

shape = (64, 56, 56, 256)
for k in [int(a) for a in sys.argv[1:]] or [4, 5, 7, 8]:
  geom = windows.make_geometry(shape, (k, k), (k, k), 0)
  x = jnp.ones(shape, jnp.float32)
  y, taps = jax.jit(lambda a, g=geom: pk.max_forward_taps(a, g, interpret=False))(x)
  for name, fn, args in [
      ("fwd", lambda a, g=geom: pk.max_forward(a, g, interpret=False), (x,)),
      ("fwd_taps", lambda a, g=geom: pk.max_forward_taps(a, g, interpret=False), (x,)),
      ("bwd", lambda i, d, g=geom: pk.max_backward(i, d, shape, g, interpret=False), (taps, y))]:
    f = jax.jit(fn)
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    print(f"{k}x{k} ({k * k} taps) {name}: first call {first:.1f} s, then "
          f"{(time.perf_counter() - t0) * 1e3:.3f} ms", flush=True)
