"""The kernel tests' shared base: configurations, data and the comparisons against XLA.

Every Pallas backend (Triton on a GPU or in interpret mode; the TPU kernels in interpret mode)
runs these same checks: bit for bit with the XLA path for max pooling (forward, taps, gradient),
to float32 rounding for average pooling. ``test_pallas.py`` and ``test_pallas_tpu.py`` choose
the kernels and call them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxpool
from jaxpool._src import settings, windows, xla
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


def kw_of(window, strides, padding, dilation, ceil_mode, data_format="channels_last"):
  return dict(window_shape=window, strides=strides, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode, data_format=data_format)


def data(rng, shape, dtype, *, special=True):
  x = rng.standard_normal(shape).astype(np.float32)
  if special:
    flat = x.reshape(-1)
    n = flat.size
    flat[rng.choice(n, max(n // 7, 2), replace=False)] = 0.5  # ties
    flat[rng.choice(n, max(n // 50, 1), replace=False)] = -np.inf
    flat[rng.choice(n, max(n // 97, 1), replace=False)] = np.nan
  return jnp.asarray(x).astype(dtype)


def tied(rng, shape, dtype):
  """Small integers (many ties), a few signed zeros: what a tie rule or order would show."""
  x = rng.integers(-3, 4, shape).astype(np.float32)
  x[rng.random(shape) < 0.1] = -0.0
  return jnp.asarray(x).astype(dtype)


def bits_equal(a, b):
  """The same bits (zeros' signs included), any NaN for any NaN."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  if not jnp.issubdtype(a.dtype, jnp.floating):
    assert np.array_equal(a, b), f"{np.sum(a != b)} of {a.size} differ"
    return
  both_nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
  unsigned = np.dtype(f"uint{8 * a.dtype.itemsize}")
  differ = (a.view(unsigned) != b.view(unsigned)) & ~both_nan
  assert not differ.any(), f"{np.sum(differ)} of {a.size} differ"


@functools.cache
def _max_ops(kw_items, impl, backend):
  """The max-pool ops of one configuration and implementation, jitted together: max_pool,
  max_pool_with_indices, min_pool (the max kernel on -x) and max_pool's gradient. Cached (keyed
  by the kernels' backend too), so that checks of the same configuration, dtype and shapes share
  one compile of each kernel: in interpret mode on a CPU the compile is the cost."""
  del backend  # (only a key: JAXPOOL_PALLAS_BACKEND and the nan_max setting pick the kernels while
  # tracing)
  kw = dict(kw_items)

  @jax.jit
  def run(x, xf, dy):
    y = jaxpool.max_pool(x, **kw, implementation=impl)
    yi, i = jaxpool.max_pool_with_indices(x, **kw, implementation=impl)
    ymin = jaxpool.min_pool(x, **kw, implementation=impl)
    g = jax.vjp(lambda v: jaxpool.max_pool(v, **kw, implementation=impl), xf)[1](dy)[0]
    return y, yi, i, ymin, g

  return run


def compare_max_ops(kw, x, xf, dy):
  """Every output of :func:`_max_ops`, the kernels against the XLA path, bit for bit."""
  key = tuple(sorted(kw.items()))
  # (the maximum's form is read while tracing too: tests may set it)
  kernels = (ops.backend(), settings.get("nan_max"))
  for a, b in zip(_max_ops(key, "pallas", kernels)(x, xf, dy),
                  _max_ops(key, "xla", None)(x, xf, dy), strict=True):
    bits_equal(a, b)


def check_max(rng, cfg, dtype):
  """Forward (max and min), the argmax as flat indices, and the gradient."""
  shape, *geo = cfg
  kw = kw_of(*geo)
  x = data(rng, shape, dtype)
  # gradient: NaN-free input so the cotangents are finite; dy has ties too
  xf = data(rng, shape, dtype, special=False)
  xf = jnp.where(jnp.abs(xf) < 0.3, jnp.asarray(0.25, dtype), xf)  # ties
  dy = data(rng, jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw), xf).shape, dtype,
            special=False)
  compare_max_ops(kw, x, xf, dy)
  return x, xf, dy, kw


def tol(dtype, taps):
  return (2e-6 if dtype == jnp.float32 else 1e-2) * max(taps, 1)


def check_avg(rng, cfg, dtype, count_include_pad, divisor_override):
  shape, *geo = cfg
  kw = kw_of(*geo)
  kw.update(count_include_pad=count_include_pad, divisor_override=divisor_override)
  taps = int(np.prod(geo[0]))
  x = data(rng, shape, dtype, special=False)
  dy = data(rng, jax.eval_shape(lambda v: jaxpool.avg_pool(v, **kw), x).shape, dtype,
            special=False)

  @functools.partial(jax.jit, static_argnums=0)  # forward and gradient: one compile
  def run(impl, x, dy):
    y, vjp = jax.vjp(lambda v: jaxpool.avg_pool(v, **kw, implementation=impl), x)
    return y, vjp(dy)[0]

  (a, ga), (b, gb) = run("pallas", x, dy), run("xla", x, dy)
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol(dtype, 1),
                             atol=tol(dtype, taps))
  assert ga.dtype == gb.dtype == x.dtype
  np.testing.assert_allclose(np.float32(ga), np.float32(gb), rtol=tol(dtype, 1),
                             atol=tol(dtype, taps))


