"""ROI align's GPU kernels (``jaxpool/_src/roi/triton.py``, ``triton_boxes.py``) in interpret
mode on the CPU: the forward, the feature gradient and the box gradient against the XLA path and
the NumPy reference (tests/support/roi_reference.py), the same bits on a second run, NaN where
the XLA path has it, several levels, the registry's rule (what runs where), and Triton
lowering; compiled on a GPU (``-m gpu``) against the XLA path and torchvision. (More of the box
gradient's kernel: test_roi_box_kernels.py.)

Tolerances. The forward kernel adds the same float32 terms in the XLA path's order (each
sample's four corners in torchvision's order, the samples row-major), so in interpret mode on
the CPU it has the XLA path's bits; compiled, Triton may contract a multiply and an add into
one rounding. The feature gradient adds each pixel's terms in another order than the XLA
path's sorted sum (docs/roi.md, "Where it runs"), so the two agree to float32 rounding of sums
of a few terms of size ~1: ``rtol = atol = 1e-5`` here; so does the box gradient (its kernel
sums each corner weight's products in an order of its own, the XLA path in fixed trees).
Compiled (the GPU tests), sums over hundreds of boxes fused differently: ``1e-4``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import roi_reference as rref
from roi_cases import EDGE, gpu_case, random_boxes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpool
from jaxpool._src import dispatch
from jaxpool._src.roi import form
from jaxpool._src.roi.plan import AlignConfig, Level

N, H, W, C = 2, 7, 9, 3
TOL = dict(rtol=1e-5, atol=1e-5)
GPU_TOL = dict(rtol=1e-4, atol=1e-4)  # compiled: many boxes' sums per pixel, fused differently


@functools.cache
def _vjp_fn(implementation, kw):
  """``(y, dx, dboxes)`` of roi_align under one jit."""
  kw = dict(kw)

  @jax.jit
  def go(x, boxes, dy):
    f = lambda v, b: jaxpool.roi_align(v, b, implementation=implementation, **kw)
    y, vjp = jax.vjp(f, x, boxes)
    return (y, *vjp(dy))

  return go


def _both(x, boxes, dy, **kw):
  key = tuple(sorted(kw.items()))
  return _vjp_fn("pallas", key)(x, boxes, dy), _vjp_fn("xla", key)(x, boxes, dy)


def _compare(ours, xla, exact=True):
  """``exact``: in interpret mode, the forward has the XLA path's bits (compiled, the
  programs around it fuse differently: float32 rounding); the gradients agree to float32
  rounding."""
  (y, dx, db), (ry, rdx, rdb) = ours, xla
  check = np.testing.assert_array_equal if exact else functools.partial(
      np.testing.assert_allclose, rtol=1e-4, atol=1e-4)
  check(y, ry)
  np.testing.assert_allclose(dx, rdx, **(TOL if exact else GPU_TOL))
  np.testing.assert_allclose(db, rdb, **(TOL if exact else GPU_TOL))


KW = dict(output_size=(3, 2), spatial_scale=0.9, sampling_ratio=2, aligned=True)


@pytest.fixture(scope="module")
def case():
  """The inputs, the kernels' and the XLA path's (y, dx, dboxes), and the derivatives that
  the kernels' primitive left to the XLA path's form while they were traced."""
  rng = np.random.default_rng(50)
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  boxes = np.concatenate([random_boxes(rng, 6), EDGE])
  dy = rng.standard_normal((len(boxes), 3, 2, C)).astype(np.float32)
  on_xla = []
  real = form.evaluate

  def spy(*args, wrt, **kwargs):
    on_xla.append(wrt)
    return real(*args, wrt=wrt, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(form, "evaluate", spy)
    results = _both(x, boxes, dy, **KW)
  return x, boxes, dy, results, on_xla


def test_kernels_match_the_xla_path(case):
  x, boxes, dy, (ours, xla), _ = case
  assert np.abs(np.asarray(ours[1])).max() > 0  # (the gradient reaches pixels)
  assert np.abs(np.asarray(ours[2])).max() > 0.1  # (and the boxes)
  _compare(ours, xla)


def test_every_derivative_runs_on_the_kernels(case):
  """The forward, the feature gradient and both parts of the box gradient (the corner weights
  in y and in x) run kernels: none falls back to the XLA path's form (``form.evaluate``)."""
  *_, on_xla = case
  assert on_xla == [], on_xla


