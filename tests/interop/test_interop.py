"""jaxpool.interop: the Flax (linen, nnx) and Equinox layers equal those frameworks' own pooling.

Where a framework defines the op, the values must be equal (bit for bit for max; to float32
rounding for averages) and the gradients too on inputs without ties. Where the framework and
jaxpool differ on purpose (Equinox's ceil-mode output size), the test pins the documented
difference.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool

eqx = pytest.importorskip("equinox")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

from jaxpool.interop import equinox as jpe  # noqa: E402
from jaxpool.interop import flax_linen as jpl  # noqa: E402
from jaxpool.interop import flax_nnx as jpn  # noqa: E402

RNG = np.random.default_rng(0)


def ints(shape):
  """Small integers: ties everywhere."""
  return jnp.asarray(RNG.integers(-3, 4, size=shape).astype(np.float32))


def unique(shape):
  return jnp.asarray(RNG.permutation(int(np.prod(shape))).reshape(shape).astype(np.float32) / 9)


def flat_batch(fn, x, window):
  """Flax's pooling takes one batch dim (with pairs padding): fold the others into it."""
  n = len(window) + 1
  lead = x.shape[:-n]
  if len(lead) <= 1:
    return fn(x)
  y = fn(x.reshape(-1, *x.shape[-n:]))
  return y.reshape(*lead, *y.shape[1:])


def assert_same(a, b):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# Flax's configurations: (input shape, window, strides, padding). Unbatched inputs included:
# Flax adds a batch dim for them, jaxpool takes any number of batch dims.
FLAX_CASES = [
    ((2, 9, 3), (3,), (2,), "VALID"),
    ((2, 10, 3), (4,), None, "SAME"),
    ((2, 7, 8, 3), (2, 2), (2, 2), "VALID"),
    ((2, 7, 8, 3), (3, 3), (2, 1), "SAME"),
    ((2, 7, 8, 3), (3, 2), (1, 2), ((1, 2), (0, 1))),
    ((7, 8, 3), (3, 3), (2, 2), "SAME"),
    ((2, 5, 6, 4, 2), (2, 3, 2), (2, 2, 1), "SAME"),
    ((3, 2, 6, 6, 2), (2, 2), (2, 2), ((1, 1), (1, 1))),   # two batch dims
]


@pytest.mark.parametrize("shape,window,strides,padding", FLAX_CASES)
def test_linen_max_pool_equals_flax(shape, window, strides, padding):
  x = ints(shape)
  # gradients, on distinct values (on ties the frameworks may pick different winners)
  xu = unique(shape)
  flax_max = lambda v: flat_batch(lambda u: nn.max_pool(u, window, strides, padding), v, window)

  @jax.jit  # ours and Flax's in one compile
  def run(x, xu):
    want = flax_max(x)
    g = jax.grad(lambda v: jnp.sum(jpl.max_pool(v, window, strides, padding) ** 2))(xu)
    g_flax = jax.grad(lambda v: jnp.sum(flax_max(v) ** 2))(xu)
    return [(jpl.max_pool(x, window, strides, padding), want),
            (jpl.MaxPool(window, strides, padding).apply({}, x), want), (g, g_flax)]

  for ours, theirs in run(x, xu):
    assert_same(ours, theirs)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("shape,window,strides,padding", FLAX_CASES)
def test_linen_avg_pool_equals_flax(shape, window, strides, padding, count_include_pad):
  x = unique(shape)
  flax_avg = lambda v: flat_batch(
      lambda u: nn.avg_pool(u, window, strides, padding, count_include_pad), v, window)
  layer = jpl.AvgPool(window, strides, padding, count_include_pad)

  @jax.jit  # ours and Flax's in one compile
  def run(x):
    want = flax_avg(x)
    g = jax.grad(lambda v: jnp.sum(jpl.avg_pool(v, window, strides, padding,
                                                count_include_pad) ** 2))(x)
    g_flax = jax.grad(lambda v: jnp.sum(flax_avg(v) ** 2))(x)
    return [(jpl.avg_pool(x, window, strides, padding, count_include_pad), want),
            (layer.apply({}, x), want), (g, g_flax)]

  for ours, theirs in run(x):
    assert_close(ours, theirs)


def test_linen_avg_pool_default_counts_padding_like_flax():
  # Flax's (and PyTorch's) default count_include_pad=True: a corner window of ones with
  # padding 1 and a 3x3 window averages 4 ones over 9 taps.
  x = jnp.ones((1, 4, 4, 1))
  ours = jpl.avg_pool(x, (3, 3), padding=((1, 1), (1, 1)))
  assert_same(ours, nn.avg_pool(x, (3, 3), padding=((1, 1), (1, 1))))
  assert float(ours[0, 0, 0, 0]) == pytest.approx(4 / 9)
  excl = jpl.avg_pool(x, (3, 3), padding=((1, 1), (1, 1)), count_include_pad=False)
  assert float(excl[0, 0, 0, 0]) == 1.0


