"""Adaptive and global pooling against an independent NumPy reference written here.

The reference below shares no code with the library: the bins come from PyTorch's documented
rule computed with exact fractions, and every output is a plain loop over its bin's elements in
row-major order (vectorised only over the rows ``(*batch, C)`` that are never pooled).
"""

import itertools
import logging
import math
import re
import sys
from fractions import Fraction

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from core_strategies import assert_bitwise, assert_same_bits, tie_rich, tol, unique_values
from jax.test_util import check_grads

import jaxpool
from jaxpool._src import adaptive as _adaptive
from jaxpool._src import adaptive_plan as _plan
from jaxpool._src import adaptive_xla as _stages
from tiers import draws

SETTINGS = hypothesis.settings(max_examples=draws(8, 4), deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])
E = re.escape


def jgrad(f):
  """``jax.grad`` under ``jit``: one compilation instead of one per primitive (test time)."""
  return jax.jit(jax.grad(f))

# ------------------------------------------------------------------------------ reference


def ref_bins(size, out):
  """PyTorch's bins: ``[floor(i*L/O), ceil((i+1)*L/O))`` with exact rational arithmetic."""
  return [(math.floor(Fraction(i * size, out)), math.ceil(Fraction((i + 1) * size, out)))
          for i in range(out)]


class RefPlan:
  """Layout bookkeeping: rows are the (*batch, C) combinations, spatial dims flattened."""

  def __init__(self, shape, output_size, data_format):
    n = len(output_size)
    self.n = n
    self.cl = data_format == "channels_last"
    self.shape = tuple(shape)
    nd = len(shape)
    self.axes = list(range(nd - 1 - n, nd - 1)) if self.cl else list(range(nd - n, nd))
    self.in_spatial = tuple(shape[a] for a in self.axes)
    self.out_spatial = tuple(L if o is None else o
                             for L, o in zip(self.in_spatial, output_size, strict=True))

  @property
  def out_shape(self):
    s = list(self.shape)
    for a, o in zip(self.axes, self.out_spatial, strict=True):
      s[a] = o
    return tuple(s)

  def rows(self, a, spatial):
    a = np.asarray(a)
    if self.cl:
      a = np.moveaxis(a, -1, a.ndim - 1 - self.n)
    lead = a.shape[:a.ndim - self.n]
    return a.reshape(int(np.prod(lead, dtype=np.int64)), int(np.prod(spatial))), lead

  def unrows(self, r, lead, spatial):
    a = r.reshape(*lead, *spatial)
    return np.moveaxis(a, a.ndim - 1 - self.n, -1) if self.cl else a

  def boxes(self):
    """For each output position (row-major): the flat input indices of its bin, row-major."""
    per_dim = [ref_bins(L, o) for L, o in zip(self.in_spatial, self.out_spatial, strict=True)]
    for o in itertools.product(*[range(v) for v in self.out_spatial]):
      ranges = [range(*per_dim[d][o[d]]) for d in range(self.n)]
      yield [int(np.ravel_multi_index(p, self.in_spatial)) for p in itertools.product(*ranges)]


def ref_max_with_indices(x, output_size, data_format="channels_last"):
  x = np.asarray(x)
  p = RefPlan(x.shape, output_size, data_format)
  wide = x.astype(np.int64 if np.issubdtype(x.dtype, np.integer) else np.float64)
  rows, lead = p.rows(wide, p.in_spatial)
  is_float = np.issubdtype(rows.dtype, np.floating)
  ys, idxs = [], []
  for box in p.boxes():
    best = rows[:, box[0]].copy()
    arg = np.full(rows.shape[0], box[0])
    for f in box[1:]:
      v = rows[:, f]
      take = v > best
      if is_float:
        take = ~np.isnan(best) & (take | np.isnan(v))
      best = np.where(take, v, best)
      arg = np.where(take, f, arg)
    ys.append(best)
    idxs.append(arg)
  y = p.unrows(np.stack(ys, 1), lead, p.out_spatial).astype(x.dtype)
  i = p.unrows(np.stack(idxs, 1), lead, p.out_spatial).astype(np.int32)
  return y, i


def ref_max_grad(x, dy, output_size, data_format="channels_last"):
  """Each output's cotangent added at its argmax (float64)."""
  p = RefPlan(np.shape(x), output_size, data_format)
  _, idx = ref_max_with_indices(x, output_size, data_format)
  irows, lead = p.rows(idx, p.out_spatial)
  dyrows, _ = p.rows(np.asarray(dy, np.float64), p.out_spatial)
  dx = np.zeros((irows.shape[0], math.prod(p.in_spatial)))
  for r in range(irows.shape[0]):
    for j in range(irows.shape[1]):
      dx[r, irows[r, j]] += dyrows[r, j]
  return p.unrows(dx, lead, p.in_spatial)


def ref_avg(x, output_size, data_format="channels_last"):
  p = RefPlan(np.shape(x), output_size, data_format)
  rows, lead = p.rows(np.asarray(x, np.float64), p.in_spatial)
  y = np.stack([rows[:, box].sum(1) / len(box) for box in p.boxes()], 1)
  return p.unrows(y, lead, p.out_spatial)