def test_sizes_past_int32_indexing_leave_the_kernels(monkeypatch):
  """vmap folds copies of the feature table into one (and many boxes make a large output): past
  the kernels' int32 indexing, the primitive runs the XLA path's form (here the bound is
  lowered to 400 elements: one table of 2 x 7 x 9 x 3 = 378 passes the registry's check, the
  two copies under vmap do not; the kernels would raise)."""
  from jaxpool._src.roi import kernels, triton

  def never(*args, **kwargs):
    raise AssertionError("a kernel ran past the int32 bound")

  monkeypatch.setattr(kernels, "MAX_ELEMENTS", 400)
  monkeypatch.setattr(triton, "forward", never)
  monkeypatch.setattr(triton, "feature_grad", never)
  rng = np.random.default_rng(7)
  xs = rng.standard_normal((2, N, H, W, C)).astype(np.float32)
  boxes = random_boxes(rng, 4)

  def loss(implementation):
    f = lambda v: jaxpool.roi_align(v, boxes, implementation=implementation, output_size=(2, 3),
                                    sampling_ratio=1)
    return jax.jit(jax.vmap(jax.value_and_grad(lambda v: jnp.sum(f(v) ** 2))))

  for a, b in zip(loss("pallas")(xs), loss("xla")(xs), strict=True):
    np.testing.assert_array_equal(a, b)


def test_the_box_lists_past_int32_indexing_leave_the_kernels():
  """The gradient's box lists hold at least one cell of K entries per image of each level
  (and of each copy that vmap folds in): past int32 indexing, the XLA path's form."""
  from types import SimpleNamespace as Shape

  from jaxpool._src.roi import kernels
  ops = dict(iy=Shape(shape=(1024, 7, 2, 2)), ix=Shape(shape=(1024, 7, 2, 2)),
             ct=Shape(shape=(1024, 7, 7, 1)))
  assert not kernels._too_large(ops, table_rows=1000, planes=8)
  assert kernels._too_large(ops, table_rows=1000, planes=2**21 + 1)


def test_sample_grids_past_int32_indexing_leave_the_kernels():
  """The samples' corner indices (``K x bins x samples x 2`` an axis, indexed flat in the
  kernels, and the shape of the box gradient's results) past int32 indexing: the XLA path's
  form, even where the outputs and the tables fit (one channel, a large ``max_samples``)."""
  from types import SimpleNamespace as Shape

  from jaxpool._src.roi import kernels
  small = dict(iy=Shape(shape=(4096, 7, 4096, 2)), ix=Shape(shape=(4096, 7, 2, 2)),
               ct=Shape(shape=(4096, 7, 7, 1)))
  assert not kernels._too_large(small, table_rows=1000, planes=8)
  large = dict(small, iy=Shape(shape=(4096, 7, 40000, 2)))
  assert kernels._too_large(large, table_rows=1000, planes=8)


def test_wide_levels_under_vmap_span_several_column_cells():
  """Maps wider than a cell (32 columns) on two levels, under vmap (two copies of the table):
  every cell's list finds its boxes; the kernels agree with the XLA path."""
  rng = np.random.default_rng(12)
  p2 = rng.standard_normal((2, 2, 6, 80, 2)).astype(np.float32)
  p3 = rng.standard_normal((2, 2, 3, 40, 2)).astype(np.float32)
  x1 = rng.uniform(-8, 300, 12)
  y1 = rng.uniform(-4, 16, 12)
  side = np.exp(rng.uniform(np.log(4), np.log(120), 12))
  boxes = np.stack([rng.integers(0, 2, 12), x1, y1, x1 + side, y1 + side / 4], 1)
  boxes = boxes.astype(np.float32)

  def run(impl):
    f = lambda fs: jaxpool.multi_scale_roi_align(fs, boxes, [(24, 320)] * 2, (2, 3),
                                                 canonical_scale=32.0, aligned=True,
                                                 sampling_ratio=2, implementation=impl)

    def one(a, b):
      y, vjp = jax.vjp(f, [a, b])
      return y, vjp(jnp.cos(y))[0]

    return jax.jit(jax.vmap(one))(p2, p3)

  (y, (g2, g3)), (ry, (r2, r3)) = run("pallas"), run("xla")
  assert np.abs(r2[:, :, :, 40:]).max() > 0 and np.abs(r3[:, :, :, 20:]).max() > 0
  np.testing.assert_array_equal(y, ry)
  np.testing.assert_allclose(g2, r2, **TOL)
  np.testing.assert_allclose(g3, r3, **TOL)


