"""jaxpool.optimize: unmodified Flax, Equinox and lax code computes the same with jaxpool.

* Max pooling: values and gradients bit for bit against the same function rewritten by hand with
  jaxpool (the same calls, the same ``implementation``) on every backend, on tie-rich inputs too
  (ties, NaN: jaxpool's documented rule, which XLA's ``select_and_scatter_add`` does not follow).
  Against the original code (XLA's gradient) on inputs without ties: bit for bit where jaxpool
  runs XLA on a CPU, else to rounding (a GPU, or the Pallas kernels, sum overlapping windows in
  another order).
* Average pooling: to float32 rounding.
* ReLU folding: values and gradients bit for bit against the unfolded code on tie-rich inputs
  (zeros of both signs, negatives, NaN, -inf).
* The rewritten programs hold no ``select_and_scatter_add`` (nor, with
  ``implementation="pallas"``, anything but ``pallas_call`` for the pools).

``implementation=None`` runs the Pallas kernels on NVIDIA GPUs. ``JAXPOOL_TEST_PLATFORM=cuda`` runs
this whole file with that dispatch on any machine (on a CPU the kernels run in interpret mode,
about four times slower); ``test_pallas_implementation`` runs both ways every time.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import device_checks

import jaxpool
from jaxpool._src import dispatch

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

RNG = np.random.default_rng(0)
JAXPOOL_SRC = str(Path(jaxpool.__file__).parent / "_src")


# ----------------------------------------------------------------------------- dispatch


@pytest.fixture(autouse=True)
def _platform_from_env(monkeypatch):
  """``JAXPOOL_TEST_PLATFORM=cuda``: the whole file with a GPU's dispatch."""
  name = os.environ.get("JAXPOOL_TEST_PLATFORM", "").strip().lower()
  if name:
    monkeypatch.setattr(dispatch, "platform", lambda: name)


@pytest.fixture(autouse=True)
def _replace_every_site(monkeypatch):
  """This file checks what the rewrites compute, so every recognised site is replaced, small
  ones on a GPU included (the cost decision is tested in tests/optimize/test_optimize_cost.py)."""
  from jaxpool._src.optimize import cost, wrapper
  monkeypatch.setattr(wrapper, "default_cost", cost.always)


def kernels_by_default() -> bool:
  """Whether ``implementation=None`` picks the Pallas kernels (where they serve the call)."""
  return dispatch.pallas_by_default()


def xla_exact(implementation=None) -> bool:
  """Whether jaxpool's gradients are XLA's own bits: only where jaxpool runs XLA on a CPU. A GPU's
  ``select_and_scatter_add`` (and the Pallas kernels) sum overlapping windows in another order."""
  uses_kernels = implementation == "pallas" or (implementation is None and kernels_by_default())
  return jax.default_backend() == "cpu" and not uses_kernels


# ----------------------------------------------------------------------------- helpers


