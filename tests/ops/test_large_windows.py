"""Windows of more than ``SEPARABLE_TAPS`` taps: the separable XLA path (xla_separable.py), and
max and min pooling through the kernels a dim at a time (``pallas/ops.py``, ``stages``) against it.

Against the independent NumPy reference (values, indices, taps, gradients of max, min and
average pooling on tie-rich, NaN, infinite and signed-zero inputs); the separable and the direct
form forced on the same geometries (the same bits); the gradient's summation order against a
NumPy model of the documented rule (docs/semantics.md, "Large windows"); forward mode and second
order; and the work: the taps a program visits grow with the window's size per dim, not with its
taps (counted in the jaxpr, loop trips included), and the gradient adds only the taps of each
element's stride phase.
"""

from __future__ import annotations

import functools
import itertools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise, assert_same_bits, jp, tie_rich, tol
from tiers import draws

import jaxpool
from jaxpool._src import xla, xla_separable, xla_taps
from jaxpool._src.pallas import ops as pallas_ops
from jaxpool._src.pallas.triton import tile
from jaxpool._src.windows import make_geometry

# (shape, window, strides, padding, dilation, ceil_mode, data_format): every one has more than
# SEPARABLE_TAPS taps.
slow = pytest.mark.slow
GRID = [
    ((2, 9, 11, 3), (7, 6), (1, 1), "SAME", None, False, "channels_last"),  # stride 1, 'same'
    pytest.param(((1, 2, 10, 12), (6, 7), (1, 2), ((2, 3), (1, 4)), None, True,
                  "channels_first"), marks=slow),
    ((1, 6, 7, 8, 2), (3, 4, 3), (1, 2, 2), 1, (1, 1, 2), False, "channels_last"),  # 3-D
    pytest.param(((2, 45, 2), (40,), (3,), 5, None, True, "channels_last"), marks=slow),  # 1-D
    pytest.param(((1, 12, 12, 1), (6, 6), (1, 1), ((5, 5), (0, 5)), (2, 2), True,
                  "channels_last"), marks=slow),  # empty windows
    pytest.param(((1, 2, 9, 9), (9, 9), None, "VALID", None, False, "channels_first"),
                 marks=slow),  # the whole input
    pytest.param(((1, 7, 44, 2), (1, 40), (3, 2), "SAME", None, False, "channels_last"),
                 marks=slow),  # a stage of one tap
    pytest.param(((1, 5, 3, 40, 1), (1, 1, 33), (2, 1, 4), "SAME", None, True, "channels_last"),
                 marks=slow),
]

SETTINGS = hypothesis.settings(max_examples=4, deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


def _kw(window, strides, padding, dilation, ceil_mode, data_format):
  return dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode, data_format=data_format)


def _inputs(rng, shape, dtype=np.float32):
  """Ties, NaN, -inf, +inf and signed zeros."""
  x = tie_rich(rng, shape, np.float64, specials=True)
  u = rng.random(shape)
  x[u > 0.9] = -0.0
  x[(u > 0.85) & (u <= 0.9)] = 0.0
  return x.astype(dtype)


def _check_against_reference(x, kw, rng):
  """Max and min: values, indices, taps, gradients; average: values and gradients."""
  y, idx = jp.max_pool_with_indices(x, **kw)
  y_ref, idx_ref = ref.max_pool_with_indices(x, **kw)
  assert_bitwise(y, y_ref)
  assert_bitwise(idx, idx_ref)
  _, taps = jp.max_pool_with_taps(x, **kw)
  np.testing.assert_array_equal(np.asarray(taps, np.int64), ref.max_pool_with_taps(x, **kw)[1])
  assert_bitwise(jp.max_pool(x, **kw), y_ref)
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)  # integer dy: exact sums
  g = jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy))(x)
  assert_bitwise(g, ref.max_pool_grad(x, dy, **kw).astype(np.float32) + 0.0)
  assert_same_bits(jaxpool.max_pool_grad_from_taps(dy, taps, x.shape, **kw), g)
  ymin, imin = ref.min_pool_with_indices(x, **kw)
  assert_bitwise(jp.min_pool(x, **kw), ymin)
  gmin = jax.grad(lambda v: jnp.sum(jp.min_pool(v, **kw) * dy))(x)
  assert_bitwise(gmin, ref.max_pool_grad(x, dy, minimum=True, **kw).astype(np.float32) + 0.0)
  xf = rng.standard_normal(x.shape).astype(np.float32)
  taps_n = math.prod(kw["window_shape"])
  for include in (True, False):
    a = jp.avg_pool(xf, **kw, count_include_pad=include)
    np.testing.assert_allclose(a, ref.avg_pool(xf, **kw, count_include_pad=include),
                               **tol(np.float32, taps_n))
    ga = jax.grad(lambda v, c=include: jnp.sum(jp.avg_pool(v, **kw, count_include_pad=c) * dy))(xf)
    np.testing.assert_allclose(ga, ref.avg_pool_grad(dy, x.shape, **kw,
                                                     count_include_pad=include),
                               **tol(np.float32, taps_n))


