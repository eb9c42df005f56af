"""ROI align's box-gradient kernel (``jaxpool/_src/roi/triton_boxes.py``, the corner weights'
derivatives ``wy`` and ``wx``): Triton lowering under its names; in interpret mode on the CPU
(slow tier) ``jax.grad`` with respect to the boxes through ``roi_align(...,
implementation="pallas")`` against the XLA path and the NumPy reference over the sampling
forms, wide grids and many channels, 16-bit maps, several levels, vmap and per-image boxes
(random configs: test_roi_kernels.py's hypothesis test); compiled on a GPU (``-m gpu``)
against the XLA path. (The default tier's checks of the box gradient on the kernels, sharing
its compiled case, are in test_roi_kernels.py: the XLA path, the reference, the same bits
twice, NaN cotangents and NaN read at dead corners, and that no derivative falls back to the
XLA path's form.)

Tolerances. The kernel sums each corner weight's products in an order of its own (channels,
then the other axis's bins, then its samples: the module's docstring), the XLA path in fixed
trees (``form.tree_sum``): sums of a few hundred terms of size ~1 here, ``rtol = atol = 1e-5``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import roi_reference as rref
from roi_cases import EDGE, gpu_case, random_boxes

import jaxpool

N, H, W, C = 2, 7, 9, 3
TOL = dict(rtol=1e-5, atol=1e-5)
GPU_TOL = dict(rtol=1e-4, atol=1e-4)


@functools.cache
def _grad_fn(implementation, kw):
  """``(dx, dboxes)`` of ``sum(roi_align(x, boxes) * dy)`` under one jit."""
  kw = dict(kw)

  @jax.jit
  def go(x, boxes, dy):
    f = lambda v, b: jnp.sum(
        jaxpool.roi_align(v, b, implementation=implementation, **kw).astype(jnp.float32) * dy)
    return jax.grad(f, argnums=(0, 1))(x, boxes)

  return go


def _both(x, boxes, dy, **kw):
  key = tuple(sorted(kw.items()))
  return _grad_fn("pallas", key)(x, boxes, dy), _grad_fn("xla", key)(x, boxes, dy)


def _case(rng, kw, k=6, hi=10.0):
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  boxes = np.concatenate([EDGE, random_boxes(rng, k, hi=hi)])
  dy = rng.standard_normal((len(boxes), *kw["output_size"], C)).astype(np.float32)
  return x, boxes, dy


KW = dict(output_size=(3, 2), spatial_scale=0.9, sampling_ratio=2, aligned=True)


@pytest.mark.parametrize("samples,channels", [
    ((5, 6), 5), pytest.param((2, 2), 600, marks=pytest.mark.slow)])
def test_box_kernel_lowers_for_cuda(samples, channels):
  """Pallas' Triton lowering accepts the kernel for both axes (Triton's compiler, on a GPU, is
  not run): looped sample grids and a partial channel block, or several channel blocks."""
  from jaxpool._src.roi import kernels
  from jaxpool._src.roi.plan import AlignConfig, Level
  levels = (Level(2, 10, 15, 0.5, 0),)
  cfg = AlignConfig((3, 5), levels, 2, samples, True, "avg")
  K = 4
  zeros = jnp.zeros(K, jnp.int32)
  f = lambda x, c: jnp.sum(kernels.roi_align((x,), zeros, c, zeros, cfg, interpret=False))
  args = (jax.ShapeDtypeStruct((2, 10, 15, channels), jnp.bfloat16),
          jax.ShapeDtypeStruct((K, 4), jnp.float32))
  text = jax.jit(jax.grad(f, argnums=1)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "jaxpool_roi_align_wy_grad" in text and "jaxpool_roi_align_wx_grad" in text


# ----------------------------------------------------------------------------- slow tier


@pytest.mark.slow
@pytest.mark.parametrize("sampling_ratio,max_samples,aligned,output_size", [
    (-1, None, True, (2, 3)), (-1, None, False, (3, 1)), (0, 3, True, (1, 4)),
    (3, None, False, (4, 2))])
def test_sampling_forms(rng, sampling_ratio, max_samples, aligned, output_size):
  kw = dict(output_size=output_size, spatial_scale=0.7, sampling_ratio=sampling_ratio,
            max_samples=max_samples, aligned=aligned)
  x, boxes, dy = _case(rng, kw, hi=14.0)
  (_, db), (_, rdb) = _both(x, boxes, dy, **kw)
  np.testing.assert_allclose(db, rdb, **TOL)
  _, _, ref = rref.roi_align(x, boxes, dy=dy, **kw)
  np.testing.assert_allclose(np.asarray(db)[:, 1:], ref, rtol=1e-4, atol=2e-4)


@pytest.mark.slow
def test_wide_grid_and_many_channels(rng):
  """Bins beyond a power of two, several channel blocks (the forward's lane budget)."""
  kw = dict(output_size=(5, 7), spatial_scale=1.0, sampling_ratio=2, aligned=True)
  x = rng.standard_normal((1, 12, 14, 300)).astype(np.float32)
  boxes = np.concatenate([[[0, -1.0, 0.5, 13.0, 11.0]], random_boxes(rng, 3, n=1, hi=14.0)])
  dy = rng.standard_normal((len(boxes), 5, 7, 300)).astype(np.float32)
  (_, db), (_, rdb) = _both(x, boxes, dy, **kw)
  np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(rng, dtype):
  """16-bit maps and cotangents: float32 sums in both, the box gradient in float32."""
  x, boxes, dy = _case(rng, KW)
  (_, db), (_, rdb) = _both(jnp.asarray(x, dtype), boxes, jnp.asarray(dy, dtype), **KW)
  assert db.dtype == jnp.float32
  np.testing.assert_allclose(db, rdb, **TOL)


@pytest.mark.slow
def test_multi_scale(rng):
  """multi_scale_roi_align over two levels: each box's gradient from its own level."""
  p2 = rng.standard_normal((2, 8, 12, 3)).astype(np.float32)
  p3 = rng.standard_normal((2, 4, 6, 3)).astype(np.float32)
  boxes = np.array([[0, 1.0, 2.0, 9.0, 12.0], [1, 3.0, 1.0, 20.0, 14.0],
                    [0, 0.0, 0.0, 47.0, 31.0], [0, 5.5, 6.5, 30.0, 29.0]], np.float32)
  dy = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)

  def grad(impl):
    f = lambda b: jnp.sum(jaxpool.multi_scale_roi_align(
        [p2, p3], b, [(32, 48)] * 2, (2, 3), canonical_scale=24.0, aligned=True,
        implementation=impl) * dy)
    return jax.jit(jax.grad(f))(boxes)

  db, rdb = grad("pallas"), grad("xla")
  assert np.abs(np.asarray(rdb)).max() > 0.1
  np.testing.assert_allclose(db, rdb, **TOL)


