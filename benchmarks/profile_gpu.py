"""Each Triton pooling kernel, called twice, on the cases of ``benchmarks/pooling_gpu.py``, for a
profiler.

Run under Nsight Compute on a GPU machine from the repository root, e.g.::

  ncu -k regex:jaxpool --metrics gpu__time_duration.sum,dram__bytes.sum,lts__t_bytes.sum \\
    python3 benchmarks/profile_gpu.py [--cases 3x3x3]

Each kernel (the max forward, with its taps, the max backward, the average forward and
backward) runs twice
(the first call compiles): profile the second (``--launch-skip 1`` per kernel name, or read
the last rows). ``--cases a,b``: the cases whose name contains a or b; ``--dtypes bfloat16``:
only those dtypes.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pooling_gpu as bench  # noqa: E402
from jaxpool._src import windows  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402


def main() -> None:
  want = sys.argv[sys.argv.index("--cases") + 1].split(",") if "--cases" in sys.argv else [""]
  kinds = sys.argv[sys.argv.index("--dtypes") + 1].split(",") if "--dtypes" in sys.argv else None
  for name, shape, window, strides, padding, data_format, dtypes in bench.CASES:
    if not any(w in name for w in want):
      continue
    for dtype in dtypes:
      if kinds is not None and dtype not in kinds:
        continue
      x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
      geom = windows.make_geometry(shape, window, strides, padding, data_format=data_format)
      fwd = jax.jit(lambda a, g=geom: pk.max_forward(a, g, interpret=False))
      taps = jax.jit(lambda a, g=geom: pk.max_forward_taps(a, g, interpret=False))
      bwd = jax.jit(lambda i, d, g=geom, s=shape: pk.max_backward(i, d, s, g, interpret=False))
      avg = jax.jit(lambda a, g=geom: pk.avg_forward(a, g, interpret=False,
                                                     count_include_pad=True,
                                                     divisor_override=None))
      avg_bwd = jax.jit(lambda d, g=geom, s=shape: pk.avg_backward(
          d, s, g, interpret=False, count_include_pad=True, divisor_override=None))
      for _ in range(2):
        jax.block_until_ready(fwd(x))
        y, i = jax.block_until_ready(taps(x))
        jax.block_until_ready(bwd(i, y))
        jax.block_until_ready(avg(x))
        jax.block_until_ready(avg_bwd(y))
      print(name, dtype, flush=True)


if __name__ == "__main__":
  main()