@pytest.mark.parametrize("case", GRID)
def test_against_reference(case, rng):
  shape, *cfg = case
  kw = _kw(*cfg)
  assert xla_taps.is_separable(make_geometry(shape, kw["window_shape"], kw["strides"],
                                             kw["padding"], kw["dilation"], kw["ceil_mode"],
                                             kw["data_format"]))
  _check_against_reference(_inputs(rng, shape), kw, rng)


@st.composite
def large_configs(draw):
  """A geometry of more than SEPARABLE_TAPS taps, strides at most the window, small input."""
  n = draw(st.integers(1, 3))
  lows = {1: 33, 2: 5, 3: 3}[n]
  highs = {1: 40, 2: 9, 3: 4}[n]
  window = tuple(draw(st.integers(lows, highs)) for _ in range(n))
  hypothesis.assume(math.prod(window) > xla_taps.SEPARABLE_TAPS)
  strides = tuple(draw(st.integers(1, k)) for k in window)
  dilation = tuple(draw(st.sampled_from([1, 1, 2])) for _ in range(n))
  eff = [d * (k - 1) + 1 for k, d in zip(window, dilation, strict=True)]
  pads = tuple((draw(st.integers(0, e - 1)), draw(st.integers(0, e - 1))) for e in eff)
  spatial = tuple(draw(st.integers(max(1, e - lo - hi), max(1, e - lo - hi) + 4))
                  for e, (lo, hi) in zip(eff, pads, strict=True))
  fmt = draw(st.sampled_from(["channels_last", "channels_first"]))
  shape = (1, *spatial, 2) if fmt == "channels_last" else (1, 2, *spatial)
  return shape, dict(window_shape=window, strides=strides, padding=pads, dilation=dilation,
                     ceil_mode=draw(st.booleans()), data_format=fmt)


@slow
@SETTINGS
@hypothesis.given(cfg=large_configs(), seed=st.integers(0, 2**31 - 1))
def test_property_against_reference(cfg, seed):
  shape, kw = cfg
  _check_against_reference(_inputs(np.random.default_rng(seed), shape), kw,
                           np.random.default_rng(seed + 1))


@pytest.mark.slow
@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(cfg=large_configs(), seed=st.integers(0, 2**31 - 1))
def test_property_against_reference_wide(cfg, seed):
  shape, kw = cfg
  _check_against_reference(_inputs(np.random.default_rng(seed), shape), kw,
                           np.random.default_rng(seed + 1))


# ------------------------------------------------------------------------------ the two forms

# Geometries both forms run, small and large windows alike.
BOTH = [
    pytest.param(((2, 8, 9, 3), (3, 3), (2, 2), 1, None, False, "channels_last"), marks=slow),
    ((1, 3, 9, 10), (5, 4), (1, 2), ((2, 1), (3, 0)), (1, 2), True, "channels_first"),
    pytest.param(((2, 7, 6, 5, 2), (2, 3, 2), (1, 1, 2), "SAME", None, True, "channels_last"),
                 marks=slow),
    pytest.param(((1, 11, 12, 2), (9, 8), (3, 1), ((4, 0), (0, 7)), None, True, "channels_last"),
                 marks=slow),
]


@pytest.mark.parametrize("case", BOTH)
@pytest.mark.parametrize("dtype", [np.float32, pytest.param(jnp.bfloat16, marks=slow),
                                   pytest.param(np.int32, marks=slow)])
def test_separable_and_direct_forms_give_the_same_bits(case, dtype, rng):
  shape, *cfg = case
  kw = _kw(*cfg)
  geom = make_geometry(shape, kw["window_shape"], kw["strides"], kw["padding"], kw["dilation"],
                       kw["ceil_mode"], kw["data_format"])
  x = jnp.asarray(_inputs(rng, shape).astype(np.float32)
                  if dtype != np.int32 else rng.integers(-2, 3, shape)).astype(dtype)
  direct = jax.jit(xla.direct_max_pool_taps, static_argnums=1)(x, geom)
  sep = jax.jit(xla_separable.max_pool_taps, static_argnums=1)(x, geom)
  assert_same_bits(sep[0], direct[0])
  assert_same_bits(sep[1], direct[1])
  assert_same_bits(xla.flat_indices(sep[1], geom), xla.flat_indices(direct[1], geom))
  mask = jnp.asarray(rng.random(shape) < 0.7)
  assert_same_bits(xla_separable.max_pool_taps(x, geom, mask)[1],
                   xla.direct_max_pool_taps(x, geom, mask)[1])
  # The gathers (forward mode) agree too; their transposes sum in their own orders.
  t = jnp.asarray(rng.standard_normal(shape), np.float32)
  assert_same_bits(xla_separable.gather_at_taps(t, direct[1], geom),
                   xla._gather_at_taps(t, direct[1], geom))


