"""roi_align against the NumPy reference (tests/support/roi_reference.py): values, the feature
gradient and the box gradient, every sampling form, aligned both ways, rectangular grids, the
edge boxes; the box gradient against finite differences; determinism."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import roi_reference as rref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpool
from tiers import draws

N, H, W, C = 2, 7, 9, 3


def _x(rng, shape=(N, H, W, C)):
  return rng.standard_normal(shape).astype(np.float32)


def _boxes(rng, k, lo=-2.0, hi=10.0):
  pts = rng.uniform(lo, hi, (k, 4)).astype(np.float32)
  x1, x2 = np.minimum(pts[:, 0], pts[:, 2]), np.maximum(pts[:, 0], pts[:, 2])
  y1, y2 = np.minimum(pts[:, 1], pts[:, 3]), np.maximum(pts[:, 1], pts[:, 3])
  img = rng.integers(0, N, k).astype(np.float32)
  return np.stack([img, x1, y1, x2, y2], axis=1)


# Boxes that exercise the edges: outside the map, zero and negative size, one pixel, the whole
# map, past the bottom-right clamp band, straddling the top-left one.
EDGE = np.array([
    [0, 20.0, 20.0, 30.0, 25.0],   # outside the map
    [1, 3.0, 2.0, 3.0, 2.0],       # zero size
    [0, 5.0, 4.0, 2.0, 1.0],       # negative size
    [1, 2.0, 3.0, 3.0, 4.0],       # one pixel
    [0, 0.0, 0.0, 9.0, 7.0],       # the whole map
    [1, 6.3, 4.2, 9.8, 7.9],       # into the bottom-right clamp band
    [0, -1.7, -0.6, 2.2, 1.9],     # over the top-left clamp band
], np.float32)


def _run(x, boxes, dy, **kw):
  """Value, feature gradient and box gradient of jaxpool.roi_align, under one jit."""
  f = lambda v, b: jaxpool.roi_align(v, b, **kw)

  @jax.jit
  def go(x, boxes, dy):
    y, vjp = jax.vjp(f, x, boxes)
    return (y, *vjp(dy))

  return go(x, boxes, dy)


def _check(x, boxes, rng, atol=2e-5, **kw):
  ref = rref.roi_align(x, boxes, **kw)
  dy = rng.standard_normal(ref.shape).astype(np.float32)
  y, dx, db = _run(x, boxes, dy, **kw)
  ry, rdx, rdb = rref.roi_align(x, boxes, dy=dy, **kw)
  np.testing.assert_allclose(y, ry, atol=atol, rtol=1e-5)
  np.testing.assert_allclose(dx, rdx, atol=atol, rtol=1e-5)
  np.testing.assert_allclose(db[:, 1:], rdb, atol=10 * atol, rtol=1e-4)
  np.testing.assert_array_equal(db[:, 0], 0)


@pytest.mark.parametrize("mode,aligned", [
    ("avg", False), ("max", True),
    pytest.param("avg", True, marks=pytest.mark.slow),
    pytest.param("max", False, marks=pytest.mark.slow)])
def test_values_and_gradients(rng, mode, aligned):
  x = _x(rng)
  boxes = np.concatenate([_boxes(rng, 6), EDGE])
  _check(x, boxes, rng, output_size=(3, 2), spatial_scale=0.9, sampling_ratio=2,
         aligned=aligned, mode=mode)


@pytest.mark.parametrize("sampling_ratio,max_samples", [
    (-1, 2), pytest.param(0, None, marks=pytest.mark.slow),
    pytest.param(1, None, marks=pytest.mark.slow)])
def test_sampling_forms(rng, sampling_ratio, max_samples):
  x = _x(rng)
  boxes = np.concatenate([_boxes(rng, 5, hi=14.0), EDGE])
  _check(x, boxes, rng, output_size=(2, 3), spatial_scale=0.7, sampling_ratio=sampling_ratio,
         max_samples=max_samples, aligned=True)


def test_adaptive_count_the_same_under_jit_and_outside(rng):
  """Outside jit the sample grid is fitted to the boxes; under jit it is the default bound:
  the same numbers."""
  x = _x(rng)
  boxes = np.concatenate([_boxes(rng, 4, hi=30.0), EDGE])
  eager = jaxpool.roi_align(x, boxes, (2, 2), sampling_ratio=0)
  jitted = jax.jit(lambda v, b: jaxpool.roi_align(v, b, (2, 2), sampling_ratio=0))(x, boxes)
  np.testing.assert_allclose(eager, jitted, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(eager, rref.roi_align(x, boxes, (2, 2), sampling_ratio=0),
                             rtol=1e-5, atol=1e-5)


def test_adaptive_count_of_a_whole_bin_size_under_jit(rng):
  """A box whose bin size ``roi / n`` is a whole number in float32 (14 / 7, 21 / 7, 28 / 7)
  takes ``ceil`` of exactly that many samples under ``jit`` too: XLA turns a division by a
  constant into a product with its inverse, one bit larger, which took one sample more a
  bin (values off by 0.03 here)."""
  x = rng.standard_normal((1, 30, 40, 2)).astype(np.float32)
  boxes = np.array([[0, 3.0, 2.0, 17.0, 16.0], [0, 1.0, 1.0, 22.0, 29.0]], np.float32)
  y = jax.jit(lambda v, b: jaxpool.roi_align(v, b, 7, sampling_ratio=0))(x, boxes)
  np.testing.assert_allclose(y, rref.roi_align(x, boxes, 7, sampling_ratio=0), rtol=1e-5,
                             atol=1e-5)


def test_box_gradient_matches_finite_differences(rng):
  """Away from pixel boundaries and the clamp bands: boxes well inside the map, a float64
  reference for the differences."""
  x = _x(rng)
  boxes = np.array([[0, 1.13, 1.27, 6.71, 5.58], [1, 2.41, 0.77, 4.36, 5.92],
                    [0, 0.62, 2.19, 7.83, 3.41]], np.float32)
  kw = dict(output_size=(2, 3), spatial_scale=1.0, sampling_ratio=2, aligned=True)
  dy = rng.standard_normal((3, 2, 3, C))
  _, _, db = _run(x, boxes, dy.astype(np.float32), **kw)
  eps = 1e-4
  fd = np.zeros((3, 4))
  for k in range(3):
    for c in range(4):
      plus, minus = boxes.astype(np.float64), boxes.astype(np.float64)
      plus[k, 1 + c] += eps
      minus[k, 1 + c] -= eps
      fp = rref.roi_align(x, plus, pos_dtype=np.float64, **kw)
      fm = rref.roi_align(x, minus, pos_dtype=np.float64, **kw)
      fd[k, c] = np.sum(dy * (fp - fm)) / (2 * eps)
  np.testing.assert_allclose(db[:, 1:], fd, rtol=1e-3, atol=1e-3)


def test_list_of_boxes_is_the_rows_form(rng):
  x = _x(rng)
  rows = _boxes(rng, 5)
  per_image = [rows[rows[:, 0] == i, 1:] for i in range(N)]
  order = np.argsort(rows[:, 0], kind="stable")
  a = jaxpool.roi_align(x, rows[order], 3, sampling_ratio=2)
  b = jaxpool.roi_align(x, per_image, 3, sampling_ratio=2)
  np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_list_of_boxes_gradient(rng):
  x = _x(rng)
  rows = _boxes(rng, 5)
  per_image = [rows[rows[:, 0] == i, 1:] for i in range(N)]
  order = np.argsort(rows[:, 0], kind="stable")
  g = jax.grad(lambda bs: jaxpool.roi_align(x, bs, 3, sampling_ratio=2).sum())(per_image)
  assert [t.shape for t in g] == [p.shape for p in per_image]
  gr = jax.grad(lambda b: jaxpool.roi_align(x, b, 3, sampling_ratio=2).sum())(rows[order])
  np.testing.assert_array_equal(np.concatenate(g), gr[:, 1:])


def test_empty_boxes_and_images_without_boxes(rng):
  x = _x(rng)
  y = jaxpool.roi_align(x, np.zeros((0, 5), np.float32), (2, 3))
  assert y.shape == (0, 2, 3, C)
  dx = jax.grad(lambda v: jaxpool.roi_align(v, np.zeros((0, 5), np.float32), 2,
                                            sampling_ratio=2).sum())(x)
  np.testing.assert_array_equal(dx, 0)
  only_first = [np.array([[1.0, 1.0, 4.0, 5.0]], np.float32), np.zeros((0, 4), np.float32)]
  dx = jax.grad(lambda v: jaxpool.roi_align(v, only_first, 2, sampling_ratio=2).sum())(x)
  np.testing.assert_array_equal(dx[1], 0)
  assert np.abs(dx[0]).sum() > 0


@pytest.mark.slow
def test_channels_first_is_the_transpose(rng):
  x = _x(rng)
  boxes = _boxes(rng, 4)
  a = jaxpool.roi_align(x, boxes, (2, 3), sampling_ratio=2)
  b = jaxpool.roi_align(np.moveaxis(x, -1, 1), boxes, (2, 3), sampling_ratio=2,
                        data_format="channels_first")
  np.testing.assert_array_equal(np.moveaxis(np.asarray(b), 1, -1), a)


@pytest.mark.parametrize("dtype", [jnp.bfloat16,
                                   pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_low_precision_accumulates_in_float32(rng, dtype):
  x = _x(rng)
  boxes = _boxes(rng, 4)
  xl = jnp.asarray(x, dtype)
  y = jaxpool.roi_align(xl, boxes, 2, sampling_ratio=2, aligned=True)
  assert y.dtype == dtype
  ref = rref.roi_align(np.asarray(xl.astype(jnp.float32)), boxes, 2, sampling_ratio=2,
                       aligned=True)
  tol = 1e-2 if dtype == jnp.bfloat16 else 2e-3
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=tol, atol=tol)
  dx = jax.grad(lambda v: jaxpool.roi_align(v, boxes, 2, sampling_ratio=2).astype(
      jnp.float32).sum())(xl)
  assert dx.dtype == dtype


def test_two_runs_same_bits(rng):
  x = _x(rng)
  boxes = np.concatenate([_boxes(rng, 4), _boxes(rng, 4)])  # overlapping boxes: shared pixels
  dy = rng.standard_normal((8, 3, 3, C)).astype(np.float32)
  f = lambda v, b: jaxpool.roi_align(v, b, (3, 3), sampling_ratio=2, aligned=True)
  run = jax.jit(lambda x, b, d: (lambda out: (out[0], *out[1](d)))(jax.vjp(f, x, b)))
  first = run(x, boxes, dy)
  second = run(x.copy(), boxes.copy(), dy.copy())
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.slow
def test_jvp_is_the_transpose_of_the_vjp(rng):
  x = _x(rng)
  boxes = np.concatenate([_boxes(rng, 8), _boxes(rng, 8)])
  kw = dict(output_size=(3, 3), sampling_ratio=2, aligned=True)
  dy = rng.standard_normal((16, 3, 3, C)).astype(np.float32)
  first = _run(x, boxes, dy, **kw)
  tx = rng.standard_normal(x.shape).astype(np.float32)
  tb = rng.standard_normal(boxes.shape).astype(np.float32)
  _, ty = jax.jvp(lambda v, b: jaxpool.roi_align(v, b, **kw), (x, boxes), (tx, tb))
  lhs = float(np.sum(np.asarray(ty, np.float64) * dy))
  rhs = float(np.sum(np.asarray(first[1], np.float64) * tx)
              + np.sum(np.asarray(first[2], np.float64) * tb))
  assert abs(lhs - rhs) < 1e-3 * max(1.0, abs(lhs))


@pytest.mark.slow
def test_vmap_forward(rng):
  xs = np.stack([_x(rng), _x(rng)])
  bs = np.stack([_boxes(rng, 3), _boxes(rng, 3)])
  f = lambda v, b: jaxpool.roi_align(v, b, 2, sampling_ratio=2)
  np.testing.assert_allclose(jax.vmap(f)(xs, bs), np.stack([f(xs[i], bs[i]) for i in range(2)]),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_vmap_is_a_loop(rng):
  xs = np.stack([_x(rng), _x(rng)])
  bs = np.stack([_boxes(rng, 3), _boxes(rng, 3)])
  f = lambda v, b: jaxpool.roi_align(v, b, 2, sampling_ratio=2, mode="max")
  np.testing.assert_allclose(jax.vmap(f)(xs, bs), np.stack([f(xs[i], bs[i]) for i in range(2)]),
                             rtol=1e-6, atol=1e-6)
  g = jax.vmap(jax.grad(lambda v, b: (f(v, b) ** 2).sum(), argnums=(0, 1)))(xs, bs)
  for i in range(2):
    gi = jax.grad(lambda v, b: (f(v, b) ** 2).sum(), argnums=(0, 1))(xs[i], bs[i])
    np.testing.assert_allclose(g[0][i], gi[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g[1][i], gi[1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_vmap_over_the_boxes_only(rng, mode):
  """The features unbatched, the boxes batched: the gradient's batching rule keeps one table."""
  x = _x(rng)
  bs = np.stack([_boxes(rng, 3) for _ in range(3)])
  f = lambda v, b: (jaxpool.roi_align(v, b, 2, sampling_ratio=2, mode=mode) ** 2).sum()
  g = jax.grad(f, argnums=(0, 1))
  gv = jax.vmap(g, in_axes=(None, 0))(x, bs)
  for i in range(3):
    gi = g(x, bs[i])
    np.testing.assert_allclose(gv[0][i], gi[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gv[1][i], gi[1], rtol=1e-6, atol=1e-6)
  whole = jax.grad(lambda v, b: jax.vmap(f, in_axes=(None, 0))(v, b).sum())(x, bs)
  np.testing.assert_allclose(whole, sum(g(x, bs[i])[0] for i in range(3)), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.slow
def test_second_order_runs(rng):
  x = _x(rng, (1, 5, 5, 1))
  boxes = np.array([[0, 0.6, 0.7, 3.3, 3.9]], np.float32)
  f = lambda b: (jaxpool.roi_align(x, b, 2, sampling_ratio=2, aligned=True) ** 2).sum()
  h = jax.hessian(f)(boxes)
  assert h.shape == (1, 5, 1, 5) and np.isfinite(h).all()


def test_max_mode_ties_and_nan(rng):
  """The first maximum (row-major samples) takes the gradient; a NaN sample wins."""
  x = np.zeros((1, 4, 4, 1), np.float32)
  box = np.array([[0, 0.0, 0.0, 4.0, 4.0]], np.float32)  # 2x2 samples at pixel centres
  f = lambda v: jaxpool.roi_align(v, box, 1, sampling_ratio=2, aligned=True, mode="max")
  g = jax.grad(lambda v: f(v).sum())(x)
  expect = np.zeros((4, 4))
  expect[0:2, 0:2] = 0.25  # the first sample (1.0, 1.0) -> aligned: pixel (0.5, 0.5)
  np.testing.assert_allclose(g[0, :, :, 0], expect)
  x[0, 3, 3, 0] = np.nan
  assert np.isnan(f(x)).all()


@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), ratio=st.sampled_from([0, 1, 2]),
       aligned=st.booleans(), mode=st.sampled_from(["avg", "max"]))