def test_kernels_match_the_reference(case):
  x, boxes, dy, (ours, _), _ = case
  ry, rdx, rdb = rref.roi_align(x, boxes, dy=dy, **KW)
  np.testing.assert_allclose(ours[0], ry, **TOL)
  np.testing.assert_allclose(ours[1], rdx, **TOL)
  np.testing.assert_allclose(np.asarray(ours[2])[:, 1:], rdb, rtol=1e-4, atol=2e-4)


def test_kernels_give_the_same_bits_twice(case):
  x, boxes, dy, (ours, _), _ = case
  again = _vjp_fn("pallas", tuple(sorted(KW.items())))(x, boxes, dy)
  for a, b in zip(ours, again):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_flags_per_box_against_numpy(dtype):
  """The flags that pick the kernels' shorter forms: a box's cotangents and weights all finite
  (NaN, +inf and -inf each clear it, huge finite values do not; at 7 x 7 x 256 cotangents a box,
  where XLA:CPU's maximum reduction can drop a NaN), a box's corners all live (no -1)."""
  from jaxpool._src.roi.triton_levels import finite_boxes, live_boxes
  rng = np.random.default_rng(0)
  ct = rng.standard_normal((8, 7 * 7 * 256)).astype(np.float32)
  ct[1, 3], ct[2, 0], ct[3, -1], ct[4, :] = np.nan, np.inf, -np.inf, 3e38
  ct[5, 7000] = np.nan
  wy = rng.uniform(size=(8, 7, 2, 2)).astype(np.float32)
  wx = rng.uniform(size=(8, 7, 2, 2)).astype(np.float32)
  wy[6, 3, 1, 0], wx[7, 0, 0, 1] = np.nan, np.inf
  want = (np.isfinite(ct.astype(np.float64)).all(axis=1) & np.isfinite(wy).all(axis=(1, 2, 3))
          & np.isfinite(wx).all(axis=(1, 2, 3)))
  got = finite_boxes(jnp.asarray(ct, dtype), jnp.asarray(wy), jnp.asarray(wx))
  assert np.asarray(got).tolist() == want.astype(int).tolist()
  assert finite_boxes(*(jnp.zeros((0, *a.shape[1:]), a.dtype) for a in (ct, wy, wx))).shape == (0,)
  iy = rng.integers(0, 9, (4, 7, 2, 2))
  ix = rng.integers(0, 9, (4, 7, 2, 2))
  iy[1, 6, 1, 0], ix[2, 0, 0, 1] = -1, -1
  live = [(iy[k] >= 0).all() and (ix[k] >= 0).all() for k in range(4)]
  assert np.asarray(live_boxes(jnp.asarray(iy), jnp.asarray(ix))).tolist() == \
      np.array(live, int).tolist()
  assert live_boxes(jnp.zeros((0, 7, 2, 2), jnp.int32), jnp.zeros((0, 7, 2, 2), jnp.int32)).shape \
      == (0,)


def _nan_mask_both(x, boxes, dy, **kw):
  out = []
  for impl in ("xla", "pallas"):
    f = lambda v, impl=impl: jaxpool.roi_align(v, jnp.asarray(boxes), implementation=impl, **kw)
    dx = jax.jit(lambda v, d, f=f: jax.vjp(f, v)[1](d)[0])(jnp.asarray(x), jnp.asarray(dy))
    out.append(np.asarray(dx))
  return out