# ------------------------------------------------------------------------------ summation order


def _order_model(taps, dy, geom):
  """The separable gradient's documented summation order, in float32, for one (batch, channel)
  row: ``taps`` and ``dy`` of the output's spatial shape (the winners from the reference).

  Stage ``i`` (the first spatial dim first) moves every partial sum from output to input
  resolution along dim ``i``: the sum at an input position adds, over that dim's taps in
  descending order, the partial sum of the output position whose window reads it through that
  tap where that window's winner lies there, else +0.0, left to right.
  """
  n = len(geom.window)
  sums = {}
  tap_of = {}
  for o in itertools.product(*map(range, geom.out_spatial)):
    if taps[o] >= 0:
      sums[o] = np.float32(dy[o])
      tap_of[o] = np.unravel_index(int(taps[o]), geom.window)
  for i in range(n):
    k, s, d, lo = geom.window[i], geom.strides[i], geom.dilation[i], geom.padding[i][0]
    # each partial sum's tap along dim i (the windows it gathers agree)
    moved: dict = {}
    at: dict = {}
    for pos, ti in ((p, tap_of[p][i]) for p in sums):
      at[pos] = ti
    targets = {pos[:i] + (pos[i] * s + at[pos] * d - lo,) + pos[i + 1:] for pos in sums}
    for q in targets:

      def term(a, q=q, i=i, s=s, d=d, lo=lo, sums=sums, at=at):
        o, r = divmod(q[i] + lo - a * d, s)
        src = q[:i] + (o,) + q[i + 1:]
        return sums[src] if (r == 0 and src in sums and at[src] == a) else np.float32(0.0)

      if k <= xla_taps.UNROLL_TAPS:
        acc = None
        for a in reversed(range(k)):
          acc = term(a) if acc is None else np.float32(acc + term(a))
      else:  # a loop: the last k % 8 taps one a trip, then trips of 8 summed among themselves
        full, _ = divmod(k, xla_taps.TAPS_PER_TRIP)
        acc = np.float32(0.0)
        for a in reversed(range(full * xla_taps.TAPS_PER_TRIP, k)):
          acc = np.float32(acc + term(a))
        for trip in reversed(range(full)):
          taps8 = range(trip * xla_taps.TAPS_PER_TRIP, (trip + 1) * xla_taps.TAPS_PER_TRIP)
          group = None
          for a in reversed(taps8):
            group = term(a) if group is None else np.float32(group + term(a))
          acc = np.float32(acc + group)
      moved[q] = acc
    new_tap = {}
    for p in sums:
      q = p[:i] + (p[i] * s + at[p] * d - lo,) + p[i + 1:]
      new_tap[q] = tap_of[p]
    sums, tap_of = moved, new_tap
  dx = np.zeros(geom.in_spatial, np.float32)
  for q, v in sums.items():
    dx[q] = v
  return dx


@pytest.mark.parametrize("case", [
    ((12, 13), (7, 6), (1, 1), "SAME", None, False),
    pytest.param(((10, 12), (6, 7), (1, 2), ((2, 3), (1, 4)), None, True), marks=slow),
    pytest.param(((6, 7, 8), (3, 4, 3), (1, 2, 1), 1, (1, 1, 2), False), marks=slow),
    pytest.param(((40,), (33,), (1,), 3, None, False), marks=slow),
    ((90,), (66,), (1,), ((10, 10),), None, False),  # a loop: trips of 8 taps
    ((30, 29), (7, 6), (4, 6), ((3, 2), (0, 5)), (2, 1), True),  # strides >= k / 2, ceil mode
    ((25, 27), (5, 9), (5, 9), "SAME", None, False),  # stride k: one tap per element
    pytest.param(((23, 26), (6, 7), (3, 9), 2, (2, 3), True), marks=slow),  # strides past k
    pytest.param(((9, 10, 11), (4, 3, 4), (2, 3, 4), 1, (1, 2, 1), True), marks=slow),
    pytest.param(((100,), (70,), (30,), 12, None, True), marks=slow),  # a loop at stride 30
])
def test_gradient_sums_in_the_documented_order(case, rng):
  spatial, window, strides, padding, dilation, ceil_mode = case
  x = rng.integers(0, 3, (1, *spatial, 1)).astype(np.float32)  # ties: shared winners
  kw = _kw(window, strides, padding, dilation, ceil_mode, "channels_last")
  y, taps = ref.max_pool_with_taps(x, **kw)
  dy = rng.standard_normal(y.shape).astype(np.float32)
  g = jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy))(x)
  geom = make_geometry(x.shape, window, strides, padding, dilation, ceil_mode)
  model = _order_model(taps[0, ..., 0], dy[0, ..., 0], geom)
  assert_bitwise(np.asarray(g)[0, ..., 0], model)