def normal(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def tie_rich(*shape, nan=True):
  """Zeros of both signs, repeated small values, negatives, -inf and (optionally) NaN."""
  pool = [-np.inf, -2.0, -1.0, -0.0, 0.0, 0.0, 1.0, 1.0, 2.0] + ([np.nan] if nan else [])
  return jnp.asarray(RNG.choice(np.array(pool, np.float32), size=shape))


def bits(a, b, what=""):
  """Same shapes, dtypes and bits (NaN compared as NaN, -0.0 told from 0.0)."""
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    u, v = np.asarray(u), np.asarray(v)
    assert u.shape == v.shape and u.dtype == v.dtype, (what, u.shape, v.shape, u.dtype, v.dtype)
    np.testing.assert_array_equal(np.isnan(u), np.isnan(v), err_msg=f"NaN mask {what}")
    ok = ~np.isnan(u)
    np.testing.assert_array_equal(u.view(np.uint32)[ok], v.view(np.uint32)[ok], err_msg=what)


def close(a, b, tol=2e-6):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


def like_xla(got, ref, what="", *, terms, implementation=None):
  """``got`` (jaxpool) against XLA's own result ``ref``: the same bits where :func:`xla_exact`,
  else float32 rounding of sums of up to ``terms`` overlapping windows."""
  if xla_exact(implementation):
    bits(got, ref, what)
  else:
    close(got, ref, 2e-6 * terms)


def prims(jaxpr, *, skip_jaxpool=False) -> list[str]:
  """Every primitive in a jaxpr and its sub-jaxprs (optionally not inside jaxpool's own ops)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  out = []
  for eqn in jaxpr.eqns:
    out.append(eqn.primitive.name)
    if eqn.primitive.name == "jaxpool_pallas_kernel":  # a kernel call: a pallas_call, lowered
      out.append("pallas_call")
    for v in eqn.params.values():
      for sub in v if isinstance(v, tuple) else (v,):
        sub = getattr(sub, "jaxpr", sub) if hasattr(sub, "jaxpr") else sub
        if hasattr(sub, "eqns"):
          src = getattr(sub.debug_info, "func_src_info", "") or ""
          if skip_jaxpool and JAXPOOL_SRC in src:
            continue
          out += prims(sub, skip_jaxpool=skip_jaxpool)
  return out


def grad_of(f, w):
  """The gradient of ``sum(f(x) * w)``: a random cotangent, so sums of several windows'
  cotangents are exercised."""
  return jax.grad(lambda x: (f(x) * w).sum())


def lax_max(window, strides, padding, dilation=None):
  return lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding,
                                     window_dilation=dilation)


# ----------------------------------------------------------------------------- raw lax max


# (input shape, window_dimensions, window_strides, padding): every layout jaxpool maps.
LAX_MAX = {
    "nhwc_same": ((2, 9, 10, 3), (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
    "nhwc_valid": ((2, 8, 8, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
    "nhwc_explicit": ((2, 9, 9, 3), (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (0, 1), (0, 0))),
    "nchw": ((2, 3, 9, 9), (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (1, 1))),
    "hwc_no_batch": ((9, 9, 3), (3, 3, 1), (2, 2, 1), "SAME"),
    "hw_only": ((9, 10), (3, 3), (2, 2), "SAME"),
    "1d": ((2, 17, 3), (1, 3, 1), (1, 2, 1), "SAME"),
    "3d": ((2, 5, 6, 7, 2), (1, 2, 3, 2, 1), (1, 2, 2, 2, 1), "SAME"),
    "hnwc_transposed": ((9, 2, 9, 3), (3, 1, 3, 1), (2, 1, 2, 1), "SAME"),
    "two_batch_dims": ((2, 2, 8, 8, 3), (1, 1, 3, 3, 1), (1, 1, 1, 1, 1), "VALID"),
}


def by_hand(case, implementation=None):
  """``LAX_MAX[case]`` rewritten by hand as one ``jaxpool.max_pool`` call in the layout that
  docs/optimize.md gives: pooled dims before one trailing dim are ``channels_last``, pooled dims
  at the end ``channels_first``, any other layout is transposed to channels-first."""
  shape, window, strides, padding = LAX_MAX[case]
  n = len(shape)
  spatial = [i for i in range(n) if window[i] != 1 or strides[i] != 1]
  other = [i for i in range(n) if i not in spatial]
  pads = lax.padtype_to_pads(shape, window, strides, padding) if isinstance(padding, str) else (
      padding)
  pick = lambda v: tuple(v[i] for i in spatial)
  k = len(spatial)
  if spatial == list(range(n - 1 - k, n - 1)):
    perm, data_format = None, "channels_last"
  elif spatial == list(range(n - k, n)) and other:
    perm, data_format = None, "channels_first"
  else:
    perm, data_format = other + spatial, "channels_first"

  def pool(x):
    if perm is not None:
      x = jnp.transpose(x, perm)
    if not other:
      x = x[None]
    y = jaxpool.max_pool(x, pick(window), pick(strides), pick(pads), data_format=data_format,
                         implementation=implementation)
    if not other:
      y = y[0]
    return y if perm is None else jnp.transpose(y, np.argsort(perm))
  return pool


@pytest.mark.parametrize("case", list(LAX_MAX))
def test_lax_max_pool_bits(case):
  shape, window, strides, padding = LAX_MAX[case]
  f = lax_max(window, strides, padding)
  g = jaxpool.optimize(f)
  x = normal(*shape)
  y = f(x)
  w = normal(*y.shape)
  # optimize of the gradient: XLA's select_and_scatter_add is replaced too.
  og = jaxpool.optimize(grad_of(f, w))

  @jax.jit  # every program of the comparisons in one compile
  def run(x):
    return (g(x), grad_of(by_hand(case), w)(x), grad_of(g, w)(x), grad_of(f, w)(x), og(x))

  y_opt, want, got, ref, og_x = run(x)
  bits(y_opt, y, "forward")
  bits(got, want, "gradient vs jaxpool by hand")
  like_xla(got, ref, "gradient vs XLA (no ties)", terms=math.prod(window))
  rep = g.report(x)
  assert [d.op for d in rep.replaced] == ["reduce_window_max"], str(rep)
  assert "select_and_scatter_add" not in prims(jax.make_jaxpr(grad_of(g, w))(x))
  assert "select_and_scatter_add" not in prims(jax.make_jaxpr(og)(x))
  bits(og_x, want, "optimize(grad)")


@pytest.mark.parametrize("case", ["nhwc_same", "nchw", "hnwc_transposed", "3d"])
def test_ties_follow_jaxpools_rule(case):
  """On tie-rich inputs the gradient is jaxpool's (the first maximum, the first NaN), both for
  ``grad(optimize(f))`` and ``optimize(grad(f))``."""
  shape, window, strides, padding = LAX_MAX[case]
  f = lax_max(window, strides, padding)
  x = tie_rich(*shape)
  direct = by_hand(case)
  y = direct(x)
  w = normal(*y.shape)
  bits(jaxpool.optimize(f)(x), y, "forward")
  want = jax.jit(grad_of(direct, w))(x)
  bits(jax.jit(grad_of(jaxpool.optimize(f), w))(x), want, "grad(optimize)")
  bits(jax.jit(jaxpool.optimize(grad_of(f, w)))(x), want, "optimize(grad)")


def test_xla_ties_differ_from_jaxpool_where_documented():
  """XLA's gradient sends a NaN window's cotangent past the NaN; jaxpool's to the first NaN."""
  f = lax_max((1, 2, 1), (1, 2, 1), "VALID")
  x = jnp.array([np.nan, 1.0, 1.0, 1.0]).reshape(1, 4, 1)
  loss = lambda x: f(x).sum()
  np.testing.assert_array_equal(jax.grad(loss)(x).ravel(), [0, 1, 1, 0])
  np.testing.assert_array_equal(jaxpool.optimize(jax.grad(loss))(x).ravel(), [1, 0, 1, 0])
  np.testing.assert_array_equal(jax.grad(jaxpool.optimize(loss))(x).ravel(), [1, 0, 1, 0])


def test_dilated_max_pool_becomes_differentiable():
  """JAX has no gradient for a dilated max pool; the optimized one has jaxpool's."""
  f = lax_max((1, 2, 2, 1), (1, 1, 1, 1), "VALID", (1, 2, 2, 1))
  x = normal(2, 7, 7, 3)
  g = jaxpool.optimize(f)
  bits(g(x), f(x))
  with pytest.raises(NotImplementedError):
    jax.grad(lambda x: f(x).sum())(x)
  want = jax.grad(lambda x: jaxpool.max_pool(x, (2, 2), dilation=(2, 2)).sum())(x)
  bits(jax.grad(lambda x: g(x).sum())(x), want)


def test_jvp_is_replaced():
  f = lax_max((1, 3, 3, 1), (1, 2, 2, 1), "SAME")
  x, t = normal(2, 9, 9, 3), normal(2, 9, 9, 3)
  jvp = lambda x, t: jax.jvp(f, (x,), (t,))
  g = jaxpool.optimize(jvp)
  assert "select_and_gather_add" not in prims(jax.make_jaxpr(g)(x, t))
  bits(g(x, t), jvp(x, t))


def test_generic_reduce_window():
  """A reduce_window whose computation is max and whose init is -inf is a max pool; with another
  init it is left alone."""
  x = normal(2, 8, 8, 3)
  maxed = lambda a, b: jnp.maximum(a, b)  # not lax.max itself: JAX keeps the generic primitive
  f = lambda x: lax.reduce_window(x, np.float32(-np.inf), maxed, (1, 2, 2, 1), (1, 2, 2, 1),
                                  "VALID")
  h = lambda x: lax.reduce_window(x, 0.0, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
  assert "reduce_window" in prims(jax.make_jaxpr(f)(x))
  rep = jaxpool.optimize(f).report(x)
  assert [d.op for d in rep.replaced] == ["reduce_window"], str(rep)
  bits(jaxpool.optimize(f)(x), f(x))
  rep = jaxpool.optimize(h).report(x)
  assert not rep.replaced and "identity" in rep.left_alone[0].detail, str(rep)
  bits(jaxpool.optimize(h)(x), h(x))


def test_left_alone_runs_unchanged():
  x = normal(2, 8, 8, 3)
  cases = {
      "base_dilation": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1),
                                                   (1, 1, 1, 1), "VALID", (1, 2, 2, 1)),
      "min pooling": lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1),
                                                 (1, 2, 2, 1), "VALID"),
      "not an average": lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1),
                                                    (1, 2, 2, 1), "VALID"),
      "padding": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 1, 1, 1),
                                             ((0, 0), (2, 2), (0, 0), (0, 0))),
      "divided by 2.5": lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1),
                                                    (1, 2, 2, 1), "VALID") / 2.5,
      "int32 average": lambda x: lax.reduce_window(x.astype(jnp.int32), 0, lax.add,
                                                   (1, 2, 2, 1), (1, 2, 2, 1), "VALID") // 4,
  }
  for name, f in cases.items():
    g = jaxpool.optimize(f)
    rep = g.report(x)
    assert not rep.replaced and rep.left_alone, (name, str(rep))
    bits(g(x), f(x), name)


