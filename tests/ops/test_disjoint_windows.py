"""Large windows that cannot overlap (span at most the stride in every dim): xla_disjoint.py.

The disjoint form against the separable form forced on the same geometries (the same bits:
values with NaN payloads, taps, indices, the gather of forward mode, the gradient with ``-0.0``
and NaN cotangents; masks that empty windows), against the independent NumPy reference
through the public functions (max and min), the transforms (vmap, jvp, second order,
``linear_transpose``, Explicit mesh axes), which form runs which geometry, and the program's
size: the same whatever the window (the separable form's grows with it).
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise, assert_same_bits, jp, tie_rich
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpool
from jaxpool._src import xla, xla_disjoint, xla_separable, xla_taps
from jaxpool._src.windows import make_geometry

slow = pytest.mark.slow


def _geom(shape, kw):
  return make_geometry(shape, kw["window_shape"], kw["strides"], kw["padding"], kw["dilation"],
                       kw["ceil_mode"], kw["data_format"])


def _nan(dtype, payload: int, negative: bool = False):
  """A quiet NaN of ``dtype`` with its own payload bits."""
  n = np.dtype(dtype).itemsize * 8
  mant = {16: 7, 32: 23}[n]  # (bfloat16, float32)
  u = (((1 << (n - mant - 1)) - 1) << mant) | (1 << (mant - 1)) | (payload % (1 << (mant - 1)))
  if negative:
    u |= 1 << (n - 1)
  return np.array(u, f"uint{n}").view(dtype)


def _inputs(rng, shape, dtype=np.float32):
  """Ties, NaN of several payloads and signs, -inf, +inf and signed zeros."""
  x = tie_rich(rng, shape, np.float64, specials=False).astype(dtype)
  u = rng.random(shape)
  x[u > 0.9] = -0.0
  x[(u > 0.85) & (u <= 0.9)] = 0.0
  x[(u > 0.8) & (u <= 0.82)] = -np.inf
  x[(u > 0.78) & (u <= 0.8)] = np.inf
  where = np.flatnonzero((u > 0.74) & (u <= 0.78))
  x.reshape(-1)[where] = [_nan(dtype, int(i) + 1, negative=bool(i % 2)) for i in where]
  return x


def _cotangents(rng, shape, dtype=np.float32):
  """Small integers, ``-0.0``, ``+0.0`` and a NaN with a payload."""
  c = rng.integers(-3, 4, shape).astype(dtype)
  u = rng.random(shape)
  c[u < 0.25] = -0.0
  c[(u >= 0.25) & (u < 0.3)] = 0.0
  c[(u >= 0.3) & (u < 0.33)] = _nan(dtype, 5)
  return c


@st.composite
def disjoint_configs(draw):
  """A geometry of more than SEPARABLE_TAPS taps whose windows cannot overlap: the stride at
  least the window's span in every dim (some past it), with padding, ceil mode and dilation."""
  n = draw(st.integers(1, 3))
  lows, highs = {1: (33, 40), 2: (5, 9), 3: (3, 4)}[n]
  window = tuple(draw(st.integers(lows, highs)) for _ in range(n))
  hypothesis.assume(math.prod(window) > xla_taps.SEPARABLE_TAPS)
  dilation = tuple(draw(st.sampled_from([1, 1, 2])) for _ in range(n))
  eff = [d * (k - 1) + 1 for k, d in zip(window, dilation, strict=True)]
  strides = tuple(e + draw(st.sampled_from([0, 0, 1, 3])) for e in eff)
  pads = tuple((draw(st.integers(0, e - 1)), draw(st.integers(0, e - 1))) for e in eff)
  spatial = tuple(max(1, e - lo - hi) + draw(st.integers(0, s + 2))
                  for e, s, (lo, hi) in zip(eff, strides, pads, strict=True))
  fmt = draw(st.sampled_from(["channels_last", "channels_first"]))
  batch = (2,) if n < 3 else ()
  shape = (*batch, *spatial, 2) if fmt == "channels_last" else (*batch, 2, *spatial)
  return shape, dict(window_shape=window, strides=strides, padding=pads, dilation=dilation,
                     ceil_mode=draw(st.booleans()), data_format=fmt)


def _rows(a, geom, ndim):
  """``a``'s spatial dims moved last and flattened: ``(rows, positions)``, and the undo."""
  axes = geom.spatial_axes(ndim)
  moved = np.moveaxis(a, axes, range(ndim - len(axes), ndim))
  return moved.reshape(-1, math.prod(moved.shape[ndim - len(axes):])), (
      lambda r, shape: np.moveaxis(r.reshape(moved.shape[:ndim - len(axes)] + shape),
                                   range(ndim - len(axes), ndim), axes))


