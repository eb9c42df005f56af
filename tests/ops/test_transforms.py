"""jit, vmap, grad/vjp, jvp/jacfwd, second order, dtypes and residuals (docs/semantics.md)."""

import functools
import io
import logging
from contextlib import redirect_stdout

import chex
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise, assert_same_bits, jp, tie_rich, tol, unique_values
from jax.test_util import check_grads

KW = dict(window_shape=(3, 3), strides=(2, 2), padding="SAME")  # overlapping windows
KW_CEIL = dict(window_shape=(2, 3), strides=(2, 2), padding=((1, 0), (0, 1)), dilation=(2, 1),
               ceil_mode=True, data_format="channels_first")
SHAPE = (2, 7, 6, 3)
SHAPE_CF = (2, 3, 7, 6)


def _ops(kw):
  """Each differentiable op as a function of x alone."""
  return {
      "max": lambda v: jp.max_pool(v, **kw),
      "max_with_indices": lambda v: jp.max_pool_with_indices(v, **kw)[0],
      "avg": lambda v: jp.avg_pool(v, **kw),
      "avg_exclude_pad": lambda v: jp.avg_pool(v, **kw, count_include_pad=False),
      "lp3": lambda v: jp.lp_pool(v, 3, **kw),
      "l2": lambda v: jp.l2_pool(v, **kw),
  }


OPS = list(_ops(KW))


# ------------------------------------------------------------------------------ jit


@pytest.mark.parametrize("kw,shape", [(KW_CEIL, SHAPE_CF)])
def test_jit_equals_eager(kw, shape, rng):
  x = tie_rich(rng, shape, specials=True)
  xu = unique_values(rng, shape)
  for name, f in _ops(kw).items():
    v = x if name.startswith("max") else xu
    assert_same_bits(jax.jit(f)(v), f(v), name)
  y, i = jp.max_pool_with_indices(x, **kw)
  yj, ij = jax.jit(lambda v: jp.max_pool_with_indices(v, **kw))(x)
  assert_same_bits(yj, y)
  assert_same_bits(ij, i)
  out_size = shape[-2:] if kw.get("data_format") == "channels_first" else shape[1:3]
  unpool = functools.partial(jp.max_unpool, output_size=out_size,
                             data_format=kw.get("data_format", "channels_last"))
  assert_same_bits(jax.jit(unpool)(y, i), unpool(y, i))
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  assert_same_bits(jax.jit(lambda a, b: jp.max_pool_grad(a, b, **kw))(x, dy),
                   jp.max_pool_grad(x, dy, **kw))
  assert_same_bits(jax.jit(lambda b: jp.avg_pool_grad(b, shape, **kw))(dy),
                   jp.avg_pool_grad(dy, shape, **kw))
  assert_same_bits(jax.jit(lambda a, b: jp.lp_pool_grad(a, b, 2.5, **kw))(xu, dy),
                   jp.lp_pool_grad(xu, dy, 2.5, **kw))