def test_integer_max_pool():
  x = jnp.asarray(RNG.integers(-5, 5, (2, 8, 8, 3)), jnp.int32)
  f = lambda x: lax.reduce_window(x, jnp.iinfo(jnp.int32).min, lax.max, (1, 3, 3, 1),
                                  (1, 2, 2, 1), "SAME")
  g = jaxpool.optimize(f)
  assert g.report(x).replaced
  np.testing.assert_array_equal(g(x), f(x))


# ----------------------------------------------------------------------------- ReLU folding


POOLS = {
    "flax_3x3s2": lambda x: nn.max_pool(x, (3, 3), (2, 2), "SAME"),
    "flax_2x2": lambda x: nn.max_pool(x, (2, 2), (2, 2)),
    "lax_nchw": lax_max((1, 1, 3, 3), (1, 1, 1, 1), "VALID"),
    "eqx_chw": lambda x: jax.vmap(eqx.nn.MaxPool2d(3, 2, padding=1))(x),
}


# (`make test` keeps flax_3x3s2, overlapping windows, for Flax's max pool and for ReLU6; flax_2x2
# and eqx_chw's ReLU6 are marked slow)
@pytest.mark.parametrize("pool,act", [
    pytest.param(p, a, id=f"{p}-{a}",
                 marks=pytest.mark.slow if (p, a) in (("flax_2x2", "relu"), ("eqx_chw", "relu6"))
                 else ())
    for p, a in [(p, "relu") for p in POOLS] + [("flax_3x3s2", "relu6"), ("eqx_chw", "relu6")]])