def test_one_nan_cotangent_among_many_channels():
  """A NaN in one channel of one box's 2 x 2 x 256 cotangents (a size where XLA:CPU's maximum
  reduction drops NaN) reaches the pixels the XLA path's reaches, in that channel only."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1, 8, 8, 256)).astype(np.float32)
  lo = rng.uniform(0, 4, (8, 2))
  boxes = np.concatenate([np.zeros((8, 1)), lo, lo + 3], 1).astype(np.float32)
  dy = rng.standard_normal((8, 2, 2, 256)).astype(np.float32)
  dy[3, 0, 0, 7] = np.nan
  xla, ours = _nan_mask_both(x, boxes, dy, output_size=2, sampling_ratio=2, aligned=True)
  np.testing.assert_array_equal(np.isnan(ours), np.isnan(xla))
  assert 0 < np.isnan(ours).sum() and set(np.argwhere(np.isnan(ours))[:, 3]) == {7}


def test_overflowing_box_size_nan_weights_stay_on_their_pixels():
  """Finite coordinates whose extent overflows float32 give NaN sample weights: the NaN reaches
  the pixels the XLA path's reaches (the box takes the masked form of the terms)."""
  x = np.random.default_rng(0).standard_normal((1, 6, 8, 1)).astype(np.float32)
  boxes = np.array([[0, 1.6, -3e38, 2.6, 3e38]], np.float32)
  xla, ours = _nan_mask_both(x, boxes, np.ones((1, 2, 2, 1), np.float32), output_size=2,
                             sampling_ratio=2, aligned=True)
  assert np.isnan(xla).any()
  np.testing.assert_array_equal(np.isnan(ours), np.isnan(xla))


