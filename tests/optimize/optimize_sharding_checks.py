"""jaxpool.optimize under sharding, compared with one device.

tests/optimize/test_optimize.py runs it; by hand, run it in its own process with 8 CPU devices::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python tests/optimize/optimize_sharding_checks.py

``--quick`` (what ``make test`` runs) leaves out the slower ``shard_map/entered/`` variants
(``check_vma=False``, partly manual, ``optimize`` of ``grad``). Each check prints one JSON line
``{"name": ..., "ok": bool, "detail": ...}``.
"""

from __future__ import annotations

import functools
import json
import os
import sys

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import device_checks  # noqa: E402
from device_checks import check  # noqa: E402  (tests/support: not on a script's path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool._src.pallas.sharding.partition import kernel_p  # noqa: E402

KERNEL = kernel_p.name  # the primitive of every Pallas kernel call

QUICK = "--quick" in sys.argv
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def moved_arrays(hlo: str) -> list[tuple[str, int]]:
  """Collectives that move more than one element (XLA:CPU's fusion barrier in jaxpool's max
  pool reads one argmax element as a predicate: a scalar may move, an array may not)."""
  return [(op, size) for op, size in device_checks.collectives(hlo, COLLECTIVES) if size > 1]


def same(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    u, v = np.asarray(u), np.asarray(v)
    assert u.shape == v.shape and u.dtype == v.dtype, (u.shape, v.shape, u.dtype, v.dtype)
    assert u.tobytes() == v.tobytes(), f"differ by up to {np.abs(u - v).max()}"


def block(x):
  """A ReLU -> 3x3/s2 max pool -> 2x2 average pool, written in plain lax (NHWC)."""
  y = lax.reduce_window(jax.nn.relu(x), -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                        ((0, 0), (1, 1), (1, 1), (0, 0)))
  return lax.reduce_window(y, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0


def loss(x):
  return (block(x) ** 2).sum()


X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 12, 12, 4)), jnp.float32)
REF = jax.jit(jax.grad(loss))(X)
REF_OPT = jax.jit(jax.grad(jaxpool.optimize(loss)))(X)

for axis_type in (AxisType.Auto, AxisType.Explicit):
  @check(f"named/{axis_type.name}")
  def _named(axis_type=axis_type):
    mesh = jax.make_mesh((4, 2), ("b", "c"), axis_types=(axis_type, axis_type))
    spec = P("b", None, None, "c")
    xs = jax.device_put(X, NamedSharding(mesh, spec))
    fn = jax.jit(jax.grad(jaxpool.optimize(loss)))
    with jax.set_mesh(mesh):
      compiled = fn.lower(xs).compile()
      out = compiled(xs)
    same(out, REF_OPT)
    np.testing.assert_allclose(np.asarray(out), np.asarray(REF), rtol=1e-6, atol=1e-6)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), out.sharding
    moved = moved_arrays(compiled.as_text())
    assert not moved, f"the compiled program moves arrays between devices: {moved}"
    return ""


@check("shard_map/grad")
def _shard_map_grad():
  mesh = jax.make_mesh((8,), ("b",), axis_types=(AxisType.Explicit,))
  opt = jaxpool.optimize(loss)

  def sharded_loss(x):
    return jax.shard_map(lambda x: lax.psum(opt(x), "b"), mesh=mesh, in_specs=P("b"),
                         out_specs=P())(x)
  xs = jax.device_put(X, NamedSharding(mesh, P("b")))
  with jax.set_mesh(mesh):
    out = jax.jit(jax.grad(sharded_loss))(xs)
  same(out, REF_OPT)
  return ""


def on_mesh():
  mesh = jax.make_mesh((8,), ("b",))
  return mesh, jax.device_put(X, NamedSharding(mesh, P("b")))


@check("shard_map/vmap_grad")
def _shard_map_vmap_grad():
  mesh, xs = on_mesh()
  one = lambda x: loss(x[None])  # one example: (H, W, C)
  fn = jax.shard_map(jax.vmap(jax.grad(jaxpool.optimize(one))), mesh=mesh, in_specs=P("b"),
                     out_specs=P("b"))
  with jax.set_mesh(mesh):
    out = jax.jit(fn)(xs)
  want = jax.jit(jax.vmap(jax.grad(one)))(X)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
  return ""