def test_relu_folding_bits(pool, act):
  """max_pool(relu(x)) == relu(max_pool(x)), gradients too, bit for bit on tie-rich inputs."""
  f = lambda x: POOLS[pool](getattr(jax.nn, act)(x * 4))  # * 4: values past relu6's 6
  x = tie_rich(2, 6, 9, 9) if pool == "eqx_chw" else tie_rich(2, 9, 9, 6)
  folded, plain = jaxpool.optimize(f), jaxpool.optimize(f, fold_relu=False)
  rep = folded.report(x)
  assert [d.op for d in rep.replaced] == [f"custom_jvp_call({act})", "reduce_window_max"], rep
  assert [d.op for d in plain.report(x).replaced] == ["reduce_window_max"]
  y = plain(x)
  bits(folded(x), y, "values")
  w = normal(*y.shape)
  bits(jax.jit(grad_of(folded, w))(x), jax.jit(grad_of(plain, w))(x), "gradients")
  # The ReLU really moved: nothing applies it before the pool (the jit of jaxpool's op). ReLU
  # is fused into the pool (activation="relu": no custom_jvp_call is left); ReLU6 runs after it.
  jaxpr = jax.make_jaxpr(folded)(x).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  pool = names.index("jit")
  assert "custom_jvp_call" not in names[:pool], names
  if act == "relu":
    assert "custom_jvp_call" not in names and "activation='relu'" in rep.replaced[1].detail, (
        names, str(rep))
  else:
    assert "custom_jvp_call" in names[pool:], names


def test_relu_with_a_second_reader_is_not_moved():
  def f(x):
    r = jax.nn.relu(x)
    return nn.max_pool(r, (2, 2), (2, 2)).sum() + r.sum()
  x = tie_rich(2, 8, 8, 3)
  g = jaxpool.optimize(f)
  rep = g.report(x)
  assert [d.op for d in rep.replaced] == ["reduce_window_max"], str(rep)
  assert "other readers" in rep.left_alone[0].detail
  bits(g(x), jaxpool.optimize(f, fold_relu=False)(x))


def test_raw_max_with_zero_is_not_moved():
  """lax.max(x, 0) has gradient 1/2 at 0: moving it after the pool would change gradients."""
  f = lambda x: nn.max_pool(jnp.maximum(x, 0.0), (2, 2), (2, 2))
  x = jnp.array([-1.0, 0.0, 0.0, -3.0]).reshape(1, 2, 2, 1)
  g = jaxpool.optimize(f)
  rep = g.report(x)
  assert "1/2" in rep.left_alone[0].detail, str(rep)
  loss = lambda f: lambda x: f(x).sum()
  bits(jax.grad(loss(g))(x), jax.grad(loss(jaxpool.optimize(f, fold_relu=False)))(x))


# ----------------------------------------------------------------------------- average pools


AVG = {
    "flax_same": lambda x: nn.avg_pool(x, (3, 3), (2, 2), "SAME"),
    "flax_valid": lambda x: nn.avg_pool(x, (2, 2), (2, 2), "VALID"),
    "flax_explicit_no_pad_count": lambda x: nn.avg_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)),
                                                        count_include_pad=False),
    "flax_same_no_pad_count": lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME",
                                                    count_include_pad=False),
    "flax_1d": lambda x: nn.avg_pool(x[:, 0], (3,), (2,), "SAME"),
    "lax_divisor_override": lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1),
                                                        (1, 2, 2, 1), "SAME") / 4.0,
    "eqx_2d": lambda x: jax.vmap(eqx.nn.AvgPool2d(3, 2, padding=1))(jnp.moveaxis(x, -1, 1)),
    "eqx_1d": lambda x: jax.vmap(eqx.nn.AvgPool1d(3, 2, padding=1))(x[:, :, 0]),
    "eqx_3d": lambda x: eqx.nn.AvgPool3d(2, 2)(x),
}


@pytest.mark.parametrize("case", list(AVG))
def test_average_pools(case):
  f = AVG[case]
  x = normal(2, 9, 9, 3)
  g = jaxpool.optimize(f)
  rep = g.report(x)
  assert [d.op for d in rep.replaced] == ["reduce_window_sum"], str(rep)
  y = f(x)
  close(g(x), y)
  w = normal(*y.shape)
  close(jax.jit(grad_of(g, w))(x), jax.jit(grad_of(f, w))(x))
  og = jaxpool.optimize(grad_of(f, w))
  assert all(d.replaced or "window counts" in d.detail for d in og.report(x).findings), (
      str(og.report(x)))
  close(jax.jit(og)(x), jax.jit(grad_of(f, w))(x))
  # Outside jaxpool's own ops, no window sum is left but the counts of ones.
  counts = "no_pad_count" in case
  assert prims(jax.make_jaxpr(og)(x), skip_jaxpool=True).count("reduce_window_sum") == counts


# ----------------------------------------------------------------------------- models


# Each model also rewritten by hand with jaxpool, as optimize rewrites it (a ReLU before a max pool
# fused into it): the same bits on every backend.
relu_pool = functools.partial(jaxpool.max_pool, activation="relu")


