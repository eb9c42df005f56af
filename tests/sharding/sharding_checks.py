"""Sharded runs of every jaxpool op, compared with one device.

Run it in its own process: by default with 8 CPU devices (what the test runs)::

  python tests/sharding/sharding_checks.py [--quick]

or on the devices the process has, 2 or more GPUs say (the Pallas kernels then compiled, not
interpreted)::

  python tests/sharding/sharding_checks.py --devices-as-is [--quick]

(``JAXPOOL_CHECK_DEVICES=as-is`` does the same, and makes tests/sharding/test_sharding.py run it so:
``JAXPOOL_CHECK_DEVICES=as-is python -m pytest -q tests/sharding/test_sharding.py``). The meshes are
``(4, 2)`` on 8 devices (or more: the first 8), ``(2, 2)`` on 4 and ``(2, 1)`` on 2
(``device_checks.mesh_shape``); every check runs on each, the ``"model"`` axis splitting nothing
on 2. The summary line says the platform, the devices and the mesh.

Each check prints one JSON line ``{"name": ..., "ok": bool, "detail": ...}``; the pytest side
turns each line into a test. A check compares, for one op and one layout:

* ``jit`` with ``NamedSharding`` inputs (batch on one mesh axis, channels on the other, or
  batch only) against the same call on unsharded, single-device inputs: results must be equal
  bit for bit (pooling never reduces over the batch or channel dims, so sharding them changes no
  arithmetic);
* that the output keeps the input's sharding, and that the compiled program moves no data
  between devices (no all-gather, all-to-all, all-reduce or collective-permute) where the
  pooled dims are not sharded;
* the same op inside ``shard_map`` (each device pools its own block);
* spatially sharded inputs (XLA inserts the halo exchange): equal, communication allowed.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import device_checks  # noqa: E402  (tests/support: run as a script, it is not on the path)

device_checks.prepare(sys.argv)  # 8 CPU devices, unless --devices-as-is

import functools  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpool  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")

RESULTS: list[dict] = []

# `--quick` (what `make test` runs): channels_last on the Explicit mesh and in shard_map, every
# op; spatial sharding, data parallelism, vmap(grad), the Pallas kernels and the graph. The
# Auto mesh, channels_first and the 1-D and 3-D checks run without it (`make test-all`).
QUICK = "--quick" in sys.argv

if jax.default_backend() == "gpu":
  # Full float32 matmuls and convolutions (no TF32): the graph checks compare a sharded network
  # with one device to float32 rounding, and a convolution over a smaller batch may pick
  # another algorithm.
  jax.config.update("jax_default_matmul_precision", "highest")


def check(name):
  return device_checks.check(name, results=RESULTS)


def _rng(key):
  """A NumPy generator from a seed (or a JAX key's data). (NumPy, not ``jax.random``: each
  ``jax.random`` call on a new shape compiles a program, a second each on 8 CPU devices.)"""
  if not isinstance(key, int):
    key = np.asarray(jax.random.key_data(key)).tolist()
  return np.random.default_rng(key)


def tie_rich(key, shape, dtype=jnp.float32):
  """Small integers: many ties, so a wrong tie-break would show."""
  return jnp.asarray(_rng(key).integers(-4, 5, shape), dtype)


def unique(key, shape, dtype=jnp.float32):
  """Distinct values (a permutation of ``0 .. size - 1``, divided by 7)."""
  return jnp.asarray(_rng(key).permutation(math.prod(shape)).reshape(shape), dtype) / 7.0


def assert_equal(a, b, what):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b), what
  for u, v in zip(a, b, strict=True):
    u, v = np.asarray(u), np.asarray(v)
    assert u.shape == v.shape and u.dtype == v.dtype, f"{what}: {u.shape}/{u.dtype} vs {v.shape}"
    if not np.array_equal(u, v, equal_nan=True):
      bad = np.argwhere(~((u == v) | (np.isnan(u) & np.isnan(v))))
      raise AssertionError(f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}: "
                           f"{u[tuple(bad[0])]} vs {v[tuple(bad[0])]}")


def collectives(hlo: str) -> list[tuple[str, int]]:
  """``(op, elements)`` of every collective instruction in an HLO module's text."""
  return device_checks.collectives(hlo, COLLECTIVES)