# ------------------------------------------------------------------------------ transforms


def test_forward_mode_and_second_order(rng):
  kw = _kw((6, 7), (2, 1), 2, None, False, "channels_last")
  x = jnp.asarray(rng.permutation(2 * 9 * 10 * 2).reshape(2, 9, 10, 2).astype(np.float32))
  t = jnp.asarray(rng.standard_normal(x.shape), np.float32)
  _, idx = ref.max_pool_with_indices(np.asarray(x), **kw)
  _, jt = jax.jvp(lambda v: jp.max_pool(v, **kw), (x,), (t,))
  rows = np.moveaxis(np.asarray(t), -1, 1).reshape(4, -1)
  want = np.take_along_axis(rows, np.moveaxis(idx, -1, 1).reshape(4, -1), axis=1)
  assert_bitwise(np.moveaxis(np.asarray(jt), -1, 1).reshape(4, -1), want)
  f = lambda v: jnp.sum(jp.max_pool(v, **kw) ** 2)
  hvp = jax.jvp(jax.grad(f), (x,), (t,))[1]
  # d/dx of 2 y dy/dx: 2 at each winner, summed over the windows that chose it
  expect = ref.max_pool_grad(np.asarray(x), 2 * want.reshape(2, 2, *idx.shape[1:3])
                             .transpose(0, 2, 3, 1), **kw)
  np.testing.assert_allclose(hvp, expect, rtol=1e-6, atol=1e-6)
  g = jax.vmap(jax.grad(lambda v: jnp.sum(jp.max_pool(v[None], **kw))))(x)
  np.testing.assert_array_equal(g, jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw)))(x))


@slow
def test_gradient_deterministic_and_loop_form(rng):
  """A dim of more than UNROLL_TAPS taps runs its stages as loops; two runs give the same bits."""
  kw = _kw((70, 2), (3, 1), ((10, 0), (1, 1)), None, True, "channels_last")
  x = _inputs(rng, (1, 80, 5, 2))
  _check_against_reference(x, kw, rng)
  dy = rng.standard_normal(jp.max_pool(x, **kw).shape).astype(np.float32)
  f = jax.jit(jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy)))
  assert_same_bits(f(x), f(jnp.asarray(x) + 0))
  assert "scan" in str(jax.make_jaxpr(f)(x))


def test_loop_form_1d(rng):
  """A window of more than UNROLL_TAPS taps in one dim: its stage is a loop over the taps."""
  kw = _kw((66,), (2,), 3, None, True, "channels_last")
  x = _inputs(rng, (1, 70, 1))
  y, idx = jp.max_pool_with_indices(x, **kw)
  y_ref, idx_ref = ref.max_pool_with_indices(x, **kw)
  assert_bitwise(y, y_ref)
  assert_bitwise(idx, idx_ref)
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  f = jax.jit(jax.grad(lambda v: jnp.sum(jp.max_pool(v, **kw) * dy)))
  assert_bitwise(f(x), ref.max_pool_grad(x, dy, **kw).astype(np.float32) + 0.0)
  assert "scan" in str(jax.make_jaxpr(f)(x))


def test_average_half_precision_accumulates_in_float32(rng):
  kw = _kw((7, 6), (1, 2), "SAME", None, False, "channels_last")
  x = rng.standard_normal((1, 10, 11, 2)).astype(jnp.bfloat16)
  y = jp.avg_pool(x, **kw)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float64),
                             ref.avg_pool(np.asarray(x, np.float64), **kw), **tol(jnp.bfloat16))
  dy = rng.standard_normal(y.shape).astype(jnp.bfloat16)
  g = jax.vjp(lambda v: jp.avg_pool(v, **kw), x)[1](dy)[0]
  np.testing.assert_allclose(np.asarray(g, np.float64),
                             ref.avg_pool_grad(np.asarray(dy, np.float64), x.shape, **kw),
                             **tol(jnp.bfloat16))


# ------------------------------------------------------------------------------ routing