def ref_avg_grad(dy, shape, output_size, data_format="channels_last"):
  p = RefPlan(shape, output_size, data_format)
  dyrows, lead = p.rows(np.asarray(dy, np.float64), p.out_spatial)
  dx = np.zeros((dyrows.shape[0], math.prod(p.in_spatial)))
  for j, box in enumerate(p.boxes()):
    for f in box:
      dx[:, f] += dyrows[:, j] / len(box)
  return p.unrows(dx, lead, p.in_spatial)


def ref_global(fn, x, data_format, keepdims=False):
  """A global op as the adaptive reference with output 1 per spatial dim (one batch dim)."""
  x = np.asarray(x)
  n = x.ndim - 2
  y = fn(x, (1,) * n, data_format)
  return y if keepdims else y.reshape(y.shape[:1] + (y.shape[-1] if data_format ==
                                                      "channels_last" else y.shape[1],))


# ------------------------------------------------------------------------------ grid

# (shape, output_size, data_format): 1-D/2-D/3-D, both layouts, 0-2 batch dims, odd sizes,
# outputs larger than the input, None entries, divisible sizes (the fixed-window path), large
# divisible bins (reshape stages), outputs of size 1 (the global path).
GRID = [
    ((2, 13, 3), (7,), "channels_last"),
    ((2, 3, 5), (3,), "channels_first"),
    ((4, 2), (9,), "channels_last"),  # 1-D, no batch dim, upsampling
    ((1, 1, 2), (5,), "channels_last"),  # L = 1
    ((2, 13, 11, 2), (7, 5), "channels_last"),
    ((2, 2, 7, 9), (4, 4), "channels_first"),
    ((2, 5, 3, 2), (7, 8), "channels_last"),  # larger than the input in both dims
    ((1, 6, 5, 1), (4, None), "channels_last"),
    ((2, 3, 8, 6), (4, 3), "channels_first"),  # divisible: max_pool / avg_pool
    ((1, 26, 24, 2), (2, 2), "channels_last"),  # divisible, 13x12 bins: reshape stages
    ((2, 6, 7, 2), (1, 1), "channels_last"),  # global
    ((2, 6, 4, 2), (6, 3), "channels_last"),  # identity + reshape
    ((2, 2, 5, 4, 6, 3), (3, 2, 4), "channels_last"),  # 3-D, two batch dims
    ((1, 2, 4, 7, 5), (5, 3, 2), "channels_first"),  # 3-D mixed: up, down, down
    ((3, 4, 5), (2, 2), "channels_first"),  # no batch dim: (C, H, W)
]


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}->{c[1]}-{c[2][9:]}")
def test_max_grid(case, rng):
  shape, out, fmt = case
  x = tie_rich(rng, shape, specials=True)  # ties, NaN, -inf, +inf
  y_ref, i_ref = ref_max_with_indices(x, out, fmt)
  dy = rng.integers(-3, 4, size=y_ref.shape).astype(np.float32)  # integer cotangents: exact sums

  @jax.jit  # the forwards and both gradients in one compile
  def run(x, dy):
    y, i = jaxpool.adaptive_max_pool_with_indices(x, out, data_format=fmt)
    g = jax.grad(lambda v: jnp.sum(jaxpool.adaptive_max_pool(v, out, data_format=fmt) * dy))(x)
    g2 = jax.grad(lambda v: jnp.sum(
        jaxpool.adaptive_max_pool_with_indices(v, out, data_format=fmt)[0] * dy))(x)
    return y, i, jaxpool.adaptive_max_pool(x, out, data_format=fmt), g, g2

  y, i, y2, g, g2 = run(x, dy)
  assert_bitwise(y, y_ref)
  assert_bitwise(i, i_ref)
  assert_bitwise(y2, y_ref)
  assert_bitwise(g, ref_max_grad(x, dy, out, fmt).astype(np.float32) + 0.0)
  assert_same_bits(g2, g)


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}->{c[1]}-{c[2][9:]}")
def test_avg_grid(case, rng):
  shape, out, fmt = case
  x = rng.standard_normal(shape).astype(np.float32)
  y = jaxpool.adaptive_avg_pool(x, out, data_format=fmt)
  y_ref = ref_avg(x, out, fmt)
  assert y.shape == y_ref.shape and y.dtype == np.float32
  taps = math.prod(shape) // max(1, math.prod(y.shape))
  np.testing.assert_allclose(y, y_ref, **tol(np.float32, taps + 1))
  dy = rng.standard_normal(y.shape).astype(np.float32)
  g = jgrad(lambda v: jnp.sum(jaxpool.adaptive_avg_pool(v, out, data_format=fmt) * dy))(x)
  np.testing.assert_allclose(g, ref_avg_grad(dy, shape, out, fmt), **tol(np.float32, 8))