class LinenCNN(nn.Module):
  """A small VGG-like linen model: conv3x3 + ReLU + max pools, an average pool, a head."""

  by_hand: bool = False

  @nn.compact
  def __call__(self, x):
    for feats in (8, 16):
      x = nn.Conv(feats, (3, 3))(x)
      x = relu_pool(x, (2, 2), (2, 2)) if self.by_hand else nn.max_pool(nn.relu(x), (2, 2), (2, 2))
    x = nn.Conv(16, (3, 3))(x)
    if self.by_hand:
      x = relu_pool(x, (3, 3), (2, 2), "SAME")
      x = jaxpool.avg_pool(x, (2, 2), (2, 2), count_include_pad=False)
    else:
      x = nn.max_pool(nn.relu(x), (3, 3), (2, 2), "SAME")
      x = nn.avg_pool(x, (2, 2), (2, 2), count_include_pad=False)
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


class NnxCNN(nnx.Module):
  def __init__(self, rngs):
    self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
    self.head = nnx.Linear(8 * 4 * 4, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.max_pool(nnx.relu(self.c1(x)), (2, 2), (2, 2))
    x = nnx.max_pool(nnx.relu(self.c2(x)), (3, 3), (2, 2), "SAME")
    return self.head(x.reshape(x.shape[0], -1))

  def by_hand(self, x):
    x = relu_pool(self.c1(x), (2, 2), (2, 2))
    x = relu_pool(self.c2(x), (3, 3), (2, 2), "SAME")
    return self.head(x.reshape(x.shape[0], -1))


class EqxCNN(eqx.Module):
  c1: eqx.nn.Conv2d
  c2: eqx.nn.Conv2d
  pool: eqx.nn.MaxPool2d
  avg: eqx.nn.AvgPool2d
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.c1 = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
    self.c2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)
    self.pool = eqx.nn.MaxPool2d(2, 2)
    self.avg = eqx.nn.AvgPool2d(2, 2)
    self.head = eqx.nn.Linear(8 * 2 * 2, 10, key=k3)

  def __call__(self, x):  # x: (C, H, W), one example
    x = self.pool(jax.nn.relu(self.c1(x)))
    x = self.avg(self.pool(jax.nn.relu(self.c2(x))))
    return self.head(x.reshape(-1))

  def by_hand(self, x):
    # Equinox pools (C, H, W) as (1, H, W, C); so does its rewrite.
    def nhwc(pool):
      return lambda x: jnp.moveaxis(pool(jnp.moveaxis(x, 0, -1)[None], (2, 2), (2, 2))[0], -1, 0)
    x = nhwc(relu_pool)(self.c1(x))
    x = nhwc(jaxpool.avg_pool)(nhwc(relu_pool)(self.c2(x)))
    return self.head(x.reshape(-1))