def test_linen_ties_go_to_the_first_maximum():
  # A window of equal values: jaxpool's gradient goes to the first one (DirectML's rule).
  x = jnp.zeros((1, 2, 2, 1))
  g = jax.grad(lambda v: jnp.sum(jpl.max_pool(v, (2, 2))))(x)
  assert_same(g[0, :, :, 0], [[1.0, 0.0], [0.0, 0.0]])


def test_linen_modules_in_a_model():
  model = nn.Sequential([nn.Conv(4, (3, 3)), nn.relu, jpl.MaxPool((2, 2), (2, 2)),
                         jpl.AvgPool((2, 2), padding="SAME"), jpl.L2Pool((2, 2)),
                         jpl.LPPool(3.0, (1, 1))])
  ref = nn.Sequential([nn.Conv(4, (3, 3)), nn.relu, lambda v: nn.max_pool(v, (2, 2), (2, 2)),
                       lambda v: nn.avg_pool(v, (2, 2), padding="SAME"),
                       lambda v: jnp.sqrt(nn.pool(v * v, 0.0, jax.lax.add, (2, 2), (1, 1),
                                                  "VALID")),
                       lambda v: v])
  x = unique((2, 12, 12, 3))
  params = jax.jit(model.init)(jax.random.key(0), x)
  assert_close(jax.jit(model.apply)(params, x), jax.jit(ref.apply)(params, x))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x))))(params)
  grads_ref = jax.jit(jax.grad(lambda p: jnp.sum(ref.apply(p, x))))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               grads, grads_ref)


@pytest.mark.parametrize("shape,window,strides,padding", FLAX_CASES[:6])
def test_nnx_layers_equal_nnx_functions(shape, window, strides, padding):
  x = unique(shape)
  assert_same(jpn.MaxPool(window, strides, padding)(x), nnx.max_pool(x, window, strides, padding))
  for cip in (True, False):
    assert_close(jpn.AvgPool(window, strides, padding, cip)(x),
                 nnx.avg_pool(x, window, strides, padding, cip))


def test_nnx_model_jit_and_grad():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
      self.pool = jpn.MaxPool([2, 2], [2, 2])  # lists are fine: stored as tuples
      self.avg = jpn.AvgPool((3, 3), padding="SAME", count_include_pad=False)
      self.l2 = jpn.L2Pool((2, 2))

    def __call__(self, x):
      return self.l2(self.avg(self.pool(nnx.relu(self.conv(x)))))

  net = Net(nnx.Rngs(0))
  x = unique((2, 10, 10, 3))
  y = nnx.jit(lambda m, v: m(v))(net, x)
  h = nnx.max_pool(nnx.relu(net.conv(x)), (2, 2), (2, 2))
  h = nnx.avg_pool(h, (3, 3), padding="SAME", count_include_pad=False)
  want = jnp.sqrt(nnx.avg_pool(h * h, (2, 2)) * 4)
  assert_close(y, want)
  grads = nnx.grad(lambda m: jnp.sum(m(x)))(net)
  assert grads.conv.kernel.value.shape == (3, 3, 3, 4)
  assert np.isfinite(np.asarray(grads.conv.kernel.value)).all()


# Equinox: (layer, ours, input shape (channels, *spatial), kwargs).
EQX_CASES = [
    (eqx.nn.MaxPool1d, jpe.MaxPool1d, (3, 11), dict(kernel_size=3, stride=2)),
    (eqx.nn.MaxPool1d, jpe.MaxPool1d, (3, 11), dict(kernel_size=4, stride=1, padding=2)),
    (eqx.nn.MaxPool2d, jpe.MaxPool2d, (3, 9, 8), dict(kernel_size=2, stride=2)),
    (eqx.nn.MaxPool2d, jpe.MaxPool2d, (3, 9, 8), dict(kernel_size=(3, 2), stride=(2, 1),
                                                      padding=((1, 0), (1, 1)))),
    (eqx.nn.MaxPool2d, jpe.MaxPool2d, (3, 9, 8), dict(kernel_size=3, stride=2, padding=1,
                                                      use_ceil=True)),
    (eqx.nn.MaxPool3d, jpe.MaxPool3d, (2, 5, 6, 7), dict(kernel_size=2, stride=2, padding=1)),
    (eqx.nn.AvgPool1d, jpe.AvgPool1d, (3, 11), dict(kernel_size=3, stride=2, padding=1)),
    (eqx.nn.AvgPool2d, jpe.AvgPool2d, (3, 9, 8), dict(kernel_size=3, stride=2, padding=1)),
    (eqx.nn.AvgPool2d, jpe.AvgPool2d, (3, 9, 8), dict(kernel_size=(2, 3), stride=1,
                                                      padding=(1, 1))),
    (eqx.nn.AvgPool2d, jpe.AvgPool2d, (3, 8, 8), dict(kernel_size=2, stride=2, use_ceil=True)),
    (eqx.nn.AvgPool2d, jpe.AvgPool2d, (3, 9, 8), dict(kernel_size=3, stride=2, padding=1,
                                                      use_ceil=True)),  # overhang in dim 1
    (eqx.nn.AvgPool3d, jpe.AvgPool3d, (2, 5, 6, 7), dict(kernel_size=3, stride=2)),
]


