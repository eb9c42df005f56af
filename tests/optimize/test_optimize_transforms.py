"""The ReLU fold of :func:`jaxpool.optimize` under each transform order (issue 49).

``optimize(jax.grad(f))``, ``optimize(jax.value_and_grad(f))`` and ``jax.grad(optimize(f))``
fold the same ReLUs into the same max pools: in the first two, the backward pass that JAX built
reads the ReLU's result (the pool's gradient, ``select_and_scatter_add``, masked by ReLU's
derivative ``select(x > 0, ., 0)``), and that reader is recognised as the pool's own. The
values and the gradient at the pool's input are the same bits under every order; gradients
further back (a convolution's kernel) are equal to rounding where XLA compiles the program
around the pool differently (docs/optimize.md, "Under a transformation").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool

nn = pytest.importorskip("flax.linen")

RNG = np.random.default_rng(49)


def tie_rich(*shape):
  """Zeros of both signs, repeated small values, negatives, -inf: windows whose maximum is
  positive, zero and negative, with ties."""
  pool = np.array([-np.inf, -2.0, -1.0, -0.0, 0.0, 0.0, 1.0, 1.0, 2.0], np.float32)
  return jnp.asarray(RNG.choice(pool, size=shape))


def bits(a, b, what=""):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    u, v = np.asarray(u), np.asarray(v)
    assert u.shape == v.shape and u.dtype == v.dtype, what
    np.testing.assert_array_equal(u.view(np.uint32), v.view(np.uint32), err_msg=what)


def folded(report) -> list[tuple[str, str]]:
  """The forward sites a report replaced: (op, source line), in order."""
  return [(f.op, f.source) for f in report.replaced if f.op != "select_and_scatter_add"]


ORDERS = ("grad(optimize(f))", "optimize(grad(f))", "optimize(value_and_grad(f))")


def _orders(loss):
  """Each order as (a function of the arguments giving (value, grad), its report)."""
  opt = jaxpool.optimize(loss)
  og = jaxpool.optimize(jax.grad(loss))
  ovg = jaxpool.optimize(jax.value_and_grad(loss))
  return {
      "grad(optimize(f))": (jax.jit(jax.value_and_grad(opt)), opt.report),
      "optimize(grad(f))": (jax.jit(lambda *a: (loss(*a), og(*a))), og.report),
      "optimize(value_and_grad(f))": (jax.jit(ovg), ovg.report),
  }


@pytest.mark.parametrize("order", ORDERS)
def test_the_fold_under_each_order_is_the_same_bits(order):
  """A pool of a ReLU, tie-rich input with windows of every sign, a random cotangent: the same
  sites, and values and gradients bit for bit equal to the plain jax.value_and_grad."""
  w = jnp.asarray(RNG.standard_normal((2, 3, 3, 3)), jnp.float32)

  def loss(x):
    return (nn.max_pool(jax.nn.relu(x), (2, 2), (2, 2), padding="SAME") * w).sum()

  x = tie_rich(2, 6, 5, 3)
  run, report = _orders(loss)[order]
  rep = report(x)
  assert folded(rep) == folded(jaxpool.optimize(loss).report(x)), str(rep)
  assert [f.op for f in rep.replaced][:2] == ["custom_jvp_call(relu)", "reduce_window_max"]
  assert "activation='relu'" in rep.replaced[1].detail and not rep.left_alone, str(rep)
  if order != "grad(optimize(f))":  # XLA's pool gradient is replaced as well
    assert [f.op for f in rep.replaced][2:] == ["select_and_scatter_add"], str(rep)
  bits(run(x), jax.jit(jax.value_and_grad(loss))(x), order)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.max_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), (2, 2), padding="same")
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def test_a_flax_cnn_folds_the_same_sites_under_each_order():
  """A conv-ReLU-pool block: the ReLU folds under each order; the loss and every parameter
  gradient equal the plain step's (to rounding: float32, relative 1e-6 of each leaf's scale)."""
  model = CNN()
  x = jnp.asarray(RNG.standard_normal((2, 7, 7, 3)), jnp.float32)
  params = model.init(jax.random.key(0), x)

  def loss(p, x):
    return (model.apply(p, x) ** 2).sum()

  plain = jax.jit(jax.value_and_grad(loss))(params, x)
  want_sites = folded(jaxpool.optimize(loss).report(params, x))
  assert [op for op, _ in want_sites] == ["custom_jvp_call(relu)", "reduce_window_max"]
  for order, (run, report) in _orders(loss).items():
    rep = report(params, x)
    assert folded(rep) == want_sites and not rep.left_alone, (order, str(rep))
    for got, want in zip(jax.tree.leaves(run(params, x)), jax.tree.leaves(plain), strict=True):
      scale = float(jnp.max(jnp.abs(want)))
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale, err_msg=order)


def test_a_relu_with_another_reader_under_grad_is_not_folded():
  """The backward pass's own reads are recognised; a reader the user wrote still blocks."""
  def loss(x):
    r = jax.nn.relu(x)
    return nn.max_pool(r, (2, 2), (2, 2)).sum() + (r * r).sum()

  x = tie_rich(1, 4, 4, 2)
  g = jaxpool.optimize(jax.grad(loss))
  rep = g.report(x)
  assert [f.op for f in rep.left_alone] == ["custom_jvp_call(relu)"], str(rep)
  assert "other readers" in rep.left_alone[0].detail
  bits(jax.jit(g)(x), jax.jit(jax.grad(loss))(x))


def test_a_relu6_under_grad_is_not_folded():
  """ReLU6's derivative mask is not ReLU's: under grad it is left where it is."""
  loss = lambda x: nn.max_pool(jax.nn.relu6(x), (2, 2), (2, 2)).sum()  # noqa: E731
  x = tie_rich(1, 4, 4, 2) * 4
  g = jaxpool.optimize(jax.grad(loss))
  rep = g.report(x)
  assert [f.op for f in rep.left_alone] == ["custom_jvp_call(relu6)"], str(rep)
  bits(jax.jit(g)(x), jax.jit(jax.grad(loss))(x))