class _Records(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.mark.parametrize("op", ["max_pool", "max_pool_with_indices", "avg_pool", "lp_pool",
                                "max_pool_grad", "avg_pool_grad", "lp_pool_grad", "max_unpool"])
def test_no_retrace_for_repeated_eager_calls(op, rng):
  """A second eager call with the same shapes and static config neither traces nor compiles."""
  width = 20 + len(op)  # shapes no other test uses: the first call must compile
  shape = (1, 5, width, 2)
  kw = dict(window_shape=(2, 3), strides=(2, 1), padding=((1, 0), (0, 2)))
  x = unique_values(rng, shape)
  y, i = ref.max_pool_with_indices(x, **kw)
  dy = np.ones(y.shape, np.float32)
  calls = {
      "max_pool": lambda: jp.max_pool(x, **kw),
      "max_pool_with_indices": lambda: jp.max_pool_with_indices(x, **kw),
      "avg_pool": lambda: jp.avg_pool(x, **kw, count_include_pad=False),
      "lp_pool": lambda: jp.lp_pool(x, 1.5, **kw),
      "max_pool_grad": lambda: jp.max_pool_grad(x, dy, **kw),
      "avg_pool_grad": lambda: jp.avg_pool_grad(dy, shape, **kw, count_include_pad=False),
      "lp_pool_grad": lambda: jp.lp_pool_grad(x, dy, 1.5, **kw),
      "max_unpool": lambda: jp.max_unpool(y, i, (5, width)),
  }
  handler = _Records()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      jax.block_until_ready(calls[op]())
      first = list(handler.messages)
      handler.messages.clear()
      jax.block_until_ready(calls[op]())
      second = list(handler.messages)
  finally:
    logger.removeHandler(handler)
  assert any("Compiling" in m for m in first), first  # the log works
  assert not [m for m in second if "tracing" in m.lower() or "compiling" in m.lower()], second


# ------------------------------------------------------------------------------ vmap


@pytest.mark.parametrize("kw,shape", [(KW, SHAPE)])
def test_vmap_equals_batch_dim(kw, shape, rng):
  """vmap over a new leading axis equals the same op with that axis as a batch dim."""
  x = tie_rich(rng, (3, *shape), specials=True)
  xu = unique_values(rng, (3, *shape))
  for name, f in _ops(kw).items():
    v = x if name.startswith("max") else xu
    assert_same_bits(jax.vmap(f)(v), f(v), name)
  # vmap over a non-leading axis too (in_axes=1, out_axes=1)
  f = _ops(kw)["max"]
  assert_same_bits(jax.vmap(f, in_axes=1, out_axes=1)(np.swapaxes(x, 0, 1)),
                   np.swapaxes(f(x), 0, 1))
  y, i = jp.max_pool_with_indices(x, **kw)
  yv, iv = jax.vmap(lambda v: jp.max_pool_with_indices(v, **kw))(x)
  assert_same_bits(yv, y)
  assert_same_bits(iv, i)
  out_size = shape[-2:] if kw.get("data_format") == "channels_first" else shape[1:3]
  unpool = functools.partial(jp.max_unpool, output_size=out_size,
                             data_format=kw.get("data_format", "channels_last"))
  assert_same_bits(jax.vmap(unpool)(y, i), unpool(y, i))
  dy = rng.integers(-3, 4, size=y.shape).astype(np.float32)
  assert_same_bits(jax.vmap(lambda a, b: jp.max_pool_grad(a, b, **kw))(x, dy),
                   jp.max_pool_grad(x, dy, **kw))
  assert_same_bits(jax.vmap(lambda b: jp.avg_pool_grad(b, shape, **kw))(dy),
                   jp.avg_pool_grad(dy, (3, *shape), **kw))
  assert_same_bits(jax.vmap(lambda a, b: jp.lp_pool_grad(a, b, 2.5, **kw))(xu, dy),
                   jp.lp_pool_grad(xu, dy, 2.5, **kw))


@pytest.mark.parametrize("op", ["max", "avg", "lp3"])
def test_per_example_gradients(op, rng):
  """vmap(grad(loss)) over examples equals a Python loop of grad(loss)."""
  f = _ops(KW)[op]
  w = rng.standard_normal((4, 4, 3)).astype(np.float32)  # the output of one example
  loss = lambda v: jnp.sum(jnp.tanh(f(v[None])[0]) * w)
  xs = tie_rich(rng, (5, 7, 8, 3)) if op.startswith("max") else unique_values(rng, (5, 7, 8, 3))
  batched = jax.vmap(jax.grad(loss))(xs)
  looped = np.stack([jax.grad(loss)(xs[b]) for b in range(xs.shape[0])])
  if op.startswith("max"):
    assert_same_bits(batched, looped)
  else:
    np.testing.assert_allclose(batched, looped, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------ forward mode


def test_max_jvp_is_tangent_at_argmax(rng):
  """jvp of max pool gathers the tangent at each window's argmax (reference indices)."""
  kw = dict(KW, padding=((2, 2), (1, 2)), dilation=(2, 2))  # includes empty windows
  x = tie_rich(rng, (2, 6, 5, 3), specials=True)
  t = rng.standard_normal(x.shape).astype(np.float32)
  y, ty = jax.jvp(lambda v: jp.max_pool(v, **kw), (x,), (t,))
  y_ref, idx = ref.max_pool_with_indices(x, **kw)
  assert_bitwise(y, y_ref)
  flat_t = np.moveaxis(t, -1, 1).reshape(2, 3, -1)
  flat_i = np.moveaxis(idx, -1, 1).reshape(2, 3, -1)
  gathered = np.take_along_axis(flat_t, np.maximum(flat_i, 0), axis=-1)
  gathered = np.where(flat_i >= 0, gathered, 0.0).reshape(2, 3, *y.shape[1:3])
  assert_bitwise(ty, np.moveaxis(gathered, 1, -1).astype(np.float32))


@pytest.mark.parametrize("op", ["max", "max_with_indices", "avg_exclude_pad", "lp3"])
def test_jacfwd_equals_jacrev(op, rng):
  f = _ops(KW_CEIL)[op]
  shape = (1, 2, 5, 4)
  x = tie_rich(rng, shape, specials=True) if op.startswith("max") else unique_values(rng, shape)
  jf, jr = jax.jacfwd(f)(x), jax.jacrev(f)(x)
  assert jf.shape == jr.shape == (*f(x).shape, *shape)
  if op.startswith("max"):
    assert_same_bits(jf, jr)  # entries are 0 or 1, exact in both modes
  else:
    np.testing.assert_allclose(jf, jr, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------ second order


@pytest.mark.parametrize("op", ["max", "max_with_indices"])
def test_max_hessian_is_zero(op, rng):
  f = _ops(KW)[op]
  x = unique_values(rng, (1, 5, 4, 1))
  w = rng.standard_normal(f(x).shape).astype(np.float32)
  h = jax.hessian(lambda v: jnp.sum(f(v) * w))(x)
  assert h.shape == 2 * x.shape
  assert not np.any(np.asarray(h))
  v = rng.standard_normal(x.shape).astype(np.float32)
  hvp = jax.jvp(jax.grad(lambda u: jnp.sum(f(u) * w)), (x,), (v,))[1]
  assert not np.any(np.asarray(hvp))
  # a loss that is not linear in y: Hessian = J^T diag(2w) J, J the 0/1 argmax selection
  h2 = jax.hessian(lambda u: jnp.sum(f(u) ** 2 * w))(x)
  # (in NumPy: a jax matmul on a GPU would round through TF32)
  jac = np.asarray(jax.jacrev(f)(x)).reshape(w.size, x.size)
  expected = jac.T @ np.diag(2 * w.reshape(-1)) @ jac
  np.testing.assert_allclose(np.asarray(h2).reshape(x.size, x.size), expected, rtol=1e-6,
                             atol=1e-6)


@pytest.mark.parametrize("p", [
    1.5,
    # (`make test` keeps p=1.5's Hessian-vector product and check_grads_float64[lp3], second
    # order in both modes; p=3 adds the full Hessian)
    pytest.param(3, marks=pytest.mark.slow)])
def test_lp_hessian_matches_finite_differences(p, rng):
  """In float64: Hessian-vector product vs central differences of the gradient."""
  with jax.enable_x64(True):
    kw = dict(KW_CEIL, data_format="channels_last")
    x = unique_values(rng, (1, 5, 4, 2), np.float64)
    x = x + 0.5 * np.sign(x)  # no zeros: |x|^p is not twice differentiable there for p < 2
    w = rng.standard_normal(jp.lp_pool(x, p, **kw).shape)
    loss = lambda u: jnp.sum(jp.lp_pool(u, p, **kw) * w)
    grad = jax.grad(loss)
    v = rng.standard_normal(x.shape)
    hvp = jax.jvp(grad, (x,), (v,))[1]
    eps = 1e-6
    fd = (grad(x + eps * v) - grad(x - eps * v)) / (2 * eps)
    assert hvp.dtype == np.float64
    np.testing.assert_allclose(hvp, fd, rtol=1e-6, atol=1e-7)
    if p == 3:  # the full Hessian (jacfwd of jacrev) once: it is the slow part
      h = jax.hessian(loss)(x).reshape(x.size, x.size)
      np.testing.assert_allclose(h, h.T, rtol=1e-10, atol=1e-12)  # symmetric
      np.testing.assert_allclose(h @ v.reshape(-1), np.asarray(hvp).reshape(-1), rtol=1e-9,
                                 atol=1e-12)


@pytest.mark.parametrize("op", ["max", "avg_exclude_pad", "lp3"])
def test_check_grads_float64(op, rng):
  """jax.test_util.check_grads, orders 1 and 2, fwd and rev, on unique values (float64)."""
  with jax.enable_x64(True):
    f = _ops(KW_CEIL)[op]
    x = unique_values(rng, (1, 1, 5, 4), np.float64, spread=2.0)  # gaps of 0.1 >> eps
    x = x + 0.5 * np.sign(x)  # no zeros (Lp's |x|^(p-1) is not smooth there)
    check_grads(f, (x,), order=2, modes=("fwd", "rev"), eps=1e-4, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("op", ["max", "avg", "lp3"])
def test_check_grads_float32(op, rng):
  f = _ops(KW)[op]
  x = unique_values(rng, (1, 5, 6, 2), spread=8.0)
  x = x + 0.5 * np.sign(x)
  check_grads(f, (x,), order=1, modes=("fwd", "rev"), eps=1e-2, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------ dtypes


def test_float64_under_x64(rng):
  with jax.enable_x64(True):
    x = tie_rich(rng, SHAPE, np.float64, specials=True)
    y = jp.max_pool(x, **KW)
    assert y.dtype == np.float64
    assert_bitwise(y, ref.max_pool(x, **KW))
    dy = rng.standard_normal(y.shape)
    dx = jp.max_pool_grad(x, dy, **KW)
    assert dx.dtype == np.float64
    np.testing.assert_allclose(dx, ref.max_pool_grad(x, dy, **KW), rtol=1e-15, atol=1e-15)
    xu = rng.standard_normal(SHAPE)
    for count_include_pad in (True, False):
      y = jp.avg_pool(xu, **KW, count_include_pad=count_include_pad)
      assert y.dtype == np.float64
      np.testing.assert_allclose(y, ref.avg_pool(xu, **KW, count_include_pad=count_include_pad),
                                 **tol(np.float64, 9))
    y = jp.lp_pool(xu, 2.5, **KW)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, ref.lp_pool(xu, 2.5, **KW), **tol(np.float64, 9))
    dx = jp.lp_pool_grad(xu, dy, 2.5, **KW)
    np.testing.assert_allclose(dx, ref.lp_pool_grad(xu, dy, 2.5, **KW), rtol=1e-12, atol=1e-12)
    dx = jp.avg_pool_grad(dy, SHAPE, **KW)
    assert dx.dtype == np.float64
    np.testing.assert_allclose(dx, ref.avg_pool_grad(dy, SHAPE, **KW), rtol=1e-13, atol=1e-13)
  assert jnp.ones(1).dtype == np.float32  # x64 is off again for the other tests


# (`make test` keeps the 16-bit dtypes, which a float32 gradient would change; float32 gradients
# keep their dtype in every other gradient test)
@pytest.mark.parametrize("dtype", [pytest.param(np.float32, marks=pytest.mark.slow), jnp.bfloat16,
                                   np.float16])
def test_grad_dtypes(dtype, rng):
  x = tie_rich(rng, SHAPE, dtype)
  grads = {name: jax.grad(lambda v, f=f: jnp.sum(f(v).astype(np.float32)))(x)
           for name, f in _ops(KW).items() if name in ("max", "avg", "lp3")}
  # Each gradient has the input's shape and dtype (not float32), and is finite; a failure names
  # the op (the tree path).
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, {name: x for name in grads})
  chex.assert_tree_all_finite(grads)


def test_integer_inputs():
  x = np.arange(2 * 6 * 6 * 3, dtype=np.int32).reshape(2, 6, 6, 3) % 7
  y = jp.max_pool(x, **KW)
  assert y.dtype == np.int32
  assert_bitwise(y, ref.max_pool(x, **KW))
  with pytest.raises(TypeError):
    jax.grad(lambda v: jnp.sum(jp.max_pool(v, **KW)))(x)
  with pytest.raises(TypeError, match="x.*float.*int32"):
    jp.max_pool_grad(x, np.ones(y.shape, np.float32), **KW)
  # Average and Lp pooling of integers return JAX's default float, as Flax's avg_pool does.
  assert jp.avg_pool(x, **KW).dtype == jnp.float32
  np.testing.assert_allclose(jp.avg_pool(x, **KW), ref.avg_pool(x.astype(np.float64), **KW),
                             rtol=1e-6)
  assert jp.lp_pool(x, 2, **KW).dtype == jnp.float32


# ------------------------------------------------------------------------------ residuals


def _residuals(f, x):
  buf = io.StringIO()
  with redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(f, x)
  return [line for line in buf.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize("window,dtype", [((3, 3), "i8"), ((8, 15), "i8"), ((16, 16), "i16")])
def test_max_pool_keeps_only_the_argmax(window, dtype):
  """Reverse mode saves one narrow int per output element, not the input (docs/semantics.md)."""
  x = np.zeros((2, 32, 32, 4), np.float32)
  kw = dict(window_shape=window, strides=window, padding="SAME")
  out = jp.max_pool(x, **kw).shape
  res = _residuals(lambda v: jp.max_pool(v, **kw), x)
  assert len(res) == 1, res
  assert res[0].startswith(f"{dtype}[{','.join(map(str, out))}]"), res
  # the same through max_pool_with_indices' differentiable y
  res = _residuals(lambda v: jp.max_pool_with_indices(v, **kw)[0], x)
  assert all(not r.startswith("f32") for r in res), res
