"""The cost decision of jaxpool.optimize: a site that the cost source judges slower stays XLA's,
and the report says which and why; jaxpool's own cost model on its known cases."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool
from jaxpool._src import dispatch, platforms
from jaxpool._src.optimize import cost

nn = pytest.importorskip("flax.linen")

RNG = np.random.default_rng(0)


def normal(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def prims(jaxpr) -> list[str]:
  """The primitives of a jaxpr, not entering jaxpool's own jitted ops."""
  return [e.primitive.name for e in jaxpr.jaxpr.eqns]


def net(x):
  """A ReLU then a 3x3/s2 max pool, a 2x2 max pool, a 2x2 average pool."""
  y = nn.max_pool(jax.nn.relu(x), (3, 3), (2, 2), "SAME")
  return nn.avg_pool(nn.max_pool(y, (2, 2), (2, 2)), (2, 2), (2, 2))


def test_a_site_judged_slower_is_left_to_xla_and_reported():
  seen = []

  def fake(site):
    seen.append(site)
    return "judged slower by the fake" if site.layout.window == (3, 3) else None

  x = normal(2, 16, 16, 3)
  g = jaxpool.optimize(net, cost=fake)
  rep = g.report(x)
  assert [(s.op, s.layout.window, s.dtype) for s in seen] == [
      ("max_pool", (3, 3), "float32"), ("max_pool", (2, 2), "float32"),
      ("avg_pool", (2, 2), "float32")]
  assert seen[0].fused_relu and seen[0].shape == (2, 16, 16, 3)
  assert seen[0].producer == "custom_jvp_call"  # the ReLU
  assert seen[1].producer == "reduce_window_max" and seen[2].readers == ("",)
  # The 3x3 pool and the ReLU before it stay XLA's; the others are replaced.
  assert [d.op for d in rep.replaced] == ["reduce_window_max", "reduce_window_sum"], str(rep)
  assert [d.op for d in rep.left_to_xla] == ["reduce_window_max"], str(rep)
  kept = rep.left_to_xla[0]
  assert kept.cost == "judged slower by the fake" and "left to XLA" in kept.detail
  assert "jaxpool.max_pool(window (3, 3)" in kept.detail  # what it would have become
  relu = [d for d in rep.findings if d.op == "custom_jvp_call(relu)"]
  assert relu and not relu[0].replaced and "left to XLA" in relu[0].detail, str(rep)
  assert "1 of them left to XLA by the cost decision" in str(rep)
  assert "left to XLA  " in str(rep)
  # The program keeps XLA's pool (and the ReLU) for that site and computes the same.
  names = prims(jax.make_jaxpr(g)(x))
  assert names.count("reduce_window_max") == 1 and "custom_jvp_call" in names, names
  np.testing.assert_allclose(g(x), net(x), rtol=1e-6)
  w = normal(*net(x).shape)
  loss = lambda f: lambda x: (f(x) * w).sum()
  np.testing.assert_allclose(jax.grad(loss(g))(x), jax.grad(loss(net))(x), rtol=1e-6, atol=1e-6)


def test_cost_functions_are_checked():
  with pytest.raises(TypeError, match="cost must be None or a function"):
    jaxpool.optimize(net, cost="fast")
  with pytest.raises(TypeError, match="must return None or a str"):
    jaxpool.optimize(net, cost=lambda site: True).report(normal(1, 8, 8, 1))


# ----------------------------------------------------------------------------- the default model


@pytest.fixture
def gpu_dispatch(monkeypatch):
  """As on an NVIDIA H100 (only traced here): implementation=None runs the kernels, and no
  measured cost table ships for it (the tables are tested in test_cost_table.py)."""
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  monkeypatch.setattr(platforms, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
  if dispatch.default_implementation() is not None:
    pytest.skip("JAXPOOL_IMPLEMENTATION=xla: the kernels never run by default")


class Transition(nn.Module):
  """DenseNet's transition: BatchNorm, ReLU, a 1x1 convolution, a 2x2/s2 average pool."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
    x = nn.Conv(8, (1, 1), use_bias=False)(x)
    return nn.avg_pool(x, (2, 2), (2, 2))


def test_default_model_leaves_densenet_transitions_to_xla(gpu_dispatch):
  x = jax.ShapeDtypeStruct((4, 32, 32, 16), jnp.float32)
  model = Transition()
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  loss = lambda p, x: model.apply(p, x).sum()
  rep = jaxpool.optimize(loss).report(params, x)
  assert not rep.replaced and [d.op for d in rep.left_to_xla] == ["reduce_window_sum"], str(rep)
  assert "convolution" in rep.left_to_xla[0].cost
  rep = jaxpool.optimize(jax.grad(loss, argnums=1)).report(params, x)
  ops = {d.op for d in rep.left_to_xla}
  assert not rep.replaced and ops == {"reduce_window_sum"} and len(rep.left_to_xla) == 2, str(rep)
  # With the kernels asked for explicitly, or where jaxpool runs XLA, the user's choice stands.
  assert jaxpool.optimize(loss, implementation="pallas").report(params, x).replaced
  assert jaxpool.optimize(loss, implementation="xla").report(params, x).replaced


def test_default_model_small_and_large_pools(gpu_dispatch):
  f = lambda x: nn.max_pool(x, (2, 2), (2, 2))
  small = jaxpool.optimize(f).report(jax.ShapeDtypeStruct((1, 6, 6, 2), jnp.float32))
  assert not small.replaced and "too small" in small.left_to_xla[0].cost, str(small)
  large = jaxpool.optimize(f).report(jax.ShapeDtypeStruct((2, 64, 64, 8), jnp.float32))
  assert large.replaced and not large.left_to_xla, str(large)
  # An average pool that reads no convolution is left to XLA too (measured slower replaced on
  # an H100, benchmarks/optimize_cost_gpu.py), and says so.
  g = lambda x: nn.avg_pool(x, (2, 2), (2, 2))
  rep = jaxpool.optimize(g).report(jax.ShapeDtypeStruct((2, 64, 64, 8), jnp.float32))
  assert not rep.replaced and "fuses its window sum" in rep.left_to_xla[0].cost, str(rep)


def test_default_model_replaces_everything_where_jaxpool_runs_xla(monkeypatch):
  monkeypatch.setattr(dispatch, "platform", lambda: "cpu")
  x = jax.ShapeDtypeStruct((1, 6, 6, 2), jnp.float32)
  rep = jaxpool.optimize(lambda x: nn.max_pool(x, (2, 2), (2, 2))).report(x)
  assert rep.replaced and not rep.left_to_xla


def test_default_model_is_a_function_of_the_site():
  """The same site, the same answer: nothing in it depends on the process (timings, ids)."""
  from jaxpool._src.optimize.layout import layout
  from jaxpool._src.optimize.site import Site
  lay = layout((4, 16, 16, 8), (1, 2, 2, 1), (1, 2, 2, 1), ((0, 0),) * 4, None)
  site = Site("avg_pool", (4, 16, 16, 8), "float32", lay, implementation=None, kernels=True,
              producer="conv_general_dilated")
  answers = {cost.default_cost(dataclasses.replace(site)) for _ in range(3)}
  assert len(answers) == 1 and "convolution" in answers.pop()
  assert cost.default_cost(dataclasses.replace(site, kernels=False)) is None
  assert cost.default_cost(dataclasses.replace(site, implementation="pallas")) is None
