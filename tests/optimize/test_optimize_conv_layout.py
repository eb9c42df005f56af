"""jaxpool.optimize after a convolution that XLA lays out channels-first on an NVIDIA GPU: the
pool runs ``channels_first`` on the transposed view (no transposes of the activations), says so
in the report, and computes the same bits.

No GPU is needed: the tests make jaxpool's dispatch see ``cuda`` and the decision see a compute
capability; the kernels run in interpret mode on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpool
from jaxpool._src import dispatch, platforms
from jaxpool._src.optimize import conv_layout, cost

RNG = np.random.default_rng(0)
TRANSPOSED = "channels_first on the transposed view: XLA lays the convolution before it out"
ALWAYS = cost.always  # replace every site, small ones included


@pytest.mark.parametrize("cc, spatial, dtype, expected", [
    ((9, 0), 3, "float32", True), ((9, 0), 3, "bfloat16", True), ((9, 0), 3, "float64", True),
    ((9, 0), 2, "float32", False), ((9, 0), 2, "bfloat16", False), ((9, 0), 2, "float64", True),
    ((9, 0), 1, "float32", False), ((10, 0), 3, "float16", True), ((12, 0), 2, "float16", False),
    ((8, 0), 3, "float32", True), ((8, 0), 3, "bfloat16", True), ((8, 0), 3, "float64", True),
    ((8, 0), 2, "float32", True), ((8, 0), 2, "bfloat16", False), ((8, 0), 2, "float16", False),
    ((8, 0), 2, "float64", True), ((8, 6), 1, "bfloat16", True),
    ((7, 0), 2, "float16", False), ((6, 1), 2, "float16", True), ((6, 1), 2, "float32", True),
])
def test_xla_layout_rule(cc, spatial, dtype, expected):
  """XLA's GPU layout assignment, as jaxpool mirrors it."""
  assert conv_layout.conv_is_channels_first(cc, spatial, jnp.dtype(dtype)) is expected