def xent(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def filled(abstract):
  """Random parameters for abstract ones (from eval_shape): no initializer runs or compiles."""
  def fill(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return jnp.asarray(0.3 * RNG.standard_normal(leaf.shape), leaf.dtype)
    return leaf
  return jax.tree.map(fill, abstract)


def model_case(kind):
  """(loss(params, x, labels), the loss written by hand with jaxpool, params, x, labels, pools
  expected to be replaced)."""
  labels = jnp.asarray(RNG.integers(0, 10, 4))
  if kind == "linen":
    model = LinenCNN()
    x = normal(4, 16, 16, 3)
    params = filled(jax.eval_shape(model.init, jax.random.key(0), x))
    return ((lambda p, x, y: xent(model.apply(p, x), y)),
            (lambda p, x, y: xent(LinenCNN(by_hand=True).apply(p, x), y)), params, x, labels, 4)
  if kind == "nnx":
    graphdef, state = nnx.split(nnx.eval_shape(lambda: NnxCNN(nnx.Rngs(0))))
    model = nnx.merge(graphdef, filled(state))
    x = normal(4, 16, 16, 3)
    return ((lambda m, x, y: xent(m(x), y)), (lambda m, x, y: xent(m.by_hand(x), y)), model, x,
            labels, 2)
  model = filled(eqx.filter_eval_shape(EqxCNN, jax.random.key(0)))
  x = normal(4, 3, 16, 16)
  return ((lambda m, x, y: xent(jax.vmap(m)(x), y)),
          (lambda m, x, y: xent(jax.vmap(m.by_hand)(x), y)), model, x, labels, 3)


@pytest.mark.parametrize("kind", ["linen", "nnx", "equinox"])
def test_models(kind):
  loss, hand, params, x, labels, pools = model_case(kind)
  opt = jaxpool.optimize(loss)
  rep = opt.report(params, x, labels)
  ops = [d.op for d in rep.replaced]
  assert ops.count("reduce_window_max") + ops.count("reduce_window_sum") == pools, str(rep)
  assert ops.count("custom_jvp_call(relu)") == ops.count("reduce_window_max"), str(rep)
  # Equinox models hold functions: its filtered transformations treat them as static, and
  # optimize does too.
  # (the three steps in one compile)
  steps = eqx.filter_jit(lambda *a: [eqx.filter_value_and_grad(f)(*a) for f in (loss, opt, hand)])
  (l0, g0), (l1, g1), (lh, gh) = steps(params, x, labels)
  if kind == "equinox":
    # vmap batches jaxpool's gather by its batching rule in the hand-written loss, while optimize
    # rewrites the already batched program: XLA fuses the two differently, and a bias gradient (a
    # sum over batch and space) may round differently (a few ULPs on a CPU); the loss and every
    # other gradient keep the same bits.
    bits(l1, lh, "optimize vs jaxpool by hand: loss")
    close(g1, gh, 1e-6)
  else:
    bits((l1, g1), (lh, gh), "optimize vs jaxpool by hand")
  # Against the original code: to rounding (XLA's average pools and, on a GPU or with the
  # kernels, XLA's max-pool gradients sum in another order).
  close(l1, l0, 1e-6)
  close(g1, g0, 1e-5)
  make_jaxpr = lambda f: eqx.filter_make_jaxpr(f)(params, x, labels)[0]
  assert "select_and_scatter_add" not in prims(make_jaxpr(eqx.filter_grad(opt)))
  assert "select_and_scatter_add" not in prims(make_jaxpr(jaxpool.optimize(
      eqx.filter_grad(loss))))


def test_pallas_implementation(monkeypatch):
  """implementation= reaches every op: "pallas" runs the kernels (in interpret mode on a CPU),
  "xla" never does, None does where they run by default (an NVIDIA GPU: faked here)."""
  f = lambda x: nn.max_pool(nn.relu(x), (3, 3), (2, 2), "SAME")
  x = normal(1, 6, 6, 2)
  w = normal(1, 3, 3, 2)
  ref = jax.jit(grad_of(f, w))(x)
  # An explicit implementation wins on any platform; None picks the kernels, as on a GPU (unless
  # JAXPOOL_IMPLEMENTATION=xla).
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  impls = ["pallas", "xla"] + ([None] if dispatch.default_implementation() != "xla" else [])
  for impl in impls:
    names = prims(jax.make_jaxpr(grad_of(jaxpool.optimize(f, implementation=impl), w))(x))
    kernels = impl == "pallas" or (impl is None and kernels_by_default())
    assert ("pallas_call" in names) == kernels and "select_and_scatter_add" not in names, impl
  # optimize of the gradient: XLA's select_and_scatter_add becomes the same kernels.
  og = jaxpool.optimize(grad_of(f, w))
  if None in impls:
    assert "pallas_call" in prims(jax.make_jaxpr(og)(x))

  @jax.jit  # every gradient in one program: the kernels (the same in each) compile once
  def run(x):
    got = [grad_of(jaxpool.optimize(f, implementation=impl), w)(x) for impl in impls]
    hand = {impl: grad_of(lambda v, impl=impl: jaxpool.max_pool(
        v, (3, 3), (2, 2), "SAME", activation="relu", implementation=impl), w)(x)
        for impl in ("pallas", "xla")}
    return got, hand, og(x) if None in impls else None

  got, hand, og_x = run(x)
  for impl, g in zip(impls, got, strict=True):
    # None runs the kernels here: the same bits as implementation="pallas" by hand
    bits(g, hand["pallas" if impl is None else impl], f"implementation={impl!r} vs jaxpool by hand")
    like_xla(g, ref, f"implementation={impl!r} vs XLA", terms=9, implementation=impl)
  if None in impls:
    bits(og_x, hand["pallas"], "optimize(grad) vs jaxpool by hand")


def test_kernels_by_default_fall_back_to_xla(monkeypatch):
  """As on a GPU, implementation=None runs XLA where the kernels cannot serve a pool (integers,
  a dim of over 32 taps, 4 spatial dims); implementation="pallas" raises, saying why."""
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  ints = jnp.asarray(RNG.integers(-5, 5, (1, 6, 6, 2)), jnp.int32)
  cases = {
      "int32": (lambda x: lax.reduce_window(jax.nn.relu(x), jnp.iinfo(jnp.int32).min, lax.max,
                                            (1, 3, 3, 1), (1, 2, 2, 1), "SAME"), ints),
      "40 taps": (lambda x: nn.max_pool(jax.nn.relu(x), (1, 40), (1, 1)), normal(1, 3, 44, 2)),
      "4 spatial dims": (lax_max((2, 2, 2, 2, 1), (1, 1, 1, 1, 1), "VALID"),
                         normal(3, 3, 3, 3, 2)),
  }
  for name, (f, x) in cases.items():
    g = jaxpool.optimize(f)
    assert g.report(x).replaced, name
    assert "pallas_call" not in prims(jax.make_jaxpr(g)(x)), name
    np.testing.assert_array_equal(g(x), f(x), err_msg=name)
    with pytest.raises(ValueError, match="implementation='pallas' cannot serve"):
      jaxpool.optimize(f, implementation="pallas")(x)


# ----------------------------------------------------------------------------- transforms


def block(x):
  return nn.max_pool(jax.nn.relu(x), (3, 3), (1, 1), "SAME")


def block_by_hand(x):
  """``block`` rewritten by hand with jaxpool, as optimize rewrites it."""
  return jaxpool.max_pool(x, (3, 3), (1, 1), "SAME", activation="relu")


def transformed(how, block, avg_pool, x):
  """``block`` (and, for ``cond``, ``avg_pool``) inside the transformation ``how``."""
  if how == "scan":
    return lambda x: lax.scan(lambda c, _: (block(c), None), x, None, length=3)[0]
  if how == "remat":
    return jax.checkpoint(lambda x: block(block(x)))
  if how == "cond":
    return lambda x: lax.cond(x[0, 0, 0, 0] > 0, block,
                              lambda x: avg_pool(x, (3, 3), padding="SAME"), x)
  if how == "while":
    return lambda x: lax.while_loop(lambda c: c[1] < 2, lambda c: (block(c[0]), c[1] + 1),
                                    (x, 0))[0]
  if how == "inner_jit":
    return jax.jit(block)
  if how == "linen_remat_scan":
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, c, _):
        return block(nn.Conv(3, (3, 3))(c)), None
    stack = nn.scan(nn.remat(Layer), variable_broadcast="params", split_rngs={"params": False},
                    length=2)
    mod = stack()
    params = filled(jax.eval_shape(mod.init, jax.random.key(0), x, None))
    return lambda x: mod.apply(params, x, None)[0]
  return block


TRANSFORMS = ["jit_grad", "vmap_grad", "optimize_grad", "scan", "remat", "cond", "while",
              "inner_jit", "linen_remat_scan"]


@pytest.mark.parametrize("how", TRANSFORMS)
def test_transforms(how):
  x = normal(2, 8, 8, 3)
  state = RNG.bit_generator.state
  f = transformed(how, block, nn.avg_pool, x)
  RNG.bit_generator.state = state  # the same parameters for linen_remat_scan
  hand = transformed(how, block_by_hand, jaxpool.avg_pool, x)
  g = jaxpool.optimize(f)
  if how == "while":  # no reverse mode through while_loop: the forward and the JVP
    assert [d.op for d in g.report(x).replaced] == ["custom_jvp_call(relu)",
                                                     "reduce_window_max"]
    bits(g(x), f(x))
    bits(jax.jvp(g, (x,), (x,)), jax.jvp(hand, (x,), (x,)))
    bits(jax.jvp(g, (x,), (x,)), jax.jvp(f, (x,), (x,)))  # a JVP gathers: no sums
    return
  w = normal(*f(x).shape)
  rep = g.report(x)
  assert rep.replaced and all(d.replaced or d.op.startswith("custom_") for d in rep.findings), (
      str(rep))
  if how == "vmap_grad":
    one = lambda block: lambda x: (block(x[None]) * w[:1]).sum()
    per_example = lambda f: jax.vmap(jax.grad(f))(x)
    got, by_hand, xla = jax.jit(lambda: (per_example(jaxpool.optimize(one(block))),
                                         per_example(one(block_by_hand)),
                                         per_example(one(block))))()
    bits(got, by_hand, "vs jaxpool by hand")
    like_xla(got, xla, "vs XLA", terms=9)
    return
  if how == "optimize_grad":
    og = jaxpool.optimize(grad_of(f, w))
    og_x, got, by_hand = jax.jit(lambda x: (og(x), grad_of(g, w)(x), grad_of(hand, w)(x)))(x)
    bits(og_x, got)
    bits(og_x, by_hand)
    assert "select_and_scatter_add" not in prims(jax.make_jaxpr(og)(x))
    return

  @jax.jit  # every program of the comparisons in one compile
  def run(x):
    return (g(x), hand(x), f(x), grad_of(g, w)(x), grad_of(hand, w)(x), grad_of(f, w)(x))

  y, y_hand, y_f, got, got_hand, ref = run(x)
  bits(y, y_hand, "forward vs jaxpool by hand")
  close(y, y_f)  # max pools are exact, average pools and convs round
  bits(got, got_hand, "gradient vs jaxpool by hand")
  if how == "cond":  # its average pool branch rounds differently from Flax's
    close(got, ref)
  else:
    like_xla(got, ref, "gradient vs XLA", terms=9 * (2 if how == "linen_remat_scan" else 1))
  assert "select_and_scatter_add" not in prims(jax.make_jaxpr(grad_of(g, w))(x))


def test_custom_vjp_keeps_the_users_rule():
  @jax.custom_vjp
  def pool(x):
    return nn.max_pool(x, (2, 2), (2, 2))
  pool.defvjp(lambda x: (pool(x), x), lambda x, g: (jnp.full_like(x, 7.0),))
  x = normal(1, 4, 4, 1)
  g = jaxpool.optimize(pool)
  rep = g.report(x)
  assert rep.replaced and "user's" in rep.left_alone[0].detail, str(rep)
  bits(g(x), pool(x))
  bits(jax.grad(lambda x: g(x).sum())(x), jnp.full_like(x, 7.0))


def test_rebuilt_control_flow_carries_new_constants():
  """A rewrite that closes over an array: cond, scan, while and remat take it as an operand."""
  from jax.extend.core import primitives as p

  from jaxpool._src.optimize import interpreter as opt

  k = np.linspace(0, 1, 6).astype(np.float32)

  def f(x):
    a = lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)
    b = lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
    c = lax.while_loop(lambda c: c[1] < 2, lambda c: (jnp.sin(c[0]), c[1] + 1), (x, 0))[0]
    return a, b, c, jax.checkpoint(jnp.sin)(x)

  def want(x):  # f with sin(v) + k for every sin
    s = lambda v: jnp.sin(v) + k
    return lax.cond(x[0] > 0, s, jnp.cos, x), s(s(x)), s(s(x)), s(x)

  def plan(jaxpr):
    rules = {}
    for i, e in enumerate(jaxpr.eqns):
      prim = e.primitive
      if prim is p.sin_p:
        rules[i] = opt.Rule(tuple(e.invars), lambda v: [jnp.sin(v) + k])
      elif prim is p.cond_p:
        rules[i] = opt.rebuild_cond(e, [plan(b.jaxpr) for b in e.params["branches"]])
      elif prim is p.scan_p:
        rules[i] = opt.rebuild_scan(e, plan(e.params["jaxpr"].jaxpr))
      elif prim is p.while_p:
        rules[i] = opt.rebuild_while(e, {}, plan(e.params["body_jaxpr"].jaxpr))
      elif prim is p.remat_p:
        rules[i] = opt.rebuild_remat(e, plan(e.params["jaxpr"]))
    return rules
  x = jnp.arange(1.0, 7.0)
  closed = jax.make_jaxpr(f)(x)
  rules = plan(closed.jaxpr)
  run = lambda x: tuple(opt.eval_jaxpr(closed.jaxpr, closed.consts, [x], rules))
  assert "cond" in prims(jax.make_jaxpr(run)(x))
  for v in (x, -x):
    close(jax.jit(run)(v), want(v))
    close(run(v), want(v))
    loss = lambda fn: jax.grad(lambda u: sum(o.sum() for i, o in enumerate(fn(u)) if i != 2))
    close(jax.jit(loss(run))(v), loss(want)(v))


