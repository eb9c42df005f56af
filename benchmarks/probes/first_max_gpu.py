"""What the global max pool's index pass costs, in the library's two forms and one more.

``jaxpool.global_max_pool`` differentiates through ``adaptive_xla.first_max``, the maximum and the
index of its first occurrence, in one of two forms (all compare ``dtypes.order_key``, integers
in the order of a max pool's scan):

- ``two_pass``: the largest key, then the least index holding it (two plain reductions; what a
  CPU runs);
- ``keyed``: one variadic reduction, ``jnp.argmax`` of the keys (what other platforms run);
- ``keyed_max``: ``keyed`` with the values from ``jnp.max`` instead of a gather at the indices;
- ``keyed32``: ``keyed`` with int32 keys from the float32 values of narrower floats;

against ``x.max(axis=(1, 2))`` with JAX's autodiff. (Runs 9 and 11, `raw/first_max_v9.log`
and `first_max_v11.log`, timed earlier forms of the index pass's test.)

``--shape 128x7x7x2048`` times one shape; ``--long`` takes 90 samples instead of 30;
``--in-jit K`` times K forward + backward passes chained in one jit
(``global_adaptive.chained``) and reports the time per pass: the GPU's time, for cases whose
host-timed calls are bound by launching them (an input that fits in the GPU's L2 cache, 0.1 ms
a call). Rounds alternate the variants. Prints a table and saves
``benchmarks/results/first_max_<backend>[_in_jit<K>].json``.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from global_adaptive import RESULTS, chained, distinct_data, time_all  # noqa: E402
from jaxpool._src import adaptive_xla, dtypes  # noqa: E402

SHAPES = [(128, 7, 7, 2048), (64, 56, 56, 256)]


def _keyed_max(v, axis, index_dtype):
  """``keyed`` with the values from ``jnp.max`` (a reduction XLA may fuse with the argmax's)
  instead of a gather at the indices."""
  idx = jnp.argmax(dtypes.order_key(v), axis=axis).astype(index_dtype)
  return jnp.max(v, axis=axis), idx


def _keyed32(v, axis, index_dtype):
  """``keyed`` with the keys of narrower floats made from their float32 values (int32 keys)."""
  wide = v.astype(jnp.float32) if v.dtype.itemsize < 4 else v
  idx = jnp.argmax(dtypes.order_key(wide), axis=axis).astype(index_dtype)
  return adaptive_xla._at_index(v, idx, axis), idx


FORMS = {"two_pass": adaptive_xla.first_max_two_pass, "keyed": adaptive_xla.first_max_keyed,
         "keyed_max": _keyed_max, "keyed32": _keyed32}


def main() -> None:
  quick = "--quick" in sys.argv
  chain = int(sys.argv[sys.argv.index("--in-jit") + 1]) if "--in-jit" in sys.argv else 0
  shapes = [(8, 7, 7, 64)] if quick else SHAPES
  if "--shape" in sys.argv:  # e.g. --shape 128x7x7x2048
    shapes = [tuple(int(n) for n in sys.argv[sys.argv.index("--shape") + 1].split("x"))]
  repeats, inner = (3, 1) if quick else (90 if "--long" in sys.argv else 30, 10)
  rows = []
  library_form = adaptive_xla.first_max_keyed
  for shape in shapes:
    for dtype in (jnp.bfloat16, jnp.float32):
      x = distinct_data(shape, dtype)
      dy = jax.random.normal(jax.random.key(1), (shape[0], shape[3]), dtype)
      calls = {}
      for name, form in FORMS.items():
        # first_max calls adaptive_xla.first_max_keyed on a GPU: swapped while the jit traces
        adaptive_xla.first_max_keyed = form

        def run(a, g):
          y, vjp = jax.vjp(lambda v: adaptive_xla.global_max(v, 2, True), a)
          return y, vjp(g)[0]
        fn = chained(run, chain) if chain else jax.jit(run)
        jax.block_until_ready(fn(x, dy))  # traced now, with this form
        calls[name] = (fn, (x, dy))
      adaptive_xla.first_max_keyed = library_form

      def base(a, g):
        y, vjp = jax.vjp(lambda v: v.max(axis=(1, 2)), a)
        return y, vjp(g)[0]
      calls["x.max autodiff"] = (chained(base, chain) if chain else jax.jit(base), (x, dy))
      t = time_all(calls, repeats, inner)
      if chain:
        t = {name: ms / chain for name, ms in t.items()}
      ref = calls["keyed"][0](x, dy)
      for name, ms in t.items():
        out = calls[name][0](x, dy)
        same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                   for a, b in zip(out, ref))
        rows.append(dict(shape=list(shape), dtype=jnp.dtype(dtype).name, variant=name,
                         fwd_bwd_ms=round(ms, 4), same_as_keyed=same))
  print(f"{'shape':<18} {'dtype':<9} {'variant':<15} {'fwd+bwd ms':>10} {'x.max/this':>10}")
  for r in rows:
    base = next(b["fwd_bwd_ms"] for b in rows if b["shape"] == r["shape"]
                and b["dtype"] == r["dtype"] and b["variant"] == "x.max autodiff")
    print(f"{'x'.join(map(str, r['shape'])):<18} {r['dtype']:<9} {r['variant']:<15} "
          f"{r['fwd_bwd_ms']:>10.4f} {base / r['fwd_bwd_ms']:>10.2f}")
  os.makedirs(RESULTS, exist_ok=True)
  tag = ("_quick" if quick else "") + (f"_in_jit{chain}" if chain else "")
  path = os.path.join(RESULTS, f"first_max_{jax.default_backend()}{tag}.json")
  with open(path, "w") as f:
    json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind), rows=rows), f,
              indent=1)
  print("saved", path)


if __name__ == "__main__":
  main()
