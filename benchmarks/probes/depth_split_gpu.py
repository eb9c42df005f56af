"""Probe: where a depth-split pooling gradient's time goes on several GPUs.

The max pool's gradient (3x3x3/s2/p1 on 2x128x128x128x32, float32 and bfloat16) chained ten to
a program as in ``benchmarks/multi_gpu.py``'s pool part, on one GPU, with the batch split and
with the depth split over every GPU (an Auto mesh): the time per gradient, the compiled
program's collectives, and from a profile (``vgg_overlap_gpu.profile``) per GPU and gradient
the time its kernels keep it busy, the collectives' time and the longest kernels, and whether
every gradient has one GPU's bits (``--op avg_pool``: the average pool's; ``--consume``: each
gradient feeds the next call, as in a training step; ``--with-copy``: the depth split's
backward also as it ran before its in-place path; ``--plain-concat``: the depth split also with
each halo joined to its block by XLA's concatenation along the split dim, as before
``halo.join``). Prints one
JSON line a case; ``--out`` appends them to a file::

  PYTHONPATH=$PWD python benchmarks/probes/depth_split_gpu.py --out depth_split.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vgg_overlap_gpu import emit, median_ms, profile  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool._src.pallas.sharding import halo  # noqa: E402
from jaxpool._src.pallas.sharding import halo_inplace  # noqa: E402

CHAIN = 10


@contextlib.contextmanager
def _copy_path(on: bool):
  """With ``on``, the depth split's backward takes the copy path (no in-place plan)."""
  saved = halo_inplace._grad_plan
  if on:
    halo_inplace._grad_plan = lambda *args: None
  try:
    yield
  finally:
    halo_inplace._grad_plan = saved


@contextlib.contextmanager
def _plain_join(on: bool):
  """With ``on``, halos are joined to their blocks by one concatenation along the split dim."""
  saved = halo.join
  if on:
    halo.join = lambda parts, axis: (
        parts[0] if len(parts) == 1 else jax.lax.concatenate(parts, axis))
  try:
    yield
  finally:
    halo.join = saved


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--size", type=int, default=128)
  ap.add_argument("--op", default="max_pool")
  ap.add_argument("--out", default="")
  ap.add_argument("--consume", action="store_true",
                  help="each gradient feeds the next call's cotangent (a strided slice of it "
                       "added in), as a training step consumes a gradient; only the last is "
                       "returned")
  ap.add_argument("--with-copy", action="store_true",
                  help="a fourth row, the depth split with each device's cotangent rows "
                       "copied with their halo (the max pool's path before its in-place one; "
                       "the average pool's gradient takes that path anyway)")
  ap.add_argument("--plain-concat", action="store_true",
                  help="a row more: the depth split with XLA's concatenation along the split "
                       "dim joining each halo to its block")
  a = ap.parse_args()
  shape = (2, a.size, a.size, a.size, 32)
  kw = dict(window_shape=(3, 3, 3), strides=(2, 2, 2), padding=1)
  pool = getattr(jaxpool, a.op)
  m = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(0)
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    y_shape = jax.eval_shape(lambda v: pool(v, **kw), x).shape
    dys = [jnp.asarray(rng.standard_normal(y_shape), dtype) for _ in range(CHAIN)]

    def chain(v, *ds):
      outs = []
      for k, d in enumerate(ds):
        if a.consume and k:
          d = d + v[:, ::2, ::2, ::2]
        v = jax.vjp(lambda u: pool(u, **kw), v)[1](d)[0]
        outs.append(v)
      return (outs[-1],) if a.consume else tuple(outs)

    ref = None
    splits = [("one GPU", None), ("batch", P("d")), ("depth", P(None, "d"))]
    if a.with_copy:
      splits.append(("depth, copy", P(None, "d")))
    if a.plain_concat:
      splits.append(("depth, plain concat", P(None, "d")))
    for split, spec in splits:
      dev = jax.devices()[0] if spec is None else NamedSharding(m, spec)
      args = [jax.device_put(v, dev) for v in (x, *dys)]
      with _copy_path(split.endswith("copy")), _plain_join(split.endswith("plain concat")):
        # (a function of its own each split: JAX would reuse the depth split's program)
        compiled = jax.jit(lambda *v: chain(*v)).lower(*args).compile()
      outs = [np.asarray(o.astype(jnp.float32)) for o in compiled(*args)]
      ref = outs if ref is None else ref
      same = all(np.array_equal(o.view(np.uint32), r.view(np.uint32)) for o, r in zip(outs, ref))
      text = compiled.as_text()
      ms = median_ms(compiled, args, reps=15)
      prof = profile(compiled, args, steps=3, top=8)
      per_grad = {dev: {k: (round(v / CHAIN, 4) if isinstance(v, float) else v)
                        for k, v in d.items() if k != "top_kernels_ms"}
                  | {"top_kernels_ms": {n: round(t / CHAIN, 4)
                                        for n, t in d.get("top_kernels_ms", {}).items()}}
                  for dev, d in prof.items()}
      row = dict(op=a.op, dtype=jnp.dtype(dtype).name, split=split,
                 devices=1 if spec is None else jax.device_count(),
                 ms_per_grad=ms / CHAIN, equal_to_one_gpu=same,
                 consume=a.consume,
                 collective_permutes=len(re.findall(
                   r"= [^\n]*? collective-permute(?:-start)?\(", text)),
                 conditionals=text.count(" conditional("), profile_per_grad=per_grad)
      emit(row, a.out)


if __name__ == "__main__":
  main()
