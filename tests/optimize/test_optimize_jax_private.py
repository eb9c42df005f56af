"""The JAX internals that ``jaxpool.optimize`` uses (``jaxpool/_src/optimize/_jax_private.py``)
and the primitives its registries are keyed by: each exists and does what optimize relies on.

A JAX release that moves or changes one of them fails here, naming it, before optimize's own
tests fail in a less telling way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core
from jax.extend import linear_util as lu
from jax.extend.core import primitives as prims
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxpool
from jaxpool._src.optimize import _jax_private, interpreter, planner


def test_trace_to_jaxpr_dynamic_keeps_avals():
  """A function traced on avals (a weak type kept) to ``(jaxpr, out_avals, consts)``."""
  k = np.arange(3.0, dtype=np.float32)
  fun = lu.wrap_init(lambda x: [x * 2 + k], debug_info=jax.make_jaxpr(jnp.sin)(1.0).jaxpr
                     .debug_info)
  aval = core.ClosedJaxpr(jax.make_jaxpr(lambda x: x)(1.0).jaxpr, ()).in_avals[0]
  assert aval.weak_type
  jaxpr, out_avals, consts = _jax_private.trace_to_jaxpr_dynamic(fun, [aval])
  assert isinstance(jaxpr, core.Jaxpr)
  closed = core.ClosedJaxpr(jaxpr, consts)  # (the one form the interpreter uses)
  assert closed.in_avals == [aval]
  assert out_avals[0].shape == (3,) and [np.shape(c) for c in consts] == [(3,)]
  out = core.jaxpr_as_fun(closed)(np.float32(1.5))
  np.testing.assert_array_equal(out[0], 3.0 + k)


def test_convert_constvars_jaxpr_makes_constants_leading_inputs():
  k = np.arange(3.0, dtype=np.float32)
  closed = jax.make_jaxpr(lambda x: x + k)(np.ones(3, np.float32))
  assert len(closed.jaxpr.constvars) == 1
  open_ = _jax_private.convert_constvars_jaxpr(closed.jaxpr)
  assert not open_.constvars and len(open_.invars) == 2
  assert open_.invars[0].aval.shape == (3,)
  out = core.jaxpr_as_fun(core.ClosedJaxpr(open_, ()))(k, np.ones(3, np.float32))
  np.testing.assert_array_equal(out[0], k + 1)


def test_user_frames_name_this_file():
  eqn = jax.make_jaxpr(lambda x: jnp.sin(x))(1.0).jaxpr.eqns[0]
  frames = list(_jax_private.user_frames(eqn.source_info.traceback))
  assert frames, "no user frames"
  f = frames[0]
  assert f.file_name == __file__ and isinstance(f.start_line, int) and f.function_name


def test_scan_operands_with_new_consts():
  """JAX >= 0.11 describes scan's operands as a flat tree; older JAX counts ``num_consts``."""
  params = jax.make_jaxpr(lambda x: lax.scan(lambda c, _: (c + x, None), x, None, length=2)[0])(
      1.0).jaxpr.eqns[0].params
  if "ft_in" not in params:
    assert isinstance(params["num_consts"], int)
    pytest.skip("this JAX has no flat-tree scan operands (num_consts is used instead)")
  tree = _jax_private.scan_operands_with_new_consts(params["ft_in"], 2)
  consts, carry, xs = tree.unpack()
  new, old = consts.unpack()  # (flat trees, not pytrees: jax.tree sees one leaf)
  assert len(new.unpack()) == 2