def test_the_kernels_serve_large_max_and_min_pools_one_dim_at_a_time():
  """A window of more than MAX_TAPS taps: the GPU kernels serve ``max_pool`` and ``min_pool``
  as 1-D stages, the last dim first, where every dim has at most MAX_TAPS taps and every
  window holds an element along every dim; the rest (taps, indices, a longer dim, the TPU
  kernels) stays on the XLA path. (Fails before: every window of more
  than MAX_TAPS taps was refused.)"""
  assert pallas_ops.MAX_TAPS == xla_taps.SEPARABLE_TAPS
  geom = make_geometry((1, 40, 30, 2), (6, 7), (1, 2), 1, None, False, "channels_last")
  for op in ("max_pool", "min_pool"):
    assert pallas_ops.unsupported(op, (1, 40, 30, 2), np.float32, geom, "triton") is None
  for op, kernels in (("max_pool_with_taps", "triton"), ("max_pool", "tpu")):
    assert "taps" in pallas_ops.unsupported(op, (1, 40, 30, 2), np.float32, geom, kernels)
  w, h = pallas_ops.stages(geom)  # W first, then H: each a 1-D pool of the running shape
  assert (w.window, w.strides, w.padding, w.in_spatial, w.out_spatial) == (
      (1, 7), (1, 2), ((0, 0), (1, 1)), (40, 30), (40, geom.out_spatial[1]))
  assert (h.window, h.strides, h.padding, h.in_spatial, h.out_spatial) == (
      (6, 1), (1, 1), ((1, 1), (0, 0)), (40, geom.out_spatial[1]), geom.out_spatial)
  cube = make_geometry((1, 9, 9, 9, 1), (4, 3, 3), (1, 1, 1), 0, None, False, "channels_last")
  assert [g.window for g in pallas_ops.stages(cube)] == [(1, 1, 3), (1, 3, 1), (4, 1, 1)]
  assert pallas_ops.stages(make_geometry((1, 40, 2), (33,))) is None  # a dim of 33 taps
  assert pallas_ops.stages(make_geometry((1, 9, 9, 2), (5, 5))) is None  # 25 taps: one call
  assert not xla_taps.is_separable(make_geometry((1, 40, 40, 2), (4, 8)))
  x = jnp.zeros((1, 45, 8, 1))
  with pytest.raises(ValueError, match="40 taps"):
    jaxpool.max_pool(x, (40, 1), implementation="pallas")


def test_the_kernels_leave_values_of_little_overlap_to_one_reduce_window(rng):
  """Windows that overlap fewer than 3 times a dim, values alone asked (inference): one
  ``reduce_window`` over whole windows, no kernel; with a derivative asked the stages run, and
  the values are the same bits either way. (Fails before: no kernel served these windows.)"""
  x = jnp.asarray(_inputs(rng, (1, 13, 14, 2)))
  kw = dict(window_shape=(7, 7), strides=(5, 4), padding="SAME")
  for fn in (jaxpool.max_pool, jaxpool.min_pool):
    f = functools.partial(fn, **kw, implementation="pallas")
    plain = str(jax.make_jaxpr(f)(x))
    assert plain.count("reduce_window_max") == 1, fn.__name__
    assert "jaxpool_pallas_kernel" not in plain, fn.__name__
    y, vjp = jax.vjp(f, x)
    staged = str(jax.make_jaxpr(lambda v, f=f: jax.vjp(f, v)[0])(x))
    assert staged.count("jaxpool_pallas_kernel") == 2 and "reduce_window" not in staged
    assert_same_bits(y, f(x))
    dy = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    assert_same_bits(vjp(dy)[0], jax.vjp(functools.partial(fn, **kw, implementation="xla"),
                                         x)[1](dy)[0])


def _same_bits_as_xla(x, kw, rng, nan_payloads=True, relu=False, minimum=True):
  """implementation="pallas" (the kernels a dim at a time; interpreted on a CPU) against the
  XLA path's separable form: max and min values, gradients and tangents, bit for bit (the
  cotangents of many magnitudes, so that another summation order would round differently);
  and a second run the same. ``nan_payloads=False``: a NaN value is compared as NaN (the
  compiled kernels return one quiet NaN: NaN is the contract, not its payload). ``relu``: the
  max pool with its fused ReLU too (applied after the last stage); ``minimum``: the min pool
  too."""
  dtype = x.dtype
  fns = [jaxpool.max_pool] + ([jaxpool.min_pool] if minimum else [])
  if relu:
    fns.append(functools.partial(jaxpool.max_pool, activation="relu"))
  for fn in fns:
    f = {impl: functools.partial(fn, **kw, implementation=impl) for impl in ("xla", "pallas")}
    y = f["pallas"](x)
    (assert_same_bits if nan_payloads else assert_bitwise)(y, f["xla"](x), str(fn))
    dy = jnp.asarray(rng.standard_normal(y.shape) * 10.0 ** rng.integers(-3, 4, y.shape), dtype)
    g = {impl: jax.vjp(f[impl], x)[1](dy)[0] for impl in f}
    assert_same_bits(g["pallas"], g["xla"], str(fn))
    assert_same_bits(jax.vjp(f["pallas"], x)[1](dy)[0], g["pallas"])
    t = jnp.asarray(rng.standard_normal(x.shape), dtype)
    assert_same_bits(jax.jvp(f["pallas"], (x,), (t,))[1], jax.jvp(f["xla"], (x,), (t,))[1])