def test_float16_values_have_the_xla_paths_bits():
  """Interpreted, the forward of boxes whose corners are all live gives the XLA path's bits in
  float16 too (a select-free sum that XLA:CPU would contract into multiply-adds would not)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((1, 8, 8, 64)), jnp.float16)
  lo = rng.uniform(0, 4, (40, 2))
  boxes = jnp.asarray(np.concatenate([np.zeros((40, 1)), lo, lo + rng.uniform(0.1, 3.5, (40, 2))],
                                     1), jnp.float32)
  y = [np.asarray(jax.jit(lambda v, impl=impl: jaxpool.roi_align(
      v, boxes, 3, sampling_ratio=2, aligned=True, implementation=impl))(x))
       for impl in ("xla", "pallas")]
  assert y[0].tobytes() == y[1].tobytes()


def test_nan_cotangent_reaches_the_pixels_the_xla_path_reaches(case):
  """A NaN in one bin's cotangent spreads to that bin's live corners only (a pixel the bin
  does not sample stays finite), and to the coordinates of its box whose corner weights meet
  them, as on the XLA path."""
  x, boxes, dy, *_ = case
  dy = dy.copy()
  dy[0, 1, 1, :] = np.nan
  ours, xla = _both(x, boxes, dy, **KW)
  for a, b in zip(ours[1:], xla[1:], strict=True):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    ok = ~np.isnan(np.asarray(b))
    np.testing.assert_allclose(np.asarray(a)[ok], np.asarray(b)[ok], **TOL)
  assert 0 < np.isnan(ours[1]).sum() < ours[1].size
  assert 0 < np.isnan(ours[2]).sum() <= 4 and not np.isnan(ours[2][1:]).any()


def test_nan_read_at_dead_corners_goes_nowhere(case):
  """Dead samples read the first pixel of their image (clamped corner indices): a NaN and an
  inf there reach no gradient of a box that does not sample that pixel (the box outside the
  map keeps a zero box gradient), as on the XLA path."""
  x, boxes, dy, *_ = case
  x = x.copy()
  x[0, 0, 0, :] = np.nan
  x[1, 0, 0, 0] = np.inf
  ours, xla = _both(x, boxes, dy, **KW)
  outside = 6  # EDGE's first box: every sample outside the map
  np.testing.assert_array_equal(np.isnan(ours[2]), np.isnan(xla[2]))
  np.testing.assert_array_equal(np.asarray(ours[2])[outside], 0)
  ok = ~np.isnan(np.asarray(xla[2]))
  assert ok.sum() > ok.size // 2
  np.testing.assert_allclose(np.asarray(ours[2])[ok], np.asarray(xla[2])[ok], **TOL)


@pytest.mark.slow
def test_a_level_narrower_than_a_column_block_of_the_widest():
  """A level narrower than the widest by more than a column block of the gradient's tiles:
  its last column gets its gradient (when the column blocks spanned the widest level, a block
  wholly past a narrower level's width stored zeros over its last column in interpret
  mode)."""
  rng = np.random.default_rng(11)
  p2 = rng.standard_normal((1, 4, 40, 2)).astype(np.float32)
  p3 = rng.standard_normal((1, 2, 20, 2)).astype(np.float32)
  boxes = np.array([[0, 2.0, 2.0, 10.0, 10.0], [0, 100.0, 0.0, 160.0, 16.0]], np.float32)

  def run(impl):
    f = lambda fs: jaxpool.multi_scale_roi_align(fs, boxes, [(16, 160)], (2, 2),
                                                 canonical_scale=32.0, aligned=True,
                                                 implementation=impl)
    y, vjp = jax.vjp(f, [p2, p3])
    return vjp(jnp.ones_like(y))[0]

  (g2, g3), (r2, r3) = run("pallas"), run("xla")
  assert np.abs(r3[0, :, -1]).max() > 0 and np.abs(r2).max() > 0
  np.testing.assert_allclose(g2, r2, **TOL)
  np.testing.assert_allclose(g3, r3, **TOL)


@pytest.mark.parametrize("tile", [(1, 8, 2, 1, 8), (2, 2, 4, 2, 2),
                                  pytest.param((4, 32, 128, 8, 64), marks=pytest.mark.slow)])
def test_the_gradient_bits_do_not_depend_on_the_tile(monkeypatch, tile):
  """The feature gradient's tile (rows x columns x lanes) and the cells of its box lists (rows
  x columns) change which programs add a pixel's terms, not the terms or their order: the same
  bits."""
  from jaxpool._src.roi import triton
  from jaxpool._src.roi.plan import align_plan
  rng = np.random.default_rng(5)
  levels = (Level(2, 9, 21, 1.0, 0), Level(2, 5, 11, 0.5, 2 * 9 * 21))
  cfg = AlignConfig((3, 4), levels, 2, (2, 2), True, "avg")
  K, C = 12, 3
  image, level = rng.integers(0, 2, K).astype(np.int32), rng.integers(0, 2, K).astype(np.int32)
  coords = np.sort(rng.uniform(-3, 24, (K, 2, 2)), axis=1).transpose(0, 2, 1).reshape(K, 4)
  ct = rng.standard_normal((K, 3, 4, C)).astype(np.float32)

  def grad():
    def f(image, coords, level, ct):
      ops, _, _, _ = align_plan(image, coords, level, cfg)
      return jnp.concatenate(triton.feature_grad(
          ops["base"], ops["iy"], ops["ix"], ops["wy"], ops["wx"], ct, levels=levels,
          dtype=jnp.dtype(jnp.float32), interpret=True))
    return np.asarray(jax.jit(f)(image, coords.astype(np.float32), level, ct))

  first = grad()
  assert np.abs(first[:2 * 9 * 21]).max() > 0 and np.abs(first[2 * 9 * 21:]).max() > 0
  for name, value in zip(("GRAD_ROWS", "GRAD_COLS", "GRAD_LANES", "GRAD_BAND", "GRAD_CBAND"),
                         tile, strict=True):
    monkeypatch.setattr(triton, name, value)
  assert grad().tobytes() == first.tobytes()


@pytest.mark.slow
def test_levels_and_images_withoutrandom_boxes():
  """multi_scale_roi_align over two levels: each gradient tile finds the boxes of its own
  level and image; the second image has none on the coarse level."""
  rng = np.random.default_rng(7)
  p2 = rng.standard_normal((2, 8, 12, 4)).astype(np.float32)
  p3 = rng.standard_normal((2, 4, 6, 4)).astype(np.float32)
  boxes = np.array([[0, 1.0, 2.0, 9.0, 12.0], [1, 3.0, 1.0, 20.0, 14.0],
                    [0, 0.0, 0.0, 47.0, 31.0], [0, 5.5, 6.5, 30.0, 29.0]], np.float32)

  def run(impl):
    f = lambda fs: jaxpool.multi_scale_roi_align(fs, boxes, [(32, 48)] * 2, (2, 3),
                                                 canonical_scale=24.0, aligned=True,
                                                 implementation=impl)
    y, vjp = jax.vjp(f, [p2, p3])
    return y, vjp(jnp.ones_like(y) + jnp.arange(y.size).reshape(y.shape) / y.size)[0]

  (y, (g2, g3)), (ry, (r2, r3)) = run("pallas"), run("xla")
  np.testing.assert_array_equal(y, ry)
  np.testing.assert_allclose(g2, r2, **TOL)
  np.testing.assert_allclose(g3, r3, **TOL)
  assert np.abs(g3).max() > 0 and np.abs(g2).max() > 0


def test_the_registry_rule(monkeypatch):
  """On an NVIDIA GPU, implementation=None runs the kernels for both modes, and the XLA path
  for the max mode with per-image boxes; implementation="pallas" refuses that, naming why
  (roi_pool's kernels: test_roi_pool_kernels.py)."""
  x = jnp.ones((1, 4, 4, 2))
  lv = (Level(1, 4, 4, 1.0, 0),)
  avg = AlignConfig((2, 2), lv, 2, (2, 2), True, "avg")
  mx = AlignConfig((2, 2), lv, 2, (2, 2), True, "max")
  mx_per_image = AlignConfig((2, 2), lv, 2, (2, 2), True, "max", per_image=1)
  monkeypatch.delenv(dispatch.ENV, raising=False)
  for where, expected in (("cuda", "pallas"), ("cpu", "xla")):
    monkeypatch.setattr(dispatch, "platform", lambda w=where: w)
    assert dispatch.choose("roi_align", None, x, None, config=avg).name == expected
    assert dispatch.choose("roi_align", None, x, None, config=mx).name == expected
    assert dispatch.choose("roi_align", None, x, None, config=mx_per_image).name == "xla"
  with pytest.raises(ValueError, match="per-image boxes .N, K, 4. run it on the XLA path"):
    jaxpool.roi_align(x, jnp.array([[[0., 0., 2., 2.]]]), 2, mode="max",
                      implementation="pallas")
  assert "TPU" in dispatch.PALLAS_TPU.supports(dispatch.Op.ROI_ALIGN, x, None, None, avg)


def test_long_sample_loops_skip_dead_samples(rng):
  """A sample grid longer than ``triton.UNROLL`` is a loop that skips dead samples (the
  adaptive count's padding, samples outside the map): the same bits as the XLA path."""
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  boxes = np.concatenate([random_boxes(rng, 3, hi=16.0), EDGE[[0, 4, 6]]])
  kw = dict(output_size=(2, 1), spatial_scale=0.8, sampling_ratio=-1, max_samples=(5, 7),
            aligned=False)
  dy = rng.standard_normal((len(boxes), 2, 1, C)).astype(np.float32)
  ours, xla = _both(x, boxes, dy, **kw)
  _compare(ours, xla)
  ry, rdx, _ = rref.roi_align(x, boxes, dy=dy, **kw)
  np.testing.assert_allclose(ours[1], rdx, **TOL)


@pytest.mark.parametrize("samples,channels", [((2, 2), 256), ((5, 6), 5)])
def test_kernels_lower_for_cuda(samples, channels):
  """Pallas' Triton lowering accepts both kernels (Triton's compiler, on a GPU, is not run):
  whole channel blocks (contiguous slices) and a partial one (clamped lanes), unrolled and
  looped sample grids, a rectangular grid, bfloat16."""
  from jaxpool._src.roi import triton
  from jaxpool._src.roi.plan import align_plan
  levels = (Level(2, 10, 15, 0.5, 0),)
  cfg = AlignConfig((3, 5), levels, 2, samples, True, "avg")
  K, rows = 4, 300

  def f(coords, x, ct):
    image = jnp.zeros(K, jnp.int32)
    ops, _, _, _ = align_plan(image, coords, jnp.zeros(K, jnp.int32), cfg)
    y = triton.forward(ops["base"], ops["stride"], ops["iy"], ops["ix"], ops["wy"], ops["wx"],
                       x, dtype=jnp.dtype(x.dtype), interpret=False)
    g, = triton.feature_grad(ops["base"], ops["iy"], ops["ix"], ops["wy"], ops["wx"], ct,
                             levels=levels, dtype=jnp.dtype(x.dtype), interpret=False)
    return y, g

  args = (jax.ShapeDtypeStruct((K, 4), jnp.float32),
          jax.ShapeDtypeStruct((rows, channels), jnp.bfloat16),
          jax.ShapeDtypeStruct((K, 3, 5, channels), jnp.bfloat16))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") >= 2


# ----------------------------------------------------------------------------- slow tier


@pytest.mark.slow
@pytest.mark.parametrize("sampling_ratio,max_samples,aligned", [
    (-1, None, False), (0, 3, True), (1, None, False)])
def test_sampling_forms(rng, sampling_ratio, max_samples, aligned):
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  boxes = np.concatenate([random_boxes(rng, 5, hi=14.0), EDGE])
  kw = dict(output_size=(2, 3), spatial_scale=0.7, sampling_ratio=sampling_ratio,
            max_samples=max_samples, aligned=aligned)
  dy = rng.standard_normal((len(boxes), 2, 3, C)).astype(np.float32)
  ours, xla = _both(x, boxes, dy, **kw)
  _compare(ours, xla)
  ry, rdx, _ = rref.roi_align(x, boxes, dy=dy, **kw)
  np.testing.assert_allclose(ours[0], ry, **TOL)
  np.testing.assert_allclose(ours[1], rdx, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(rng, dtype):
  """16-bit maps: float32 sums, one rounding to the dtype at the end (the gradient's sums in
  another order: a last-bit difference of the dtype)."""
  x = jnp.asarray(rng.standard_normal((N, H, W, C)), dtype)
  boxes = np.concatenate([random_boxes(rng, 6), EDGE])
  dy = jnp.asarray(rng.standard_normal((len(boxes), 3, 2, C)), dtype)
  (y, dx, _), (ry, rdx, _) = _both(x, boxes, dy, **KW)
  assert y.dtype == dx.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ry, np.float32))
  eps = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(rdx, np.float32),
                             rtol=2 * eps, atol=2 * eps)


