"""Every pool that Flax and Equinox build is recognised by jaxpool.optimize: cases in the manner
of Flax's ``PoolTest`` and Equinox's pooling tests (their shapes, dtypes, weak types, ``use_ceil``
and integer inputs), run under ``optimize`` and under ``optimize`` of their gradient, give the
frameworks' own values and gradients, and the report leaves no pool of more than one element
unrecognised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool

nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")

@pytest.fixture(autouse=True)
def _replace_every_site(monkeypatch):
  """Recognition is tested here: every recognised site is replaced, small ones on a GPU
  included (the cost decision is tested in tests/optimize/test_optimize_cost.py)."""
  from jaxpool._src.optimize import cost, wrapper
  monkeypatch.setattr(wrapper, "default_cost", cost.always)


POOLING_OPS = ("reduce_window_max", "reduce_window_sum", "reduce_window", "select_and_scatter_add",
               "select_and_gather_add")


def unrecognised(report) -> list[str]:
  """The pools the report left alone, but the window counts of ``count_include_pad=False`` (a
  constant, not a pool) and windows of one element (nothing is pooled)."""
  return [f"{d.op}: {d.detail}" for d in report.left_alone
          if d.op in POOLING_OPS and "window counts" not in d.detail
          and "single element" not in d.detail and not d.cost]


def check(f, x, *, grad=True, tol=1e-6):
  """``optimize(f)`` and (for floats) both gradients against ``f``'s own; all pools replaced."""
  g = jaxpool.optimize(f)
  rep = g.report(x)
  assert rep.replaced and not unrecognised(rep), str(rep)
  loss = lambda f: lambda x: (f(x) * jnp.arange(1, f(x).size + 1).reshape(f(x).shape)).sum()
  og = jaxpool.optimize(jax.grad(loss(f)))
  if grad:
    rep = og.report(x)
    assert rep.replaced and not unrecognised(rep), str(rep)

  @jax.jit  # every program of the comparison in one compile
  def run(x):
    if not grad:
      return g(x), f(x)
    return g(x), f(x), jax.grad(loss(g))(x), jax.grad(loss(f))(x), og(x)

  got, want, *grads = run(x)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                             atol=tol)
  if grad:
    dg, df, dog = grads
    np.testing.assert_allclose(dg, df, rtol=tol, atol=tol)
    np.testing.assert_allclose(dog, df, rtol=tol, atol=tol)


def window_sums(x, k, s, pads):
  """NumPy reference: the window sums of a 2-D ``x`` (and the counts of real elements)."""
  xp = np.pad(x, pads)
  ones = np.pad(np.ones_like(x), pads)
  h = (xp.shape[0] - k[0]) // s[0] + 1
  w = (xp.shape[1] - k[1]) // s[1] + 1
  out, cnt = np.zeros((h, w)), np.zeros((h, w))
  for i in range(h):
    for j in range(w):
      win = (slice(i * s[0], i * s[0] + k[0]), slice(j * s[1], j * s[1] + k[1]))
      out[i, j], cnt[i, j] = xp[win].sum(), ones[win].sum()
  return out, cnt


# ----------------------------------------------------------------------------- Flax


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("batch", [True, False])
def test_flax_avg_pool_weakly_typed(count_include_pad, batch):
  """``jnp.full(..., 2.0)`` is weakly typed: Flax's count_include_pad=False then converts the
  window sum before dividing it by the counts."""
  shape = (1, 3, 3, 1) if batch else (3, 3, 1)
  x = jnp.full(shape, 2.0)
  assert x.weak_type
  f = lambda x: nn.avg_pool(x, (2, 2), count_include_pad=count_include_pad)
  check(f, x)
  g = jaxpool.optimize(f)
  np.testing.assert_allclose(g(x), np.full((1, 2, 2, 1)[-len(shape):], 2.0))
  # Each element's gradient: the number of windows that hold it, over the window size.
  cover = np.zeros((3, 3))
  for i in range(2):
    for j in range(2):
      cover[i:i + 2, j:j + 2] += 1 / 4
  grad = jax.grad(lambda x: g(x).sum())(x)
  np.testing.assert_allclose(np.asarray(grad).reshape(3, 3), cover)


def test_flax_max_pool():
  x = jnp.arange(9).reshape((1, 3, 3, 1)).astype(jnp.float32)
  f = lambda x: nn.max_pool(x, (2, 2))
  check(f, x)
  g = jaxpool.optimize(f)
  np.testing.assert_array_equal(g(x).ravel(), [4, 5, 7, 8])
  np.testing.assert_array_equal(jax.grad(lambda x: g(x).sum())(x).ravel(),
                                [0, 0, 0, 0, 1, 1, 0, 1, 1])