def _as_bits(a):
  return a.view(f"uint{a.dtype.itemsize * 8}")


def _np_gather(t, taps, geom):
  """``t`` at each winner, bit for bit; ``+0.0`` for tap -1 (NumPy, from the flat indices)."""
  idx, undo = _rows(np.asarray(xla.flat_indices(jnp.asarray(taps), geom)), geom, t.ndim)
  rows, _ = _rows(_as_bits(t), geom, t.ndim)
  got = np.where(idx >= 0, np.take_along_axis(rows, np.maximum(idx, 0), axis=1), 0)
  return undo(got, geom.out_spatial).view(t.dtype)


def _np_scatter(ct, taps, geom):
  """Each window's cotangent at its winner (no element has two), ``-0.0`` as ``+0.0``."""
  idx, _ = _rows(np.asarray(xla.flat_indices(jnp.asarray(taps), geom)), geom, ct.ndim)
  rows, _ = _rows(_as_bits(ct + ct.dtype.type(0)), geom, ct.ndim)
  out = np.zeros((rows.shape[0], math.prod(geom.in_spatial)), rows.dtype)
  r, c = np.nonzero(idx >= 0)
  assert len(set(zip(r, idx[r, c], strict=True))) == len(r)  # (disjoint windows)
  out[r, idx[r, c]] = rows[r, c]
  _, undo = _rows(np.zeros(geom.input_shape(ct.shape), ct.dtype), geom, ct.ndim)
  return undo(out, geom.in_spatial).view(ct.dtype)


def _check_against_separable(shape, kw, rng, dtype=np.float32, wide=False):
  """Both forms on one geometry: every output bit for bit."""
  geom = _geom(shape, kw)
  assert xla_taps.is_separable(geom) and xla_disjoint.is_disjoint(geom)
  x = jnp.asarray(_inputs(rng, shape, dtype))
  masks = [None, jnp.asarray(rng.random(shape) < 0.6)][:2 if wide else 1] + [
      jnp.asarray(rng.random(shape[:-1] + (1,)) < 0.03)]  # (broadcast; windows all masked)
  for mask in masks:
    got = jax.jit(xla.max_pool_taps, static_argnums=1)(x, geom, mask)
    want = jax.jit(xla_separable.max_pool_taps, static_argnums=1)(x, geom, mask)
    assert_same_bits(got[0], want[0])
    assert_same_bits(got[1], want[1])
    assert_same_bits(xla.flat_indices(got[1], geom), xla.flat_indices(want[1], geom))
  empty = int((np.asarray(want[1]) < 0).sum())  # (the last mask: windows without a winner)
  for taps in (got[1], want[1])[:2 if wide else 1]:
    t = jnp.asarray(_cotangents(rng, shape, dtype))
    g = xla.gather_at_taps(t, taps, geom)
    assert_same_bits(g, _np_gather(np.asarray(t), np.asarray(taps), geom))
    # (the separable form's selects on a CPU drop bfloat16 NaN payloads: NaN as NaN)
    assert_bitwise(g, xla_separable.gather_at_taps(t, taps, geom))
    ct = jnp.asarray(_cotangents(rng, taps.shape, dtype))
    grad = lambda gather, t=t, taps=taps, ct=ct: jax.jit(
        jax.linear_transpose(lambda v: gather(v, taps, geom), t))(ct)
    dx = grad(xla.gather_at_taps)[0]
    assert_same_bits(dx, _np_scatter(np.asarray(ct), np.asarray(taps), geom))
    assert_bitwise(dx, grad(xla_separable.gather_at_taps)[0])
  return empty


CASES = [
    # (shape, window, strides, padding, dilation, ceil_mode, data_format)
    ((2, 27, 29, 3), (6, 7), (6, 7), "SAME", None, False, "channels_last"),
    ((1, 2, 20, 23), (5, 7), (7, 9), ((2, 1), (0, 6)), (1, 1), True, "channels_first"),
    ((1, 9, 10, 8, 2), (4, 3, 3), (7, 3, 5), 1, (2, 1, 2), True, "channels_last"),
    ((3, 75, 2), (33,), (40,), ((5, 32),), None, True, "channels_last"),
]


@pytest.mark.parametrize("case", [pytest.param(c, marks=slow) if i != 1 else c
                                  for i, c in enumerate(CASES)])
