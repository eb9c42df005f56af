"""The Pallas kernels in the shared rules: which calls they serve, and the ops built on them.

:func:`unsupported` says why the kernels cannot serve a call (or None when they can); the
Pallas backends of the registry (``pallas/backend.py``: Pallas Triton and Pallas TPU) ask it
in their ``supports``, then call :func:`max_pool`, :func:`max_pool_with_taps`,
:func:`max_pool_grad_from_taps`, :func:`min_pool` or :func:`avg_pool` with their ``kernels``
(``"triton"``: ``triton/ops.py``; ``"tpu"``: ``tpu/ops.py``).

Max pooling is the shared rule of ``jaxpool._src.autodiff`` with the kernels plugged in: the
forward kernel (no taps) as the primal, the forward kernel that also writes the winning taps in
the JVP, and a gather primitive whose transpose is the backward kernel, so reverse mode runs the
Pallas gather kernel, not XLA's scatter. Average pooling is linear in its input: one primitive
pair, the forward kernel and the backward kernel, each the other's transpose. ``vmap`` works
through the kernels' ``custom_vmap`` rules and the primitives' batching rules (a mapped axis is
one more batch dim).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from jaxpool._src import autodiff, xla, xla_taps
from jaxpool._src.backend import Op
from jaxpool._src.linear import LinearPair
from jaxpool._src.pallas.sharding import partition
from jaxpool._src.pallas.triton import ops as _triton
from jaxpool._src.platforms import PALLAS_ENV as BACKEND_ENV
from jaxpool._src.platforms import PALLAS_KERNELS as BACKENDS
from jaxpool._src.platforms import pallas_kernels as backend
from jaxpool._src.windows import Geometry, real_taps

# (``backend()``: the kernels ``implementation="pallas"`` means on this platform, which
# ``JAXPOOL_PALLAS_BACKEND`` overrides; ``platforms.pallas_kernels``.)
__all__ = ["BACKENDS", "BACKEND_ENV", "backend"]

OPS = frozenset({Op.MAX_POOL, Op.MAX_POOL_WITH_TAPS, Op.MAX_POOL_GRAD_FROM_TAPS, Op.MIN_POOL,
                 Op.AVG_POOL})
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
# The kernels unroll their tap loops, and Triton's compile time grows faster than the taps: on an
# H100 the forward kernels took 1.0, 2.6, 13.5 and 30.8 s to compile for 16, 25, 49 and 64 taps
# (the forward with taps 1.3, 3.5, 20.8, 40.4 s; benchmarks/compile_gpu.py,
# docs/design/window-limits.md). Larger
# windows run a dim at a time (max and min pooling: ``stages``) or on the XLA path, whose loop
# over the taps compiles in bounded time. It is the XLA path's separable bound: a larger
# window's gradient sums in the separable form's order.
MAX_TAPS = xla.SEPARABLE_TAPS
MAX_ELEMENTS = 2**31 - 1  # the kernels index in int32; larger arrays stay on XLA


def unsupported(op: Op | str, shape, dtype, geom: Geometry,
                kernels: str | None = None) -> str | None:
  """Why the kernels cannot serve this call, or None when they can.

  Served (GPU, or interpret mode on a CPU): max pooling (with or without taps and the fused
  activation), min pooling (the max-pool kernels, mirrored) and average pooling, 1-D, 2-D and
  3-D, either layout, float32, bfloat16 and float16, at most ``MAX_TAPS`` taps (more for
  ``max_pool`` and ``min_pool``, one dim at a time: :func:`stages`), no empty dims,
  every padding, stride, dilation, ceil mode, ``count_include_pad`` and ``divisor_override``,
  arrays of at most ``MAX_ELEMENTS`` elements (int32 indexing). The TPU kernels
  (``kernels="tpu"``; None: :func:`backend`) serve 1-D and 2-D ``channels_last`` only, and need
  one image's channel block to fit their VMEM budget.
  """
  op = Op(op)
  if op not in OPS:
    return f"there is no Pallas kernel for {op.value}"
  if op is Op.MAX_POOL_GRAD_FROM_TAPS:  # called with dy: the kernel writes the input's shape
    shape = geom.input_shape(shape)
  if geom.nspatial not in (1, 2, 3):
    return f"the kernels pool 1 to 3 spatial dims, not {geom.nspatial}"
  if np.dtype(dtype) not in _FLOAT_DTYPES:
    return f"the kernels take float32, bfloat16 and float16, not {np.dtype(dtype)}"
  if geom.num_taps > MAX_TAPS and not (op in (Op.MAX_POOL, Op.MIN_POOL)
                                       and (kernels or backend()) == "triton"
                                       and stages(geom) is not None):
    return (f"the window has {geom.num_taps} taps; the kernels take at most {MAX_TAPS} (more "
            f"only for max_pool and min_pool on GPUs, one dim at a time, where each dim has at "
            f"most {MAX_TAPS} taps and every window holds an element along every dim)")
  if any(int(s) == 0 for s in shape):
    return f"the input shape {tuple(shape)} has an empty dim"
  if math.prod(int(s) for s in shape) > MAX_ELEMENTS:
    return f"the input has over {MAX_ELEMENTS} elements (the kernels index in int32)"
  if (kernels or backend()) == "tpu":
    from jaxpool._src.pallas.tpu import ops as _tpu
    if not geom.channels_last or geom.nspatial > 2:
      return "the TPU kernels pool 1-D and 2-D channels_last inputs only"
    if not _tpu.fits(geom, shape, dtype):
      return "one image's channel block does not fit the TPU kernels' VMEM budget"
  return None


def stages(geom: Geometry) -> tuple[Geometry, ...] | None:
  """A window of more than ``MAX_TAPS`` taps as 1-D pools, the last spatial dim first (W, then
  H, then D), each a kernel call of at most ``MAX_TAPS`` taps; None where the window has at
  most ``MAX_TAPS`` taps, a dim of more, or a window whose part along some dim holds no element
  (padding or the ceil-mode overhang only: a stage would give it a value that the next stage
  could pick).

  This is the separable form of the XLA path (``xla_separable.py``), stage for stage: each
  stage keeps the first of equal maxima, so the values and the winners are the direct form's;
  each stage's gradient is its kernel's (one dim's cotangents in descending tap order), and
  reverse mode runs the stages backwards, the first spatial dim first: the separable form's
  summation order, so the same bits as the XLA path. Each stage is a max pool of its own with
  the shared rule (``autodiff.max_pool``); JAX composes their derivatives and batching."""
  n = geom.nspatial
  if geom.num_taps <= MAX_TAPS or max(geom.window) > MAX_TAPS:
    return None
  for i in range(n):
    first, last = real_taps(geom, i, np.arange(geom.out_spatial[i]))
    if np.any(first > last):
      return None
  out = []
  spatial = list(geom.in_spatial)
  for i in reversed(range(n)):
    if (geom.window[i], geom.strides[i], geom.padding[i], geom.extra[i]) == (1, 1, (0, 0), 0):
      continue  # (nothing to do along this dim)
    one = lambda v, unit, i=i: tuple(v[j] if j == i else unit for j in range(n))  # noqa: E731
    after = list(spatial)
    after[i] = geom.out_spatial[i]
    out.append(Geometry(in_spatial=tuple(spatial), window=one(geom.window, 1),
                        strides=one(geom.strides, 1), dilation=one(geom.dilation, 1),
                        padding=one(geom.padding, (0, 0)), extra=one(geom.extra, 0),
                        out_spatial=tuple(after), channels_last=geom.channels_last))
    spatial = after
  return tuple(out)


def _kernels(name: str):
  """The backend module: ``tpu/ops.py`` (Mosaic TPU) or ``triton/ops.py`` (GPU; interpret on a
  CPU)."""
  if name == "tpu":
    from jaxpool._src.pallas.tpu import ops as _tpu
    return _tpu
  return _triton


def _batched(fn):
  """``fn(x)`` for ``x: (*batch, ...)``: under ``vmap`` the mapped axis (moved to the front by
  ``custom_vmap``) is one more batch dim, so the kernel runs once on the whole batch instead of
  gaining a grid dim."""
  f = custom_vmap(fn)

  @f.def_vmap
  def _rule(axis_size, in_batched, x):
    del axis_size, in_batched
    out = f(x)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  return f


# ----------------------------------------------------------------------------- max


def _gather(taps, t, *, geom, interpret, kernels, activation):
  del interpret, kernels  # forward mode evaluates the gather with XLA ops
  return xla.gather_at_taps(t, taps, geom, activation)


def _scatter(taps, ct, *, geom, interpret, kernels, activation):
  del activation  # a tap of -1 (no winner, or a non-positive maximum) sends nothing
  kc = partition.kernel_call(_max_backward, _max_backward_xla, geom, backward=True,
                             neutral_pads=True, pads_alike=True, sums_as_is=True,
                             kernels=kernels, interpret=interpret)
  return partition.call(kc, taps, ct)


# ``gather(taps, t)`` is t at each window's winner; its transpose is the backward kernel.
GATHER = LinearPair("max_pool_gather", _gather, _scatter,
                    forward_shape=lambda taps, t, **p: taps,
                    transpose_shape=lambda taps, ct, **p: p["geom"].input_shape(taps))
partition.needs_devices(GATHER.transpose_p)


# The kernels as partitioned calls (``partition.call``): ``fn(*operands, geom, **options)``.


def _max_forward(x, geom, *, kernels, interpret, activation):
  return _kernels(kernels).max_forward(x, geom, interpret=interpret, activation=activation)


def _max_forward_taps(x, geom, *, kernels, interpret, activation):
  return _kernels(kernels).max_forward_taps(x, geom, interpret=interpret, activation=activation)


def _max_backward(taps, dy, geom, *, kernels, interpret):
  return _kernels(kernels).max_backward(taps, dy, geom.input_shape(dy.shape), geom,
                                        interpret=interpret)


def _avg_forward_kernel(x, geom, *, kernels, interpret, count_include_pad, divisor_override):
  return _kernels(kernels).avg_forward(x, geom, interpret=interpret,
                                       count_include_pad=count_include_pad,
                                       divisor_override=divisor_override)


def _avg_backward_kernel(dy, geom, *, kernels, interpret, count_include_pad, divisor_override):
  return _kernels(kernels).avg_backward(dy, geom.input_shape(dy.shape), geom,
                                        interpret=interpret, count_include_pad=count_include_pad,
                                        divisor_override=divisor_override)


# The same computations in XLA ops (what ``jax.export`` serialises; ``partition.KernelCall``).


def _max_forward_xla(x, geom, *, kernels, interpret, activation):
  del kernels, interpret
  return autodiff.apply_activation(xla.max_pool_values(x, geom), None, activation)[0]


def _max_forward_taps_xla(x, geom, *, kernels, interpret, activation):
  del kernels, interpret
  return autodiff.apply_activation(*xla.max_pool_taps(x, geom), activation)


def _max_backward_xla(taps, dy, geom, *, kernels, interpret):
  del kernels, interpret
  return xla.scatter_to_taps(taps, dy, geom)


def _avg_forward_xla(x, geom, *, kernels, interpret, count_include_pad, divisor_override):
  del kernels, interpret
  return xla.avg_pool(x, geom, count_include_pad, divisor_override)


def _avg_backward_xla(dy, geom, *, kernels, interpret, count_include_pad, divisor_override):
  del kernels, interpret
  zeros = jax.lax.full_like(dy, 0, shape=geom.input_shape(dy.shape))
  _, vjp = jax.vjp(lambda v: xla.avg_pool(v, geom, count_include_pad, divisor_override), zeros)
  return vjp(dy)[0]


@functools.cache
def _forward_fns(geom: Geometry, activation: str | None, interpret: bool, kernels: str):
  plain = partition.kernel_call(_max_forward, _max_forward_xla, geom, kernels=kernels,
                                interpret=interpret, activation=activation)
  with_taps = partition.kernel_call(_max_forward_taps, _max_forward_taps_xla, geom, n_out=2,
                                    kernels=kernels, interpret=interpret, activation=activation)
  return (_batched(functools.partial(partition.call, plain)),
          _batched(functools.partial(partition.call, with_taps)))


@functools.cache
def max_pool_ops(interpret: bool, kernels: str) -> autodiff.MaxPoolOps:
  """The kernels as the shared max-pool rule's three functions (one object per setting)."""

  def forward(x, geom, activation):
    return _forward_fns(geom, activation, interpret, kernels)[0](x)

  def forward_with_taps(x, geom, activation):
    return _forward_fns(geom, activation, interpret, kernels)[1](x)

  def gather(t, taps, geom, activation):
    return GATHER.forward(taps, t, geom=geom, interpret=interpret, kernels=kernels,
                          activation=activation)

  return autodiff.MaxPoolOps(forward, forward_with_taps, gather)


_max_pool_jit = jax.jit(autodiff.max_pool, static_argnums=(1, 2, 3))
_max_pool_with_taps_jit = jax.jit(autodiff.max_pool_with_taps, static_argnums=(1, 2, 3))
_grad_from_taps_jit = jax.jit(autodiff.grad_from_taps, static_argnums=(2, 3))


# Each takes ``kernels`` (``"triton"`` or ``"tpu"``; None: :func:`backend`, this platform's).


def max_pool(x: jax.Array, geom: Geometry, *, interpret: bool = False,
             activation: str | None = None, kernels: str | None = None) -> jax.Array:
  """Max pooling (then ``activation``) through the Pallas kernels; a window of more than
  ``MAX_TAPS`` taps one dim at a time (:func:`stages`)."""
  ops = max_pool_ops(bool(interpret), kernels or backend())
  return _staged(x, geom, activation, ops, xla.MAX_POOL_OPS)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _staged(x: jax.Array, geom: Geometry, activation: str | None, ops: autodiff.MaxPoolOps,
            xla_ops: autodiff.MaxPoolOps) -> jax.Array:
  """``ops``' max pool (the kernels), a window of more than ``MAX_TAPS`` taps a dim at a time;
  ``xla_ops``: the XLA path's same pool (max or min), whose forward serves values alone of
  windows that overlap little (:func:`_whole_values`)."""
  parts = stages(geom)
  if parts is None:
    return _max_pool_jit(x, geom, activation, ops)
  if xla_taps.reads_windows_whole(geom):
    return _whole_values(x, geom, parts, activation, ops, xla_ops)
  return _stage_by_stage(x, parts, activation, ops)


def _stage_by_stage(x, parts, activation, ops):
  for i, part in enumerate(parts):  # (the activation after the last stage)
    x = _max_pool_jit(x, part, activation if i == len(parts) - 1 else None, ops)
  return x


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4, 5))
def _whole_values(x, geom, parts, activation, ops, xla_ops):
  """Windows that overlap fewer than 3 times a dim (``xla_taps.reads_windows_whole``): the
  values alone (no derivative asked) as the XLA path computes them, one ``reduce_window`` over
  whole windows, which read each element fewer than ``3^d`` times and beat the stages' passes
  in most such cells of the sweep on an H200 (docs/large-windows.md); the same values.
  Derivatives (and the values beside them) come from the stages."""
  return xla_ops.forward(x, geom, activation)


