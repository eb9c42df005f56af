"""roi_pool's GPU kernels (``jaxpool/_src/roi/triton_pool.py``: each bin's argmax and the
feature gradient) in interpret mode on the CPU: against the XLA path (the values and indices
bit for bit, the gradient to float32 rounding: the same terms in another order) and the NumPy
reference (tests/support/roi_reference.py), the same bits on a second run, ``vmap`` and forward
mode, bfloat16 and float16, the registry's rule and Triton lowering; compiled on a GPU
(``-m gpu``) against the XLA path and torchvision's CUDA ``roi_pool``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import roi_reference as rref
from roi_cases import gpu_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpool
from jaxpool._src import dispatch
from jaxpool._src.roi.plan import Level, PoolConfig

TOL = dict(rtol=1e-6, atol=1e-6)

BOXES = np.array([
    [0, 0.0, 0.0, 40.0, 9.0],     # the whole map: bins of many pixels, several cells
    [1, 1.5, 0.5, 4.49, 3.5],     # halves: C's round goes away from zero
    [0, -2.5, -1.5, 2.0, 1.0],    # partly outside
    [1, 50.0, 12.0, 54.0, 14.0],  # outside: empty bins
    [0, 3.0, 2.0, 3.0, 2.0],      # one pixel
    [1, 5.0, 4.0, 2.0, 1.0],      # negative size: raised to one pixel
    [1, 30.0, 2.0, 39.0, 8.0],    # across the second column cell
    [0, 1.0, 1.0, 38.0, 9.0],     # overlaps the first: pixels shared by boxes
], np.float32)


def _maps(rng, shape=(2, 10, 41, 5), dtype=np.float32):
  """Few distinct values (ties decide the argmax), NaN and -inf."""
  x = rng.integers(-3, 4, shape).astype(np.float32)
  flat = x.reshape(-1)
  flat[rng.choice(flat.size, min(12, flat.size), replace=False)] = np.nan  # (maps of any size)
  flat[rng.choice(flat.size, min(8, flat.size), replace=False)] = -np.inf
  return jnp.asarray(x, dtype)


@functools.cache
def _run(implementation, output_size, scale):
  @jax.jit
  def go(x, boxes, dy):
    f = lambda v: jaxpool.roi_pool(v, boxes, output_size, spatial_scale=scale,
                                   implementation=implementation)
    y, vjp = jax.vjp(f, x)
    _, idx = jaxpool.roi_pool(x, boxes, output_size, spatial_scale=scale, return_indices=True,
                              implementation=implementation)
    return y, idx, vjp(dy)[0]

  return go


def _both(x, boxes, output_size, scale=1.0, seed=0):
  ph, pw = (output_size, output_size) if isinstance(output_size, int) else output_size
  dy = np.random.default_rng(seed).standard_normal((len(boxes), ph, pw, x.shape[-1]))
  dy = jnp.asarray(dy, x.dtype)
  return (_run("pallas", output_size, scale)(x, boxes, dy),
          _run("xla", output_size, scale)(x, boxes, dy), dy)


def _compare(ours, xla):
  np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(xla[0], np.float32))
  np.testing.assert_array_equal(ours[1], xla[1])
  np.testing.assert_allclose(np.asarray(ours[2], np.float32), np.asarray(xla[2], np.float32),
                             **TOL)


@pytest.mark.parametrize("output_size,scale", [((3, 2), 1.0), (2, 0.5), ((1, 5), 1.0)])
def test_kernels_match_the_xla_path_and_the_reference(rng, output_size, scale):
  x = _maps(rng)
  ours, xla, dy = _both(x, BOXES, output_size, scale)
  _compare(ours, xla)
  ry, ridx = rref.roi_pool(np.asarray(x), BOXES, output_size, scale)
  _, _, rdx = rref.roi_pool(np.asarray(x), BOXES, output_size, scale, dy=np.asarray(dy))
  np.testing.assert_array_equal(ours[0], ry.astype(np.float32))
  np.testing.assert_array_equal(ours[1], ridx)
  np.testing.assert_allclose(ours[2], rdx, **TOL)
  assert np.abs(ours[2]).max() > 0


def test_kernels_give_the_same_bits_twice(rng):
  x = _maps(rng)
  a, _, dy = _both(x, np.concatenate([BOXES, BOXES]), 3)
  b = _run("pallas", 3, 1.0)(x, np.concatenate([BOXES, BOXES]), dy)
  assert all(np.asarray(u).tobytes() == np.asarray(v).tobytes() for u, v in zip(a, b))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(rng, dtype):
  """Compared in float32 (the XLA path's test), the result and gradient in ``dtype``."""
  x = _maps(rng, dtype=dtype)
  ours, xla, _ = _both(x, BOXES, 2)
  assert ours[0].dtype == dtype and ours[2].dtype == dtype
  np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(xla[0], np.float32))
  np.testing.assert_array_equal(ours[1], xla[1])
  np.testing.assert_allclose(np.asarray(ours[2], np.float32), np.asarray(xla[2], np.float32),
                             rtol=1e-2, atol=1e-2)


