"""The TPU (Mosaic) Pallas kernels against jaxpool's XLA path, in Pallas' interpreters on a CPU.

No TPU is reachable here. ``JAXPOOL_PALLAS_BACKEND=tpu`` makes ``implementation="pallas"`` run
``jaxpool/_src/pallas/tpu.py`` in Pallas' generic interpreter; the comparisons are those of
``kernel_base.py`` (bit for bit for max, forward and gradient; float32 rounding for avg) on small
odd shapes. ``test_kernels_in_tpu_interpreter`` calls every kernel directly in the TPU
interpreter (``pltpu.InterpretParams``: out-of-bounds reads raise, uninitialized VMEM reads as
NaN), which ``ops.py`` cannot use under ``grad`` in JAX 0.10.2 (see ``tpu._interpret_arg``).
``test_lowers_to_mosaic`` checks that every kernel lowers to a Mosaic TPU custom call
(``lowering_platforms=("tpu",)``): Pallas' TPU lowering runs, Mosaic's compiler (on a TPU) not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import kernel_base as base

import jaxpool
from jaxpool._src import windows, xla
from jaxpool._src.pallas import ops
from jaxpool._src.pallas.tpu import ops as tpu

# No TPU is reachable: the TPU kernels are tested in interpret mode, which the dispatcher picks
# on a CPU only (on a GPU it would try to compile them for the GPU).
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="TPU kernels run in interpret mode on a CPU only")


@pytest.fixture(autouse=True)
def _tpu_kernels(monkeypatch):
  monkeypatch.setenv(ops.BACKEND_ENV, "tpu")
  assert ops.backend() == "tpu"


# The TPU kernels are opt-in and never compiled here: `make test` keeps one check of each kind
# (test_max_bfloat16_channel_blocks, test_avg_matches_xla, test_empty_windows_and_all_neg_inf,
# test_kernels_in_tpu_interpreter[stride_gt_window_ceil], test_lowers_to_mosaic); the other
# configurations are marked slow.


@pytest.mark.slow  # (`make test` checks max pooling through ops.py in
# test_max_bfloat16_channel_blocks, overlapping windows, and every float32 max kernel in
# test_kernels_in_tpu_interpreter)
@pytest.mark.parametrize("cfg", base.CONFIGS, ids=["2d_overlap", "2d_dilated_ceil", "1d_edge"])
def test_max_matches_xla(rng, cfg):
  base.check_max(rng, cfg, jnp.float32)


def test_max_bfloat16_channel_blocks(rng):
  # 256 channels: two channel blocks of 128 lanes.
  base.check_max(rng, ((1, 4, 5, 256), (3, 3), (2, 2), 1, None, False), jnp.bfloat16)


def test_avg_matches_xla(rng):
  base.check_avg(rng, base.CONFIGS[0], jnp.float32, False, None)
  base.check_avg(rng, base.CONFIGS[1], jnp.float32, True, None)
  base.check_avg(rng, base.CONFIGS[2], jnp.bfloat16, False, 5)


@pytest.mark.parametrize("cfg,cip,div", [
    (base.CONFIGS[2], True, None), (base.CONFIGS[0], False, None), (base.CONFIGS[1], True, 5)],
    ids=["1d_edge", "2d_exclude_pad", "2d_dilated_ceil_divisor"])
def test_avg_grad_zero_signs_match_xla(rng, cfg, cip, div):
  base.check_avg_grad_zero_signs(rng, cfg, jnp.float32, cip, div)


def test_empty_windows_and_all_neg_inf():
  base.check_empty_windows_and_all_neg_inf()


@pytest.mark.slow  # (`make test` checks the same rules, ops.py's for both backends, through the
# Triton kernels: test_pallas.py::test_transformations)
def test_transformations(rng):
  """vmap(grad) and jvp through the TPU kernels, against the XLA path; grad runs the kernel."""
  shape, window, strides, padding = (2, 7, 5, 3), (3, 3), (2, 2), 1
  x = base.data(rng, shape, jnp.float32, special=False)

  def loss(impl):
    def f(v):
      y = jaxpool.max_pool(v, window, strides, padding, implementation=impl)
      z = jaxpool.avg_pool(v, window, strides, padding, implementation=impl)
      return jnp.sum(y * y) + jnp.sum(jnp.sin(z))
    return f

  p, q = loss("pallas"), loss("xla")
  ga = jax.jit(jax.vmap(jax.grad(p)))(x[:, None])
  gb = jax.jit(jax.vmap(jax.grad(q)))(x[:, None])
  np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-6)
  t = base.data(rng, shape, jnp.float32, special=False)
  (pa, ta), (pb, tb) = jax.jvp(p, (x,), (t,)), jax.jvp(q, (x,), (t,))
  np.testing.assert_allclose(pa, pb, rtol=1e-6)
  np.testing.assert_allclose(ta, tb, rtol=1e-5)
  jaxpr = str(jax.make_jaxpr(jax.grad(p))(x))
  assert "jaxpool_max_pool_gather_transpose" in jaxpr and "jaxpool_avg_pool_transpose" in jaxpr
  assert "scatter" not in jaxpr



@pytest.mark.parametrize("cfg", [
    # (`make test` keeps stride_gt_window_ceil: windows overlap in H there, stride 3 > 2 in W)
    pytest.param(base.CONFIGS[0], marks=pytest.mark.slow),
    ((1, 3, 8, 130), (2, 2), (1, 3), 1, None, True)], ids=["2d_overlap", "stride_gt_window_ceil"])
def test_kernels_in_tpu_interpreter(rng, cfg):
  shape, *geo = cfg
  geom = windows.make_geometry(shape, *geo)
  x = base.data(rng, shape, jnp.float32)
  y, idx = tpu.max_forward_taps(x, geom, interpret="tpu")
  yb, ib = xla.max_pool_taps(x, geom)
  base.bits_equal(y, yb)
  base.bits_equal(idx, ib)
  base.bits_equal(tpu.max_forward(x, geom, interpret="tpu"), yb)
  dy = base.data(rng, y.shape, jnp.float32, special=False)
  dx = tpu.max_backward(ib, dy, shape, geom, interpret="tpu")
  base.bits_equal(dx, jax.vjp(lambda t: xla.gather_at_taps(t, ib, geom), x)[1](dy)[0])
  xf = base.data(rng, shape, jnp.float32, special=False)
  avg = dict(count_include_pad=True, divisor_override=None)
  a = tpu.avg_forward(xf, geom, interpret="tpu", **avg)
  ref, vjp = jax.vjp(lambda v: xla.avg_pool(v, geom, **avg), xf)
  np.testing.assert_allclose(a, ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(tpu.avg_backward(dy, shape, geom, interpret="tpu", **avg),
                             vjp(dy)[0], rtol=1e-6, atol=1e-6)


def test_lowers_to_mosaic():
  """Every TPU kernel (not interpreted) lowers to a Mosaic custom call for the TPU platform."""
  shape = (2, 9, 11, 5)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), ((1, 2), (2, 1)))
  x = jnp.zeros(shape, jnp.bfloat16)
  y, idx = xla.max_pool_taps(x, geom)
  avg = dict(interpret=False, count_include_pad=False, divisor_override=None)
  fns = [
      lambda: tpu.max_forward(x, geom, interpret=False),
      lambda: tpu.max_forward_taps(x, geom, interpret=False),
      lambda: tpu.max_backward(idx, y, shape, geom, interpret=False),
      lambda: tpu.avg_forward(x, geom, **avg),
      lambda: tpu.avg_backward(y, shape, geom, **avg),
  ]
  for fn in fns:
    text = jax.jit(fn).trace().lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_backend_choice_and_vmem_limit(monkeypatch):
  g = windows.make_geometry((2, 8, 8, 4), (2, 2), (2, 2))
  assert ops.unsupported("max_pool", (2, 8, 8, 4), jnp.float32, g) is None
  # One image's block must fit the VMEM budget; a larger one stays on XLA.
  big = (1, 1024, 1024, 128)
  gb = windows.make_geometry(big, (2, 2), (2, 2))
  assert not tpu.fits(gb, big, jnp.float32)
  assert "VMEM" in ops.unsupported("max_pool", big, jnp.float32, gb)
  # 3-D and channels_first pooling: Triton kernels only.
  g3 = windows.make_geometry((1, 4, 4, 4, 2), (2, 2, 2))
  cf = windows.make_geometry((2, 4, 8, 8), (2, 2), (2, 2), data_format="channels_first")
  assert "1-D and 2-D channels_last" in ops.unsupported("max_pool", (1, 4, 4, 4, 2),
                                                        jnp.float32, g3)
  assert "1-D and 2-D channels_last" in ops.unsupported("avg_pool", (2, 4, 8, 8), jnp.float32, cf)
  monkeypatch.setenv(ops.BACKEND_ENV, "triton")
  assert ops.backend() == "triton" and ops.unsupported("max_pool", big, jnp.float32, gb) is None
  assert ops.unsupported("max_pool", (1, 4, 4, 4, 2), jnp.float32, g3) is None
  monkeypatch.setenv(ops.BACKEND_ENV, "mosaic")
  with pytest.raises(ValueError, match="JAXPOOL_PALLAS_BACKEND"):
    ops.backend()