@pytest.mark.parametrize("count_include_pad", [True, False])
def test_flax_avg_pool_same_padding(count_include_pad):
  x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape((1, 2, 2, 1))
  f = lambda x: nn.avg_pool(x, (2, 2), padding="SAME", count_include_pad=count_include_pad)
  check(f, x)
  sums, counts = window_sums(np.arange(1.0, 5.0).reshape(2, 2), (2, 2), (1, 1), ((0, 1), (0, 1)))
  want = sums / (4 if count_include_pad else counts)
  np.testing.assert_allclose(np.asarray(jaxpool.optimize(f)(x)).reshape(2, 2), want)


@pytest.mark.parametrize("shape", [(1, 2, 8, 8, 3), (8, 8, 3)])
def test_flax_pooling_batch_dims(shape):
  x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
  check(lambda x: nn.max_pool(x, (2, 2), (2, 2)), x)
  check(lambda x: nn.avg_pool(x, (3, 3), (2, 2), "SAME", count_include_pad=False), x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flax_mixed_precision_counts(dtype):
  """A bfloat16 sum divided by float32 counts (Flax's counts are float32): a conversion between
  the window sum and the division."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9, 9, 3)), dtype)
  f = lambda x: nn.avg_pool(x, (3, 3), (2, 2), "SAME", count_include_pad=False)
  check(f, x, grad=dtype == jnp.float32, tol=1e-6 if dtype == jnp.float32 else 2e-2)


@pytest.mark.slow
def test_flax_resnet_stem():
  """The stem of Flax's ResNet example: conv, batch norm, ReLU, 3x3/s2 SAME max pool."""
  class Stem(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(8, (7, 7), (2, 2), padding=[(3, 3), (3, 3)])(x)
      x = nn.BatchNorm(use_running_average=True)(x)
      return nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME").mean(axis=(1, 2))
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 16, 16, 3)), jnp.float32)
  variables = Stem().init(jax.random.key(0), x)
  check(lambda x: Stem().apply(variables, x), x, tol=1e-5)


# ----------------------------------------------------------------------------- Equinox


EQX = {
    "maxpool1d": (lambda: eqx.nn.MaxPool1d(2, 3), (1, 14), "int"),
    "maxpool1d_ceil": (lambda: eqx.nn.MaxPool1d(3, 3, padding=0, use_ceil=True), (1, 14), "int"),
    "avgpool1d": (lambda: eqx.nn.AvgPool1d(2, 3), (1, 14), "int"),
    "maxpool2d": (lambda: eqx.nn.MaxPool2d(2, (3, 2)), (1, 6, 6), "int"),
    "maxpool2d_ceil": (lambda: eqx.nn.MaxPool2d((3, 3), 2, (1, 1), use_ceil=True), (1, 6, 6),
                       "int"),
    "avgpool2d": (lambda: eqx.nn.AvgPool2d((1, 3), 2), (1, 6, 6), "int"),
    "maxpool3d": (lambda: eqx.nn.MaxPool3d(2, (3, 2, 1)), (1, 4, 4, 4), "float"),
    "maxpool3d_ceil": (lambda: eqx.nn.MaxPool3d(3, padding=(0, 1, 1), stride=2, use_ceil=True),
                       (1, 4, 4, 4), "float"),
    "avgpool3d": (lambda: eqx.nn.AvgPool3d((1, 3, 1), 2), (1, 4, 4, 4), "float"),
    "poolpadding": (lambda: eqx.nn.MaxPool3d(2, 1, ((0, 1), (0, 1), (0, 1))), (1, 4, 4, 4),
                    "float"),
}


@pytest.mark.parametrize("case", list(EQX))
def test_equinox_pools(case):
  make, shape, kind = EQX[case]
  pool = make()
  x = jnp.arange(int(np.prod(shape))).reshape(shape)
  if kind == "float":
    x = x.astype(jnp.float32)
  check(pool, x, grad=kind == "float")


def test_equinox_network_backprop():
  """Equinox's pooling network test: vmap of value_and_grad through conv and max pool."""
  class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    head: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.conv = eqx.nn.Conv2d(3, 2, 3, key=k1)
      self.pool = eqx.nn.MaxPool2d(2, 2)
      self.head = eqx.nn.Linear(2 * 7 * 7, 4, key=k2)

    def __call__(self, x):
      return jax.nn.relu(self.head(self.pool(self.conv(x)).ravel()))

  cnn = CNN(jax.random.key(0))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 3, 16, 16)), jnp.float32)
  y = jnp.asarray(np.random.default_rng(4).standard_normal((5, 4)), jnp.float32)
  step = lambda x, y: jax.vmap(jax.value_and_grad(lambda x, y: jnp.mean((y - cnn(x)) ** 2)))(x, y)
  opt = jaxpool.optimize(step)
  rep = opt.report(x, y)
  assert rep.replaced and not unrecognised(rep), str(rep)
  for a, b in zip(*jax.jit(lambda x, y: (opt(x, y), step(x, y)))(x, y), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