def check_vmap_grad_and_jvp(rng, x, kw, also=None):
  """Per-example gradients (vmap of grad) and jvp of a max + avg loss, Pallas against XLA;
  returns the two losses and, given ``also`` (a function of a loss and ``x``), its results for
  each. Each implementation's transformations run in one jit: they share their kernels (vmap
  folds its axis into the batch), which then compile once."""
  def loss(impl):
    def f(v):
      y = jaxpool.max_pool(v, **kw, implementation=impl)
      z = jaxpool.avg_pool(v, **kw, implementation=impl)
      return jnp.sum(y * y) + jnp.sum(jnp.sin(z))
    return f

  @functools.partial(jax.jit, static_argnums=0)
  def run(f, x, t):
    return (jax.vmap(jax.grad(f))(x[:, None]), jax.jvp(f, (x,), (t,)),
            None if also is None else also(f, x))

  p, q = loss("pallas"), loss("xla")
  t = data(rng, x.shape, jnp.float32, special=False)
  (ga, (pa, ta), also_p), (gb, (pb, tb), also_q) = run(p, x, t), run(q, x, t)
  np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(pa, pb, rtol=1e-6)
  np.testing.assert_allclose(ta, tb, rtol=1e-5)
  return p, q, (also_p, also_q)


def check_empty_windows_and_all_neg_inf():
  """Windows of only padding and of only -inf, every op, Pallas against XLA."""
  # Windows that hold only padding (ceil mode + large padding) and windows of only -inf.
  x = jnp.full((1, 3, 3, 2), -jnp.inf).at[0, 2, 2, 0].set(1.0)
  kw = dict(window_shape=(2, 2), strides=(2, 2), padding=1, ceil_mode=True)
  for fn in (jaxpool.max_pool, lambda *a, **k: jaxpool.max_pool_with_indices(*a, **k)[1]):
    bits_equal(fn(x, **kw, implementation="pallas"), fn(x, **kw, implementation="xla"))
  kw1 = dict(window_shape=(3,), strides=(3,), padding=((2, 2),), ceil_mode=True)
  x1 = jnp.arange(8.0).reshape(1, 4, 2)
  geom = windows.make_geometry(x1.shape, (3,), (3,), ((2, 2),), None, True)
  ya, ta = ops.max_pool_with_taps(x1, geom, interpret=not ON_GPU)
  yb, tb = xla.max_pool_taps(x1, geom)
  bits_equal(ya, yb)
  bits_equal(ta, tb)
  assert ta.dtype == windows.taps_dtype(3)
  bits_equal(jaxpool.avg_pool(x1, **kw1, implementation="pallas"),
              jaxpool.avg_pool(x1, **kw1, implementation="xla"))


def check_avg_grad_zero_signs(rng, cfg, dtype, count_include_pad, divisor_override):
  """The average pool's gradient where it is zero has the XLA path's sign: its sums start from
  ``+0.0`` (JAX's transpose of a window sum pads with zeros), so a gradient element whose
  windows all send ``-0.0`` is ``+0.0``. Most cotangents are zeros of either sign; the rest are
  +-1, so every nonzero element agrees to rounding and every zero exactly."""
  shape, *geo = cfg
  kw = kw_of(*geo)
  kw.update(count_include_pad=count_include_pad, divisor_override=divisor_override)
  x = jnp.zeros(shape, dtype)
  y_shape = jax.eval_shape(lambda v: jaxpool.avg_pool(v, **kw), x).shape
  dy = jnp.asarray(rng.choice(np.float32([-0.0, 0.0, 1.0, -1.0]), y_shape,
                              p=[0.6, 0.2, 0.1, 0.1])).astype(dtype)

  @functools.partial(jax.jit, static_argnums=0)
  def grad(impl, x, dy):
    return jax.vjp(lambda v: jaxpool.avg_pool(v, **kw, implementation=impl), x)[1](dy)[0]

  got, want = np.float32(grad("pallas", x, dy)), np.float32(grad("xla", x, dy))
  np.testing.assert_allclose(got, want, rtol=tol(dtype, 1), atol=0)
  zero = want == 0
  assert zero.any()
  wrong = np.signbit(got[zero]) != np.signbit(want[zero])
  assert not wrong.any(), f"{wrong.sum()} of {zero.sum()} zeros have the other sign"


def check_signed_zeros(rng, cfg, dtype):
  """Windows whose maximum is zero, of either sign: ``+0.0`` beats ``-0.0`` (as in
  ``lax.max``), the first of equal zeros otherwise; values, taps and gradient bit for bit with
  the XLA path, max and min. Half the cotangents are zeros of either sign (a gradient element
  whose windows all send ``-0.0``)."""
  shape, *geo = cfg
  kw = kw_of(*geo)
  x = rng.choice(np.array([-0.0, 0.0, -1.0, -np.inf, np.nan], np.float32), shape,
                 p=[0.4, 0.25, 0.25, 0.05, 0.05])
  x = jnp.asarray(x).astype(dtype)
  xf = jnp.where(jnp.isnan(x) | jnp.isinf(x), jnp.zeros_like(x), x)
  dy = data(rng, jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw), xf).shape, dtype,
            special=False)
  u = rng.random(dy.shape)
  dy = jnp.where(u < 0.4, jnp.asarray(-0.0, dtype), jnp.where(u < 0.5, jnp.asarray(0.0, dtype), dy))
  compare_max_ops(kw, x, xf, dy)  # (the compile check_max made for this config, if it ran)
