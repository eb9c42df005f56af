"""The Pallas kernels against jaxpool's XLA path, bit for bit (max) or to float32 rounding (avg).

On a CPU the kernels run in interpret mode (``implementation="pallas"``), on small, odd shapes:
sizes that are not multiples of the block, windows larger than the stride, padding on both sides.
The tests marked ``gpu`` run the same comparisons compiled, on larger shapes, plus determinism;
run them on a GPU machine with ``pytest -m gpu tests/test_pallas.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool
from jaxpool._src import windows
from jaxpool._src.pallas import ops

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")

# (shape (N, H, W, C) or (N, W, C), window, strides, padding, dilation, ceil_mode)
CONFIGS = [
    ((2, 9, 11, 5), (3, 3), (2, 2), ((1, 2), (2, 1)), None, False),  # overlap, odd pads
    ((1, 7, 6, 3), (2, 3), (2, 1), "SAME", (2, 1), True),  # dilation, ceil mode
    ((3, 10, 4), (4,), (3,), ((3, 2),), None, True),  # 1-D, windows past the edge
]
# 3-D and channels_first (the TPU kernels cover neither), with the layout last.
CONFIGS_ND = [
    ((2, 3, 9, 11), (3, 3), (2, 2), ((1, 2), (2, 1)), None, False, "channels_first"),
    ((2, 5, 6, 7, 3), (3, 2, 3), (2, 1, 2), ((1, 1), (0, 1), (1, 0)), (1, 2, 1), True),
    ((1, 2, 5, 6, 7), (2, 3, 2), (2, 2, 1), 1, None, False, "channels_first"),
    ((2, 3, 10), (4,), (3,), ((3, 2),), None, True, "channels_first"),
    # wide rows: channels_first blocks of 64 columns, so some take the interior path
    ((1, 2, 5, 150), (3, 3), (2, 2), 1, None, False, "channels_first"),
]
ND_IDS = ["2d_first", "3d_last_dilated_ceil", "3d_first", "1d_first", "2d_first_wide"]
GPU_CONFIGS = [
    ((4, 57, 45, 64), (3, 3), (2, 2), 1, None, False),
    ((2, 33, 70, 40), (2, 2), (2, 2), 0, None, True),
    ((3, 31, 29, 96), (5, 3), (2, 3), ((2, 1), (0, 2)), (1, 2), False),
    ((5, 100, 24), (3,), (2,), ((1, 1),), None, False),
    ((4, 64, 56, 57), (3, 3), (2, 2), 1, None, False, "channels_first"),
    ((2, 9, 30, 33, 32), (3, 3, 3), (2, 2, 2), 1, None, False),
    ((2, 8, 9, 20, 22), (2, 2, 2), (2, 2, 2), 0, (1, 1, 2), True, "channels_first"),
    ((2, 16, 20, 300), (3, 3), (2, 2), 1, None, False, "channels_first"),
    ((3, 16, 31, 29), (5, 3), (2, 3), ((2, 1), (0, 2)), (1, 2), False, "channels_first"),
]


def _kw(window, strides, padding, dilation, ceil_mode, data_format="channels_last"):
  return dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode, data_format=data_format)


def _data(rng, shape, dtype, *, special=True):
  x = rng.standard_normal(shape).astype(np.float32)
  if special:
    flat = x.reshape(-1)
    n = flat.size
    flat[rng.choice(n, max(n // 7, 2), replace=False)] = 0.5  # ties
    flat[rng.choice(n, max(n // 50, 1), replace=False)] = -np.inf
    flat[rng.choice(n, max(n // 97, 1), replace=False)] = np.nan
  return jnp.asarray(x).astype(dtype)


def _bits_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
  assert np.array_equal(np.where(both_nan, 0, a), np.where(both_nan, 0, b)), (
      f"{np.sum(a != b)} of {a.size} differ")


def _check_max(rng, cfg, dtype):
  shape, *geo = cfg
  kw = _kw(*geo)
  x = _data(rng, shape, dtype)
  # forward, and the argmax as flat indices
  _bits_equal(jaxpool.max_pool(x, **kw, implementation="pallas"),
              jaxpool.max_pool(x, **kw, implementation="xla"))
  ya, ia = jaxpool.max_pool_with_indices(x, **kw, implementation="pallas")
  yb, ib = jaxpool.max_pool_with_indices(x, **kw, implementation="xla")
  _bits_equal(ya, yb)
  _bits_equal(ia, ib)
  # gradient: NaN-free input so the cotangents are finite; dy has ties too
  xf = _data(rng, shape, dtype, special=False)
  xf = jnp.where(jnp.abs(xf) < 0.3, jnp.asarray(0.25, dtype), xf)  # ties
  dy = _data(rng, jaxpool.max_pool(xf, **kw).shape, dtype, special=False)
  grads = [jax.jit(lambda a, g, impl=impl: jax.vjp(
      lambda v: jaxpool.max_pool(v, **kw, implementation=impl), a)[1](g)[0])(xf, dy)
      for impl in ("pallas", "xla")]
  _bits_equal(*grads)
  return x, xf, dy, kw


def _tol(dtype, taps):
  return (2e-6 if dtype == jnp.float32 else 1e-2) * max(taps, 1)


def _check_avg(rng, cfg, dtype, count_include_pad, divisor_override):
  shape, *geo = cfg
  kw = _kw(*geo)
  kw.update(count_include_pad=count_include_pad, divisor_override=divisor_override)
  taps = int(np.prod(geo[0]))
  x = _data(rng, shape, dtype, special=False)
  a = jaxpool.avg_pool(x, **kw, implementation="pallas")
  b = jaxpool.avg_pool(x, **kw, implementation="xla")
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=_tol(dtype, 1),
                             atol=_tol(dtype, taps))
  dy = _data(rng, a.shape, dtype, special=False)
  ga, gb = [jax.vjp(lambda v, impl=impl: jaxpool.avg_pool(v, **kw, implementation=impl),
                    x)[1](dy)[0] for impl in ("pallas", "xla")]
  assert ga.dtype == gb.dtype == x.dtype
  np.testing.assert_allclose(np.float32(ga), np.float32(gb), rtol=_tol(dtype, 1),
                             atol=_tol(dtype, taps))


# ----------------------------------------------------------------------------- CPU (interpret)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["2d_overlap", "2d_dilated_ceil", "1d_edge"])
def test_max_matches_xla(rng, cfg):
  _check_max(rng, cfg, jnp.float32)


@pytest.mark.parametrize("cfg", CONFIGS_ND, ids=ND_IDS)
def test_nd_and_channels_first_match_xla(rng, cfg):
  _check_max(rng, cfg, jnp.float32)
  _check_avg(rng, cfg, jnp.float32, cfg[-1] == "channels_first", None)


def test_nd_bfloat16_avg_divisor(rng):
  _check_max(rng, CONFIGS_ND[1], jnp.bfloat16)
  _check_avg(rng, CONFIGS_ND[2], jnp.bfloat16, False, 5)


def test_max_bfloat16_matches_xla(rng):
  _check_max(rng, ((1, 5, 7, 6), (3, 3), (2, 2), 1, None, False), jnp.bfloat16)


def test_avg_matches_xla(rng):
  _check_avg(rng, CONFIGS[0], jnp.float32, False, None)
  _check_avg(rng, CONFIGS[1], jnp.float32, True, None)


def test_avg_bfloat16_divisor_1d(rng):
  _check_avg(rng, CONFIGS[2], jnp.bfloat16, False, 5)


def test_empty_windows_and_all_neg_inf():
  # Windows that hold only padding (ceil mode + large padding) and windows of only -inf.
  x = jnp.full((1, 3, 3, 2), -jnp.inf).at[0, 2, 2, 0].set(1.0)
  kw = dict(window_shape=(2, 2), strides=(2, 2), padding=1, ceil_mode=True)
  for fn in (jaxpool.max_pool, lambda *a, **k: jaxpool.max_pool_with_indices(*a, **k)[1]):
    _bits_equal(fn(x, **kw, implementation="pallas"), fn(x, **kw, implementation="xla"))
  kw1 = dict(window_shape=(3,), strides=(3,), padding=((2, 2),), ceil_mode=True)
  x1 = jnp.arange(8.0).reshape(1, 4, 2)
  geom = windows.make_geometry(x1.shape, (3,), (3,), ((2, 2),), None, True)
  ya, ta = ops.max_pool_with_argmax(x1, geom, interpret=not ON_GPU)
  from jaxpool._src import xla
  yb, tb = xla.max_pool_argmax(x1, geom)
  _bits_equal(ya, yb)
  _bits_equal(ta, tb)
  assert ta.dtype == windows.argmax_dtype(3)
  _bits_equal(jaxpool.avg_pool(x1, **kw1, implementation="pallas"),
              jaxpool.avg_pool(x1, **kw1, implementation="xla"))


def _check_vmap_grad_and_jvp(rng, x, kw):
  """Per-example gradients (vmap of grad) and jvp of a max + avg loss, Pallas against XLA;
  returns the two losses."""
  def loss(impl):
    def f(v):
      y = jaxpool.max_pool(v, **kw, implementation=impl)
      z = jaxpool.avg_pool(v, **kw, implementation=impl)
      return jnp.sum(y * y) + jnp.sum(jnp.sin(z))
    return f

  p, q = loss("pallas"), loss("xla")
  ga = jax.jit(jax.vmap(jax.grad(p)))(x[:, None])
  gb = jax.jit(jax.vmap(jax.grad(q)))(x[:, None])
  np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-6)
  t = _data(rng, x.shape, jnp.float32, special=False)
  (pa, ta), (pb, tb) = jax.jvp(p, (x,), (t,)), jax.jvp(q, (x,), (t,))
  np.testing.assert_allclose(pa, pb, rtol=1e-6)
  np.testing.assert_allclose(ta, tb, rtol=1e-5)
  return p, q


def test_transformations(rng):
  """vmap(grad), jvp, hessian and shard_map, against the XLA path."""
  shape, window, strides, padding = (2, 6, 5, 3), (3, 3), (2, 2), 1
  x = _data(rng, shape, jnp.float32, special=False)
  p, q = _check_vmap_grad_and_jvp(rng, x, dict(window_shape=window, strides=strides,
                                               padding=padding))
  # second order: jacfwd over jacrev
  xs = x[:1, :4, :4, :1]
  np.testing.assert_allclose(jax.hessian(p)(xs), jax.hessian(q)(xs), rtol=1e-5, atol=1e-6)
  # shard_map over the batch (on every device there is)
  from jax.sharding import PartitionSpec as P
  try:
    from jax import shard_map
  except ImportError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map
  import inspect
  check = ({"check_vma": False} if "check_vma" in inspect.signature(shard_map).parameters
           else {"check_rep": False})
  n = len(jax.devices())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("b",))
  xb = jnp.concatenate([x] * n)
  sm = shard_map(jax.grad(p), mesh=mesh, in_specs=P("b"), out_specs=P("b"), **check)
  np.testing.assert_allclose(jax.jit(sm)(xb), jnp.concatenate([jax.grad(q)(x)] * n),
                             rtol=1e-6, atol=1e-6)


def test_backward_is_the_pallas_kernel():
  x = jnp.ones((1, 5, 5, 2))
  f = lambda v: jaxpool.max_pool(v, (2, 2), (1, 1), implementation="pallas").sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(f))(x))
  assert "jaxpool_max_pool_bwd" in jaxpr and "scatter" not in jaxpr
  g = lambda v: jaxpool.avg_pool(v, (2, 2), (1, 1), implementation="pallas").sum()
  assert "jaxpool_avg_pool_bwd" in str(jax.make_jaxpr(jax.grad(g))(x))


def test_supports():
  g2 = windows.make_geometry((2, 8, 8, 4), (2, 2), (2, 2))
  assert ops.supports("max_pool", (2, 8, 8, 4), jnp.float32, g2)
  assert ops.supports("avg_pool", (2, 8, 8, 4), jnp.bfloat16, g2, count_include_pad=False,
                      divisor_override=3)
  assert not ops.supports("lp_pool", (2, 8, 8, 4), jnp.float32, g2)
  assert not ops.supports("max_pool", (2, 8, 8, 4), jnp.int32, g2)
  cf = windows.make_geometry((2, 4, 8, 8), (2, 2), (2, 2), data_format="channels_first")
  assert ops.supports("max_pool", (2, 4, 8, 8), jnp.float32, cf)
  g3 = windows.make_geometry((1, 4, 4, 4, 2), (2, 2, 2))
  assert ops.supports("max_pool", (1, 4, 4, 4, 2), jnp.float32, g3)
  g4 = windows.make_geometry((1, 3, 3, 3, 3, 1), (2, 2, 2, 2))
  assert not ops.supports("max_pool", (1, 3, 3, 3, 3, 1), jnp.float32, g4)
  huge = (2**16, 2**8, 2**7, 1)  # 2**31 elements: only the shape is looked at
  gh = windows.make_geometry(huge, (2, 2), (2, 2))
  assert not ops.supports("max_pool", huge, jnp.float32, gh)
  under = (2**16, 2**8, 2**7 - 1, 1)
  assert ops.supports("max_pool", under, jnp.float32, windows.make_geometry(under, (2, 2), (2, 2)))
  big = windows.make_geometry((1, 20, 20, 1), (9, 9))
  assert not ops.supports("max_pool", (1, 20, 20, 1), jnp.float32, big)
  with pytest.raises(ValueError, match="pallas"):
    jaxpool.max_pool(jnp.ones((1, 3, 3, 3, 3, 1)), (2, 2, 2, 2), implementation="pallas")


# ----------------------------------------------------------------------------- GPU (compiled)

gpu = pytest.mark.gpu


def _need_gpu():
  if not ON_GPU:
    pytest.skip("needs a GPU")


@gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=[str(i) for i in range(len(GPU_CONFIGS))])
def test_gpu_max_matches_xla(rng, cfg, dtype):
  _need_gpu()
  _check_max(rng, cfg, dtype)


@gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cip,div", [(True, None), (False, None), (True, 7)])
def test_gpu_avg_matches_xla(rng, dtype, cip, div):
  _need_gpu()
  for cfg in GPU_CONFIGS:
    _check_avg(rng, cfg, dtype, cip, div)


@gpu
def test_gpu_transformations(rng):
  _need_gpu()
  test_transformations(rng)
  test_empty_windows_and_all_neg_inf()
  test_backward_is_the_pallas_kernel()


@gpu
def test_gpu_deterministic(rng):
  _need_gpu()
  x = _data(rng, (16, 56, 56, 64), jnp.float32, special=False)
  x = jnp.round(x * 4) / 4  # many ties, many windows choosing the same element
  dy = _data(rng, (16, 28, 28, 64), jnp.float32, special=False)
  f = jax.jit(functools.partial(jax.grad(
      lambda v, g: jnp.sum(jaxpool.max_pool(v, (3, 3), (2, 2), 1) * g))))
  a, b = f(x, dy), f(x, dy)
  assert np.array_equal(np.asarray(a), np.asarray(b))
  assert "jaxpool_max_pool_bwd" in str(jax.make_jaxpr(f)(x, dy))


@pytest.mark.parametrize("cfg", [GPU_CONFIGS[0], CONFIGS_ND[0], CONFIGS_ND[1], CONFIGS_ND[3]],
                         ids=["2d_last", "2d_first", "3d_last", "1d_first"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_lowers_to_triton(cfg, dtype):
  """Every kernel, compiled (not interpreted), lowers to a Triton call for CUDA, on any host:
  Pallas' Triton lowering runs; Triton's compiler (on a GPU) does not."""
  from jaxpool._src.pallas import triton as pk
  shape, *geo = cfg
  geom = windows.make_geometry(shape, *_kw(*geo).values())
  x = jnp.zeros(shape, dtype)
  y = jax.ShapeDtypeStruct(geom.output_shape(shape), dtype)
  idx = jax.ShapeDtypeStruct(y.shape, windows.argmax_dtype(geom.num_taps))
  avg = dict(interpret=False, count_include_pad=False, divisor_override=None)
  fns = [
      (lambda a: pk.max_forward(a, geom, interpret=False), x),
      (lambda a: pk.max_forward_argmax(a, geom, interpret=False), x),
      (lambda i, d: pk.max_backward(i, d, shape, geom, interpret=False), idx, y),
      (lambda a: pk.avg_forward(a, geom, **avg), x),
      (lambda d: pk.avg_backward(d, shape, geom, **avg), y),
  ]
  for fn, *args in fns:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


def test_default_dispatch(monkeypatch):
  """None: the kernels where they run compiled (GPU, TPU), XLA on a CPU or when
  JAXPOOL_IMPLEMENTATION=xla; a bad value of that variable is an error naming it."""
  from jaxpool._src import api
  x = jnp.ones((2, 8, 8, 4))
  geom = windows.make_geometry(x.shape, (2, 2), (2, 2))
  monkeypatch.delenv(api.DEFAULT_ENV, raising=False)
  for platform, expected in (("cpu", False), ("gpu", True), ("tpu", True)):
    monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
    assert api._use_pallas(None, "max_pool", x, geom) is expected, platform
  monkeypatch.setenv(api.DEFAULT_ENV, "xla")
  assert api._use_pallas(None, "max_pool", x, geom) is False
  assert api._use_pallas("pallas", "max_pool", x, geom) is True  # an explicit choice wins
  monkeypatch.setenv(api.DEFAULT_ENV, "triton")
  with pytest.raises(ValueError, match="JAXPOOL_IMPLEMENTATION.*'triton'"):
    api._use_pallas(None, "max_pool", x, geom)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS_ND[0], CONFIGS_ND[3]],
                         ids=["2d_last", "2d_first", "1d_first_stride3"])
def test_small_blocks_take_both_paths(rng, cfg):
  """Blocks of 2 columns and 2 lanes, so that a small image has interior blocks (no masks) and
  edge blocks: every kernel, both code paths, against the XLA path."""
  from jaxpool._src import xla
  from jaxpool._src.pallas import triton as pk
  shape, *geo = cfg
  geom = windows.make_geometry(shape, *_kw(*geo).values())
  launch = (2, 2, 1)
  x = _data(rng, shape, jnp.float32)
  y, idx = pk._window_call(x, geom, "argmax", True, launch=launch)
  yb, ib = xla.max_pool_argmax(x, geom)
  _bits_equal(y, yb)
  _bits_equal(idx, ib)
  _bits_equal(pk._window_call(x, geom, "max", True, launch=launch)[0], yb)
  dy = _data(rng, y.shape, jnp.float32, special=False)
  dx = pk._backward_call((ib, dy), shape, geom, "max", True, launch=launch)
  _bits_equal(dx, jax.vjp(lambda t: xla.gather_at_argmax(t, ib, geom), x)[1](dy)[0])
  xf = _data(rng, shape, jnp.float32, special=False)
  a = pk._window_call(xf, geom, "avg", True, True, None, launch=launch)[0]
  ref, vjp = jax.vjp(lambda v: xla.avg_pool(v, geom, True, None), xf)
  np.testing.assert_allclose(a, ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(pk._backward_call((dy,), shape, geom, "avg", True, True, None,
                                               launch=launch), vjp(dy)[0], rtol=1e-6, atol=1e-6)


def test_nd_transformations(rng):
  """Per-example gradients (vmap of grad) and jvp through the 3-D and channels_first kernels."""
  for shape, window, strides, fmt in (((2, 3, 7, 9), (3, 3), (2, 2), "channels_first"),
                                      ((2, 5, 6, 4, 2), (2, 3, 2), (2, 2, 1), "channels_last")):
    x = _data(rng, shape, jnp.float32, special=False)
    p, _ = _check_vmap_grad_and_jvp(rng, x, dict(window_shape=window, strides=strides,
                                                 padding=1, data_format=fmt))
    assert "jaxpool_max_pool_bwd" in str(jax.make_jaxpr(jax.grad(p))(x))