@pytest.mark.slow
def test_vmap(rng):
  """vmap over the maps and the boxes (the kernels' primitive folds the axis into the boxes and
  copies of the table): each element its own call's box gradient."""
  x, boxes, dy = _case(rng, KW, k=3)
  xs, bs = np.stack([x, -2 * x]), np.stack([boxes, boxes + 0.25])
  f = {impl: lambda v, b, i=impl: _grad_fn(i, tuple(sorted(KW.items())))(v, b, dy)[1]
       for impl in ("pallas", "xla")}
  db = jax.jit(jax.vmap(f["pallas"]))(xs, bs)
  np.testing.assert_allclose(db, jax.vmap(f["xla"])(xs, bs), **TOL)
  for e in range(2):
    np.testing.assert_allclose(db[e], f["pallas"](xs[e], bs[e]), **TOL)


@pytest.mark.slow
def test_per_image_boxes(rng):
  """Boxes ``(N, K, 4)`` with a mask on the kernels: the XLA path's box gradient to float32
  rounding, zeros for the padding rows."""
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  xy = rng.uniform(-2, 8, (N, 4, 2))
  boxes = np.concatenate([xy, xy + rng.uniform(-0.5, 6, (N, 4, 2))], -1).astype(np.float32)
  mask = np.array([[True, True, False, True], [True, False, True, True]])
  dy = rng.standard_normal((N, 4, 2, 3, C)).astype(np.float32)

  def grad(impl):
    f = lambda b: jnp.sum(jaxpool.roi_align(x, b, (2, 3), sampling_ratio=2, mask=mask,
                                            implementation=impl) * dy)
    return jax.jit(jax.grad(f))(boxes)

  db, rdb = grad("pallas"), grad("xla")
  assert np.abs(np.asarray(rdb)).max() > 0.1
  np.testing.assert_allclose(db, rdb, **TOL)
  np.testing.assert_array_equal(np.asarray(db)[~mask], 0)


# ----------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("output_size", [(7, 7), (14, 14)])
def test_gpu_box_gradient_matches_xla(output_size, dtype):
  """Compiled on an NVIDIA GPU: the default path's box gradient (the kernel) against the XLA
  path, float32 rounding; the same bits on a second run."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(9)
  x, boxes = gpu_case(rng)
  x = jnp.asarray(x, dtype)
  dy = jnp.asarray(rng.standard_normal((300, *output_size, 256)), dtype)

  def grad(impl):
    @jax.jit
    def go(x, boxes, dy):
      f = lambda v, b: jnp.sum(jaxpool.roi_align(
          v, b, output_size, sampling_ratio=2, aligned=True,
          implementation=impl).astype(jnp.float32) * dy.astype(jnp.float32))
      return jax.grad(f, argnums=(0, 1))(x, boxes)
    return go(x, boxes, dy)

  (dx, db), (rdx, rdb) = grad(None), grad("xla")
  # (sums of ~10**5 products per coordinate: the tolerance scales with the largest)
  np.testing.assert_allclose(db, rdb, rtol=1e-4, atol=1e-5 * float(np.abs(rdb).max()))
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(rdx, np.float32),
                             **(GPU_TOL if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)))
  _, db2 = grad(None)
  assert np.asarray(db).tobytes() == np.asarray(db2).tobytes()