@pytest.mark.parametrize("case, dtype", [
    pytest.param(GRID[0], np.float32, marks=slow),  # 7x6, stride 1, 'same'
    (((1, 2, 10, 12), (6, 7), (1, 2), ((2, 3), (1, 4)), None, True, "channels_first"),
     jnp.bfloat16),
    pytest.param(GRID[2], np.float32, marks=slow),  # 3-D, dilation
    pytest.param(((1, 14, 5, 1), (13, 3), (1, 1), "SAME", None, False, "channels_last"),
                 jnp.float16, marks=slow),
    # dims of more than LOOP_TAPS taps: the stages' taps in a loop
    (((1, 2, 30, 33), (17, 21), (1, 1), ((3, 5), (9, 2)), None, False, "channels_first"),
     jnp.bfloat16),
    pytest.param(((1, 30, 31, 2), (17, 18), (2, 2), 4, (1, 2), True, "channels_last"),
                 np.float32, marks=slow),
])
def test_the_kernels_a_dim_at_a_time_give_the_xla_paths_bits(case, dtype, rng):
  shape, *cfg = case
  kw = _kw(*cfg)
  geom = make_geometry(shape, kw["window_shape"], kw["strides"], kw["padding"],
                       kw["dilation"], kw["ceil_mode"], kw["data_format"])
  assert pallas_ops.stages(geom) is not None
  quick = dtype == jnp.bfloat16  # (make test's case: the max pool; the rest in the slow tier)
  _same_bits_as_xla(jnp.asarray(_inputs(rng, shape, dtype)), kw, rng, relu=not quick,
                    minimum=not quick)


@pytest.mark.parametrize("strides", [(1,), pytest.param((3,), marks=slow)])
def test_a_1d_window_of_more_than_loop_taps_on_the_kernels(strides, rng):
  """A 1-D window of 20 taps (at most 32: one kernel call, no stages): its taps in a loop, the
  XLA path's bits (at stride 3 the backward's phases stay unrolled)."""
  kw = _kw((20,), strides, 5, None, strides != (1,), "channels_last")
  assert 20 > tile.LOOP_TAPS
  _same_bits_as_xla(jnp.asarray(_inputs(rng, (2, 45, 4))), kw, rng, relu=strides == (1,))