def run_sharded(fn, args, specs, mesh, *, expect_no_comm=True, out_spec=None, single=None):
  """``jit(fn)`` on inputs placed with ``specs``, compared with ``fn`` on one device."""
  if single is None:
    single = jax.jit(fn)(*args)
  placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
  compiled = jax.jit(fn).lower(*placed).compile()
  out = compiled(*placed)
  assert_equal(out, single, "sharded vs one device")
  if out_spec is not None:
    for leaf in jax.tree.leaves(out):
      want = NamedSharding(mesh, out_spec)
      assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (
          f"output sharding {leaf.sharding} is not {want}")
  comm = collectives(compiled.as_text())
  if expect_no_comm:
    # A scalar may move (XLA:CPU's fusion barrier reads one argmax element as its predicate);
    # an array may not.
    big = [c for c in comm if c[1] > 1]
    assert not big, f"compiled program moves arrays between devices: {big}"
    return f"scalar collectives: {comm}" if comm else ""
  return f"collectives: {comm}"


def run_shard_map(fn, args, specs, out_specs, mesh, *, single=None):
  """``fn`` applied blockwise inside ``shard_map`` against ``fn`` on the whole array."""
  if single is None:
    single = jax.jit(fn)(*args)
  mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs))
  placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
  assert_equal(mapped(*placed), single, "shard_map vs one device")


def with_spatial(shape, fmt, *spatial):
  """``shape`` with its spatial dims replaced by ``spatial``."""
  n = len(spatial)
  if fmt == "channels_last":
    return (*shape[:-n - 1], *spatial, shape[-1])
  return (*shape[:-n], *spatial)


# The ops that the second mesh (Auto) and the second layout (channels_first) check; channels_last
# on the Explicit mesh and in shard_map checks all twelve.
SUBSET = ("max_pool_ceil_dilated", "avg_pool_exclude_pad_ceil", "max_pool_with_indices",
          "max_unpool", "max_pool_grad", "avg_pool_grad", "lp_pool_grad")