def test_nan_and_neg_inf_hand_case():
  # L = 5 -> O = 3: bins [0, 2) [1, 4) [3, 5).
  x = np.array([np.nan, 1., np.nan, -np.inf, -np.inf], np.float32).reshape(1, 5, 1)
  y, i = jaxpool.adaptive_max_pool_with_indices(x, (3,))
  np.testing.assert_array_equal(i[0, :, 0], [0, 2, 3])  # first NaN; first NaN; first -inf
  assert np.isnan(y[0, :2, 0]).all() and y[0, 2, 0] == -np.inf
  g = jax.grad(lambda v: jaxpool.adaptive_max_pool(v, (3,)).sum())(x)
  np.testing.assert_array_equal(g[0, :, 0], [1, 0, 1, 1, 0])


def test_ties_go_to_the_first_in_row_major_order():
  # 3x3 -> 2x2: bins [0, 2) and [1, 3) per dim; the 9 at (1, 2) wins two bins, the 5 ties.
  x = np.array([[9, 2, 3], [4, 5, 9], [7, 8, 1]], np.float32)[None, :, :, None]
  y, i = jaxpool.adaptive_max_pool_with_indices(x, (2, 2))
  np.testing.assert_array_equal(i[0, ..., 0], [[0, 5], [7, 5]])
  g = jax.grad(lambda v: jaxpool.adaptive_max_pool(v, (2, 2)).sum())(x)
  np.testing.assert_array_equal(g[0, ..., 0], [[1, 0, 0], [0, 0, 2], [0, 1, 0]])
  # all equal: every bin picks its first element
  y, i = jaxpool.adaptive_max_pool_with_indices(np.ones((1, 3, 3, 1), np.float32), (2, 2))
  np.testing.assert_array_equal(i[0, ..., 0], [[0, 1], [3, 4]])


def test_upsampling_hand_case():
  x = np.array([1., 5., 2., 2., 7.], np.float32).reshape(1, 5, 1)
  y, i = jaxpool.adaptive_max_pool_with_indices(x, (8,))
  np.testing.assert_array_equal(y[0, :, 0], [1, 5, 5, 5, 2, 2, 7, 7])
  np.testing.assert_array_equal(i[0, :, 0], [0, 1, 1, 1, 2, 3, 4, 4])
  g = jax.grad(lambda v: jaxpool.adaptive_max_pool(v, (8,)).sum())(x)
  np.testing.assert_array_equal(g[0, :, 0], [1, 3, 1, 1, 2])
  g = jax.grad(lambda v: jaxpool.adaptive_avg_pool(v, (8,)).sum())(x)
  np.testing.assert_allclose(g[0, :, 0], [1.5, 2, 1, 2, 1.5])


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8])
def test_integer_max(dtype, rng):
  x = rng.integers(0, 5, size=(2, 7, 5, 3)).astype(dtype)
  for out in [(3, 2), (9, 7), (1, 1), (7, 5)]:
    y, i = jaxpool.adaptive_max_pool_with_indices(x, out)
    y_ref, i_ref = ref_max_with_indices(x, out)
    assert_bitwise(y, y_ref)
    assert_bitwise(i, i_ref)
  # gradients of integer inputs raise, as JAX's
  with pytest.raises(TypeError):
    jax.grad(lambda v: jaxpool.adaptive_max_pool(v, (3, 2)).sum())(x)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_low_precision_avg_accumulates_in_float32(dtype, rng):
  x = rng.standard_normal((2, 13, 11, 3)).astype(dtype)
  for out in [(7, 5), (2, 2), (1, 1), (15, 12)]:
    y = jaxpool.adaptive_avg_pool(x, out)
    assert y.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float64), ref_avg(x.astype(np.float64), out),
                               **tol(dtype))
  y = jaxpool.global_avg_pool(x)
  assert y.dtype == dtype
  np.testing.assert_allclose(np.asarray(y, np.float64), x.astype(np.float64).mean((1, 2)),
                             **tol(dtype))


def test_low_precision_max_is_exact(rng):
  x = tie_rich(rng, (2, 9, 7, 2), dtype=ml_dtypes.bfloat16, specials=True)
  y, i = jaxpool.adaptive_max_pool_with_indices(x, (4, 5))
  y_ref, i_ref = ref_max_with_indices(x, (4, 5))
  assert_bitwise(y, y_ref)
  assert_bitwise(i, i_ref)


# ------------------------------------------------------------------------------ transforms

GRAD_CASES = [((1, 7, 6, 2), (4, 5), "channels_last"),
              ((1, 2, 3, 5), (7, 8), "channels_first"),
              ((1, 6, 4, 5, 1), (4, 3, 7), "channels_last")]
