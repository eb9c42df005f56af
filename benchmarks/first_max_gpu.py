"""What the global max pool's index pass costs, with four forms of its test.

``jaxpool.global_max_pool`` differentiates through ``adaptive.first_max``: one reduction for the
max, then one for the least index whose element is the max. The second reduction tests each
element against the max with ``dtypes.same_value`` (equal with the same sign, or both NaN). This
script times the global max pool's forward + backward (``jax.vjp``) with that test written four
ways, against ``x.max(axis=(1, 2))`` with JAX's autodiff:

- ``same_value``: what the library does;
- ``bits``: equal bit patterns, or both NaN (the same answer: equal floats with the same sign
  have the same bits);
- ``f32``: ``same_value`` on the values converted to float32;
- ``eq``: plain ``==``, the cost floor (it gets ``-0.0`` against ``+0.0`` wrong).

Rounds alternate the variants. Prints a table and saves
``benchmarks/results/first_max_<backend>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from global_adaptive import RESULTS, distinct_data, time_all  # noqa: E402
from jaxpool._src import adaptive, dtypes  # noqa: E402

SHAPES = [(128, 7, 7, 2048), (64, 56, 56, 256)]


def _bits_rule(a, b):
  if not jnp.issubdtype(a.dtype, jnp.floating):
    return a == b
  as_int = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[dtypes.bits(a.dtype)]
  same = lax.bitcast_convert_type(a, as_int) == lax.bitcast_convert_type(b, as_int)
  return same | (jnp.isnan(a) & jnp.isnan(b))


def _f32_rule(a, b):
  return dtypes.same_value(a.astype(jnp.float32), b.astype(jnp.float32))


VARIANTS = {"same_value": dtypes.same_value, "bits": _bits_rule, "f32": _f32_rule,
            "eq": lambda a, b: a == b}


def main() -> None:
  quick = "--quick" in sys.argv
  shapes = [(8, 7, 7, 64)] if quick else SHAPES
  repeats, inner = (3, 1) if quick else (30, 10)
  rows = []
  for shape in shapes:
    for dtype in (jnp.bfloat16, jnp.float32):
      x = distinct_data(shape, dtype)
      dy = jax.random.normal(jax.random.key(1), (shape[0], shape[3]), dtype)
      calls = {}
      for name, rule in VARIANTS.items():
        adaptive.same_value = rule  # read when the jit below traces

        def run(a, g):
          y, vjp = jax.vjp(lambda v: adaptive._global_max(v, 2, True), a)
          return y, vjp(g)[0]
        fn = jax.jit(run)
        jax.block_until_ready(fn(x, dy))  # traced now, with this rule
        calls[name] = (fn, (x, dy))

      def base(a, g):
        y, vjp = jax.vjp(lambda v: v.max(axis=(1, 2)), a)
        return y, vjp(g)[0]
      calls["x.max autodiff"] = (jax.jit(base), (x, dy))
      adaptive.same_value = dtypes.same_value
      t = time_all(calls, repeats, inner)
      ref = calls["same_value"][0](x, dy)
      for name, ms in t.items():
        out = calls[name][0](x, dy)
        same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                   for a, b in zip(out, ref))
        rows.append(dict(shape=list(shape), dtype=jnp.dtype(dtype).name, variant=name,
                         fwd_bwd_ms=round(ms, 4), same_as_library=same))
  print(f"{'shape':<18} {'dtype':<9} {'variant':<15} {'fwd+bwd ms':>10} {'x.max/this':>10}")
  for r in rows:
    base = next(b["fwd_bwd_ms"] for b in rows if b["shape"] == r["shape"]
                and b["dtype"] == r["dtype"] and b["variant"] == "x.max autodiff")
    print(f"{'x'.join(map(str, r['shape'])):<18} {r['dtype']:<9} {r['variant']:<15} "
          f"{r['fwd_bwd_ms']:>10.4f} {base / r['fwd_bwd_ms']:>10.2f}")
  os.makedirs(RESULTS, exist_ok=True)
  path = os.path.join(RESULTS, f"first_max_{jax.default_backend()}{'_quick' if quick else ''}.json")
  with open(path, "w") as f:
    json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind), rows=rows), f,
              indent=1)
  print("saved", path)


if __name__ == "__main__":
  main()