# ----------------------------------------------------------------------------- the wrapper


def test_pytrees_static_args_and_no_retrace():
  traces = []

  def f(inputs, *, window, scale):
    traces.append(1)
    y = nn.max_pool(inputs["x"], window, window)
    return {"y": y * scale, "n": y.size}
  g = jaxpool.optimize(f)
  x = normal(2, 8, 8, 3)
  out = g({"x": x}, window=(2, 2), scale=2.0)
  bits(out["y"], f({"x": x}, window=(2, 2), scale=2.0)["y"])
  assert int(out["n"]) == 2 * 4 * 4 * 3
  g({"x": x}, window=(2, 2), scale=2.0)
  g({"x": x + 1}, window=(2, 2), scale=2.0)
  assert len(traces) == 2  # one for g, one for the reference call f
  g({"x": x}, window=(4, 4), scale=2.0)  # a new static value: traced again
  assert len(traces) == 3
  # Under jit the arguments are tracers of the same types: the cached trace serves them.
  jitted = jax.jit(g, static_argnames=("window", "scale"))
  jitted({"x": x}, window=(2, 2), scale=2.0)
  jitted({"x": x}, window=(2, 2), scale=2.0)
  assert len(traces) == 3


def test_closure_over_outer_tracers():
  """A function that closes over a value of an enclosing transformation (not cached)."""
  x = normal(2, 8, 8, 3)

  def outer(s):
    return jaxpool.optimize(lambda x: nn.max_pool(x * s, (2, 2), (2, 2)))(x).sum()
  bits(jax.grad(outer)(1.5), jax.grad(lambda s: nn.max_pool(x * s, (2, 2), (2, 2)).sum())(1.5))