def test_channels_over_one_lane_block(rng):
  """More channels than a gradient program's block (128) and a partial last block."""
  x = _maps(rng, shape=(2, 5, 7, 130))
  boxes = np.array([[0, 0.0, 0.0, 6.0, 4.0], [1, 1.0, 1.0, 5.0, 3.0], [0, 2.0, 0.0, 3.0, 4.0]],
                   np.float32)
  _compare(*_both(x, boxes, 2)[:2])


def test_vmap_forward_mode_and_second_order(rng):
  x = np.asarray(_maps(rng, shape=(2, 6, 9, 3)))
  x = np.nan_to_num(x, nan=0.5, neginf=-5.0)
  boxes = BOXES[[1, 2, 4, 5]]

  def grads(impl):
    loss = lambda v: (jaxpool.roi_pool(v, boxes, 2, implementation=impl) ** 2).sum()
    g = jax.vmap(jax.grad(loss))(np.stack([x, 2 * x]))
    t = jax.jvp(lambda v: jaxpool.roi_pool(v, boxes, 2, implementation=impl), (x,), (x,))[1]
    hv = jax.jvp(jax.grad(loss), (x,), (np.ones_like(x),))[1]
    return g, t, hv

  for a, b in zip(grads("pallas"), grads("xla")):
    np.testing.assert_allclose(a, b, **TOL)


def test_out_of_range_image_under_jit(rng):
  """A box whose image index is out of range gives zeros and -1 (as on the XLA path)."""
  x = _maps(rng)
  boxes = BOXES.copy()
  boxes[3, 0] = 7
  ours, xla, _ = _both(x, boxes, 2)
  _compare(ours, xla)
  assert (np.asarray(ours[1][3]) == -1).all()


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), ph=st.integers(1, 4), pw=st.integers(1, 4),
       scale=st.sampled_from([1.0, 0.5, 0.25]), k=st.integers(0, 6))
def test_random_configs(seed, ph, pw, scale, k):
  r = np.random.default_rng(seed)
  x = _maps(r, shape=(2, int(r.integers(1, 12)), int(r.integers(1, 40)), int(r.integers(1, 6))))
  lo = r.uniform(-8, 40, (k, 2))
  boxes = np.concatenate([r.integers(0, 2, (k, 1)), lo, lo + r.uniform(-3, 30, (k, 2))],
                         1).astype(np.float32)
  _compare(*_both(x, boxes, (ph, pw), scale, seed)[:2])


def test_the_registry_runs_roi_pool_on_the_kernels(monkeypatch):
  """On an NVIDIA GPU, implementation=None runs roi_pool on the kernels (float32, bfloat16,
  float16); other dtypes take the XLA path, and implementation="pallas" names why."""
  x = jnp.ones((1, 4, 4, 2))
  pool = PoolConfig((2, 2), Level(1, 4, 4, 1.0, 0))
  monkeypatch.delenv(dispatch.ENV, raising=False)
  for where, expected in (("cuda", "pallas"), ("cpu", "xla")):
    monkeypatch.setattr(dispatch, "platform", lambda w=where: w)
    assert dispatch.choose("roi_pool", None, x, None, config=pool).name == expected
  from jaxpool._src.roi import kernels
  assert "roi_pool kernels take float32, bfloat16 and float16, not float64" in (
      kernels.unsupported(np.ones((1, 4, 4, 2)), pool))