@_whole_values.defjvp
def _whole_values_jvp(geom, parts, activation, ops, xla_ops, primals, tangents):
  return jax.jvp(lambda v: _stage_by_stage(v, parts, activation, ops), primals, tangents)


def min_pool(x: jax.Array, geom: Geometry, *, interpret: bool = False,
             kernels: str | None = None) -> jax.Array:
  """Min pooling through the max-pool kernels, mirrored (``autodiff.mirrored``); a window of
  more than ``MAX_TAPS`` taps one dim at a time (:func:`stages`)."""
  return _staged(x, geom, None,
                 autodiff.mirrored(max_pool_ops(bool(interpret), kernels or backend())),
                 autodiff.mirrored(xla.MAX_POOL_OPS))


def max_pool_with_taps(x: jax.Array, geom: Geometry, *, interpret: bool = False,
                       activation: str | None = None,
                       kernels: str | None = None) -> tuple[jax.Array, jax.Array]:
  """``(y, taps)``: as ``xla.max_pool_taps`` (``taps_dtype``, -1: no element), then
  ``activation``."""
  return _max_pool_with_taps_jit(x, geom, activation,
                                 max_pool_ops(bool(interpret), kernels or backend()))


def max_pool_grad_from_taps(dy: jax.Array, geom: Geometry, *, taps: jax.Array,
                            interpret: bool = False, kernels: str | None = None) -> jax.Array:
  """``dx`` from kept taps: the transpose of the gather primitive, i.e. the backward kernel."""
  return _grad_from_taps_jit(dy, taps, geom, max_pool_ops(bool(interpret), kernels or backend()))