@slow
@hypothesis.settings(SETTINGS, max_examples=draws(4, 1))
@hypothesis.given(cfg=large_configs(), seed=st.integers(0, 2**31 - 1))
def test_property_the_kernels_a_dim_at_a_time_give_the_xla_paths_bits(cfg, seed):
  shape, kw = cfg
  geom = make_geometry(shape, kw["window_shape"], kw["strides"], kw["padding"],
                       kw["dilation"], kw["ceil_mode"], kw["data_format"])
  hypothesis.assume(pallas_ops.stages(geom) is not None)
  rng = np.random.default_rng(seed)
  _same_bits_as_xla(jnp.asarray(_inputs(rng, shape)), kw, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_the_kernels_a_dim_at_a_time_give_the_xla_paths_bits(dtype):
  """The compiled kernels a dim at a time against the XLA path's separable form on a GPU: max
  and min values, gradients and tangents, bit for bit, on zeros of both signs, subnormals,
  infinities and NaN; SPP's stride 1 and 'same', a stride below the window, a 3-D window,
  channels_first with ceil mode, and dims of more than ``LOOP_TAPS`` taps (their loops)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(0)
  vals = np.float32([-0.0, 0.0, 1e-40, -1e-40, 1.0, -1.0, 2.5, np.nan, -np.inf, np.inf])
  p = [.2, .2, .06, .06, .15, .15, .1, .02, .03, .03]
  for shape, window, strides, padding, ceil, fmt in [
      ((4, 40, 40, 16), (13, 13), (1, 1), "SAME", False, "channels_last"),
      ((4, 37, 41, 16), (9, 9), (2, 2), 4, False, "channels_last"),
      ((2, 18, 16, 17, 8), (7, 7, 7), (1, 1, 1), 3, False, "channels_last"),
      ((2, 16, 23, 29), (6, 7), (1, 2), ((2, 3), (1, 4)), True, "channels_first"),
      ((2, 40, 40, 16), (31, 31), (1, 1), "SAME", False, "channels_last"),  # (loops)
      ((2, 8, 30, 33), (17, 21), (1, 1), ((3, 5), (9, 2)), False, "channels_first")]:
    x = jnp.asarray(rng.choice(vals, shape, p=p)).astype(dtype)
    kw = dict(window_shape=window, strides=strides, padding=padding, ceil_mode=ceil,
              data_format=fmt)
    assert pallas_ops.stages(make_geometry(shape, window, strides, padding, None, ceil, fmt))
    _same_bits_as_xla(x, kw, rng, nan_payloads=False, relu=True)


# ------------------------------------------------------------------------------ work


def _inner(eqn):
  """The jaxprs an equation runs: its sub-jaxprs, and a jaxpool primitive's implementation
  (linear.LinearPair: the separable gather and its transpose) traced on its operands."""
  if eqn.primitive.name.startswith("jaxpool_"):
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    yield jax.make_jaxpr(lambda *a: eqn.primitive.impl(*a, **eqn.params))(*avals).jaxpr
  for param in eqn.params.values():
    for sub in param if isinstance(param, (tuple, list)) else (param,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        yield inner


def _work(jaxpr, prims=("slice", "dynamic_slice", "pad"), weigh=None) -> int:
  """Equations of ``prims`` a run of ``jaxpr`` executes (``weigh(eqn)`` each; default 1): loop
  bodies times their trips, jaxpool's primitives through their implementations."""
  total = 0
  for eqn in jaxpr.eqns:
    trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    if eqn.primitive.name in prims:
      total += 1 if weigh is None else weigh(eqn)
    for inner in _inner(eqn):
      total += trips * _work(inner, prims, weigh)
  return total


def _grad_jaxpr(k: int):
  x = jnp.zeros((1, 48, 48, 2), jnp.float32)
  f = lambda v: jnp.sum(jp.max_pool(v, (k, k), padding="SAME"))
  return jax.make_jaxpr(jax.grad(f))(x).jaxpr


def test_taps_visited_grow_with_the_window_size_not_its_taps():
  """Forward and gradient: tap slices executed (loop trips counted) for 13x13 and 31x31 are in
  the ratio of the sizes per dim (31/13), not of the taps ((31/13)^2 = 5.7, today's direct
  loop over every tap); the programs' sizes too."""
  w13, w31 = _work(_grad_jaxpr(13)), _work(_grad_jaxpr(31))
  assert w31 / w13 < 31 / 13 * 1.15, (w13, w31)
  size = lambda k: len(str(_grad_jaxpr(k)).splitlines())
  s13, s31 = size(13), size(31)
  assert s31 / s13 < 31 / 13 * 1.15, (s13, s31)
  # past UNROLL_TAPS per dim the stages are loops: the program stops growing
  assert size(200) < size(66) * 1.1


def _kernel_eqns(fn, *args) -> tuple[int, int]:
  """Equations in the kernel of the ``pallas_call`` that ``fn(*args)`` makes (loop bodies once),
  and how many of them are loops."""
  found = [e.params["jaxpr"] for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns
           if e.primitive.name == "pallas_call"]
  assert len(found) == 1

  def count(jaxpr):
    n = loops = 0
    for eqn in jaxpr.eqns:
      n += 1
      loops += eqn.primitive.name in ("scan", "while")
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            n, loops = (a + b for a, b in zip((n, loops), count(inner), strict=True))
    return n, loops

  return count(found[0])


@pytest.mark.parametrize("window_of", [lambda k: (k,), lambda k: (k, 1)])
def test_the_kernels_code_stops_growing_past_loop_taps(window_of):
  """A kernel's code (its equations, a loop's body counted once) for a dim of 31 taps is that of
  17 taps, forward (with the taps) and backward, along W and along H: what Triton compiles does
  not grow with the window (a 31x31 pool's stages compile like a 17x17 one's). Up to
  ``LOOP_TAPS`` the taps stay straight-line code."""
  from jaxpool._src.pallas.triton import ops as triton_ops

  def kernels(k):
    shape = (2, 60, 8) if len(window_of(k)) == 1 else (2, 60, 5, 8)
    geom = make_geometry(shape, window_of(k), None, "SAME")
    x = jnp.zeros(shape, jnp.float32)
    fwd = _kernel_eqns(lambda v: triton_ops.max_forward_taps(v, geom, interpret=True), x)
    y, taps = triton_ops.max_forward_taps(x, geom, interpret=True)
    bwd = _kernel_eqns(lambda t, dy: triton_ops.max_backward(t, dy, shape, geom,
                                                             interpret=True), taps, y)
    return fwd, bwd

  # (a dim of more than LOOP_TAPS taps beside another dim: more than 32 taps, no kernel call)
  assert tile.loop_dim(make_geometry((1, 40, 40, 2), (2, 20), None, 0)) is None
  (f17, b17), (f31, b31) = kernels(17), kernels(31)
  assert f17 == f31 and b17 == b31, (f17, f31, b17, b31)
  assert f17[1] and b17[1]  # (loops)
  (f9, b9), (f13, b13) = kernels(9), kernels(13)
  assert f9[1] == b9[1] == 0 and f13[0] > f9[0] and b13[0] > b9[0]  # (straight-line code)


def _float_elements(eqn) -> int:
  aval = eqn.outvars[0].aval
  return math.prod(aval.shape) if jnp.issubdtype(aval.dtype, jnp.floating) else 0


@pytest.mark.parametrize("shape, window, strides, dilation", [
    ((1, 52, 52, 1), (13, 13), (13, 13), (1, 1)),
    ((1, 64, 64, 1), (17, 17), (8, 8), (1, 1)),
    ((1, 40, 41, 1), (7, 9), (3, 4), (2, 1)),
    ((1, 120, 1), (40,), (40,), (1,)),
])
def test_gradient_adds_the_taps_of_one_stride_phase(shape, window, strides, dilation):
  """Along a dim of ``k`` taps at stride ``s`` and dilation ``d``, an input element is reached
  by at most ``ceil(k * g / s)`` taps (``g = gcd(d, s)``): those of its stride phase. The
  gradient adds only those, so its float additions (elements written, transpose included) stay
  within that bound per stage; a stage adding one full-size term per tap (the transpose JAX
  derives) does ``k - 1`` additions per element whatever the stride (12 at 13x13/s13)."""
  geom = make_geometry(shape, window, strides, "SAME", dilation, False, "channels_last")
  assert xla_taps.is_separable(geom)
  x = jnp.zeros(shape, jnp.float32)
  dy = jnp.zeros(jp.max_pool(x, window, strides, "SAME", dilation=dilation).shape, jnp.float32)
  f = lambda v: jax.vjp(lambda u: jp.max_pool(u, window, strides, "SAME", dilation=dilation),
                        v)[1](dy)[0]
  adds = _work(jax.make_jaxpr(f)(x).jaxpr, ("add", "add_any"), _float_elements)
  bound = 0
  for i, (k, s, d) in enumerate(zip(window, strides, dilation, strict=True)):
    per_phase = -(-k * math.gcd(d, s) // s)
    assert max(sum((a * d) % s == r for a in range(k)) for r in range(s)) == per_phase
    blocks = -(-(geom.padding[i][0] + geom.in_spatial[i]) // s) * s
    rest = math.prod(geom.in_spatial[:i]) * math.prod(geom.out_spatial[i + 1:])
    bound += (per_phase - 1) * blocks * rest
  assert adds <= bound, (adds, bound)
  if all(s >= k for k, s in zip(window, strides, strict=True)):
    assert adds == 0


def test_the_separable_forward_is_a_reduce_window_per_dim():
  x = jnp.zeros((1, 40, 40, 2))
  jaxpr = jax.make_jaxpr(lambda v: jp.max_pool(v, (13, 13), padding="SAME"))(x)
  assert str(jaxpr).count("reduce_window_max") == 2
  jaxpr = jax.make_jaxpr(lambda v: jp.avg_pool(v, (13, 13), padding="SAME"))(x)
  assert str(jaxpr).count("reduce_window_sum") == 2


@pytest.mark.parametrize("window, strides, whole", [
    ((13, 13), (6, 6), True), ((9, 9), (4, 4), True), ((31, 31), (31, 31), True),
    ((5, 5, 5), (2, 2, 2), True), ((13, 13), (4, 4), False), ((7, 7), (2, 2), False),
    ((13, 13), (6, 4), False), ((40,), (14,), True), ((40,), (13,), False),
])
def test_the_forward_without_taps_reads_windows_whole_where_they_overlap_little(
    window, strides, whole, rng):
  """Max pooling without the taps: one ``reduce_window`` where windows overlap fewer than 3
  times in every dim (an element read fewer than 3^d times), a ``reduce_window`` a dim where
  they overlap more; the reference's values either way (ties, NaN, infinities and signed
  zeros). (Fails before: every window of more
  than SEPARABLE_TAPS taps took one reduce_window a dim.)"""
  shape = (2, *(k + 2 * s + 1 for k, s in zip(window, strides, strict=True)), 3)
  x = jnp.asarray(_inputs(rng, shape))
  f = lambda v: jp.max_pool(v, window, strides, padding="SAME")  # noqa: E731
  assert str(jax.make_jaxpr(f)(x)).count("reduce_window_max") == (1 if whole else len(window))
  expected = ref.max_pool(np.asarray(x), window, strides, "SAME")
  assert_bitwise(f(x), expected)
  assert_bitwise(jax.jit(f)(x), expected)


@pytest.mark.parametrize("window, strides", [
    ((13, 13), (1, 1)), ((13, 13), (6, 6)), ((13, 13), (13, 13)), ((9, 9), (4, 4)),
    ((7, 7), (7, 7)), ((3, 3, 5), (1, 1, 1)), ((40,), (30,)), ((1, 40), (3, 2)),
])
def test_every_window_over_the_bound_runs_separably(window, strides):
  """Every stride: where few windows share an element (13x13 at stride 6 or 13) the direct
  form's gradient ran 4-40x slower still than the separable one's on an H200. A window of
  at most SEPARABLE_TAPS taps keeps the direct form (and the kernels)."""
  shape = (1, *(max(k, 2 * s) + 3 for k, s in zip(window, strides, strict=True)), 1)
  assert xla_taps.is_separable(make_geometry(shape, window, strides, 0, None, False,
                                             "channels_last"))
  assert not xla_taps.is_separable(make_geometry((1, 9, 9, 1), (5, 5), (1, 1), 0, None, False,
                                                 "channels_last"))
