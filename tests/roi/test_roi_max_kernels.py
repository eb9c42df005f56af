"""ROI align's max mode on the GPU kernels (``jaxpool/_src/roi/triton_max.py``: the taps and
the values at them; the feature and box gradients with taps in ``triton.py`` and
``triton_boxes.py``) in interpret mode on the CPU: against the XLA path (the taps and values
bit for bit, the gradients to float32 rounding: their own summation orders) and the NumPy
reference, ties and NaN, every derivative on the kernels, grids of many samples a bin (the
feature gradient then on the XLA path's form); compiled under ``-m gpu``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import roi_reference as rref
from roi_cases import EDGE, gpu_case, random_boxes

import jaxpool
from jaxpool._src.roi import form

TOL = dict(rtol=1e-5, atol=1e-5)


@functools.cache
def _vjp_fn(implementation, kw):
  kw = dict(kw)

  @jax.jit
  def go(x, boxes, dy):
    f = lambda v, b: jaxpool.roi_align(v, b, mode="max", implementation=implementation, **kw)
    y, vjp = jax.vjp(f, x, boxes)
    return (y, *vjp(dy))

  return go


def _inputs(rng, shape=(2, 7, 9, 3)):
  """Few distinct values (ties between samples) and a NaN."""
  x = rng.integers(-2, 3, shape).astype(np.float32)
  x[0, 1, 2, 0] = np.nan
  return x, np.concatenate([random_boxes(rng, 5, hi=9.0), EDGE]).astype(np.float32)


def _run(x, boxes, **kw):
  """The kernels' and the XLA path's (y, dx, dboxes), and the derivatives the kernels'
  primitive left to the XLA path's form."""
  key = tuple(sorted(kw.items()))
  on_xla, real = [], form.evaluate

  def spy(*args, wrt, **kwargs):
    on_xla.append(wrt)
    return real(*args, wrt=wrt, **kwargs)

  ph, pw = kw["output_size"]  # (pairs in these tests)
  dy = np.random.default_rng(1).standard_normal((len(boxes), ph, pw, x.shape[-1]))
  dy = dy.astype(np.float32)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(form, "evaluate", spy)
    ours = _vjp_fn("pallas", key)(x, boxes, dy)
  return ours, _vjp_fn("xla", key)(x, boxes, dy), on_xla


def _compare(ours, xla):
  np.testing.assert_array_equal(ours[0], xla[0])
  np.testing.assert_allclose(ours[1], xla[1], **TOL)
  np.testing.assert_allclose(ours[2], xla[2], **TOL)


def test_every_derivative_on_the_kernels_matches_the_xla_path(rng):
  x, boxes = _inputs(rng)
  kw = dict(output_size=(2, 3), sampling_ratio=2, aligned=True)
  ours, xla, on_xla = _run(x, boxes, **kw)
  assert on_xla == [], on_xla  # (the taps, the forward and the three gradients: kernels)
  _compare(ours, xla)
  np.testing.assert_allclose(ours[0], rref.roi_align(x, boxes, mode="max", **kw), **TOL)
  assert np.nanmax(np.abs(ours[1])) > 0 and np.nanmax(np.abs(ours[2])) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(output_size=(2, 2), sampling_ratio=-1, max_samples=(3, 4), spatial_scale=0.7),
    dict(output_size=(3, 1), sampling_ratio=3),
    dict(output_size=(1, 2), sampling_ratio=5),  # (25 samples a bin: feature gradient on XLA)
])
def test_sampling_forms(rng, kw):
  x, boxes = _inputs(rng)
  ours, xla, on_xla = _run(x, boxes, **kw)
  _compare(ours, xla)
  assert on_xla == (["x"] if kw["sampling_ratio"] == 5 else []), on_xla


@pytest.mark.slow
def test_two_levels_and_several_channel_blocks(rng):
  """multi_scale_roi_align over two levels, more channels than a block (130 > 128)."""
  p2 = rng.integers(-2, 3, (2, 16, 24, 130)).astype(np.float32)
  p3 = rng.integers(-2, 3, (2, 8, 12, 130)).astype(np.float32)
  boxes = np.array([[0, 1.0, 2.0, 9.0, 12.0], [1, 3.0, 1.0, 20.0, 14.0],
                    [0, 0.0, 0.0, 47.0, 31.0], [1, 5.5, 6.5, 30.0, 29.0]], np.float32)

  def run(impl):
    f = lambda fs, b: jaxpool.multi_scale_roi_align(fs, b, [(32, 48)] * 2, (2, 3),
                                                    canonical_scale=24.0, mode="max",
                                                    implementation=impl)
    y, vjp = jax.vjp(f, [p2, p3], boxes)
    return y, *vjp(jnp.ones_like(y) + jnp.arange(y.size).reshape(y.shape) / y.size)

  (y, (g2, g3), gb), (ry, (r2, r3), rb) = run("pallas"), run("xla")
  np.testing.assert_array_equal(y, ry)
  for a, b in ((g2, r2), (g3, r3), (gb, rb)):
    np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.gpu
def test_gpu_max_mode_matches_the_xla_path():
  """Compiled on an NVIDIA GPU: the default (the kernels) against the XLA path (float32
  rounding: compiled, multiply-adds may fuse), the same bits on a second run."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(4)
  x, boxes = gpu_case(rng)
  x = x.astype(np.float32)
  kw = tuple(sorted(dict(output_size=(7, 7), sampling_ratio=2, aligned=True).items()))
  dy = rng.standard_normal((300, 7, 7, 256)).astype(np.float32)
  ours = _vjp_fn(None, kw)(x, boxes, dy)
  xla = _vjp_fn("xla", kw)(x, boxes, dy)
  for a, b in zip(ours, xla):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  again = _vjp_fn(None, kw)(x, boxes, dy)
  assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(ours, again))