@pytest.mark.slow
def test_vmap_and_forward_mode(rng):
  """vmap runs the kernels once on the whole batch (the mapped axis folds into the boxes and
  copies of the feature table); jvp and the second order go through the kernels' primitive."""
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  boxes = jnp.asarray(random_boxes(rng, 4))
  f = {impl: functools.partial(jaxpool.roi_align, output_size=(2, 3), sampling_ratio=2,
                               implementation=impl) for impl in ("pallas", "xla")}
  xs = np.stack([x, 2 * x + 1, -x])
  dys = rng.standard_normal((3, 4, 2, 3, C)).astype(np.float32)

  def fwd_grad(impl):
    def one(v, dy):
      y, vjp = jax.vjp(lambda u: f[impl](u, boxes), v)
      return y, vjp(dy)[0]
    return jax.jit(jax.vmap(one))

  assert "jaxpool_roi_form_kernels" in str(jax.make_jaxpr(fwd_grad("pallas"))(xs, dys))
  (y, g), (ry, rg) = fwd_grad("pallas")(xs, dys), fwd_grad("xla")(xs, dys)
  np.testing.assert_array_equal(y, ry)
  np.testing.assert_allclose(g, rg, **TOL)
  bs = jnp.stack([boxes, boxes + 0.5])  # the boxes mapped, the maps not
  np.testing.assert_array_equal(jax.vmap(lambda b: f["pallas"](x, b))(bs),
                                jax.vmap(lambda b: f["xla"](x, b))(bs))
  t = rng.standard_normal(x.shape).astype(np.float32)
  _, dy = jax.jvp(lambda v: f["pallas"](v, boxes), (x,), (t,))
  np.testing.assert_allclose(dy, jax.jvp(lambda v: f["xla"](v, boxes), (x,), (t,))[1], **TOL)
  hess = {impl: jax.grad(lambda b, i=impl: jnp.sum(
      jax.grad(lambda v: jnp.sum(f[i](v, b) ** 2))(x) ** 2))(boxes) for impl in f}
  np.testing.assert_allclose(hess["pallas"], hess["xla"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), ph=st.integers(1, 4), pw=st.integers(1, 4),
       ratio=st.sampled_from([-1, 1, 2, 3]), aligned=st.booleans(),
       scale=st.sampled_from([0.5, 1.0, 1.3]), k=st.integers(0, 6))