def test_the_same_bits_as_the_separable_form(case, rng):
  shape, window, strides, padding, dilation, ceil_mode, fmt = case
  kw = dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
            ceil_mode=ceil_mode, data_format=fmt)
  assert _check_against_separable(shape, kw, rng) > 0


@slow
@pytest.mark.parametrize("case", CASES + [
    ((1, 200, 1), (70,), (70,), ((3, 69),), None, True, "channels_last"),  # a stage's loop
    ((1, 1, 1), (33,), (65,), ((1, 63),), (2,), False, "channels_first"),  # padding only
])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_the_same_bits_as_the_separable_form_wide(case, dtype, rng):
  shape, window, strides, padding, dilation, ceil_mode, fmt = case
  kw = dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
            ceil_mode=ceil_mode, data_format=fmt)
  _check_against_separable(shape, kw, rng, dtype, wide=True)


@hypothesis.settings(max_examples=2, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(cfg=disjoint_configs(), seed=st.integers(0, 2**31 - 1))
def test_property_the_same_bits_as_the_separable_form(cfg, seed):
  _check_against_separable(*cfg, np.random.default_rng(seed))


@slow
@hypothesis.settings(max_examples=25, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(cfg=disjoint_configs(), seed=st.integers(0, 2**31 - 1),
                  dtype=st.sampled_from([np.float32, jnp.bfloat16]))
def test_property_the_same_bits_as_the_separable_form_wide(cfg, seed, dtype):
  _check_against_separable(*cfg, np.random.default_rng(seed), dtype, wide=True)


@slow
def test_int_and_bool_inputs(rng):
  kw = dict(window_shape=(6, 6), strides=(7, 6), padding=2, dilation=None, ceil_mode=True,
            data_format="channels_last")
  geom = _geom((2, 20, 19, 3), kw)
  for x in (rng.integers(-3, 3, (2, 20, 19, 3)).astype(np.int32),
            rng.random((2, 20, 19, 3)) < 0.1):
    got = xla.max_pool_taps(jnp.asarray(x), geom)
    want = xla_separable.max_pool_taps(jnp.asarray(x), geom)
    assert_same_bits(got[0], want[0])
    assert_same_bits(got[1], want[1])


# ------------------------------------------------------------------------------ the reference


def _check_against_reference(x, kw, rng):
  """Max and min through the public functions: values, indices, taps, gradients."""
  y, idx = jp.max_pool_with_indices(x, **kw)
  y_ref, idx_ref = ref.max_pool_with_indices(x, **kw)
  assert_bitwise(y, y_ref)
  assert_bitwise(idx, idx_ref)
  _, taps = jp.max_pool_with_taps(x, **kw)
  np.testing.assert_array_equal(np.asarray(taps, np.int64), ref.max_pool_with_taps(x, **kw)[1])
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  g = jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy))(x)
  assert_bitwise(g, ref.max_pool_grad(x, dy, **kw).astype(np.float32) + 0.0)
  assert_same_bits(jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **kw), g)
  assert_same_bits(jp.max_pool_grad(x, dy, **kw), g)
  # (the values of the forward with taps, this form's: under vjp)
  ymin, pull = jax.vjp(lambda v: jp.min_pool(v, **kw), x)
  assert_bitwise(ymin, ref.min_pool_with_indices(x, **kw)[0])
  gmin = pull(jnp.asarray(dy))[0]
  assert_bitwise(gmin, ref.max_pool_grad(x, dy, minimum=True, **kw).astype(np.float32) + 0.0)


@pytest.mark.parametrize("case", [CASES[0], pytest.param(CASES[1], marks=slow)])
def test_against_reference(case, rng):
  shape, window, strides, padding, dilation, ceil_mode, fmt = case
  kw = dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
            ceil_mode=ceil_mode, data_format=fmt)
  x = np.asarray(_inputs(rng, shape))
  x[np.isnan(x)] = np.nan  # (the reference keeps no payloads)
  _check_against_reference(x, kw, rng)