# ----------------------------------------------------------------------------- average


def _avg_forward(x, *, geom, interpret, kernels, count_include_pad, divisor_override):
  return partition.call(partition.kernel_call(
      _avg_forward_kernel, _avg_forward_xla, geom, kernels=kernels, interpret=interpret,
      count_include_pad=count_include_pad, divisor_override=divisor_override), x)


def _avg_backward(ct, *, geom, interpret, kernels, count_include_pad, divisor_override):
  # Where every row a window can reach past a device's block counts like a data row (a fixed
  # divisor; or count_include_pad with no ceil-mode overhang, which is never counted: a window
  # of a device's block can reach past the next devices' rows into it), the neighbour rows
  # can stand as padding and each device's gradient block is computed in place (neutral_pads;
  # every backward kernel divides each cotangent by its window's count on both code paths, so
  # a window gives the same bits whichever path computes it). Windows past the input's end
  # with a zero cotangent then add exact zeros, as the kernels' edge path adds for windows
  # that do not exist, so every device can run one kernel call (pads_alike).
  neutral = divisor_override is not None or (count_include_pad and not any(geom.extra))
  return partition.call(partition.kernel_call(
      _avg_backward_kernel, _avg_backward_xla, geom, backward=True, kernels=kernels,
      neutral_pads=neutral, pads_alike=neutral, interpret=interpret,
      count_include_pad=count_include_pad, divisor_override=divisor_override), ct)


# Average pooling is linear in x: the forward kernel, with the backward kernel as its transpose.
AVG = LinearPair("avg_pool", _avg_forward, _avg_backward,
                 forward_shape=lambda x, **p: p["geom"].output_shape(x),
                 transpose_shape=lambda ct, **p: p["geom"].input_shape(ct))
partition.needs_devices(AVG.forward_p)
partition.needs_devices(AVG.transpose_p)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _avg_pool_jit(x, geom, interpret, kernels, count_include_pad, divisor_override):
  return AVG.forward(x, geom=geom, interpret=interpret, kernels=kernels,
                     count_include_pad=count_include_pad, divisor_override=divisor_override)


def avg_pool(x: jax.Array, geom: Geometry, *, interpret: bool = False,
             count_include_pad: bool = True, divisor_override: int | None = None,
             kernels: str | None = None) -> jax.Array:
  """Average pooling through the Pallas kernels; the gradient is the backward kernel."""
  return _avg_pool_jit(x, geom, bool(interpret), kernels or backend(), bool(count_include_pad),
                       None if divisor_override is None else int(divisor_override))