# (`make test` runs the 2-D cases; the 3-D one is marked slow: test_max_grid and test_avg_grid
# check 3-D values and gradients against the reference there)
GRAD_PARAMS = [*GRAD_CASES[:2], pytest.param(GRAD_CASES[2], marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", GRAD_PARAMS)
def test_check_grads_float64(case, rng):
  """Finite differences in float64, forward and reverse (adaptive max: second order on the first
  case; the average is linear)."""
  shape, out, fmt = case
  order = 2 if case is GRAD_CASES[0] else 1
  with jax.enable_x64(True):
    x = unique_values(rng, shape, np.float64)
    avg = lambda v: jaxpool.adaptive_avg_pool(v, out, data_format=fmt)
    mx = lambda v: jaxpool.adaptive_max_pool(v, out, data_format=fmt)
    check_grads(avg, (x,), order=1, modes=("fwd", "rev"), eps=1e-4, atol=1e-8, rtol=1e-8)
    check_grads(mx, (x,), order=order, modes=("fwd", "rev"), eps=1e-4, atol=1e-8, rtol=1e-8)
    dy = rng.standard_normal(ref_avg(x, out, fmt).shape)
    g = jgrad(lambda v: jnp.sum(avg(v) * dy))(x)
    np.testing.assert_allclose(g, ref_avg_grad(dy, shape, out, fmt), rtol=1e-12, atol=1e-12)
    if order == 2:
      for f in (jaxpool.global_avg_pool, jaxpool.global_max_pool):
        check_grads(lambda v, f=f: f(v, data_format=fmt), (x,), order=1, modes=("fwd", "rev"),
                    eps=1e-4, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("case", GRAD_PARAMS)
def test_forward_mode(case, rng):
  """The JVP of max is the tangent at the reference's argmax; of avg, the avg of the tangent."""
  shape, out, fmt = case
  x = tie_rich(rng, shape, specials=True)
  t = rng.standard_normal(shape).astype(np.float32)
  _, idx = ref_max_with_indices(x, out, fmt)
  p = RefPlan(shape, out, fmt)
  trows, lead = p.rows(t, p.in_spatial)
  irows, _ = p.rows(idx, p.out_spatial)
  expected = p.unrows(np.take_along_axis(trows, irows, 1), lead, p.out_spatial)
  _, yt = jax.jvp(lambda v: jaxpool.adaptive_max_pool(v, out, data_format=fmt), (x,), (t,))
  assert_bitwise(yt, expected.astype(np.float32))
  (_, _), (yt2, it) = jax.jvp(
      lambda v: jaxpool.adaptive_max_pool_with_indices(v, out, data_format=fmt), (x,), (t,))
  assert_same_bits(yt2, yt)
  assert it.dtype == jax.dtypes.float0
  _, at = jax.jvp(lambda v: jaxpool.adaptive_avg_pool(v, out, data_format=fmt), (x,), (t,))
  np.testing.assert_allclose(at, ref_avg(t, out, fmt), **tol(np.float32, 8))


def test_vmap_grad_and_vmap(rng):
  x = tie_rich(rng, (3, 2, 9, 7, 2), specials=True)
  for f in [lambda v: jaxpool.adaptive_max_pool(v, (4, 9)),
            lambda v: jaxpool.adaptive_avg_pool(v, (4, 9)),
            lambda v: jaxpool.global_max_pool(v),
            lambda v: jaxpool.global_avg_pool(v)]:
    loss = lambda v, f=f: jnp.sum(jnp.where(jnp.isnan(f(v)), 0, f(v)) ** 2)
    vg = jax.jit(jax.vmap(jax.grad(loss)))(x)
    g = jgrad(loss)
    for b in range(3):
      assert_same_bits(vg[b], g(x[b]))
  xm = tie_rich(rng, (3, 9, 7, 2), specials=True)  # vmap adds a batch dim to adaptive pooling
  y, i = jax.vmap(lambda v: jaxpool.adaptive_max_pool_with_indices(v, (4, 9)))(xm)
  y_ref, i_ref = ref_max_with_indices(xm, (4, 9))
  assert_bitwise(y, y_ref)
  assert_bitwise(i, i_ref)


def test_hessian_of_max(rng):
  """f = sum(adaptive_max(x)^2): the Hessian is diag(2 * how many bins chose each element)."""
  x = unique_values(rng, (1, 3, 4, 1))
  f = lambda v: jnp.sum(jaxpool.adaptive_max_pool(v, (5, 3)) ** 2)
  h = jax.jit(jax.hessian(f))(x).reshape(12, 12)
  _, idx = ref_max_with_indices(x, (5, 3))
  counts = np.bincount(idx.reshape(-1), minlength=12)
  np.testing.assert_array_equal(h, np.diag(2.0 * counts))


def test_jit_equals_eager_and_gradients_repeat_bit_for_bit(rng):
  x = rng.standard_normal((2, 11, 13, 3)).astype(np.float32)
  for f in [lambda v: jaxpool.adaptive_max_pool(v, (19, 5)),
            lambda v: jaxpool.adaptive_avg_pool(v, (19, 5)),
            lambda v: jaxpool.global_max_pool(v, keepdims=True),
            lambda v: jaxpool.global_avg_pool(v)]:
    assert_same_bits(jax.jit(f)(x), f(x))
    dy = rng.standard_normal(f(x).shape).astype(np.float32)
    g = jax.jit(jax.grad(lambda v, f=f, dy=dy: jnp.sum(f(v) * dy)))
    assert_same_bits(g(x), g(x))


def _jaxprs_in_params(params):
  find = getattr(jax.extend.core, "jaxprs_in_params", None)  # JAX 0.11; older: jax.core
  return (find or jax.core.jaxprs_in_params)(params)


def _backward_ops(f, x):
  """The primitive names in the jaxpr of ``jax.grad`` of ``sum(f)``."""
  jaxpr = jax.make_jaxpr(jax.grad(lambda v: jnp.sum(f(v))))(x)
  names = set()

  def visit(j):
    for eqn in j.eqns:
      names.add(eqn.primitive.name)
      for sub in _jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  return names


def test_gradient_structure_is_deterministic_by_construction():
  """Upsampling: no scatter at all in the gradient; global max: no scatter either.

  Downsampling may scatter-add, but each element gets at most two values (checked on the
  tables), and ``0 + a + b`` is the same float in either order.
  """
  x = np.zeros((2, 5, 3, 2), np.float32)
  for f in [lambda v: jaxpool.adaptive_max_pool(v, (11, 7)),
            lambda v: jaxpool.adaptive_avg_pool(v, (11, 7)),
            lambda v: jaxpool.global_max_pool(v),
            lambda v: jaxpool.global_avg_pool(v)]:
    names = _backward_ops(f, x)
    assert not any("scatter" in n for n in names), names
  for size in range(1, 40):
    for out in range(1, size + 1):
      tab = _plan.table(size, out)
      if tab.kind == "gather":
        hits = np.bincount(tab.gather[tab.gather < size], minlength=size)
        assert hits.max() <= 2, (size, out)
    for out in range(size + 1, 3 * size + 3):
      assert _plan.table(size, out).k <= 2  # a bin holds at most two elements


# ------------------------------------------------------------------------------ global


@pytest.mark.parametrize("shape,fmt", [((3, 7, 5, 4), "channels_last"),
                                       ((3, 4, 7, 5), "channels_first"),
                                       ((2, 9, 3), "channels_last"),
                                       ((2, 3, 4, 3, 5, 2), "channels_last"),
                                       ((2, 3, 4, 3, 5), "channels_first")])
def test_global(shape, fmt, rng):
  x = tie_rich(rng, shape, specials=True)
  y = jaxpool.global_max_pool(x, data_format=fmt)
  assert_bitwise(y, ref_global(lambda *a: ref_max_with_indices(*a)[0], x, fmt))
  yk = jaxpool.global_max_pool(x, data_format=fmt, keepdims=True)
  assert_bitwise(yk, ref_max_with_indices(x, (1,) * (x.ndim - 2), fmt)[0])
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  g = jgrad(lambda v: jnp.sum(jaxpool.global_max_pool(v, data_format=fmt) * dy))(x)
  dyk = dy.reshape(yk.shape)
  assert_bitwise(g, ref_max_grad(x, dyk, (1,) * (x.ndim - 2), fmt).astype(np.float32) + 0.0)
  # adaptive pooling to ones is global pooling
  assert_bitwise(jaxpool.adaptive_max_pool(x, (1,) * (x.ndim - 2), data_format=fmt), yk)
  _, ik = jaxpool.adaptive_max_pool_with_indices(x, (1,) * (x.ndim - 2), data_format=fmt)
  assert_bitwise(ik, ref_max_with_indices(x, (1,) * (x.ndim - 2), fmt)[1])
  xu = rng.standard_normal(shape).astype(np.float32)
  a = jaxpool.global_avg_pool(xu, data_format=fmt)
  np.testing.assert_allclose(a, ref_global(ref_avg, xu, fmt), **tol(np.float32, 64))
  ak = jaxpool.global_avg_pool(xu, data_format=fmt, keepdims=True)
  np.testing.assert_allclose(ak, ref_avg(xu, (1,) * (x.ndim - 2), fmt), **tol(np.float32, 64))
  ga = jgrad(lambda v: jnp.sum(jaxpool.global_avg_pool(v, data_format=fmt) * dy))(xu)
  np.testing.assert_allclose(ga, ref_avg_grad(dyk, shape, (1,) * (x.ndim - 2), fmt),
                             **tol(np.float32))


def test_global_max_gradient_is_not_split_among_ties():
  x = np.array([[3., 1.], [3., 3.]], np.float32)[None, :, :, None]
  g = jax.grad(lambda v: jaxpool.global_max_pool(v).sum())(x)
  np.testing.assert_array_equal(g[0, ..., 0], [[1, 0], [0, 0]])
  g_jnp = jax.grad(lambda v: v.max(axis=(1, 2)).sum())(x)  # JAX splits: 1/3 each
  assert not np.array_equal(g, g_jnp)
  _, t = jax.jvp(jaxpool.global_max_pool, (x,), (np.arange(4.0, dtype=np.float32)
                                                 .reshape(x.shape),))
  np.testing.assert_array_equal(t, [[0.0]])


def test_global_integer_max(rng):
  x = rng.integers(-5, 5, size=(2, 4, 3, 3)).astype(np.int16)
  assert_bitwise(jaxpool.global_max_pool(x), x.max(axis=(1, 2)))


# ------------------------------------------------------------------------------ fast path


@pytest.mark.parametrize("shape,out,fmt", [((2, 8, 6, 3), (4, 2), "channels_last"),
                                           ((2, 3, 9, 6), (3, 3), "channels_first")])
def test_divisible_sizes_equal_fixed_window_pooling(shape, out, fmt, rng):
  """Evenly dividing sizes: the same bits as max_pool/avg_pool with window = stride = L // O,
  whether the call goes there (small bins) or through the stages (forced here)."""
  x = tie_rich(rng, shape, specials=True)
  xu = rng.standard_normal(shape).astype(np.float32)
  axes = (1, 2) if fmt == "channels_last" else (2, 3)
  w = tuple(shape[a] // o for a, o in zip(axes, out, strict=True))
  plan = _plan.Plan(tuple(shape[a] for a in axes), out, fmt == "channels_last")
  y = jaxpool.max_pool(x, w, w, data_format=fmt)
  # (Values bit for bit, NaN as NaN: a GPU's XLA max may return another NaN payload.)
  assert_bitwise(jaxpool.adaptive_max_pool(x, out, data_format=fmt), y)
  assert_bitwise(_stages.adaptive_max_jit(x, plan), y)
  _, i = jaxpool.max_pool_with_indices(x, w, w, data_format=fmt)
  assert_same_bits(jaxpool.adaptive_max_pool_with_indices(x, out, data_format=fmt)[1], i)
  assert_same_bits(_stages.adaptive_max_indices_jit(x, plan)[1], i)
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  g = jaxpool.max_pool_grad(x, dy, w, w, data_format=fmt)
  assert_same_bits(jgrad(lambda v: jnp.sum(_stages.adaptive_max(v, plan) * dy))(x), g)
  a = jaxpool.avg_pool(xu, w, w, data_format=fmt)
  np.testing.assert_allclose(jaxpool.adaptive_avg_pool(xu, out, data_format=fmt), a,
                             **tol(np.float32, math.prod(w)))
  np.testing.assert_allclose(_stages.adaptive_avg_jit(xu, plan), a,
                             **tol(np.float32, math.prod(w)))


# ------------------------------------------------------------------------------ properties


@st.composite
def adaptive_configs(draw):
  n = draw(st.integers(1, 3))
  hi = 6 if n == 3 else 9
  spatial = [draw(st.integers(1, hi)) for _ in range(n)]
  out = [draw(st.one_of(st.none(), st.integers(1, hi + 2))) for _ in range(n)]
  batch = [draw(st.integers(1, 2)) for _ in range(draw(st.integers(0, 2)))]
  c = draw(st.integers(1, 2))
  fmt = draw(st.sampled_from(["channels_last", "channels_first"]))
  shape = (*batch, *spatial, c) if fmt == "channels_last" else (*batch, c, *spatial)
  return tuple(shape), tuple(out), fmt


@SETTINGS
@hypothesis.given(cfg=adaptive_configs(), seed=st.integers(0, 2**31 - 1),
                  specials=st.booleans())
def test_max_property(cfg, seed, specials):
  shape, out, fmt = cfg
  rng = np.random.default_rng(seed)
  x = tie_rich(rng, shape, specials=specials)
  y, i = jaxpool.adaptive_max_pool_with_indices(x, out, data_format=fmt)
  y_ref, i_ref = ref_max_with_indices(x, out, fmt)
  assert_bitwise(y, y_ref)
  assert_bitwise(i, i_ref)
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  g = jgrad(lambda v: jnp.sum(jaxpool.adaptive_max_pool(v, out, data_format=fmt) * dy))(x)
  assert_bitwise(g, ref_max_grad(x, dy, out, fmt).astype(np.float32) + 0.0)


@SETTINGS
@hypothesis.given(cfg=adaptive_configs(), seed=st.integers(0, 2**31 - 1))
def test_avg_property(cfg, seed):
  shape, out, fmt = cfg
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  y = jaxpool.adaptive_avg_pool(x, out, data_format=fmt)
  np.testing.assert_allclose(y, ref_avg(x, out, fmt), **tol(np.float32, 16))
  dy = rng.standard_normal(y.shape).astype(np.float32)
  g = jgrad(lambda v: jnp.sum(jaxpool.adaptive_avg_pool(v, out, data_format=fmt) * dy))(x)
  np.testing.assert_allclose(g, ref_avg_grad(dy, shape, out, fmt), **tol(np.float32, 16))


# ------------------------------------------------------------------------------ errors

X = np.zeros((2, 6, 6, 3), np.float32)
ADAPTIVE = {
    "adaptive_max_pool": jaxpool.adaptive_max_pool,
    "adaptive_max_pool_with_indices": jaxpool.adaptive_max_pool_with_indices,
    "adaptive_avg_pool": jaxpool.adaptive_avg_pool,
}
BAD = {
    "zero": ((0, 2), {}, ValueError, E("output_size") + ".*0.*" + E("(0, 2)")),
    "negative": ((2, -1), {}, ValueError, E("output_size") + ".*-1.*" + E("(2, -1)")),
    "float": ((2.0, 2), {}, TypeError, E("output_size") + ".*2.0"),
    "bool": ((True, 2), {}, TypeError, E("output_size") + ".*True"),
    "int": (7, {}, TypeError, "output_size.*7"),
    "bool_scalar": (True, {}, TypeError, "output_size.*True"),
    "none": (None, {}, TypeError, "output_size.*None"),
    "string": ("77", {}, TypeError, "output_size.*'7'"),
    "empty": ((), {}, ValueError, E("output_size") + ".*" + E("()")),
    "too_long": ((2, 2, 2, 2), {}, ValueError,
                 "x must have at least 5 dims.*" + E("(2, 2, 2, 2)") + ".*" + E("(2, 6, 6, 3)")),
    "data_format": ((2, 2), dict(data_format="NHWC"), ValueError, "data_format.*'NHWC'"),
    "implementation": ((4, 4), dict(implementation="cuda"), ValueError, "implementation.*'cuda'"),
}


@pytest.mark.parametrize("op", list(ADAPTIVE))
@pytest.mark.parametrize("bad", list(BAD))
def test_adaptive_bad_arguments(op, bad):
  out, kw, exc, pattern = BAD[bad]
  with pytest.raises(exc, match=pattern):
    ADAPTIVE[op](X, out, **kw)


def test_bad_inputs():
  with pytest.raises(ValueError, match=E("x must have at least 3 dims") + ".*" + E("(6, 6)")):
    jaxpool.adaptive_max_pool(np.zeros((6, 6)), (2, 2))
  with pytest.raises(ValueError, match="non-empty spatial.*" + E("(2, 0, 6, 3)")):
    jaxpool.adaptive_max_pool(np.zeros((2, 0, 6, 3)), (2, 2))
  with pytest.raises(TypeError, match="x must have a float dtype; got int32"):
    jaxpool.adaptive_avg_pool(np.zeros((2, 6, 6, 3), np.int32), (2, 2))
  with pytest.raises(TypeError, match="x must have a float or integer dtype; got bool"):
    jaxpool.adaptive_max_pool(np.zeros((2, 6, 6, 3), bool), (2, 2))
  with pytest.raises(TypeError, match="x must be an array"):
    jaxpool.adaptive_max_pool("x", (2, 2))
  for f in (jaxpool.global_max_pool, jaxpool.global_avg_pool):
    with pytest.raises(ValueError, match="x must have at least 3 dims.*" + E("(2, 3)")):
      f(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="data_format.*'NCHW'"):
      f(X, data_format="NCHW")
    with pytest.raises(TypeError, match="keepdims must be a bool; got 1"):
      f(X, keepdims=1)
    with pytest.raises(ValueError, match="non-empty spatial.*" + E("(2, 3, 0)")):
      f(np.zeros((2, 3, 0), np.float32), data_format="channels_first")
  with pytest.raises(TypeError, match="x must have a float dtype; got int32"):
    jaxpool.global_avg_pool(np.zeros((2, 6, 6, 3), np.int32))


# ------------------------------------------------------------------------------ jit caching


class _Records(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.mark.parametrize("op", ["adaptive_max_pool", "adaptive_max_pool_with_indices",
                                "adaptive_avg_pool", "global_max_pool", "global_avg_pool"])
def test_no_retrace_for_repeated_eager_calls(op, rng):
  """A second eager call with the same shapes and sizes neither traces nor compiles."""
  width = 30 + len(op)  # shapes no other test uses: the first call must compile
  x = unique_values(rng, (1, 5, width, 2))
  out = (3, 7) if op.startswith("adaptive") else None
  call = (lambda: getattr(jaxpool, op)(x, out)) if out else (lambda: getattr(jaxpool, op)(x))
  handler = _Records()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      jax.block_until_ready(call())
      first = list(handler.messages)
      handler.messages.clear()
      jax.block_until_ready(call())
      second = list(handler.messages)
  finally:
    logger.removeHandler(handler)
  assert any("Compiling" in m for m in first), first
  assert not [m for m in second if "tracing" in m.lower() or "compiling" in m.lower()], second


def test_no_retrace_under_jit(rng):
  traces = []

  @jax.jit
  def f(v):
    traces.append(1)
    return jaxpool.adaptive_max_pool(v, (3, 7)).sum() + jaxpool.global_avg_pool(v).sum()

  x = unique_values(rng, (1, 5, 9, 2))
  f(x)
  f(x + 1)
  assert len(traces) == 1


def test_torch_is_not_needed():
  assert "torch" not in sys.modules


def test_pallas_is_refused_where_no_kernel_serves():
  x = jnp.ones((1, 13, 13, 2))
  for fn in (jaxpool.adaptive_max_pool, jaxpool.adaptive_avg_pool,
             jaxpool.adaptive_max_pool_with_indices):
    with pytest.raises(ValueError, match="implementation='pallas' cannot serve .*no Pallas"):
      fn(x, (7, 7), implementation="pallas")
    with pytest.raises(ValueError, match="implementation='pallas' cannot serve .*global"):
      fn(x, (1, 1), implementation="pallas")
  # evenly dividing sizes are fixed windows: the kernels serve them
  jaxpool.adaptive_max_pool(jnp.ones((1, 8, 8, 2)), (4, 4), implementation="pallas")


def test_signed_zero_follows_max_pool():
  # +0.0 beats -0.0, as in max_pool: the value at the index is the output, bit for bit.
  x = jnp.asarray([-0.0, 0.0, -0.0, -0.0, 1.0, -0.0, 0.0], jnp.float32).reshape(1, 7, 1)
  y, i = jaxpool.adaptive_max_pool_with_indices(x, (3,))
  at_index = np.asarray(x)[0, np.asarray(i)[0, :, 0], 0]
  np.testing.assert_array_equal(np.signbit(np.asarray(y))[0, :, 0], np.signbit(at_index))
  np.testing.assert_array_equal(np.asarray(y)[0, :, 0], at_index)
  y2, _ = jaxpool.max_pool_with_indices(x[:, :2], (2,))
  np.testing.assert_array_equal(np.signbit(np.asarray(y2)), [[[False]]])


def test_route_follows_the_kernels(monkeypatch):
  from jaxpool._src import dispatch
  from jaxpool._src.backend import Op
  monkeypatch.delenv(dispatch.ENV, raising=False)
  x = jnp.ones((1, 35, 35, 2))
  plan = _plan.Plan((35, 35), (7, 7), True)  # 5x5 bins: 25 taps
  monkeypatch.setattr(dispatch, "platform", lambda: "cpu")
  assert _adaptive._route(plan, x, Op.MAX_POOL) == "stages"
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  assert _adaptive._route(plan, x, Op.MAX_POOL) == "fixed"
  assert _adaptive._route(plan, x, Op.AVG_POOL) == "fixed"
  x56 = jnp.ones((1, 56, 56, 2))
  assert _adaptive._route(_plan.Plan((56, 56), (7, 7), True), x56, Op.MAX_POOL) == "stages"


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16,
                                   ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
                                   ml_dtypes.float8_e8m0fnu, np.int8, np.int32, np.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_first_max_forms_agree(dtype, rng):
  """The three forms (one reduction of order keys with jnp.argmax, two integer reductions, and
  the slot-by-slot scan of short axes with beats) give the same indices and the same bits, on
  data heavy with ties, signed zeros, subnormals, NaN and infinities."""
  vals = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.0, 1e-40])
  if np.dtype(dtype).kind in "iub":
    vals = np.array([-3, 0, 1, 2, 1, 0])
  x = jnp.asarray(rng.choice(vals, size=(3, 9, 4, 5)).astype(dtype))
  forms = (_stages.first_max_keyed, _stages.first_max_scan)
  for axis in (1, 3):
    y2, i2 = jax.jit(_stages.first_max_two_pass, static_argnums=(1, 2))(x, axis, np.int16)
    y2 = np.asarray(y2)
    for form in forms:
      yk, ik = jax.jit(form, static_argnums=(1, 2))(x, axis, np.int16)
      assert ik.dtype == i2.dtype == np.int16
      np.testing.assert_array_equal(np.asarray(ik), np.asarray(i2))
      yk = np.asarray(yk)
      nan = np.isnan(y2.astype(np.float32)) & np.isnan(yk.astype(np.float32))
      assert_same_bits(np.where(nan, 0, yk).astype(y2.dtype),
                       np.where(nan, 0, y2).astype(y2.dtype))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_order_key_sorts_every_16_bit_value_as_max_pool_does(dtype):
  """Every bit pattern: keys in the order of the values, -0.0 just below +0.0, NaN on top."""
  from jaxpool._src import dtypes
  v = np.arange(2**16, dtype=np.uint16).view(dtype)
  keys = np.asarray(dtypes.order_key(jnp.asarray(v))).astype(np.int64)
  with np.errstate(invalid="ignore"):
    f = v.astype(np.float32).astype(np.float64)
  nan = np.isnan(f)
  top = np.iinfo(np.int32).max
  assert (keys[nan] == top).all() and (keys[~nan] < top).all()
  # ordered by (value, sign bit clear), the non-NaN keys rise strictly: equal values differ
  # only as -0.0 and +0.0
  num, k = f[~nan], keys[~nan]
  order = np.lexsort((~np.signbit(num), num))
  assert (np.diff(k[order]) > 0).all()


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e8m0fnu,
                                   ml_dtypes.float8_e5m2],
                         ids=lambda d: np.dtype(d).name)
def test_global_max_of_narrow_floats(dtype, rng):
  """Formats without a sign bit (e8m0fnu) or with NaN where -0.0 would be (fnuz): the
  global max and its index against a NumPy loop over float32 values (first NaN, else the first
  maximum)."""
  vals = np.array([0.25, 0.5, 1.0, 2.0, 4.0, -1.0, -0.0, 0.0], np.float32)
  if dtype == ml_dtypes.float8_e8m0fnu:  # (powers of two only; the rest would be NaN)
    vals = vals[:5]
  f = rng.choice(vals, size=(3, 4, 5, 2))
  f[:, 1, 2, 1] = np.nan  # channel 1: a NaN in every window
  with np.errstate(invalid="ignore", over="ignore"):
    x = f.astype(dtype)
  y, i = jaxpool.adaptive_max_pool_with_indices(jnp.asarray(x), (1, 1))
  f = x.astype(np.float32)
  for b, c in itertools.product(range(3), range(2)):
    col = f[b, :, :, c].reshape(-1)
    nan = np.flatnonzero(np.isnan(col))
    want = nan[0] if nan.size else int(np.flatnonzero(col == col.max())[0])
    assert int(np.asarray(i)[b, 0, 0, c]) == want, (b, c, col)
    assert np.array_equal(np.asarray(y).astype(np.float32)[b, 0, 0, c], col[want],
                          equal_nan=True)