@slow
@hypothesis.settings(max_examples=20, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(cfg=disjoint_configs(), seed=st.integers(0, 2**31 - 1))
def test_property_against_reference(cfg, seed):
  shape, kw = cfg
  x = _inputs(np.random.default_rng(seed), shape)
  x[np.isnan(x)] = np.nan
  _check_against_reference(x, kw, np.random.default_rng(seed + 1))


# ------------------------------------------------------------------------------ transforms


def test_transforms(rng):
  """vmap of the gradient, forward mode, second order, ``max_pool_with_taps`` under vmap."""
  kw = dict(window_shape=(6, 7), strides=(6, 8), padding=((1, 2), (3, 0)))
  x = jnp.asarray(rng.permutation(3 * 19 * 22 * 2).reshape(3, 19, 22, 2).astype(np.float32))
  t = jnp.asarray(rng.standard_normal(x.shape), np.float32)
  _, idx = ref.max_pool_with_indices(np.asarray(x), **kw)
  _, jt = jax.jvp(lambda v: jp.max_pool(v, **kw), (x,), (t,))
  rows = np.moveaxis(np.asarray(t), -1, 1).reshape(6, -1)
  want = np.take_along_axis(rows, np.moveaxis(idx, -1, 1).reshape(6, -1), axis=1)
  assert_bitwise(np.moveaxis(np.asarray(jt), -1, 1).reshape(6, -1), want)
  f = lambda v: jnp.sum(jp.max_pool(v, **kw) ** 2)
  hvp = jax.jvp(jax.grad(f), (x,), (t,))[1]
  expect = ref.max_pool_grad(np.asarray(x), 2 * want.reshape(3, 2, *idx.shape[1:3])
                             .transpose(0, 2, 3, 1), **kw)
  np.testing.assert_allclose(hvp, expect, rtol=1e-6, atol=1e-6)
  g = jax.vmap(jax.grad(lambda v: jnp.sum(jp.max_pool(v[None], **kw))))(x)
  assert_same_bits(g, jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw)))(x))
  taps = jax.vmap(lambda v: jp.max_pool_with_taps(v, **kw)[1])(x[:, None])[:, 0]
  assert_same_bits(taps, jp.max_pool_with_taps(x, **kw)[1])


def test_explicit_mesh_axes_run_the_separable_form(rng):
  """Under Explicit mesh axes the windows' view would need shardings of its own: the separable
  form runs, with the same bits."""
  kw = dict(window_shape=(6, 6), strides=(6, 6), padding="SAME")
  x = jnp.asarray(_inputs(rng, (2, 25, 26, 2)))
  dy = jnp.asarray(_cotangents(rng, jp.max_pool(x, **kw).shape))
  f = lambda v: jax.vjp(lambda u: jp.max_pool(u, **kw), v)[1](dy)[0]
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  with jax.sharding.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(f)(xs))
    got = f(xs)
  assert "jaxpool_xla_disjoint" not in jaxpr
  assert "jaxpool_xla_disjoint" in str(jax.make_jaxpr(f)(x))
  assert_same_bits(got, f(x))


# ------------------------------------------------------------------------------ routing, size


@pytest.mark.parametrize("window, strides, dilation, form", [
    ((13, 13), (13, 13), (1, 1), "disjoint"),
    ((7, 7), (7, 9), (1, 1), "disjoint"),
    ((5, 5, 5), (5, 5, 5), (1, 1, 1), "disjoint"),
    ((33,), (40,), (1,), "disjoint"),
    ((6, 6), (11, 11), (2, 2), "disjoint"),  # span 11
    ((6, 6), (10, 11), (2, 2), "separable"),  # span 11 > 10: overlap along H
    ((13, 13), (12, 13), (1, 1), "separable"),
    ((13, 13), (6, 6), (1, 1), "separable"),
    ((5, 5), (5, 5), (1, 1), "direct"),  # 25 taps: the kernels' and the tap loop's
])
def test_the_form_depends_on_the_geometry_only(window, strides, dilation, form):
  shape = (1, *(2 * s + 3 for s in strides), 1)
  geom = make_geometry(shape, window, strides, 0, dilation, False, "channels_last")
  got = ("direct" if not xla_taps.is_separable(geom)
         else "disjoint" if xla_disjoint.is_disjoint(geom) else "separable")
  assert got == form


def _program_size(k: int) -> int:
  """Lines of the lowered program (StableHLO) of a k x k / sk max pool's forward + gradient."""
  x = jnp.zeros((2, 64, 64, 4), jnp.float32)
  f = jax.jit(lambda v: jax.value_and_grad(
      lambda u: jnp.sum(jp.max_pool(u, (k, k), (k, k), "SAME")))(v))
  text = f.lower(x).as_text()
  return len(text.splitlines())


def test_program_size_does_not_grow_with_the_window():
  """9x9/s9 and 31x31/s31 lower to programs of the same size (the separable form's grows with
  the taps per dim: 1.9x between these), and the gradient runs the disjoint form."""
  assert _program_size(31) == _program_size(9)
  x = jnp.zeros((1, 52, 52, 1), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda v: jnp.sum(jp.max_pool(v, (13, 13), (13, 13)))))(x)
  assert "jaxpool_xla_disjoint_gather" in str(jaxpr)