@pytest.fixture
def gpu(monkeypatch):
  """As on an NVIDIA GPU of compute capability ``cc`` (call it; default an H100's 9.0)."""
  def set_cc(cc=(9, 0)):
    monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
    monkeypatch.setattr(conv_layout, "compute_capability", lambda: cc)
    # (a kind without a measured cost table: the rules before the tables decide)
    monkeypatch.setattr(platforms, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
  return set_cc


def conv_relu_pool(spatial: int, dtype=jnp.float32):
  """A channels-last convolution with ``spatial`` spatial dims, a bias, jax.nn.relu and a 2x../s2
  max pool (Flax's 3-D U-Net's encoder step), and its parameters and input."""
  lhs = "N" + "DHW"[3 - spatial:] + "C"
  rhs = "DHW"[3 - spatial:] + "IO"
  win = (1, *(2,) * spatial, 1)

  def f(w, b, x):
    y = lax.conv_general_dilated(x, w, (1,) * spatial, "SAME", dimension_numbers=(lhs, rhs, lhs))
    y = jax.nn.relu(y + b)
    return lax.reduce_window(y, -jnp.inf, lax.max, win, win, "VALID")

  # Small integers: every sum exact, many ties (the convolutions' rounding cannot differ).
  ints = lambda *s: jnp.asarray(RNG.integers(-3, 4, s), dtype)
  w = ints(*(3,) * spatial, 3, 4)
  b = ints(*(1,) * (spatial + 1), 4)  # Flax's bias, reshaped to the rank
  x = ints(2, *(4,) * spatial, 3)
  return f, (w, b, x)


def details(rep) -> list[str]:
  return [d.detail for d in rep.replaced]


def pool(rep) -> str:
  """What the report says of the one replaced pool (not of a folded ReLU)."""
  (out,) = [d for d in details(rep) if "jaxpool." in d]
  return out


def test_3d_conv_pool_runs_on_the_transposed_view(gpu):
  gpu((9, 0))
  f, args = conv_relu_pool(3)
  g = jaxpool.optimize(f, implementation="pallas", cost=ALWAYS)
  rep = g.report(*args)
  pools = [d for d in details(rep) if "jaxpool.max_pool(" in d]
  assert len(pools) == 1 and TRANSPOSED in pools[0], str(rep)
  assert "window (2, 2, 2)" in pools[0] and "ReLU folded" in pools[0], str(rep)
  # The program transposes into (N, C, D, H, W) and back around the kernel: XLA makes those
  # bitcasts of the convolution's channels-first buffer on the GPU.
  eqns = jax.make_jaxpr(g)(*args).jaxpr.eqns
  perms = [e.params["permutation"] for e in eqns if e.primitive.name == "transpose"]
  assert perms == [(0, 4, 1, 2, 3), (0, 2, 3, 4, 1)], perms
  # The same bits as the function itself, value and gradient.
  y = f(*args)
  np.testing.assert_array_equal(g(*args), y)
  ct = jnp.asarray(RNG.integers(-3, 4, y.shape), y.dtype)
  loss = lambda h: lambda *a: (h(*a) * ct).sum()
  for k in range(3):
    np.testing.assert_array_equal(jax.grad(loss(g), argnums=k)(*args),
                                  jax.grad(loss(f), argnums=k)(*args))


def test_3d_conv_pool_gradient_and_jvp_on_the_transposed_view(gpu):
  """The max-pool gradient (``select_and_scatter_add``) and JVP (``select_and_gather_add``)
  of XLA's own differentiation take the transposed view too."""
  gpu((9, 0))
  f, args = conv_relu_pool(3)
  y = f(*args)
  ct = jnp.asarray(RNG.integers(-3, 4, y.shape), y.dtype)
  grad = jax.grad(lambda *a: (f(*a) * ct).sum(), argnums=(0, 1, 2))
  g = jaxpool.optimize(grad, implementation="pallas", cost=ALWAYS)
  rep = g.report(*args)
  pool_grads = [d for d in details(rep) if "jaxpool.max_pool_grad(" in d]
  assert len(pool_grads) == 1 and TRANSPOSED in pool_grads[0], str(rep)
  for got, want in zip(g(*args), grad(*args), strict=True):
    np.testing.assert_array_equal(got, want)
  tangents = tuple(jnp.asarray(RNG.integers(-3, 4, a.shape), a.dtype) for a in args)
  jvp = lambda *a: jax.jvp(f, a, tangents)[1]
  h = jaxpool.optimize(jvp, implementation="pallas", cost=ALWAYS)
  rep = h.report(*args)
  jvps = [d for d in details(rep) if "the JVP of jaxpool.max_pool(" in d]
  assert len(jvps) == 1 and TRANSPOSED in jvps[0], str(rep)
  np.testing.assert_array_equal(h(*args), jvp(*args))


def test_3d_conv_average_pool_on_the_transposed_view(gpu):
  gpu((9, 0))
  _, (w, b, x) = conv_relu_pool(3)
  win = (1, 2, 2, 2, 1)

  def f(w, b, x):
    y = lax.conv_general_dilated(x, w, (1, 1, 1), "SAME",
                                 dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
    return lax.reduce_window(y + b, 0.0, lax.add, win, win, "VALID") / 8

  g = jaxpool.optimize(f, implementation="pallas", cost=ALWAYS)
  rep = g.report(w, b, x)
  assert len(rep.replaced) == 1 and TRANSPOSED in pool(rep), str(rep)
  np.testing.assert_array_equal(g(w, b, x), f(w, b, x))


@pytest.mark.parametrize("cc, spatial, dtype, transposed", [
    ((9, 0), 2, jnp.bfloat16, False), ((9, 0), 2, jnp.float32, False),
    ((8, 0), 2, jnp.float32, True), ((8, 0), 2, jnp.bfloat16, False)])
def test_2d_conv_follows_the_rule(gpu, cc, spatial, dtype, transposed):
  gpu(cc)
  f, args = conv_relu_pool(spatial, dtype)
  g = jaxpool.optimize(f, implementation="pallas", cost=ALWAYS)
  rep = g.report(*args)
  (pool,) = [d for d in details(rep) if "jaxpool.max_pool(" in d]
  assert (TRANSPOSED in pool) is transposed, str(rep)
  assert ("channels_last" in pool) is not transposed, str(rep)
  np.testing.assert_array_equal(np.asarray(g(*args), np.float32), np.asarray(f(*args), np.float32))


def test_no_convolution_before_the_pool(gpu):
  """A pool of a function input, or of a convolution's output through a transpose: as it was."""
  gpu((9, 0))
  f = lambda x: lax.reduce_window(jax.nn.relu(x), -jnp.inf, lax.max, (1, 2, 2, 2, 1),
                                  (1, 2, 2, 2, 1), "VALID")
  x = jnp.asarray(RNG.standard_normal((2, 4, 4, 4, 3)), jnp.float32)
  rep = jaxpool.optimize(f, implementation="pallas", cost=ALWAYS).report(x)
  assert rep.replaced and "channels_last" in pool(rep), str(rep)
  assert "transposed" not in pool(rep), str(rep)
  conv, (w, b, x) = conv_relu_pool(3)
  moved = lambda w, b, x: conv(w, b, jnp.swapaxes(x, 1, 2))  # a transpose before the conv: fine
  rep = jaxpool.optimize(moved, implementation="pallas", cost=ALWAYS).report(w, b, x)
  assert TRANSPOSED in pool(rep), str(rep)

  def after(w, b, x):  # the convolution's output transposed before the pool: left alone
    y = lax.conv_general_dilated(x, w, (1, 1, 1), "SAME",
                                 dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
    return lax.reduce_window(jnp.swapaxes(y + b, 1, 2), -jnp.inf, lax.max, (1, 2, 2, 2, 1),
                             (1, 2, 2, 2, 1), "VALID")
  rep = jaxpool.optimize(after, implementation="pallas", cost=ALWAYS).report(w, b, x)
  assert "transposed" not in pool(rep), str(rep)


def test_only_where_the_kernels_run_on_an_nvidia_gpu(gpu, monkeypatch):
  f, args = conv_relu_pool(3)
  gpu((9, 0))
  rep = jaxpool.optimize(f, implementation="xla", cost=ALWAYS).report(*args)
  assert "transposed" not in pool(rep), str(rep)  # jaxpool runs XLA: XLA picks layouts
  for name in ("cpu", "rocm", "tpu"):
    monkeypatch.setattr(dispatch, "platform", lambda n=name: n)
    rep = jaxpool.optimize(f, implementation="pallas", cost=ALWAYS).report(*args)
    assert "transposed" not in pool(rep), (name, str(rep))
  gpu(None)  # a CUDA device that says no compute capability
  rep = jaxpool.optimize(f, implementation="pallas", cost=ALWAYS).report(*args)
  assert "transposed" not in pool(rep), str(rep)


def test_only_where_the_kernels_serve_the_pool(gpu):
  """Where the kernels would not serve the site (a dtype they do not take, a dim of more taps
  than they unroll), jaxpool runs its XLA path, whose layout XLA chooses: no transpose is
  written."""
  gpu((9, 0))
  f, (w, b, x) = conv_relu_pool(3)
  rep = jaxpool.optimize(f, cost=ALWAYS).report(w, b, x)  # (implementation=None: kernels)
  assert TRANSPOSED in pool(rep), str(rep)
  wide = lambda w, b, x: lax.reduce_window(  # noqa: E731  (a 1x34 window: a dim of 34 taps)
      jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                           dimension_numbers=("NHWC", "HWIO", "NHWC")) + b),
      -jnp.inf, lax.max, (1, 1, 34, 1), (1, 1, 1, 1), "VALID")
  _, (w2, b2, _) = conv_relu_pool(2)
  x2 = jnp.asarray(RNG.integers(-3, 4, (2, 3, 36, 3)), jnp.float32)
  rep = jaxpool.optimize(wide, cost=ALWAYS).report(w2, b2, x2)
  assert rep.replaced and "transposed" not in pool(rep), str(rep)
  with jax.enable_x64(True):
    f64 = [a.astype(jnp.float64) for a in (w, b, x)]
    rep = jaxpool.optimize(f, cost=ALWAYS).report(*f64)
    assert rep.replaced and "transposed" not in pool(rep), str(rep)


def test_compute_capability_of_this_machine():
  """A string like "9.0" on an NVIDIA GPU; None on a CPU (no such attribute)."""
  cc = conv_layout.compute_capability()
  dev = jax.devices()[0]
  if hasattr(dev, "compute_capability"):
    assert cc == tuple(int(v) for v in str(dev.compute_capability).split(".")[:2])
  else:
    assert cc is None


def test_the_walk_back_to_the_convolution(gpu):
  """Through a broadcast bias, conversions, a jit and up to 32 elementwise ops; not through an
  elementwise op of two activations (which one's layout?) nor a conv of another layout."""
  gpu((9, 0))
  _, (w, b, x) = conv_relu_pool(3)
  win = (1, 2, 2, 2, 1)
  spec = ("NDHWC", "DHWIO", "NDHWC")
  conv = lambda x: lax.conv_general_dilated(x, w, (1, 1, 1), "SAME", dimension_numbers=spec)
  mp = lambda y: lax.reduce_window(y, -jnp.inf, lax.max, win, win, "VALID")
  report = lambda f, *a: pool(jaxpool.optimize(f, implementation="pallas", cost=ALWAYS).report(*a))

  def chain(x):
    y = conv(x) + jnp.broadcast_to(b, (2, 4, 4, 4, 4))
    y = jax.jit(lambda v: jax.nn.relu(v.astype(jnp.bfloat16)) * 2)(y)
    return mp(y.astype(jnp.float32))
  assert TRANSPOSED in report(chain, x)

  negs = lambda n: lambda x: mp(functools.reduce(lambda v, _: -v, range(n), conv(x)))
  assert TRANSPOSED in report(negs(32), x)
  assert "transposed" not in report(negs(33), x)

  residual = lambda x, r: mp(conv(x) + r)
  assert "transposed" not in report(residual, x, jnp.zeros((2, 4, 4, 4, 4)))

  def other_spec(x):  # the convolution's output is NCDHW, made NDHWC by a transpose
    y = lax.conv_general_dilated(x, w, (1, 1, 1), "SAME",
                                 dimension_numbers=("NDHWC", "DHWIO", "NCDHW"))
    return mp(jnp.moveaxis(y, 1, -1))
  assert "transposed" not in report(other_spec, x)
