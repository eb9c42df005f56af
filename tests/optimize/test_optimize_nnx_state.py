"""jaxpool.optimize carries Flax NNX state out: batch statistics, RNG counters and any
``nnx.Variable`` written inside the optimized function, exactly as the function without optimize
does; a mutation it cannot carry raises."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool

nnx = pytest.importorskip("flax.nnx")

RNG = np.random.default_rng(0)


class Net(nnx.Module):
  """Conv, BatchNorm, ReLU, max pool, Dropout, an average pool and a head."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.head = nnx.Linear(4 * 2 * 2, 3, rngs=rngs)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # a plain Variable written each call

  def __call__(self, x):
    self.calls.value = self.calls.value + 1
    x = nnx.max_pool(nnx.relu(self.bn(self.conv(x))), (2, 2), (2, 2))
    x = self.drop(x)
    x = nnx.avg_pool(x, (2, 2), (2, 2))
    return self.head(x.reshape(x.shape[0], -1))


def loss(model, x, y):
  logits = model(x)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def train(opt: bool, steps: int = 2):
  model = Net(nnx.Rngs(0, dropout=1))
  fn = jaxpool.optimize(loss) if opt else loss

  @nnx.jit
  def step(model, x, y):
    value, grads = nnx.value_and_grad(fn)(model, x, y)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return value

  rng = np.random.default_rng(1)
  losses = []
  for _ in range(steps):
    x = jnp.asarray(rng.standard_normal((4, 8, 8, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 4))
    losses.append(step(model, x, y))
  return model, losses


def test_state_after_two_steps_equals_without_optimize():
  plain, l0 = train(False)
  opt, l1 = train(True)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  # Batch statistics moved, the RNG counter counted, the plain Variable was written.
  assert np.any(np.asarray(plain.bn.mean.value) != 0)
  s0, s1 = nnx.state(plain), nnx.state(opt)
  p0 = dict(jax.tree_util.tree_leaves_with_path(s0))
  p1 = dict(jax.tree_util.tree_leaves_with_path(s1))
  assert p0.keys() == p1.keys()
  for path, v0 in p0.items():
    v1 = p1[path]
    if jnp.issubdtype(jnp.asarray(v0).dtype, jax.dtypes.prng_key):
      v0, v1 = jax.random.key_data(v0), jax.random.key_data(v1)
    v0, v1 = np.asarray(v0), np.asarray(v1)
    if np.issubdtype(v0.dtype, np.floating):
      np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    else:
      np.testing.assert_array_equal(v1, v0, err_msg=jax.tree_util.keystr(path))
  assert int(opt.calls.value) == 2
  assert int(opt.drop.rngs.count.value) == int(plain.drop.rngs.count.value) == 2


def test_state_written_eagerly_and_under_jit():
  """Without nnx.jit too: an eager call and jax-style use update the caller's module."""
  model = Net(nnx.Rngs(0, dropout=1))
  ref = Net(nnx.Rngs(0, dropout=1))
  x = jnp.asarray(RNG.standard_normal((4, 8, 8, 3)), jnp.float32)
  y = jnp.asarray(RNG.integers(0, 3, 4))
  opt = jaxpool.optimize(loss)
  np.testing.assert_allclose(opt(model, x, y), loss(ref, x, y), rtol=1e-6)
  np.testing.assert_allclose(model.bn.mean.value, ref.bn.mean.value, rtol=1e-6, atol=1e-7)
  assert int(model.calls.value) == int(ref.calls.value) == 1
  opt(model, x, y)  # a cached signature carries the state too
  assert int(model.calls.value) == 2


def test_mutation_that_cannot_be_carried_raises():
  class Grows(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(3))

    def __call__(self, x):
      self.extra = nnx.Variable(jnp.zeros(3))  # a new Variable: the module's structure changes
      return x * self.w.value

  with pytest.raises(ValueError, match="adds or removes"):
    jaxpool.optimize(lambda m, x: m(x))(Grows(), jnp.ones(3))

  class ToPython(nnx.Module):
    def __init__(self):
      self.n = nnx.Variable(jnp.zeros(()))

    def __call__(self, x):
      self.n.value = 3.0  # a Python float, not an array: nothing a jaxpr can return as state
      return x

  with pytest.raises(TypeError, match="not an array"):
    jaxpool.optimize(lambda m, x: m(x))(ToPython(), jnp.ones(3))


def test_writes_into_a_module_that_the_function_carries_raise():
  """``optimize(model)``: the module is the function, not an argument; its writes cannot be
  carried (Flax refuses them inside the trace), and the error says what to do."""
  model = Net(nnx.Rngs(0, dropout=1))
  x = jnp.asarray(RNG.standard_normal((4, 8, 8, 3)), jnp.float32)
  mean = np.asarray(model.bn.mean.value)
  for fn in (model, model.__call__):
    with pytest.raises(ValueError, match="Pass the module as an argument"):
      jaxpool.optimize(fn)(x)
    np.testing.assert_array_equal(model.bn.mean.value, mean)  # untouched
    assert int(model.calls.value) == 0
  # A module that writes nothing (BatchNorm in evaluation mode) may be the function.
  rngs = nnx.Rngs(0)
  plain = nnx.Sequential(nnx.Conv(3, 4, (3, 3), rngs=rngs), nnx.BatchNorm(4, rngs=rngs),
                         lambda x: nnx.max_pool(x, (2, 2), (2, 2)))
  plain.eval()
  np.testing.assert_allclose(jaxpool.optimize(plain)(x), plain(x), rtol=1e-6, atol=1e-6)