def test_report(capsys):
  f = lambda x: nn.avg_pool(nn.max_pool(jax.nn.relu(x), (2, 2), (2, 2)), (2, 2), (2, 2)) + (
      lax.reduce_window(x, 0.0, lax.add, (1, 4, 4, 1), (1, 4, 4, 1), "VALID"))
  x = normal(1, 8, 8, 2)
  g = jaxpool.optimize(f, report=True)
  g(x)
  printed = capsys.readouterr().out
  rep = g.report(jax.ShapeDtypeStruct(x.shape, x.dtype))
  assert printed.strip() == str(rep)
  assert len(rep.replaced) == 3 and len(rep.left_alone) == 1
  assert "3 replaced, 1 left alone" in str(rep)
  assert "not an average pool" in rep.left_alone[0].detail
  assert all("test_optimize.py" in d.source for d in rep.findings), str(rep)
  g(x)
  assert capsys.readouterr().out == ""  # printed once per traced signature
  assert repr(g).startswith("jaxpool.optimize(")


def test_bad_arguments():
  with pytest.raises(TypeError, match="fn must be callable; got int"):
    jaxpool.optimize(3)
  with pytest.raises(ValueError, match="implementation must be one of"):
    jaxpool.optimize(block, implementation="cuda")
  with pytest.raises(TypeError, match="report must be a bool"):
    jaxpool.optimize(block, report="yes")
  with pytest.raises(TypeError, match="fold_relu must be a bool"):
    jaxpool.optimize(block, fold_relu=1)


# ----------------------------------------------------------------------------- sharding


@pytest.fixture(scope="module")
def sharded(request):
  quick = ["--quick"] if device_checks.quick(request.config) else []
  return device_checks.run(Path(__file__).with_name("optimize_sharding_checks.py"), *quick,
                           timeout=600)


@pytest.mark.parametrize("name", ["named/Auto", "named/Explicit", "shard_map/grad",
                                  "shard_map/vmap_grad", "shard_map/optimize_of_grad",
                                  "shard_map/entered/check_vma=True"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in (
        "shard_map/entered/check_vma=False", "shard_map/entered/partly_manual",
        "shard_map/entered/optimize_of_grad")])
def test_sharding(sharded, name):
  assert name in sharded, sorted(sharded)
  assert sharded[name]["ok"], sharded[name]["detail"]
