"""The Pallas path: which calls it covers, and the differentiation rules around its kernels.

The dispatcher (``jaxpool._src.api``) calls :func:`supports` and then one of :func:`max_pool`,
:func:`max_pool_with_argmax` or :func:`avg_pool`.

Differentiation keeps the design of the XLA path (``xla.py``): max pooling is a ``custom_jvp``
whose primal is the fast forward kernel (no argmax) and whose JVP rule runs the forward kernel
that also writes the argmax, then maps the tangent through ``gather_at_argmax`` (linear in the
tangent). That linear map is a ``linear_call`` whose transpose is the backward kernel, so reverse
mode (``grad``, ``vjp``) runs the Pallas gather kernel, not XLA's scatter. Average pooling is
linear in its input, so it is one ``linear_call`` of the forward kernel with the backward kernel
as its transpose. ``jvp``/``jacfwd`` evaluate the linear map forward; second order works because
``linear_call`` has JVP and transpose rules; ``vmap`` works through the kernels'
``custom_vmap`` rules (a mapped axis is one more batch dim) and a batching rule for
``linear_call`` registered here when JAX has none.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import linear_call

from jaxpool._src import xla
from jaxpool._src.pallas import triton as _triton
from jaxpool._src.windows import Geometry

OPS = ("max_pool", "avg_pool")
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
MAX_TAPS = 64  # the tap loops are unrolled; larger windows stay on XLA
MAX_ELEMENTS = 2**31 - 1  # the kernels index in int32; larger arrays stay on XLA


def supports(op: str, shape, dtype, geom: Geometry, **config) -> bool:
  """Whether the Pallas kernels cover this call (else the dispatcher uses XLA).

  Covered (GPU, or interpret mode on a CPU): 1-D, 2-D and 3-D pooling in either layout,
  float32, bfloat16 and float16, at most ``MAX_TAPS`` taps, no empty dims; every padding,
  stride, dilation, ceil mode, and for average pooling every ``count_include_pad`` and
  ``divisor_override``; arrays of at most ``MAX_ELEMENTS`` elements (int32 indexing). The TPU
  kernels (:func:`backend` ``"tpu"``) cover 1-D and 2-D ``channels_last`` only, and need one
  image's channel block to fit their VMEM budget.
  """
  if op not in OPS:
    return False
  del config  # every avg config is covered
  if geom.nspatial not in (1, 2, 3):
    return False
  if np.dtype(dtype) not in _FLOAT_DTYPES:
    return False
  if geom.num_taps > MAX_TAPS or any(int(s) == 0 for s in shape):
    return False
  if math.prod(int(s) for s in shape) > MAX_ELEMENTS:
    return False
  if len(shape) < geom.nspatial + 1:
    return False
  if backend() == "tpu":
    from jaxpool._src.pallas import tpu as _tpu
    return geom.channels_last and geom.nspatial <= 2 and _tpu.fits(geom, shape, dtype)
  return True


BACKEND_ENV = "JAXPOOL_PALLAS_BACKEND"
BACKENDS = ("triton", "tpu")


def backend() -> str:
  """Which kernels run: ``"tpu"`` (Mosaic TPU) on a TPU, else ``"triton"``.

  The environment variable ``JAXPOOL_PALLAS_BACKEND`` (``"tpu"`` or ``"triton"``) overrides it;
  on a CPU, ``"tpu"`` runs the TPU kernels in the TPU interpreter (how they are tested).
  """
  name = os.environ.get(BACKEND_ENV, "").strip().lower()
  if not name:
    return "tpu" if jax.default_backend() == "tpu" else "triton"
  if name not in BACKENDS:
    raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS} or unset, got {name!r}")
  return name


def _kernels(name: str):
  """The backend module: ``tpu.py`` (Mosaic TPU) or ``triton.py`` (GPU; interpret on a CPU)."""
  if name == "tpu":
    from jaxpool._src.pallas import tpu as _tpu
    return _tpu
  return _triton


# ----------------------------------------------------------------------------- vmap


def _batched_call(fn, n_args: int):
  """``fn(*arrays)`` whose arrays are ``(*batch, ...)``: under ``vmap`` the mapped axis (moved to
  the front by ``custom_vmap``) is one more batch dim, so the kernel runs once on the whole batch
  instead of gaining a grid dim. Unmapped operands are broadcast."""
  f = custom_vmap(fn)

  @f.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip(args, in_batched)]
    out = f(*args)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  del n_args
  return f


def _input_shape(geom: Geometry, out_shape) -> tuple[int, ...]:
  """The forward input's shape, from its output's (any batch dims, either layout)."""
  shape = list(out_shape)
  for ax, n in zip(geom.spatial_axes(len(shape)), geom.in_spatial):
    shape[ax] = n
  return tuple(shape)


@functools.cache
def _fwd_fns(geom: Geometry, interpret: bool, kernels: str):
  k = _kernels(kernels)
  fwd = _batched_call(functools.partial(k.max_forward, geom=geom, interpret=interpret), 1)
  fwd_arg = _batched_call(functools.partial(k.max_forward_argmax, geom=geom,
                                            interpret=interpret), 1)
  return fwd, fwd_arg


@functools.cache
def _max_bwd_fn(geom: Geometry, interpret: bool, kernels: str):
  k = _kernels(kernels)

  def bwd(idx, dy):
    return k.max_backward(idx, dy, _input_shape(geom, idx.shape), geom, interpret=interpret)

  return _batched_call(bwd, 2)


@functools.cache
def _avg_fns(geom: Geometry, interpret: bool, kernels: str, count_include_pad: bool,
             divisor_override: int | None):
  k = _kernels(kernels)
  cfg = dict(interpret=interpret, count_include_pad=count_include_pad,
             divisor_override=divisor_override)
  fwd = _batched_call(functools.partial(k.avg_forward, geom=geom, **cfg), 1)

  def bwd(dy):
    return k.avg_backward(dy, _input_shape(geom, dy.shape), geom, **cfg)

  return fwd, _batched_call(bwd, 1)


# ----------------------------------------------------------------------------- linear_call vmap


def _linear_call_batch_rule(args, dims, *, callee, transpose_thunk, num_callee_consts, num_res,
                            **unused):
  """Batching for ``linear_call``: a ``linear_call`` of the vmapped callee and transpose.

  Residuals (and the callee's constants) keep their batch dims; linear operands are moved to (or
  broadcast along) axis 0, so the transpose's outputs, mapped at 0, line up with them.
  """
  del unused
  from jax._src import core

  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  n_cr = num_callee_consts + num_res
  cr, lin = list(args[:n_cr]), list(args[n_cr:])
  cr_dims = list(dims[:n_cr])
  lin = [jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size, *a.shape))
         for a, d in zip(lin, dims[n_cr:])]
  res_dims = cr_dims[num_callee_consts:]

  def fun(cr_, lin_):
    return jax.vmap(lambda c, x: core.eval_jaxpr(callee.jaxpr, callee.consts, *c, *x),
                    in_axes=(cr_dims, 0))(cr_, lin_)

  def fun_t(cr_, cts):
    t_jaxpr, t_consts = transpose_thunk()
    res = cr_[num_callee_consts:]
    return jax.vmap(
        lambda r, ct: core.eval_jaxpr(t_jaxpr.jaxpr, t_jaxpr.consts, *t_consts, *r, *ct),
        in_axes=(res_dims, 0))(res, cts)

  out = linear_call(fun, fun_t, cr, lin)
  return out, [0] * len(out)


def _register_linear_call_batching():
  from jax._src import custom_derivatives
  from jax._src.interpreters import batching

  p = custom_derivatives.linear_call_p
  fancy = getattr(batching, "fancy_primitive_batchers", None)
  if fancy is not None and p in fancy:  # (primitive_batchers writes into this table too)
    return  # JAX has its own rule
  batching.primitive_batchers[p] = _linear_call_batch_rule


_register_linear_call_batching()


# ----------------------------------------------------------------------------- max


def _gather_lin(idx: jax.Array, t: jax.Array, geom: Geometry, interpret: bool,
                kernels: str) -> jax.Array:
  """``t`` at each window's argmax (linear in ``t``); its transpose is the backward kernel."""
  bwd = _max_bwd_fn(geom, interpret, kernels)
  return linear_call(lambda i, x: xla.gather_at_argmax(x, i, geom),
                     lambda i, ct: bwd(i, ct), idx, t)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _max_pool(x, geom, interpret, kernels):
  return _fwd_fns(geom, interpret, kernels)[0](x)