def test_kernels_lower_for_cuda():
  """Pallas' Triton lowering accepts both kernels (Triton's compiler is not run here): whole
  and partial channel blocks, bfloat16."""
  from jaxpool._src.roi import kernels

  def f(x, boxes, ct):
    cfg = PoolConfig((3, 5), Level(2, 10, 15, 1.0, 0))
    image = boxes[:, 0].astype(jnp.int32)
    y, vjp = jax.vjp(lambda v: kernels.roi_pool(v, image, boxes[:, 1:], cfg, interpret=False)[0],
                     x)
    return y, vjp(ct)[0]

  for channels in (256, 5):
    args = (jax.ShapeDtypeStruct((2, 10, 15, channels), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 5), jnp.float32),
            jax.ShapeDtypeStruct((4, 3, 5, channels), jnp.bfloat16))
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("xla.gpu.triton") >= 2
    assert "jaxpool_roi_pool_argmax" in lowered and "jaxpool_roi_pool_bwd" in lowered


# ----------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_kernels_match_xla_and_torchvision(dtype):
  """Compiled on an NVIDIA GPU: the default (the kernels) against the XLA path (values and
  indices bit for bit, the gradient to float32 rounding), the same bits on a second run, and
  torchvision's CUDA roi_pool where it imports (float32)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(5)
  x, boxes = gpu_case(rng)
  x = jnp.asarray(x, dtype)
  dy = jnp.asarray(rng.standard_normal((300, 7, 7, 256)), dtype)
  ours = _run(None, 7, 1.0)(x, boxes, dy)
  xla = _run("xla", 7, 1.0)(x, boxes, dy)
  np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(xla[0], np.float32))
  np.testing.assert_array_equal(ours[1], xla[1])
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(ours[2], np.float32), np.asarray(xla[2], np.float32),
                             rtol=tol, atol=tol)
  again = _run(None, 7, 1.0)(x, boxes, dy)
  assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(ours, again))
  try:
    import torch
    from torchvision.ops import roi_pool as tv_roi_pool
  except ImportError:
    return
  if not torch.cuda.is_available() or dtype != jnp.float32:
    return
  tx = torch.tensor(np.asarray(x), device="cuda").permute(0, 3, 1, 2).contiguous()
  tx.requires_grad_(True)
  ty = tv_roi_pool(tx, torch.tensor(boxes, device="cuda"), 7, 1.0)
  ty.backward(torch.tensor(np.asarray(dy), device="cuda").permute(0, 3, 1, 2))
  np.testing.assert_array_equal(ours[0], ty.detach().permute(0, 2, 3, 1).cpu().numpy())
  np.testing.assert_allclose(ours[2], tx.grad.permute(0, 2, 3, 1).cpu().numpy(), rtol=1e-5,
                             atol=1e-5)


def test_outputs_past_int32_indexing_leave_the_kernels():
  """Outputs of 2**31 elements or more (65,536 boxes x 7x7 x 1,024 channels) take the XLA
  path: the kernels index in int32 (found in review: the kernels took them)."""
  from jaxpool._src.roi import kernels

  def f(x, boxes):
    cfg = PoolConfig((7, 7), Level(2, 10, 15, 1.0, 0))
    return kernels.roi_pool(x, boxes[:, 0].astype(jnp.int32), boxes[:, 1:], cfg,
                            interpret=False)[0]

  for boxes, calls in ((65536, 0), (64, 1)):
    args = (jax.ShapeDtypeStruct((2, 10, 15, 1024), jnp.float32),
            jax.ShapeDtypeStruct((boxes, 5), jnp.float32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == calls, boxes