@pytest.mark.parametrize("theirs,ours,shape,kw", EQX_CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(EQX_CASES)])
def test_equinox_layers_equal_equinox(theirs, ours, shape, kw):
  a, b = theirs(**kw), ours(**kw)
  is_max = "Max" in theirs.__name__
  x = ints(shape) if is_max else unique(shape)
  xb = unique((4, *shape))  # a batch: by vmap as in Equinox, and as a leading dim for ours

  @eqx.filter_jit  # ours and Equinox's layer in one compile
  def run(a, b, x, xb):
    def outs(layer):
      grad = jax.grad(lambda v: jnp.sum(layer(v) ** 2))(xb[0])
      return layer(x), jax.vmap(layer)(xb), grad
    # (and ours on the batch as a leading dim, against Equinox's vmap)
    return [*zip(outs(b), outs(a), strict=True), (b(xb), jax.vmap(a)(xb))]

  check = assert_same if is_max else assert_close
  for u, v in run(a, b, x, xb):
    check(u, v)


def test_equinox_ceil_mode_average_equals_equinox():
  # 5 elements, kernel 2, stride 2, ceil: the third window covers element 4 and one overhang
  # tap. Equinox divides by the full kernel, and so does jaxpool's Equinox layer; the core's
  # ceil_mode (PyTorch's rule) divides by the one real tap.
  x = jnp.arange(1.0, 6.0).reshape(1, 5)
  ours = jpe.AvgPool1d(2, 2, use_ceil=True)(x)
  theirs = eqx.nn.AvgPool1d(2, 2, use_ceil=True)(x)
  assert_same(ours, theirs)
  assert_same(ours, [[1.5, 3.5, 2.5]])
  assert_same(jaxpool.avg_pool(x, (2,), (2,), ceil_mode=True, data_format="channels_first"),
              [[1.5, 3.5, 5.0]])
  # Equinox pads `stride` more at the end and then refuses padding above the kernel; PyTorch's
  # rule (ours) takes this configuration: windows [pad, 1], [2, 3], [4, 5].
  assert_same(jpe.MaxPool1d(2, 2, padding=1, use_ceil=True)(x), [[1.0, 3.0, 5.0]])
  with pytest.raises(RuntimeError, match="Paddings should be less"):
    eqx.nn.MaxPool1d(2, 2, padding=1, use_ceil=True)(x)


def test_equinox_layer_extras_and_errors():
  x = unique((2, 9, 9))
  y = jpe.MaxPool2d(2, 1, dilation=2)(x)
  want = jnp.max(jnp.stack([x[:, i:i + 7, j:j + 7] for i in (0, 2) for j in (0, 2)]), axis=0)
  assert_same(y, want)
  assert_same(jpe.LPPool2d(1, 3, 3)(jnp.abs(x)), jpe.AvgPool2d(3, 3, divisor_override=1)(
      jnp.abs(x)))
  assert not jax.tree.leaves(jpe.AvgPool2d(2))  # no array leaves: config is static
  with pytest.raises(ValueError, match="kernel_size"):
    jpe.MaxPool2d((2, 2, 2))
  with pytest.raises(ValueError, match="padding"):
    jpe.MaxPool2d(2, padding=2)(x)  # padding must be below the window on each side


@pytest.mark.parametrize("name", [f"{kind}Pool{n}d" for kind in ("Max", "Avg", "LP")
                                  for n in (1, 2, 3)])
def test_equinox_layers_are_written_out(name):
  """Each Equinox layer is a class in the module's source (as Equinox writes its own), with its
  own signature, and its call runs under a named scope of its name."""
  cls = getattr(jpe, name)
  assert cls.__module__ == jpe.__name__ and cls.__qualname__ == name
  assert f"class {name}(" in inspect.getsource(cls)  # OSError for a class made by type(...)
  params = inspect.signature(cls.__init__).parameters
  assert "num_spatial_dims" not in params and "kernel_size" in params
  n = int(name[-2])
  layer = cls(2, 2) if name.startswith("LP") else cls(2)
  hlo = jax.jit(layer).lower(jnp.ones((1,) + (4,) * n)).as_text(debug_info=True)
  assert f"jaxpool.equinox.{name}" in hlo


@pytest.mark.parametrize("kind", ["MaxPool", "MinPool", "AvgPool", "LPPool", "L2Pool"])
def test_flax_linen_and_nnx_layers_share_one_body(kind):
  from jaxpool.interop import _layers
  body = {"MaxPool": _layers.MaxPoolBody, "MinPool": _layers.MinPoolBody,
          "AvgPool": _layers.AvgPoolBody}.get(kind, _layers.LPPoolBody)
  linen, nnx_layer = getattr(jpl, kind), getattr(jpn, kind)
  assert issubclass(linen, body) and issubclass(nnx_layer, body)
  assert "__call__" in vars(linen) and "_apply_pool" not in vars(linen)
  assert "_apply_pool" not in vars(nnx_layer)


def test_core_imports_no_framework():
  code = ("import sys, jaxpool, jaxpool.interop; "
          "bad = [m for m in ('flax', 'equinox') if m in sys.modules]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)