def layout_checks(fmt, shape, spec_bc, spec_b, mesh, auto, keys):
  """The ops in one layout: jit on Explicit and Auto meshes, shard_map, spatial sharding."""
  k1, k2, k3, k4 = keys
  H, W = with_spatial_of(shape, fmt)
  cfg = dict(window_shape=(3, 3), strides=(2, 2), padding=1)
  x = tie_rich(k1, shape)
  xu = unique(k2, shape)
  kw = dict(cfg, data_format=fmt)
  y_shape = jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw), x).shape
  dy = tie_rich(k3, y_shape)

  ops = {
      "max_pool": (lambda x: jaxpool.max_pool(x, **kw), (x,)),
      "max_pool_ceil_dilated": (
          lambda x: jaxpool.max_pool(x, (2, 2), (2, 2), "SAME", dilation=(2, 1),
                                     ceil_mode=True, data_format=fmt), (x,)),
      "avg_pool": (lambda x: jaxpool.avg_pool(x, **kw), (xu,)),
      "avg_pool_exclude_pad_ceil": (
          lambda x: jaxpool.avg_pool(x, **kw, ceil_mode=True, count_include_pad=False), (xu,)),
      "lp_pool_p3": (lambda x: jaxpool.lp_pool(x, 3.0, **kw), (xu,)),
      "max_pool_with_indices": (lambda x: jaxpool.max_pool_with_indices(x, **kw), (x,)),
      "max_unpool": (
          lambda x: jaxpool.max_unpool(*jaxpool.max_pool_with_indices(x, **kw),
                                       (H, W), data_format=fmt), (x,)),
      "max_pool_grad": (lambda x, dy: jaxpool.max_pool_grad(x, dy, **kw), (x, dy)),
      "jvp_max_pool": (
          lambda x, t: jax.jvp(lambda v: jaxpool.max_pool(v, **kw), (x,), (t,)), (x, xu)),
      # input_shape from dy's own batch/channel dims: inside shard_map they are the block's.
      "avg_pool_grad": (lambda dy: jaxpool.avg_pool_grad(dy, with_spatial(dy.shape, fmt, H, W),
                                                         **kw), (dy,)),
      "lp_pool_grad": (lambda x, dy: jaxpool.lp_pool_grad(x, dy, 2.5, **kw), (xu, dy)),
      "grad_avg_pool": (
          lambda x, dy: jax.grad(lambda v: jnp.sum(jaxpool.avg_pool(v, **kw) * dy))(x),
          (xu, dy)),
  }
  every = fmt == "channels_last"
  for name, (fn, args) in ops.items():
    # (To keep `make test` fast: every op on the Explicit mesh and in shard_map in
    # channels_last; the Auto mesh and channels_first (jit and shard_map) take SUBSET, the ops
    # with the most index arithmetic (ceil mode, dilation, indices, scatters, gradients); the
    # plain forward ops that it leaves out run in those same layouts inside them. Batch-only
    # sharding is covered by the 1-D, 3-D and data-parallel checks below.)
    if not (every or name in SUBSET):
      continue
    single = jax.jit(fn)(*args)
    # Every op keeps the batch and channel dims where they were: its outputs keep the spec.
    meshes = (("explicit/batch+channels", mesh, spec_bc),)
    if every and name in SUBSET and not QUICK:
      meshes += (("auto/batch+channels", auto, spec_bc),)
    for tag, m, spec in meshes:
      check(f"jit/{fmt}/{tag}/{name}")(functools.partial(
          run_sharded, fn, args, [spec] * len(args), m, out_spec=spec, single=single))
    out_specs = jax.tree.map(lambda _: spec_bc, jax.eval_shape(fn, *args))
    check(f"shard_map/{fmt}/{name}")(functools.partial(
        run_shard_map, fn, args, [spec_bc] * len(args), out_specs, mesh, single=single))

  if fmt != "channels_last":
    return
  # Spatial sharding: rows split over "data" on the Auto mesh (XLA exchanges the halo):
  # equal, communication allowed. (On an Explicit mesh, JAX refuses to pad a sharded dim
  # whose padded size the mesh axis does not divide.)
  spec_h = (P(None, "data", None, "model") if fmt == "channels_last"
            else P(None, "model", "data", None))
  x16 = tie_rich(k4, (2, 16, 8, 4) if fmt == "channels_last" else (2, 4, 16, 8))
  dy16 = tie_rich(k3, jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw), x16).shape)
  check(f"jit/{fmt}/spatial/max_pool")(functools.partial(
      run_sharded, lambda x: jaxpool.max_pool(x, **kw), (x16,), [spec_h], auto,
      expect_no_comm=False))
  check(f"jit/{fmt}/spatial/max_pool_grad")(functools.partial(
      run_sharded, lambda x, dy: jaxpool.max_pool_grad(x, dy, **kw), (x16, dy16),
      [spec_h, spec_h], auto, expect_no_comm=False))
  check(f"jit/{fmt}/spatial/avg_pool")(functools.partial(
      run_sharded, lambda x: jaxpool.avg_pool(x, **kw), (unique(k4, x16.shape),), [spec_h],
      mesh, expect_no_comm=False))


def with_spatial_of(shape, fmt):
  return shape[1:3] if fmt == "channels_last" else shape[2:4]