@_max_pool.defjvp
def _max_pool_jvp(geom, interpret, kernels, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx = _max_pool_with_argmax(x, geom, interpret, kernels)
  return y, _gather_lin(idx, t, geom, interpret, kernels)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _max_pool_with_argmax(x, geom, interpret, kernels):
  return _fwd_fns(geom, interpret, kernels)[1](x)


@_max_pool_with_argmax.defjvp
def _max_pool_with_argmax_jvp(geom, interpret, kernels, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx = _max_pool_with_argmax(x, geom, interpret, kernels)
  return (y, idx), (_gather_lin(idx, t, geom, interpret, kernels),
                    np.zeros(idx.shape, jax.dtypes.float0))


_max_pool_jit = jax.jit(_max_pool, static_argnums=(1, 2, 3))
_max_pool_with_argmax_jit = jax.jit(_max_pool_with_argmax, static_argnums=(1, 2, 3))


def max_pool(x: jax.Array, geom: Geometry, *, interpret: bool = False) -> jax.Array:
  """Max pooling through the Pallas kernels (``x: (*batch, *spatial, C)``)."""
  return _max_pool_jit(x, geom, bool(interpret), backend())


def max_pool_with_argmax(x: jax.Array, geom: Geometry, *,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """``(y, tap)``: as ``xla.max_pool_argmax`` (``tap`` in ``argmax_dtype``, -1: no element)."""
  return _max_pool_with_argmax_jit(x, geom, bool(interpret), backend())


# ----------------------------------------------------------------------------- average


def _avg_pool(x, geom, interpret, kernels, count_include_pad, divisor_override):
  fwd, bwd = _avg_fns(geom, interpret, kernels, count_include_pad, divisor_override)
  return linear_call(lambda _, v: fwd(v), lambda _, ct: bwd(ct), (), x)


_avg_pool_jit = jax.jit(_avg_pool, static_argnums=(1, 2, 3, 4, 5))


def avg_pool(x: jax.Array, geom: Geometry, *, interpret: bool = False,
             count_include_pad: bool = True, divisor_override: int | None = None) -> jax.Array:
  """Average pooling through the Pallas kernels; the gradient is the backward kernel."""
  return _avg_pool_jit(x, geom, bool(interpret), backend(), bool(count_include_pad),
                       None if divisor_override is None else int(divisor_override))