def test_optimize_rebuilds_bodies_with_new_constants():
  """What the internals are for: a pool inside ``jit``, ``scan``, ``cond`` and ``fori_loop``
  bodies that close over a NumPy constant is replaced, and values and gradients stay."""
  k = np.linspace(-1, 1, 2 * 6 * 6 * 3, dtype=np.float32).reshape(2, 6, 6, 3)

  def pool(y):
    return lax.reduce_window(y, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                             ((0, 0), (1, 1), (1, 1), (0, 0)))
  cases = [
      lambda x: jax.jit(lambda y: pool(y + k) * 2.0)(x).sum(),
      lambda x: lax.scan(lambda c, _: (c + pool(x + k).sum(), None), 0.0, None, length=2)[0],
      lambda x: lax.cond(x.sum() > 0, lambda y: pool(y + k).sum(), lambda y: pool(y * k).sum(),
                         x),
      lambda x: lax.fori_loop(0, 2, lambda i, c: c + pool(x + k).sum(), 0.0),
  ]
  x = jnp.asarray(np.random.default_rng(0).standard_normal(k.shape), jnp.float32)
  for f in cases:
    g = jaxpool.optimize(f, implementation="xla")
    assert g.report(x).replaced
    np.testing.assert_allclose(g(x), f(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(g)(x), jax.grad(f)(x), rtol=1e-6, atol=1e-7)


def _one_device_mesh():
  return jax.make_mesh((1,), ("b",), axis_types=(AxisType.Auto,))


def test_shard_map_params_keep_what_a_rebuild_needs():
  """A ``shard_map`` equation holds its mesh, flat specs, ``check_vma``, an open body and the
  axes it made manual (``axis_names=``): what the interpreter passes to ``jax.shard_map``."""
  mesh = jax.make_mesh((1, 1), ("b", "c"), axis_types=(AxisType.Auto,) * 2)
  for check_vma, names in ((True, {"b"}), (False, {"b", "c"})):
    fn = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("b"), out_specs=P("b"),
                       axis_names=names, check_vma=check_vma)
    with jax.set_mesh(mesh):
      eqn = jax.make_jaxpr(fn)(jnp.ones((2, 3))).jaxpr.eqns[-1]
    assert eqn.primitive is _jax_private.shard_map_p
    p = eqn.params
    assert p["mesh"].axis_names == ("b", "c") and p["check_vma"] is check_vma
    assert tuple(p["in_specs"]) == (P("b"),) and tuple(p["out_specs"]) == (P("b"),)
    assert isinstance(p["jaxpr"], core.Jaxpr) and not p["jaxpr"].constvars
    assert _jax_private.shard_map_manual_axes(p) == frozenset(names)
  with pytest.raises(KeyError, match="manual axes"):
    _jax_private.shard_map_manual_axes({"mesh": mesh})


def test_varying_casts_are_what_check_vma_inserts():
  """Under ``check_vma=True`` a constant combined with a varying value is cast by one of
  ``VARYING_CASTS``, which leaves the value unchanged."""
  fn = jax.shard_map(lambda x: x / 4.0, mesh=_one_device_mesh(), in_specs=P("b"),
                     out_specs=P("b"), check_vma=True)
  with jax.set_mesh(_one_device_mesh()):
    body = jax.make_jaxpr(fn)(jnp.ones(2)).jaxpr.eqns[-1].params["jaxpr"]
  casts = [e for e in body.eqns if e.primitive in _jax_private.VARYING_CASTS]
  assert casts, [e.primitive for e in body.eqns]
  assert isinstance(casts[0].invars[0], core.Literal) and casts[0].invars[0].val == 4.0


def test_higher_order_registry_matches_what_jax_emits():
  """The interpreter's registry is keyed by the primitive objects that tracing produces."""
  ck = jax.checkpoint(jnp.sin)
  relu = jax.nn.relu

  @jax.custom_vjp
  def ident(x):
    return x
  ident.defvjp(lambda x: (x, None), lambda _, g: (g,))
  cases = {
      prims.jit_p: jax.jit(jnp.sin),
      prims.remat_p: ck,
      prims.custom_jvp_call_p: relu,
      prims.custom_vjp_call_p: ident,
      prims.scan_p: lambda x: lax.scan(lambda c, _: (c, None), x, None, length=2)[0],
      prims.while_p: lambda x: lax.while_loop(lambda c: c < 1, lambda c: c + 1, x),
      prims.cond_p: lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x),
      _jax_private.shard_map_p: jax.shard_map(jnp.sin, mesh=_one_device_mesh(), in_specs=P(),
                                              out_specs=P()),
  }
  assert set(cases) == set(interpreter.HIGHER_ORDER)
  for prim, fn in cases.items():
    with jax.set_mesh(_one_device_mesh()):
      eqn = jax.make_jaxpr(fn)(1.0).jaxpr.eqns[-1]
    assert eqn.primitive is prim, (prim, eqn.primitive)
    bodies = interpreter.HIGHER_ORDER[prim].bodies(eqn)
    assert bodies and all(isinstance(b, core.ClosedJaxpr) for _, b in bodies), prim


def test_pattern_registry_matches_what_jax_emits():
  x = jnp.ones((1, 4, 4, 1))
  made = {
      prims.reduce_window_max_p: lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1),
                                                             (1, 2, 2, 1), "VALID"),
      prims.reduce_window_sum_p: lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1),
                                                             (1, 2, 2, 1), "VALID"),
      prims.reduce_window_min_p: lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1),
                                                             (1, 2, 2, 1), "VALID"),
  }
  for prim, fn in made.items():
    assert prim in planner.PATTERNS
    assert jax.make_jaxpr(fn)(x).jaxpr.eqns[-1].primitive is prim
  names = [e.primitive for e in jax.make_jaxpr(jax.grad(lambda x: made[
      prims.reduce_window_max_p](x).sum()))(x).jaxpr.eqns]
  assert prims.select_and_scatter_add_p in names