def test_random_configs(seed, ph, pw, ratio, aligned, scale, k):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((N, 5, 6, 2)).astype(np.float32)
  boxes = random_boxes(rng, k, hi=9.0) if k else np.zeros((0, 5), np.float32)
  kw = dict(output_size=(ph, pw), spatial_scale=scale, sampling_ratio=ratio, aligned=aligned,
            max_samples=4)
  dy = rng.standard_normal((k, ph, pw, 2)).astype(np.float32)
  _compare(*_both(x, boxes, dy, **kw))


# ----------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("output_size", [(7, 7), (14, 14)])
def test_gpu_kernels_match_xla_and_torchvision(output_size):
  """Compiled on an NVIDIA GPU: against the XLA path (and torchvision's CUDA roi_align where
  it imports), float32 rounding; the same bits on a second run."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(3)
  x, boxes = gpu_case(rng)
  x = x.astype(np.float32)
  kw = dict(output_size=output_size, spatial_scale=1.0, sampling_ratio=2, aligned=True)
  dy = rng.standard_normal((300, *output_size, 256)).astype(np.float32)
  ours, xla = _both(x, boxes, dy, **kw)
  _compare(ours, xla, exact=False)
  again = _vjp_fn("pallas", tuple(sorted(kw.items())))(x, boxes, dy)
  assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(ours, again))
  try:
    import torch
    from torchvision.ops import roi_align as tv_roi_align
  except ImportError:
    return
  if not torch.cuda.is_available():
    return
  tx = torch.tensor(x, device="cuda").permute(0, 3, 1, 2).contiguous().requires_grad_(True)
  ty = tv_roi_align(tx, torch.tensor(boxes, device="cuda"), output_size, 1.0, 2, True)
  ty.backward(torch.tensor(dy, device="cuda").permute(0, 3, 1, 2))
  np.testing.assert_allclose(ours[0], ty.detach().permute(0, 2, 3, 1).cpu().numpy(),
                             **GPU_TOL)
  np.testing.assert_allclose(ours[1], tx.grad.permute(0, 2, 3, 1).cpu().numpy(), rtol=1e-4,
                             atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_multi_scale_matches_xla(dtype):
  """Compiled: multi_scale_roi_align over four levels (each gradient tile finds its level's
  and image's boxes), the default (the kernels) against the XLA path, and the same bits on a
  second run."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(4)
  image = (256, 384)
  feats = [jnp.asarray(rng.standard_normal((2, image[0] // s, image[1] // s, 64)), dtype)
           for s in (4, 8, 16, 32)]
  side = np.exp(rng.uniform(np.log(8), np.log(256), (256, 2)))
  x1, y1 = rng.uniform(0, image[1] - side[:, 0]), rng.uniform(0, image[0] - side[:, 1])
  boxes = jnp.asarray(np.stack([np.repeat([0, 1], 128), x1, y1, x1 + side[:, 0],
                                y1 + side[:, 1]], 1).astype(np.float32))
  dy = jnp.asarray(rng.standard_normal((256, 7, 7, 64)), dtype)

  def run(impl):
    @jax.jit
    def go(fs, dy):
      f = lambda v: jaxpool.multi_scale_roi_align(v, boxes, [image] * 2, 7, aligned=True,
                                                  implementation=impl)
      y, vjp = jax.vjp(f, fs)
      return y, vjp(dy)[0]
    return go(feats, dy)

  (y, g), (ry, rg) = run(None), run("xla")
  tol = GPU_TOL if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ry, np.float32), **tol)
  for a, b in zip(g, rg):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
  y2, g2 = run(None)
  assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
             for a, b in zip(jax.tree.leaves((y, g)), jax.tree.leaves((y2, g2))))


@pytest.mark.gpu
def test_gpu_per_image_boxes_run_the_kernels():
  """Compiled, on one GPU: per-image boxes (N, K, 4) with a mask run the kernels, with the bits
  of the (K, 5) form of the same boxes on the kernels (values, feature and box gradients)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(6)
  n, k, c = 4, 64, 32
  x = jnp.asarray(rng.standard_normal((n, 50, 76, c)), jnp.float32)
  xy = rng.uniform(-4, 60, (n, k, 2))
  boxes = np.concatenate([xy, xy + rng.uniform(1, 30, (n, k, 2))], -1).astype(np.float32)
  mask = rng.uniform(size=(n, k)) < 0.8
  live = np.argwhere(mask)
  rows = np.concatenate([live[:, :1], boxes[live[:, 0], live[:, 1]]], 1).astype(np.float32)
  dy = rng.standard_normal((n, k, 7, 7, c)).astype(np.float32)

  def run(b, g, **kw):
    @jax.jit
    def go(x, b, g):
      y, vjp = jax.vjp(lambda v, c: jaxpool.roi_align(v, c, 7, sampling_ratio=2, aligned=True,
                                                      **kw), x, b)
      return (y, *vjp(g))
    return [np.asarray(a) for a in go(x, b, g)]

  y, dx, db = run(boxes, dy, mask=mask)
  fy, fdx, fdb = run(rows, dy[live[:, 0], live[:, 1]])
  assert y[live[:, 0], live[:, 1]].tobytes() == fy.tobytes()
  assert dx.tobytes() == fdx.tobytes()
  assert db[live[:, 0], live[:, 1]].tobytes() == fdb[:, 1:].tobytes()
