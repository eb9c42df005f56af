"""The public max-type pools: ``max_pool``, ``min_pool``, ``max_pool_with_indices``,
``max_pool_with_taps``, their gradients (``max_pool_grad``, ``max_pool_grad_from_taps``) and
``max_unpool``.

Each checks its arguments (``api_args.py``, ``checks.py``, ``windows.make_geometry``), asks the
backend registry (``dispatch.choose``) which backend serves the call, and calls that backend's
method for the op.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src import dispatch, xla
from jaxpool._src.api_args import (NO_ORDER, Activation, DataFormat, FloatGrad, FloatIn, FloatOutIn,
                                   Implementation, IndicesIn, IndicesOut, MaskIn, Padding, PoolIn,
                                   PoolOut, PooledIn, TapsIn, TapsOut, UnpooledOut, as_array,
                                   check_dy, check_input_shape, check_mask, check_plane,
                                   grad_through)
from jaxpool._src.autodiff import ACTIVATIONS
from jaxpool._src.backend import Op
from jaxpool._src.checks import check_choice, int_tuple
from jaxpool._src.dtypes import check_dtype
from jaxpool._src.windows import Geometry, check_rank, make_geometry, spatial_rank, taps_dtype

_flat_indices = jax.jit(xla.flat_indices, static_argnums=(1,))


def _max_args(x: Any, window_shape: Any, strides: Any, padding: Any, dilation: Any,
              ceil_mode: Any, data_format: Any, mask: Any
              ) -> tuple[jax.Array, jax.Array | None, Geometry]:
  """The checks every max-type pool (max, min, with indices or taps) makes: ``x`` an ordered
  array, ``mask`` a bool array broadcastable to it, and the geometry."""
  x = as_array("x", x)
  check_dtype("x", x, allow_int=True, allow_bool=True, complex_reason=NO_ORDER)
  mask = check_mask(mask, x)
  geom = make_geometry(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  return x, mask, geom


def max_pool(x: PoolIn, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
             dilation: Sequence[int] | None = None, ceil_mode: bool = False,
             data_format: DataFormat = "channels_last",
             activation: Activation = None, mask: MaskIn = None,
             implementation: Implementation = None) -> PoolOut:
  """Max pooling over the spatial dims, with the DirectML gradient.

  Args:
    x: ``(*batch, *spatial, C)`` (``channels_last``) or ``(*batch, C, *spatial)``
      (``channels_first``); float, integer or bool dtype (complex has no order: TypeError).
    window_shape: taps per spatial dim, e.g. ``(3, 3)``; its length is the number of spatial dims.
    strides: step per spatial dim; ``None`` means all ones.
    padding: ``"VALID"``, ``"SAME"`` (extra padding at the end), ``"SAME_LOWER"`` (in any case,
      as ``lax.reduce_window``), an int (both sides of every spatial dim) or ``(lo, hi)`` pairs,
      one per spatial dim. Padding never wins.
    dilation: spacing between taps per spatial dim; ``None`` means all ones.
    ceil_mode: round the output size up (PyTorch's rule: the last window starts inside the input
      or the left padding).
    data_format: ``"channels_last"`` or ``"channels_first"``.
    activation: ``None`` or ``"relu"``: ``relu(max_pool(x))`` in one pass, the same values and
      gradients as ``jax.nn.relu`` applied to the pooled output (a window whose maximum is not
      positive gets no gradient), with no separate pass over memory in either direction.
    mask: ``None`` or a bool array of ``x``'s shape (or one that broadcasts to it), True at real
      elements (variable-length sequences, ragged images): a masked element never wins and
      takes no gradient. Served by the XLA backend only.
    implementation: ``None`` (the Pallas kernels on an NVIDIA GPU where they cover the call,
      else XLA; ``JAXPOOL_IMPLEMENTATION=xla`` makes it XLA), ``"xla"`` or ``"pallas"`` (also
      on TPUs and AMD GPUs, where the kernels are not the default). A backend that cannot serve
      the call raises a ValueError saying why.

  Returns:
    ``y``: ``(*batch, *out_spatial, C)`` (or channels first), with
    ``out = (L + lo + hi - d*(k-1) - 1) // s + 1`` in floor mode. NaN beats every number; a
    window with no real (unmasked) element gives ``-inf`` (``iinfo.min`` for ints, False for
    bool).

  The gradient sends each window's cotangent to its argmax (the first in row-major window order
  on ties, the first NaN if any) and sums where windows overlap: deterministic, bit for bit.
  Integer and bool inputs have none (``jax.grad`` raises a TypeError, as for any integer input).

  Raises:
    ValueError, TypeError: for a bad argument, naming it and the value received.

  Example:
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> max_pool(x, (2, 2), strides=(2, 2))[0, ..., 0]
    Array([[ 5.,  7.],
           [13., 15.]], dtype=float32)
    >>> lengths = jnp.array([3, 2])                    # two sequences, padded to 4 steps
    >>> seq = jnp.array([[1., 5., 2., 9.], [4., 3., 9., 9.]])[..., None]   # (2, 4, 1)
    >>> mask = (jnp.arange(4) < lengths[:, None])[..., None]               # (2, 4, 1)
    >>> max_pool(seq, (2,), strides=(2,), mask=mask)[..., 0]
    Array([[  5.,   2.],
           [  4., -inf]], dtype=float32)
  """
  check_choice("activation", activation, ACTIVATIONS)
  x, mask, geom = _max_args(x, window_shape, strides, padding, dilation, ceil_mode, data_format,
                            mask)
  return dispatch.choose(Op.MAX_POOL, implementation, x, geom, mask).max_pool(
      x, geom, activation=activation, mask=mask)


def min_pool(x: PoolIn, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
             dilation: Sequence[int] | None = None, ceil_mode: bool = False,
             data_format: DataFormat = "channels_last", mask: MaskIn = None,
             implementation: Implementation = None) -> PoolOut:
  """Min pooling (``flax.linen.pooling.min_pool``), with max pooling's rules mirrored.

  Computed as max pooling of an exact order-reversing map of ``x`` (``-x`` for floats, ``~x``
  for integers, ``not x`` for bool), so every rule of :func:`max_pool` holds with "smallest" for
  "largest": the first minimum in row-major window order wins ties; NaN wins (it is smaller
  than every number) and the first NaN wins; ``-0.0`` beats ``+0.0`` (as ``lax.min``); padding
  and masked elements never win. The gradient sends each window's cotangent to its winner.

  Args:
    x: ``(*batch, *spatial, C)`` (or channels first); float, integer or bool dtype.
    window_shape, strides, padding, dilation, ceil_mode, data_format, mask, implementation: as
      :func:`max_pool` (``implementation="pallas"`` serves float32, bfloat16 and float16
      through the max-pool kernels).

  Returns:
    ``(*batch, *out_spatial, C)`` (or channels first). A window with no real (unmasked)
    element gives ``+inf`` (``iinfo.max`` for ints, True for bool; the largest finite value
    for float types without an infinity).

  Raises:
    ValueError, TypeError: for a bad argument, naming it and the value received.

  Example:
    >>> x = jnp.array([3., 1., 1., jnp.nan, 0., -0.]).reshape(1, 6, 1)
    >>> min_pool(x, (2,), strides=(2,))[0, :, 0]
    Array([ 1., nan, -0.], dtype=float32)
    >>> jax.grad(lambda v: min_pool(v, (2,), strides=(2,))[0, :2].sum())(x)[0, :, 0]
    Array([0., 1., 0., 1., 0., 0.], dtype=float32)
  """
  x, mask, geom = _max_args(x, window_shape, strides, padding, dilation, ceil_mode, data_format,
                            mask)
  return dispatch.choose(Op.MIN_POOL, implementation, x, geom, mask).min_pool(x, geom, mask=mask)


def max_pool_with_indices(x: PoolIn, window_shape: Sequence[int],
                          strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
                          dilation: Sequence[int] | None = None, ceil_mode: bool = False,
                          data_format: DataFormat = "channels_last", mask: MaskIn = None,
                          implementation: Implementation = None) -> tuple[PoolOut, IndicesOut]:
  """Max pooling that also returns where each maximum came from (PyTorch's ``return_indices``).

  Args: as :func:`max_pool`.

  Returns:
    ``(y, indices)``: ``y`` as :func:`max_pool`; ``indices`` int32 of ``y``'s shape, the flat
    row-major index of the argmax within the input's spatial plane (padding excluded), per
    (batch..., channel). A window with no real (unmasked) element gives ``-1``. ``y`` is
    differentiable.

  Example:
    >>> x = jnp.array([[1., 2., 3.], [2., 4., 2.], [5., 6., 7.]])[None, :, :, None]
    >>> y, i = max_pool_with_indices(x, (2, 2))
    >>> i[0, ..., 0]
    Array([[4, 4],
           [7, 8]], dtype=int32)
  """
  x, mask, geom = _max_args(x, window_shape, strides, padding, dilation, ceil_mode, data_format,
                            mask)
  check_plane(f"x of shape {tuple(x.shape)}", geom.in_spatial,
              "the input plane that indices address")
  backend = dispatch.choose(Op.MAX_POOL_WITH_TAPS, implementation, x, geom, mask)
  y, taps = backend.max_pool_with_taps(x, geom, activation=None, mask=mask)
  return y, _flat_indices(taps, geom)


def max_pool_with_taps(x: PoolIn, window_shape: Sequence[int],
                       strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
                       dilation: Sequence[int] | None = None, ceil_mode: bool = False,
                       data_format: DataFormat = "channels_last",
                       activation: Activation = None, mask: MaskIn = None,
                       implementation: Implementation = None) -> tuple[PoolOut, TapsOut]:
  """Max pooling that also returns each window's winning tap: the gradient's 1-byte state.

  What reverse mode through :func:`max_pool` keeps, made public: keep ``taps`` from the forward
  and :func:`max_pool_grad_from_taps` gives the gradient later (MPS's pooling gradient node
  takes the forward's gradient state), without the input.

  Args: as :func:`max_pool`.

  Returns:
    ``(y, taps)``: ``y`` as :func:`max_pool` (differentiable); ``taps`` of ``y``'s shape, the
    row-major offset of each window's winner inside the window (``0 <= taps < prod(window)``),
    in the smallest signed int dtype that holds it (int8 up to 127 taps, then int16, int32):
    one byte per output for the usual windows. ``-1`` where the window has no winner: no real
    (unmasked) element, or with ``activation="relu"`` a maximum that is not positive (such a
    window gets no gradient). Ties, NaN and signed zeros pick the winner as :func:`max_pool`'s
    gradient does; :func:`max_pool_with_indices` gives the same winners as flat input indices.

  Raises:
    ValueError, TypeError: for a bad argument, naming it and the value received.

  Example:
    >>> x = jnp.array([[1., 2., 3.], [2., 4., 2.], [5., 6., 7.]])[None, :, :, None]
    >>> y, taps = max_pool_with_taps(x, (2, 2))                      # x: (1, 3, 3, 1)
    >>> taps[0, ..., 0]                                               # offsets in the 2x2 window
    Array([[3, 2],
           [3, 3]], dtype=int8)
    >>> max_pool_with_taps(x - 4, (2, 2), activation="relu")[1][0, ..., 0]
    Array([[-1, -1],
           [ 3,  3]], dtype=int8)
  """
  check_choice("activation", activation, ACTIVATIONS)
  x, mask, geom = _max_args(x, window_shape, strides, padding, dilation, ceil_mode, data_format,
                            mask)
  backend = dispatch.choose(Op.MAX_POOL_WITH_TAPS, implementation, x, geom, mask)
  return backend.max_pool_with_taps(x, geom, activation=activation, mask=mask)


def max_pool_grad_from_taps(dy: FloatOutIn, taps: TapsIn, input_shape: Sequence[int],
                            window_shape: Sequence[int], strides: Sequence[int] | None = None,
                            padding: Padding = "VALID", *,
                            dilation: Sequence[int] | None = None, ceil_mode: bool = False,
                            data_format: DataFormat = "channels_last",
                            implementation: Implementation = None) -> FloatGrad:
  """The max-pooling gradient from the taps the forward kept (:func:`max_pool_with_taps`).

  Each window's ``dy`` is added at its winning tap, summed where windows overlap, in a fixed
  order: the transpose of the core's tap gather, which is what ``jax.grad`` of
  :func:`max_pool` runs (XLA's fused scatter-add, or the Pallas backward kernel), so the same
  bits. Linear in ``dy``: ``jax.jvp``, ``jax.vjp`` (a gather at the taps) and ``jax.vmap`` work.

  Args:
    dy: the cotangent of the forward output ``(*batch, *out_spatial, C)`` (or channels first),
      float dtype.
    taps: of ``dy``'s shape, as :func:`max_pool_with_taps` returns them (any integer dtype;
      values in ``[-1, prod(window_shape))``, ``-1`` sends nothing). An out-of-range value
      raises a ValueError when the call runs eagerly. For a window of more than 32 taps (run
      separably, docs/large-windows.md) they must be taps that :func:`max_pool_with_taps`
      returned for this geometry (or ``-1`` in their place): the gradient routes them one dim
      at a time, relying on windows that share a row's maximum to agree on it.
    input_shape: the forward input's full shape.
    window_shape, strides, padding, dilation, ceil_mode, data_format, implementation: as the
      forward's (:func:`max_pool`).

  Returns:
    ``dx`` of shape ``input_shape`` and ``dy``'s dtype. With the forward's ``taps`` (also with
    ``activation="relu"`` or a ``mask``) it equals ``jax.vjp`` of that forward, bit for bit.

  Raises:
    ValueError, TypeError: for a bad argument (a shape that does not match: naming ``dy``,
      ``taps`` and ``input_shape``).

  Example:
    >>> x = jnp.array([[1., 2., 3.], [2., 4., 2.], [5., 6., 7.]])[None, :, :, None]
    >>> y, taps = max_pool_with_taps(x, (2, 2))
    >>> dy = jnp.array([[1., 2.], [4., 5.]])[None, :, :, None]
    >>> max_pool_grad_from_taps(dy, taps, x.shape, (2, 2))[0, ..., 0]   # == max_pool_grad
    Array([[0., 0., 0.],
           [0., 3., 0.],
           [0., 4., 5.]], dtype=float32)
  """
  dy = as_array("dy", dy)
  taps = as_array("taps", taps)
  check_dtype("dy", dy, allow_int=False)
  input_shape = check_input_shape(input_shape)
  geom = make_geometry(input_shape, window_shape, strides, padding, dilation, ceil_mode,
                       data_format, name="input_shape")
  check_plane(f"input_shape={input_shape!r}", geom.in_spatial, "the gradient's plane")
  check_dy(dy, geom.output_shape(input_shape), f" for input_shape {input_shape}")
  if tuple(taps.shape) != tuple(dy.shape):
    raise ValueError(f"taps must have dy's shape {tuple(dy.shape)} (the forward output's); got "
                     f"{tuple(taps.shape)}.")
  if not jnp.issubdtype(taps.dtype, jnp.integer):
    raise TypeError(f"taps must be an integer array (as max_pool_with_taps returns); got dtype "
                    f"{taps.dtype}.")
  if not isinstance(taps, jax.core.Tracer) and taps.size:  # (NumPy: no trace of its own)
    values = np.asarray(taps)
    low, high = int(values.min()), int(values.max())
    if low < -1 or high >= geom.num_taps:
      raise ValueError(f"taps must lie in [-1, {geom.num_taps}) for window_shape "
                       f"{geom.window}; got values in [{low}, {high}].")
  taps = taps.astype(taps_dtype(geom.num_taps))
  backend = dispatch.choose(Op.MAX_POOL_GRAD_FROM_TAPS, implementation, dy, geom)
  return backend.max_pool_grad_from_taps(dy, taps, geom)


def max_pool_grad(x: FloatIn, dy: FloatOutIn,
                  window_shape: Sequence[int], strides: Sequence[int] | None = None,
                  padding: Padding = "VALID", *, dilation: Sequence[int] | None = None,
                  ceil_mode: bool = False, data_format: DataFormat = "channels_last",
                  implementation: Implementation = None) -> FloatGrad:
  """The max-pooling gradient (DirectML's ``DML_MAX_POOLING_GRAD``).

  Args:
    x: the forward input, ``(*batch, *spatial, C)`` (or channels first), float dtype.
    dy: the cotangent of the forward output, of the forward output's shape.
    window_shape, strides, padding, dilation, ceil_mode, data_format, implementation: as
      :func:`max_pool`.

  Returns:
    ``dx`` of ``x``'s shape: zero except at each window's argmax, where that window's ``dy`` is
    added (summed where windows overlap). The same bits as ``jax.vjp`` of :func:`max_pool`.

  Example:
    >>> x = jnp.array([[1., 2., 3.], [2., 4., 2.], [5., 6., 7.]])[None, :, :, None]
    >>> dy = jnp.array([[1., 2.], [4., 5.]])[None, :, :, None]
    >>> max_pool_grad(x, dy, (2, 2))[0, ..., 0]
    Array([[0., 0., 0.],
           [0., 3., 0.],
           [0., 4., 5.]], dtype=float32)
  """
  fwd = functools.partial(max_pool, window_shape=window_shape, strides=strides, padding=padding,
                          dilation=dilation, ceil_mode=ceil_mode, data_format=data_format,
                          implementation=implementation)
  return grad_through(fwd, x, dy, window_shape, strides, padding, dilation, ceil_mode,
                      data_format)


def max_unpool(y: PooledIn, indices: IndicesIn,
               output_size: Sequence[int], *,
               data_format: DataFormat = "channels_last") -> UnpooledOut:
  """The inverse of :func:`max_pool_with_indices`: each ``y`` put back where it came from.

  Args:
    y: pooled values, ``(*batch, *out_spatial, C)`` (or channels first).
    indices: int32 of ``y``'s shape, flat indices into the unpooled spatial plane, as returned
      by :func:`max_pool_with_indices`; ``-1`` (a window with no real element) is dropped. An
      index outside ``[-1, prod(output_size))`` raises a ValueError when the call runs eagerly;
      under ``jit`` (where the values are not known when the call is traced) it is dropped.
    output_size: the unpooled spatial shape (PyTorch's ``output_size``), e.g. ``(H, W)``; its
      plane, ``prod(output_size)``, holds at most ``2**31 - 1`` elements (the indices are
      int32): a larger one is a ValueError, raised before anything is allocated.
    data_format: ``"channels_last"`` or ``"channels_first"``.

  Returns:
    ``(*batch, *output_size, C)`` (or channels first): zeros except at ``indices``. Where two
    windows picked the same element, both carry its value, so the result does not depend on the
    order of the writes. The gradient with respect to ``y`` is PyTorch's: a gather at
    ``indices`` (every window that picked an element gets that element's cotangent).

  Example:
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> y, i = max_pool_with_indices(x, (2, 2), strides=(2, 2))
    >>> max_unpool(y, i, (4, 4))[0, :, :, 0]
    Array([[ 0.,  0.,  0.,  0.],
           [ 0.,  5.,  0.,  7.],
           [ 0.,  0.,  0.,  0.],
           [ 0., 13.,  0., 15.]], dtype=float32)
  """
  y = as_array("y", y)
  indices = as_array("indices", indices)
  check_choice("data_format", data_format, ("channels_last", "channels_first"))
  n = spatial_rank(output_size, "output_size")
  size = int_tuple("output_size", output_size, n)
  if n >= y.ndim:  # a full shape, as PyTorch's max_unpool takes (batch and channels in it)
    spatial = size[2:] if data_format == "channels_first" else size[1:-1]
    meant = f"; for this one, output_size={spatial!r}" if len(size) == y.ndim >= 3 else ""
    raise ValueError(
        f"output_size is the unpooled spatial shape, one entry per spatial dim (not the full "
        f"output shape with batch and channels){meant}; got output_size={output_size!r}, "
        f"{n} entries, for y of shape {tuple(y.shape)}.")
  check_plane(f"output_size={output_size!r}", size, "the unpooled plane")
  check_rank("y", y.shape, n, data_format)
  if indices.dtype != jnp.int32:
    raise TypeError(
        f"indices must be int32 (as max_pool_with_indices returns); got {indices.dtype}.")
  if tuple(indices.shape) != tuple(y.shape):
    raise ValueError(
        f"indices must have y's shape {tuple(y.shape)}; got {tuple(indices.shape)}.")
  if not isinstance(indices, jax.core.Tracer):
    _check_unpool_indices(indices, size)
  return _max_unpool(y, indices, size, data_format == "channels_last")


def _check_unpool_indices(indices: jax.Array, size: tuple[int, ...]) -> None:
  """Eager calls: every index must address the unpooled plane (or be -1, no element)."""
  plane = math.prod(size)
  bad = (indices >= plane) | (indices < -1)
  if indices.size and bool(jnp.any(bad)):
    value = int(indices.ravel()[jnp.argmax(bad.ravel())])
    raise ValueError(
        f"indices must lie in [-1, {plane}) for output_size {size} ({plane} elements per "
        f"plane); got {value}. Was output_size the pooled input's spatial shape?")


def _unpool_scatter(y, indices, size, channels_last, *, add):
  n = len(size)
  if channels_last:  # move channels in front of the spatial dims
    y = jnp.moveaxis(y, -1, -1 - n)
    indices = jnp.moveaxis(indices, -1, -1 - n)
  lead = y.shape[:-n]
  plane = math.prod(size)
  # Only the spatial dims are flattened; the leading (batch, channel) dims stay separate, as
  # vmapped scatter dims, so a sharding of them carries through (no reshape merges them).
  flat_y = y.reshape(*lead, math.prod(y.shape[-n:]))
  flat_i = indices.reshape(flat_y.shape)
  flat_i = jnp.where(flat_i < 0, plane, flat_i)  # negative: no element; dropped below
  if add:
    scatter = lambda v, i: jnp.zeros((plane,), v.dtype).at[i].add(v, mode="drop")
  else:
    scatter = lambda v, i: jnp.zeros((plane,), v.dtype).at[i].set(v, mode="drop")
  for _ in lead:
    scatter = jax.vmap(scatter)
  out = scatter(flat_y, flat_i).reshape(*lead, *size)
  if channels_last:
    out = jnp.moveaxis(out, -1 - n, -1)
  return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _max_unpool_core(y, indices, size, channels_last):
  return _unpool_scatter(y, indices, size, channels_last, add=False)


@_max_unpool_core.defjvp
def _max_unpool_jvp(size, channels_last, primals, tangents):
  # PyTorch's convention: the gradient of unpooling is a gather at the indices, so every window
  # that picked an element gets that element's cotangent. The tangent map whose transpose is
  # that gather is a scatter-add (for indices from max_pool_with_indices, duplicates carry one
  # value, so the primal's set and an add of the primal would agree).
  (y, indices), (t, _) = primals, tangents
  out = _unpool_scatter(y, indices, size, channels_last, add=False)
  return out, _unpool_scatter(t, indices, size, channels_last, add=True)


_max_unpool = jax.jit(_max_unpool_core, static_argnums=(2, 3))