def main() -> int:
  try:
    mesh_shape = device_checks.mesh_shape(jax.device_count())
  except ValueError as e:
    print(json.dumps(dict(name="devices", ok=False, detail=str(e))))
    return 1
  devices = jax.devices()[:math.prod(mesh_shape)]
  # Explicit axes (sharding in types, make_mesh's default in new JAX) and Auto axes (the
  # compiler propagates shardings): users have both.
  mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                       devices=devices)
  auto = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=devices)
  k1, k2, k3, k4 = 1, 2, 3, 4

  # channels_last (batch, H, W, C) and channels_first (batch, C, H, W); channels sharded too.
  B, H, W, C = 8, 9, 10, 4  # H, W: odd and even, so padding and strides meet both ends
  layouts = {
      "channels_last": ((B, H, W, C), P("data", None, None, "model"), P("data")),
      "channels_first": ((B, C, H, W), P("data", "model", None, None), P("data")),
  }
  for fmt, (shape, spec_bc, spec_b) in layouts.items():
    if QUICK and fmt != "channels_last":
      continue
    layout_checks(fmt, shape, spec_bc, spec_b, mesh, auto, (k1, k2, k3, k4))

  if not QUICK:
    # Two batch dims and 1-D / 3-D pooling, batch sharded over the whole mesh.
    x1 = tie_rich(k1, (4, 2, 11, 6))
    check("jit/1d/two-batch-dims/max_pool+grad")(functools.partial(
        run_sharded,
        lambda x: jax.grad(lambda v: jnp.sum(jaxpool.max_pool(v, (3,), (2,), "SAME") ** 2))(x),
        (x1,), [P("data", "model")], mesh, out_spec=P("data", "model")))
    x3 = tie_rich(k2, (8, 5, 6, 4, 2))
    check("jit/3d/max_pool_with_indices")(functools.partial(
        run_sharded, lambda x: jaxpool.max_pool_with_indices(x, (2, 2, 2), padding=1),
        (x3,), [P("data", None, None, None, "model")], mesh,
        out_spec=P("data", None, None, None, "model")))

  # Data parallel: per-example loss, mean over the sharded batch (the gradient needs one
  # all-reduce of the parameter gradient; the pooled activations never move).
  xs = unique(k1, (16, 8, 8, 2))
  w = unique(k2, (2, 3)) / 100

  def loss(w, x):
    h = jaxpool.max_pool(jnp.tanh(x @ w), (2, 2), (2, 2))
    h = jaxpool.avg_pool(h, (2, 2), padding="SAME", count_include_pad=False)
    return jnp.mean(h ** 2)

  def dp_step(w, x):
    return jax.value_and_grad(loss)(w, x)

  def check_dp():
    single = jax.jit(dp_step)(w, xs)
    out = jax.jit(dp_step)(jax.device_put(w, NamedSharding(mesh, P())),
                           jax.device_put(xs, NamedSharding(mesh, P(("data", "model")))))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(single), strict=True):
      # the mean over the batch is summed in a different order across devices: allclose
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  check("jit/data_parallel/value_and_grad")(check_dp)

  # vmap(grad) per-example gradients inside shard_map.
  def per_example(x):
    return jax.vmap(jax.grad(lambda v: jnp.sum(jaxpool.max_pool(v, (2, 2), padding=1))))(x)
  check("shard_map/vmap_grad_per_example")(functools.partial(
      run_shard_map, per_example, (tie_rich(k3, (8, 6, 6, 2)),), [P("data")], P("data"), mesh))

  # The Pallas kernels (interpreted on a CPU, compiled on a GPU) under an Explicit mesh, inside
  # jax.set_mesh as users write it: the dispatcher runs them once per shard through shard_map.
  # Max: same bits as the XLA path; avg: float rounding.
  xp = tie_rich(k1, (8, 9, 10, 4))
  spec_p = P("data", None, None, "model")

  def pallas_ops(impl):
    kw = dict(window_shape=(3, 3), strides=(2, 2), padding=1, implementation=impl)
    return (
        jax.value_and_grad(lambda v: jnp.sum(jaxpool.max_pool(v, **kw) ** 2)),
        lambda v: jaxpool.max_pool_with_indices(v, **kw),
        jax.grad(lambda v: jnp.sum(jaxpool.avg_pool(v, **kw) ** 2)),
    )

  def check_pallas_explicit():
    placed = jax.device_put(xp, NamedSharding(mesh, spec_p))
    # (One jit per implementation: the max ops share their argmax kernel, compiled once.)
    both = lambda impl: jax.jit(lambda v: [f(v) for f in pallas_ops(impl)]).lower(
        placed).compile()
    with jax.set_mesh(mesh):
      kernels = both("pallas")
      got, want = kernels(placed), both("xla")(placed)
    if jax.default_backend() == "gpu":  # the kernels compiled, not interpreted
      assert device_checks.has_compiled_kernel(kernels.as_text()), "no compiled kernel ran"
    for g, w in zip(got[:2], want[:2], strict=True):
      assert_equal(g, w, "pallas vs xla (max)")
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6, atol=1e-6)
    for leaf in jax.tree.leaves(got):
      if leaf.ndim:  # (the loss is a replicated scalar)
        assert leaf.sharding.spec == spec_p, leaf.sharding
  check("jit/pallas/explicit/batch+channels")(check_pallas_explicit)

  graph_checks(mesh, auto, jax.random.key(4))

  failed = [r["name"] for r in RESULTS if not r["ok"]]
  platform = jax.default_backend()
  print(json.dumps(dict(name="summary", ok=not failed, detail=f"{len(RESULTS)} checks, "
                        f"failed: {failed}; {len(devices)} of {jax.device_count()} "
                        f"{platform} devices, mesh {mesh_shape}", platform=platform,
                        devices=jax.device_count(), devices_used=len(devices),
                        mesh=mesh_shape)),
        flush=True)
  return 1 if failed else 0