def test_hypothesis_against_the_reference(seed, ratio, aligned, mode):
  rng = np.random.default_rng(seed)
  _check(_x(rng), _boxes(rng, 3, hi=12.0), rng, output_size=(2, 2), spatial_scale=0.8,
         sampling_ratio=ratio, aligned=aligned, mode=mode, max_samples=3 if ratio == 0 else None)


@pytest.mark.slow
@settings(max_examples=draws(40, 20), deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), ratio=st.integers(-1, 3), aligned=st.booleans(),
       mode=st.sampled_from(["avg", "max"]), ph=st.integers(1, 4), pw=st.integers(1, 4),
       scale=st.sampled_from([0.25, 0.5, 1.0, 1.3]), k=st.integers(0, 6))
def test_hypothesis_wide(seed, ratio, aligned, mode, ph, pw, scale, k):
  rng = np.random.default_rng(seed)
  boxes = np.concatenate([_boxes(rng, k, lo=-4.0, hi=16.0 / scale), EDGE])
  _check(_x(rng), boxes, rng, output_size=(ph, pw), spatial_scale=scale, sampling_ratio=ratio,
         aligned=aligned, mode=mode, max_samples=None if ratio > 0 else 4)


def _align_grad(mode="avg", ratio=2):
  f = lambda v, b: jaxpool.roi_align(v, b, 2, sampling_ratio=ratio, aligned=True,
                                     mode=mode).sum()
  return jax.grad(f, argnums=(0, 1))