@check("shard_map/optimize_of_grad")
def _optimize_of_grad():
  mesh, xs = on_mesh()
  fn = jax.shard_map(jaxpool.optimize(jax.grad(loss)), mesh=mesh, in_specs=P("b"),
                     out_specs=P("b"))
  with jax.set_mesh(mesh):
    out = jax.jit(fn)(xs)
    text = str(jax.make_jaxpr(fn)(xs))
  same(out, REF_OPT)
  assert "select_and_scatter_add" not in text
  return ""


@functools.cache
def kernel_reference():
  """Value and gradient of ``loss`` at ``X`` on one device, optimized with the kernels."""
  return jax.jit(jax.value_and_grad(jaxpool.optimize(loss, implementation="pallas")))(X)


def entered(fn, xs, mesh, n_pools):
  """``optimize(fn)`` with the kernels enters the ``shard_map`` in ``fn``: the report counts
  the pools inside, the traced program runs the kernels, none of XLA's pooling is left, and
  value and gradient equal ``fn``'s own (and one device's with the kernels)."""
  opt = jaxpool.optimize(fn, implementation="pallas")
  with jax.set_mesh(mesh):
    rep = opt.report(xs)
    step = jax.jit(jax.value_and_grad(opt))
    text = str(jax.make_jaxpr(step)(xs))
    v, g = step(xs)
    v0, g0 = jax.jit(jax.value_and_grad(fn))(xs)
  assert len(rep.replaced) == n_pools and not rep.left_alone, str(rep)
  assert all("/shard_map" in f.where for f in rep.findings), str(rep)
  assert KERNEL in text, "the kernels do not run inside the shard_map"
  for prim in ("reduce_window", "select_and_scatter_add"):
    assert prim not in text, f"{prim} left in the optimized program"
  np.testing.assert_allclose(np.asarray(v), np.asarray(v0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-6, atol=1e-6)
  v1, g1 = kernel_reference()
  same(g, g1)
  np.testing.assert_allclose(np.asarray(v), np.asarray(v1), rtol=1e-6)
  return str(rep)


def slow_check(name):
  """A check that ``--quick`` leaves out."""
  return (lambda fn: fn) if QUICK else check(name)


for check_vma in (True, False):
  @(check if check_vma else slow_check)(f"shard_map/entered/check_vma={check_vma}")
  def _entered(check_vma=check_vma):
    mesh = jax.make_mesh((4, 2), ("b", "c"))
    spec = P("b", None, None, "c")
    fn = jax.shard_map(lambda x: lax.psum(loss(x), ("b", "c")), mesh=mesh, in_specs=spec,
                       out_specs=P(), check_vma=check_vma)
    # ReLU folded into the max pool, the max pool, the average pool.
    return entered(fn, jax.device_put(X, NamedSharding(mesh, spec)), mesh, 3)


@slow_check("shard_map/entered/partly_manual")
def _entered_partly_manual():
  """Manual over "b" only (``axis_names=``); "c" stays an Auto axis inside the body."""
  mesh = jax.make_mesh((4, 2), ("b", "c"), axis_types=(AxisType.Auto, AxisType.Auto))
  fn = jax.shard_map(lambda x: lax.psum(loss(x), "b"), mesh=mesh, in_specs=P("b"),
                     out_specs=P(), axis_names={"b"})
  return entered(fn, jax.device_put(X, NamedSharding(mesh, P("b", None, None, "c"))), mesh, 3)


@slow_check("shard_map/entered/optimize_of_grad")
def _entered_optimize_of_grad():
  """``optimize(jax.grad(f))`` where ``f`` calls ``shard_map`` (its mesh from the context): the
  transposed body's max-pool gradient and average-pool transpose are replaced too."""
  mesh, xs = on_mesh()
  with jax.set_mesh(mesh):
    fn = jax.shard_map(lambda x: lax.psum(loss(x), "b"), in_specs=P("b"), out_specs=P())
    opt = jaxpool.optimize(jax.grad(fn), implementation="pallas")
    rep = opt.report(xs)
    text = str(jax.make_jaxpr(opt)(xs))
    out = jax.jit(opt)(xs)
  ops = sorted(f.op for f in rep.replaced)
  assert ops == ["reduce_window_max", "reduce_window_sum", "reduce_window_sum",
                 "select_and_scatter_add"], str(rep)
  assert KERNEL in text and "select_and_scatter_add" not in text
  np.testing.assert_allclose(np.asarray(out), np.asarray(REF), rtol=1e-6, atol=1e-6)
  same(out, kernel_reference()[1])
  return str(rep)


print(json.dumps(dict(name="summary", ok=True, detail="")), flush=True)
