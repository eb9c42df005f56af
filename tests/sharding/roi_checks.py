"""``roi_align``'s per-image form on a batch-sharded mesh, against one device.

Run it in its own process with 8 CPU devices (tests/sharding/test_roi_sharding.py does)::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding/roi_checks.py

Features ``(8, H, W, C)``, boxes ``(8, K, 4)`` and their mask ``(8, K)`` split along the batch
over a mesh axis of 8 devices: under ``jit`` (``NamedSharding`` inputs) and under ``shard_map``;
the forward and the gradients for the features and the boxes (average and max over the samples,
fixed and adaptive sampling), and the box gradient of the adaptive count's sampling plan alone.
Each check prints one JSON line ``{"name": ..., "ok": bool,
"detail": ...}`` and asserts that the results equal one device's bit for bit, stay split along
the batch, and that the compiled program has no collective at all (no all-gather of the
features, no all-reduce, all-to-all or collective-permute). With ``--before-fix`` it checks the
flat ``(K, 5)`` form of the same boxes instead, which the partitioner cannot split (the
features are gathered): the check can fail.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpool
from jaxpool._src.roi.plan import AlignConfig, Level, align_plan

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
               "reduce-scatter")


def collectives(compiled) -> list[str]:
  """The compiled program's collectives, each as ``"op shape"``, but for an all-reduce of a
  scalar (a batched loop's condition: whether any image's loop goes on)."""
  found = set()
  for line in compiled.as_text().splitlines():
    for c in COLLECTIVES:
      m = re.search(rf"= (\S+) {c}(-start)?\(", line)
      if m and not (c == "all-reduce" and m.group(1) in ("pred[]", "s32[]")):
        found.add(f"{c} {m.group(1)}")
  return sorted(found)


def case(rng, B=8, K=6, H=13, W=11, C=4):
  x = rng.standard_normal((B, H, W, C)).astype(np.float32)
  xy = rng.uniform(-2, 12, (B, K, 2))
  wh = rng.uniform(0.5, 8, (B, K, 2))
  boxes = np.concatenate([xy, xy + wh], -1).astype(np.float32)
  mask = rng.uniform(size=(B, K)) < 0.7
  boxes[~mask] = np.nan  # padding rows: any value
  return x, boxes, mask


def main() -> int:
  flat_form = "--before-fix" in sys.argv
  devices = jax.devices()
  assert len(devices) >= 8, f"needs 8 devices, got {len(devices)}"
  mesh = jax.sharding.Mesh(np.array(devices[:8]), ("b",))
  rng = np.random.default_rng(0)
  x, boxes, mask = case(rng)
  live = np.argwhere(mask)
  rows = np.concatenate([live[:, :1], boxes[live[:, 0], live[:, 1]]], 1).astype(np.float32)
  ok_all = True
  for name, kw in (("avg_ratio2", dict(sampling_ratio=2)),
                   ("avg_adaptive", dict(sampling_ratio=-1, max_samples=4, aligned=True)),
                   ("max_ratio2", dict(sampling_ratio=2, mode="max"))):
    def pool(v, b, m, kw=kw):
      if flat_form:
        return jaxpool.roi_align(v, b, (3, 2), spatial_scale=0.9, **kw)
      return jaxpool.roi_align(v, b, (3, 2), spatial_scale=0.9, mask=m, **kw)

    def fwd_grad(v, b, m, g, pool=pool):
      y, vjp = jax.vjp(lambda v, b: pool(v, b, m), v, b)
      return (y, *vjp(g))

    b_in = rows if flat_form else boxes
    g = rng.standard_normal((len(rows), 3, 2, 4) if flat_form else (8, 6, 3, 2, 4))
    g = g.astype(np.float32)
    one = jax.jit(fwd_grad)(x, b_in, mask, g)
    spec = P("b")
    shard = NamedSharding(mesh, spec)
    rows_shard = NamedSharding(mesh, P(None)) if flat_form else shard  # (K, 5): not per image
    args = (jax.device_put(x, shard), jax.device_put(b_in, rows_shard),
            jax.device_put(mask, shard), jax.device_put(g, rows_shard))
    for how in ("jit", "shard_map"):
      if how == "jit":
        fn = jax.jit(fwd_grad)
      else:
        if flat_form:
          continue
        fn = jax.jit(jax.shard_map(fwd_grad, mesh=mesh, in_specs=(spec,) * 4,
                                   out_specs=(spec, spec, spec)))
      compiled = fn.lower(*args).compile()
      got = compiled(*args)
      differ = [int((np.asarray(a) != np.asarray(b)).sum()) for a, b in zip(got, one, strict=True)]
      same = not any(differ)
      split = all(len({str(s.index) for s in g.addressable_shards}) == 8 for g in got)
      moved = collectives(compiled)
      ok = same and split and not moved
      ok_all &= ok
      detail = {"elements_differing": differ, "split": split, "collectives": moved}
      print(json.dumps({"name": f"{how}/{name}", "ok": ok, "detail": detail}), flush=True)
  if not flat_form:
    ok_all &= plan_check(mesh, boxes)
    ok_all &= kernel_checks(mesh, x, boxes, mask)
    ok_all &= explicit_checks(devices, x, boxes, mask, rows)
  return 0 if ok_all else 1


def explicit_checks(devices, x, boxes, mask, rows) -> bool:
  """An Explicit mesh splitting the maps (and the per-image boxes) along the batch: each ROI
  function reads its inputs whole (``api.unsplit``) and gives one device's values and
  gradients (to float32 rounding: another program), the features' gradient split as the maps.
  Before, every form failed to trace (the gathers' output sharding was ambiguous)."""
  mesh = jax.make_mesh((8,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices[:8])
  maps = [x, x[:, ::2, ::2]]
  calls = {
      "roi_align_rows": lambda v, m: jaxpool.roi_align(v[0], rows, 2, sampling_ratio=2),
      "roi_align_per_image": lambda v, m: jaxpool.roi_align(v[0], boxes, 2, sampling_ratio=2,
                                                             mask=m),
      "roi_align_max_rows": lambda v, m: jaxpool.roi_align(v[0], rows, 2, sampling_ratio=2,
                                                            mode="max"),
      "roi_pool_rows": lambda v, m: jaxpool.roi_pool(v[0], rows, 2),
      "multi_scale_rows": lambda v, m: jaxpool.multi_scale_roi_align(
          v, rows, [(13, 11)] * 8, 2, sampling_ratio=2, canonical_scale=4.0),
  }
  ok_all = True
  for name, f in calls.items():
    def fwd_grad(v, m, f=f):
      y, vjp = jax.vjp(lambda u: f(u, m), v)
      return y, vjp(jnp.ones_like(y))[0]

    one = jax.jit(fwd_grad)(maps, mask)
    try:
      with jax.set_mesh(mesh):
        split = NamedSharding(mesh, P("b"))
        got = jax.jit(fwd_grad)([jax.device_put(m, split) for m in maps],
                                jax.device_put(mask, split))
      flat = lambda t: [np.asarray(a) for a in jax.tree.leaves(t)]  # noqa: E731
      same = all(np.allclose(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
                 for a, b in zip(flat(got), flat(one), strict=True))
      grad_split = all(len({str(s.index) for s in g.addressable_shards}) == 8 for g in got[1])
      ok, detail = same and grad_split, {"same": same, "gradient_split": grad_split}
    except Exception as e:  # (a failure to trace is the check failing)
      ok, detail = False, {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    ok_all &= ok
    print(json.dumps({"name": f"explicit/{name}", "ok": ok, "detail": detail}), flush=True)
  return ok_all


def kernel_checks(mesh, x, boxes, mask) -> bool:
  """``implementation="pallas"`` (the GPU kernels, interpreted here): on one device the
  per-image form runs the kernels; on a batch-sharded mesh under ``jit`` the kernels split with
  the batch, each device running them on its images (one device's bits, split, no
  collective); inside ``shard_map``, interpreted, the XLA form (the XLA path's bits; compiled
  on a GPU, the kernels on each block: tests/roi/test_roi_per_image.py's GPU tests)."""
  g = np.random.default_rng(7).standard_normal((8, 6, 3, 2, 4)).astype(np.float32)

  def fwd_grad(impl):
    def run(v, b, m, g):
      pool = lambda v, b: jaxpool.roi_align(v, b, (3, 2), spatial_scale=0.9, sampling_ratio=2,
                                            mask=m, implementation=impl)
      y, vjp = jax.vjp(pool, v, b)
      return (y, *vjp(g))
    return run

  on_xla = jax.jit(fwd_grad("xla"))(x, boxes, mask, g)
  # (one device: the kernels, whose feature gradient adds each pixel's terms in another order)
  on_kernels = jax.jit(fwd_grad("pallas"))(x, boxes, mask, g)
  same = [bool((np.asarray(a) == np.asarray(b)).all())
          for a, b in zip(on_kernels, on_xla, strict=True)]
  ran_kernels = same[0] and not same[1]
  print(json.dumps({"name": "one_device/avg_ratio2_kernels", "ok": ran_kernels,
                    "detail": {"same_as_the_xla_path": same}}), flush=True)
  spec = P("b")
  shard = NamedSharding(mesh, spec)
  args = tuple(jax.device_put(a, shard) for a in (x, boxes, mask, g))
  ok_all = ran_kernels
  for how, fn, want in (
      ("jit", jax.jit(fwd_grad("pallas")), on_kernels),
      ("shard_map", jax.jit(jax.shard_map(fwd_grad("pallas"), mesh=mesh, in_specs=(spec,) * 4,
                                          out_specs=(spec, spec, spec))), on_xla)):
    compiled = fn.lower(*args).compile()
    got = compiled(*args)
    differ = [int((np.asarray(a) != np.asarray(b)).sum()) for a, b in zip(got, want, strict=True)]
    split = all(len({str(s.index) for s in r.addressable_shards}) == 8 for r in got)
    moved = collectives(compiled)
    ok = not any(differ) and split and not moved
    ok_all &= ok
    detail = {"elements_differing": differ, "split": split, "collectives": moved}
    print(json.dumps({"name": f"{how}/avg_ratio2_kernels", "ok": ok, "detail": detail}),
          flush=True)
  return ok_all


def plan_check(mesh, boxes) -> bool:
  """The box gradient through the adaptive sample count's plan alone (the derivative of the
  sample positions, which divide by each box's sample count), split along the batch against
  one device: XLA rewrote that division into a product with the inverse in one program and
  not the other (5 elements differed), before the divisor went behind a barrier."""
  N, K = boxes.shape[:2]
  cfg = AlignConfig((3, 2), (Level(1, 13, 11, 0.9, 0),), -1, (4, 4), True, "avg")
  rng = np.random.default_rng(3)
  gy = rng.standard_normal((N, K, 3, 4, 2)).astype(np.float32)
  gx = rng.standard_normal((N, K, 2, 4, 2)).astype(np.float32)

  def box_grad(coords, gy, gx):
    def weights(c):
      zeros = jnp.zeros(N * K, jnp.int32)
      ops = align_plan(zeros, c.reshape(N * K, 4), zeros, cfg)[0]
      return ops["wy"].reshape(gy.shape), ops["wx"].reshape(gx.shape)

    return jax.vjp(weights, coords)[1]((gy, gx))[0]

  one = np.asarray(jax.jit(box_grad)(boxes, gy, gx))
  shard = NamedSharding(mesh, P("b"))
  got = jax.jit(box_grad)(*(jax.device_put(a, shard) for a in (boxes, gy, gx)))
  differ = int((np.asarray(got) != one).sum())
  ok = differ == 0
  print(json.dumps({"name": "jit/adaptive_plan_box_gradient", "ok": ok,
                    "detail": {"elements_differing": differ}}), flush=True)
  return ok


if __name__ == "__main__":
  sys.exit(main())