def _multi_grad(v, b):
  f = lambda v, w, b: jaxpool.multi_scale_roi_align([v, w], [b[:2, 1:], b[2:, 1:]],
                                                    [(14, 18)] * 2, 2).sum()
  return jax.grad(f, argnums=(0, 1, 2))(v, v[:, ::2, ::2], b)


@pytest.mark.parametrize("grad,batch", [
    pytest.param(_align_grad(), 0, id="avg"), pytest.param(_align_grad("max"), 0, id="max"),
    pytest.param(_align_grad(ratio=-1), 0, id="adaptive"),
    pytest.param(_align_grad("max", -1), 0, id="max-adaptive"),
    pytest.param(jax.vmap(_align_grad(), (0, None)), 2, id="vmap"),
    pytest.param(_multi_grad, 0, id="multi_scale"),
    pytest.param(lambda v, b: jax.grad(lambda v: jaxpool.roi_pool(v, b, 2).sum())(v), 0,
                 id="roi_pool")])
def test_gradients_have_no_scatter(rng, grad, batch):
  """The determinism claim, checked in the compiled program: no scatter (so no atomics) in the
  gradient for the features and the boxes of roi_align (both modes, fixed and adaptive
  sampling, under vmap) and multi_scale_roi_align, and for the features of roi_pool."""
  x = np.stack([_x(rng)] * batch) if batch else _x(rng)
  lowered = jax.jit(grad).lower(x, _boxes(rng, 4))
  assert "scatter" not in lowered.as_text().lower()