def graph_checks(mesh, auto, key):
  """jaxpool.graph (when present): apply and the training graph with a sharded batch."""
  try:
    from jaxpool import graph as jg
  except ImportError:
    return
  image = jg.Input("image", shape=(8, 8, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = jg.ReLU("relu1", jg.Conv("conv1", image, features=4, window=(3, 3), padding="SAME"))
  m = jg.MaxPool("pool1", x, window=(3, 3), strides=(2, 2), padding="SAME")   # 4x4x4
  a = jg.AvgPool("pool2", x, window=(2, 2), strides=(2, 2))                    # 4x4x4
  x = jg.L2Pool("pool3", jg.Add("add", m, a), window=(2, 2), strides=(2, 2))  # 2x2x4
  logits = jg.Dense("logits", x, features=5)
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)
  net, train = jg.Graph(logits), jg.training_graph(loss)
  k1, k2, k3 = jax.random.split(key, 3)
  images = tie_rich(k1, (16, 8, 8, 2)) / 4
  labels = jax.random.randint(k2, (16,), 0, 5)
  params = net.init(k3, image=images)
  close = functools.partial(np.testing.assert_allclose, rtol=2e-5, atol=1e-6)

  def compare(out, single):
    for u, v in zip(jax.tree.leaves(out), jax.tree.leaves(single), strict=True):
      close(np.asarray(u), np.asarray(v))

  def run(fn, m, batch_spec):
    single = jax.jit(fn)(params, images, labels)
    rep = jax.device_put(params, NamedSharding(m, P()))
    out = jax.jit(fn)(rep, jax.device_put(images, NamedSharding(m, batch_spec)),
                      jax.device_put(labels, NamedSharding(m, batch_spec)))
    compare(out, single)

  apply = lambda p, i, lab: net.apply(p, image=i)
  step = lambda p, i, lab: train.run(p, image=i, label=lab)
  for tag, m in (("explicit", mesh), ("auto", auto))[:1 if QUICK else 2]:
    check(f"graph/{tag}/apply")(functools.partial(run, apply, m, P(("data", "model"))))
    check(f"graph/{tag}/training_graph")(functools.partial(run, step, m, P(("data", "model"))))

  def dp_step(p, i, lab):
    # Each device: its block's mean loss and gradients. The parameters are replicated, so JAX
    # already sums their gradients over the devices (the transpose of the implicit broadcast);
    # the mean over equal blocks is that sum / devices.
    loss, grads = train.run(p, image=i, label=lab)
    n = mesh.size
    return jax.lax.pmean(loss, ("data", "model")), jax.tree.map(lambda g: g / n, grads)

  def check_shard_map():
    single = jax.jit(step)(params, images, labels)
    mapped = jax.jit(jax.shard_map(dp_step, mesh=mesh, in_specs=(P(), P(("data", "model")),
                                                                 P(("data", "model"))),
                                   out_specs=P()))
    compare(mapped(jax.device_put(params, NamedSharding(mesh, P())),
                   jax.device_put(images, NamedSharding(mesh, P(("data", "model")))),
                   jax.device_put(labels, NamedSharding(mesh, P(("data", "model"))))), single)
    # and the logits, blockwise (a convolution over a smaller batch may pick another algorithm:
    # float rounding, as for the step above)
    logits = lambda i: net.apply(params, image=i)
    blockwise = jax.jit(jax.shard_map(logits, mesh=mesh, in_specs=(P(("data", "model")),),
                                      out_specs=P(("data", "model"))))
    compare(blockwise(jax.device_put(images, NamedSharding(mesh, P(("data", "model"))))),
            jax.jit(logits)(images))
  check("graph/shard_map/training_graph_pmean")(check_shard_map)


if __name__ == "__main__":
  sys.exit(main())