def test_gradient_memory_is_bounded():
  """Under jit the adaptive grid is ceil((H + 1) / ph) = 15 samples per axis here: the feature
  gradient holds one sample of every bin at a time (183 MB before, for the whole grid)."""
  x = jax.ShapeDtypeStruct((1, 100, 100, 64), jnp.float32)
  boxes = jax.ShapeDtypeStruct((8, 5), jnp.float32)
  grad = jax.jit(jax.grad(lambda v, b: jaxpool.roi_align(v, b, 7).sum(), argnums=(0, 1)))
  assert grad.lower(x, boxes).compile().memory_analysis().temp_size_in_bytes < 16e6


def test_gradient_peak_memory_is_at_most_twice_the_inputs_and_outputs():
  """benchmarks/roi_gpu.py's measure (XLA's memory analysis of the forward and the feature
  gradient of multi_scale_roi_align: arguments, outputs and temporaries over arguments and
  outputs) on its shapes scaled down (P2-P5 of 2 images of 100x152, 64 channels, 64 boxes per
  image, 14x14): 1.86 with the channel groups of the sorted sum, 5.24 before (the contributions
  of a sample of every bin, 4 corners x the outputs, sorted whole). Compiled, not run."""
  sizes = [(25, 38), (13, 19), (7, 10), (4, 5)]
  fs = [jax.ShapeDtypeStruct((2, h, w, 64), jnp.float32) for h, w in sizes]
  boxes = jax.ShapeDtypeStruct((128, 5), jnp.float32)
  dy = jax.ShapeDtypeStruct((128, 14, 14, 64), jnp.float32)
  f = lambda fs, b: jaxpool.multi_scale_roi_align(fs, b, [(100, 152)] * 2, 14,
                                                  sampling_ratio=2, aligned=True)

  def fwd_dx(fs, b, g):
    y, vjp = jax.vjp(lambda v: f(v, b), fs)
    return y, vjp(g)[0]

  m = jax.jit(fwd_dx).lower(fs, boxes, dy).compile().memory_analysis()
  io = m.argument_size_in_bytes + m.output_size_in_bytes
  assert (io + m.temp_size_in_bytes) / io <= 2.0, m
