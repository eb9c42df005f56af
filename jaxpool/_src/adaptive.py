"""Adaptive and global pooling: PyTorch's bins, jaxpool's max rule, deterministic gradients.

The public functions. Each checks its arguments and makes a plan (``adaptive_plan.py``:
PyTorch's bins), then routes it (:func:`_route`):

* ``O == 1`` on every dim is global pooling: one reduction.
* ``L % O == 0`` on every dim, with at most ``FIXED_WINDOW_MAX_TAPS`` elements per bin, or
  where the backend registry would run the fixed window on a Pallas backend by default (an
  NVIDIA GPU, up to the kernels' tap limit), is fixed-window pooling with window = stride =
  ``L // O``: :func:`jaxpool.max_pool` and :func:`jaxpool.avg_pool` serve it.
* Otherwise the reshape-and-reduce stages (``adaptive_xla.py``).

Global pooling and the stages are ops of the registry (``Op.GLOBAL_POOL``,
``Op.ADAPTIVE_POOL``) that the XLA backend serves; ``implementation="pallas"`` is refused
there by the registry, with the Pallas backend's reason, as every op refuses a backend that
cannot serve it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp  # noqa: F401 (the docstrings' examples use jnp)

from jaxpool._src import api_avg, api_max, dispatch
from jaxpool._src.adaptive_plan import Plan, check_nonempty, make_plan
from jaxpool._src.api_args import (DataFormat, FloatIn, FloatOut, Implementation, IndicesOut,
                                   PoolIn, PoolOut, as_array, check_plane)
from jaxpool._src.backend import Backend, Op
from jaxpool._src.checks import check_bool, check_choice
from jaxpool._src.dtypes import check_dtype
from jaxpool._src.windows import DATA_FORMATS, make_geometry
from jaxpool._src.xla_taps import SEPARABLE_TAPS
from jaxpool._src.windows import spatial_axes as _spatial_axes

# Evenly dividing sizes whose bins hold at most this many elements go to the fixed-window ops
# (tap loops, Pallas kernels); larger bins to the reshape-and-reduce stages, whose program does
# not grow with the bin. (On a CPU, 8x8 bins through max_pool's tap loop took 150 times as long
# forward and backward as through the stages; benchmarks/global_adaptive.py times both.)
FIXED_WINDOW_MAX_TAPS = 16


# ----------------------------------------------------------------------------- routing


def _fixed_window(plan: Plan) -> tuple[int, ...]:
  return tuple(L // o for L, o in zip(plan.in_spatial, plan.out_spatial, strict=True))


def _route(plan: Plan, x: jax.Array, op: Op) -> str:
  """``"global"``, ``"fixed"`` (the fixed-window ``op``: max pool, with taps, average) or
  ``"stages"``."""
  if all(o == 1 for o in plan.out_spatial):
    return "global"
  if all(L % o == 0 for L, o in zip(plan.in_spatial, plan.out_spatial, strict=True)):
    w = _fixed_window(plan)
    if math.prod(w) <= FIXED_WINDOW_MAX_TAPS:
      return "fixed"
    # Where the registry runs the fixed window on the Pallas kernels by default in one call
    # (an NVIDIA GPU, up to the kernels' tap limit), they beat the stages (8x8 bins on an H100:
    # 0.175 against 0.281 ms fwd+bwd, an earlier measurement). Bins of more taps,
    # which the kernels serve a dim at a time (a pass over the data a dim), keep the stages
    # (the same bits: bins do not overlap); they are not measured against each other.
    data_format = "channels_last" if plan.channels_last else "channels_first"
    geom = make_geometry(x.shape, w, w, data_format=data_format)
    if (math.prod(w) <= SEPARABLE_TAPS
        and dispatch.choose(op, None, x, geom) is not dispatch.XLA):
      return "fixed"
  return "stages"


def _backend(route: str, implementation: Any, x: jax.Array, caller: str) -> Backend:
  """The backend of a route other than "fixed": the registry's choice for global pooling or
  the stages (XLA; ``implementation="pallas"`` is refused with the Pallas backend's reason)."""
  op = Op.GLOBAL_POOL if route == "global" else Op.ADAPTIVE_POOL
  return dispatch.choose(op, implementation, x, None, caller=caller)


def _keepdims(y: jax.Array, n: int, channels_last: bool) -> jax.Array:
  """Puts back ``n`` spatial dims of size 1 where the reduction removed them."""
  at = y.ndim - 1 if channels_last else y.ndim
  return y.reshape(y.shape[:at] + (1,) * n + y.shape[at:])


# ----------------------------------------------------------------------------- public API


def adaptive_max_pool(x: PoolIn, output_size: Sequence[int | None], *,
                      data_format: DataFormat = "channels_last",
                      implementation: Implementation = None) -> PoolOut:
  """Adaptive max pooling: the max over PyTorch's bins, with the DirectML gradient.

  Spatial dim ``d`` of size ``L`` is split into ``O = output_size[d]`` bins, bin ``i`` spanning
  ``[floor(i*L/O), ceil((i+1)*L/O))``; neighbouring bins may share an element, and ``O > L`` is
  allowed (bins then repeat elements), as in PyTorch's ``AdaptiveMaxPool``.

  Args:
    x: ``(*batch, *spatial, C)`` (``channels_last``) or ``(*batch, C, *spatial)``
      (``channels_first``); float or integer dtype; spatial dims non-empty.
    output_size: one entry per spatial dim (its length is the number of spatial dims): an int
      ``>= 1``, or ``None`` to keep that dim's input size. Each entry and the output plane
      ``prod(output_size)`` are at most ``2**31 - 1`` (a ValueError before anything is built).
    data_format: ``"channels_last"`` or ``"channels_first"``.
    implementation: as :func:`jaxpool.max_pool`, for evenly dividing sizes (``L % O == 0`` on
      every dim), which run as fixed-window pooling; other sizes always run on XLA.

  Returns:
    ``y``: ``(*batch, *output_size, C)`` (or channels first), ``x``'s dtype. Ties go to the
    first element of the bin in row-major order; NaN beats every number (the first NaN wins).

  The gradient sends each output's cotangent to its argmax only and sums where bins share an
  element (:func:`jaxpool.max_pool`'s rule); the same bits on every run. ``jax.jvp``,
  ``jax.vmap`` and second order work.

  Raises:
    ValueError, TypeError: for a bad argument, naming it and the value received.

  Example:
    >>> x = jnp.array([1., 5., 2., 2., 7.]).reshape(1, 5, 1)   # (N, L, C)
    >>> adaptive_max_pool(x, (3,))[0, :, 0]                    # bins [0,2) [1,4) [3,5)
    Array([5., 5., 7.], dtype=float32)
  """
  x = as_array("x", x)
  check_dtype("x", x, allow_int=True)
  plan = make_plan(x, output_size, data_format)
  route = _route(plan, x, Op.MAX_POOL)
  if route == "fixed":
    w = _fixed_window(plan)
    return api_max.max_pool(x, w, w, data_format=data_format, implementation=implementation)
  backend = _backend(route, implementation, x, "adaptive_max_pool")
  if route == "global":
    y = backend.global_max_pool(x, plan.nspatial, plan.channels_last)
    return _keepdims(y, plan.nspatial, plan.channels_last)
  return backend.adaptive_max_pool(x, plan)


def adaptive_max_pool_with_indices(
    x: PoolIn, output_size: Sequence[int | None], *,
    data_format: DataFormat = "channels_last",
    implementation: Implementation = None) -> tuple[PoolOut, IndicesOut]:
  """Adaptive max pooling that also returns where each maximum came from.

  Args: as :func:`adaptive_max_pool`.

  Returns:
    ``(y, indices)``: ``y`` as :func:`adaptive_max_pool` (differentiable); ``indices`` int32 of
    ``y``'s shape, the flat row-major index of the argmax within the input's spatial plane, per
    (batch..., channel), as PyTorch's ``return_indices`` and :func:`jaxpool.max_pool_with_indices`
    (so :func:`jaxpool.max_unpool` takes them).

  Example:
    >>> x = jnp.array([[9., 2., 3.], [4., 5., 9.], [7., 8., 1.]])[None, :, :, None]
    >>> y, i = adaptive_max_pool_with_indices(x, (2, 2))        # bins [0,2) [1,3) per dim
    >>> i[0, ..., 0]                                            # the 9 at (1, 2) wins twice
    Array([[0, 5],
           [7, 5]], dtype=int32)
  """
  x = as_array("x", x)
  check_dtype("x", x, allow_int=True)
  plan = make_plan(x, output_size, data_format)
  check_plane(f"x of shape {tuple(x.shape)}", plan.in_spatial,
                  "the input plane that indices address")
  route = _route(plan, x, Op.MAX_POOL_WITH_TAPS)
  if route == "fixed":
    w = _fixed_window(plan)
    return api_max.max_pool_with_indices(x, w, w, data_format=data_format,
                                         implementation=implementation)
  backend = _backend(route, implementation, x, "adaptive_max_pool_with_indices")
  if route == "global":
    y, idx = backend.global_max_pool_with_indices(x, plan.nspatial, plan.channels_last)
    return (_keepdims(y, plan.nspatial, plan.channels_last),
            _keepdims(idx, plan.nspatial, plan.channels_last))
  return backend.adaptive_max_pool_with_indices(x, plan)


def adaptive_avg_pool(x: FloatIn, output_size: Sequence[int | None], *,
                      data_format: DataFormat = "channels_last",
                      implementation: Implementation = None) -> FloatOut:
  """Adaptive average pooling: the mean over PyTorch's bins.

  Bins as :func:`adaptive_max_pool`; each output is the mean of its bin's elements (all real:
  there is no padding).

  Args:
    x: ``(*batch, *spatial, C)`` (or channels first), float dtype; bfloat16 and float16
      accumulate in float32.
    output_size, data_format, implementation: as :func:`adaptive_max_pool`.

  Returns:
    ``(*batch, *output_size, C)`` (or channels first), ``x``'s dtype. The gradient spreads
    each output's cotangent evenly over its bin, summed where bins share an element; the same
    bits on every run.

  Example:
    >>> x = jnp.arange(1., 6.).reshape(1, 5, 1)                 # [1, 2, 3, 4, 5]
    >>> adaptive_avg_pool(x, (3,))[0, :, 0]                     # [1 2] [2 3 4] [4 5]
    Array([1.5, 3. , 4.5], dtype=float32)
  """
  x = as_array("x", x)
  check_dtype("x", x, allow_int=False)
  plan = make_plan(x, output_size, data_format)
  route = _route(plan, x, Op.AVG_POOL)
  if route == "fixed":
    w = _fixed_window(plan)
    return api_avg.avg_pool(x, w, w, data_format=data_format, implementation=implementation)
  backend = _backend(route, implementation, x, "adaptive_avg_pool")
  if route == "global":
    y = backend.global_avg_pool(x, plan.nspatial, plan.channels_last)
    return _keepdims(y, plan.nspatial, plan.channels_last)
  return backend.adaptive_avg_pool(x, plan)


def _global_args(x: Any, data_format: Any, keepdims: Any, *,
                 allow_int: bool) -> tuple[jax.Array, int, bool]:
  x = as_array("x", x)
  check_dtype("x", x, allow_int=allow_int)
  check_choice("data_format", data_format, DATA_FORMATS)
  check_bool("keepdims", keepdims)
  if x.ndim < 3:
    layout = "(N, *spatial, C)" if data_format == "channels_last" else "(N, C, *spatial)"
    raise ValueError(
        f"x must have at least 3 dims, {layout} with one batch dim and at least one spatial "
        f"dim; got shape {tuple(x.shape)}.")
  n = x.ndim - 2
  channels_last = data_format == "channels_last"
  check_nonempty(x, _spatial_axes(x.ndim, n, channels_last))
  return x, n, channels_last


def global_max_pool(x: PoolIn, *, data_format: DataFormat = "channels_last",
                    keepdims: bool = False) -> PoolOut:
  """Global max pooling: the max over every spatial dim, with the DirectML gradient.

  Args:
    x: ``(N, *spatial, C)`` (``channels_last``) or ``(N, C, *spatial)`` (``channels_first``):
      exactly one batch dim and at least one spatial dim (every dim but the batch and channel
      dims is pooled). Float or integer dtype. For an input without a batch dim use ``x[None]``;
      for several, ``jax.vmap`` or a reshape.
    data_format: ``"channels_last"`` or ``"channels_first"``.
    keepdims: keep the pooled dims with size 1: ``(N, 1, ..., 1, C)`` (or channels first).

  Returns:
    ``(N, C)``, or with ``keepdims`` the shape above; ``x``'s dtype. NaN beats every number.

  The gradient sends each output's cotangent to its first argmax in row-major order (the first
  NaN if any), not split among ties as ``jax.grad`` of ``jnp.max`` does.

  Example:
    >>> x = jnp.array([[3., 1.], [3., 2.]])[None, :, :, None]   # (1, 2, 2, 1)
    >>> global_max_pool(x)
    Array([[3.]], dtype=float32)
    >>> jax.grad(lambda v: global_max_pool(v).sum())(x)[0, ..., 0]
    Array([[1., 0.],
           [0., 0.]], dtype=float32)
  """
  a, n, channels_last = _global_args(x, data_format, keepdims, allow_int=True)
  y = _backend("global", None, a, "global_max_pool").global_max_pool(a, n, channels_last)
  return _keepdims(y, n, channels_last) if keepdims else y


def global_avg_pool(x: FloatIn, *, data_format: DataFormat = "channels_last",
                    keepdims: bool = False) -> FloatOut:
  """Global average pooling: the mean over every spatial dim.

  Args:
    x: ``(N, *spatial, C)`` (or ``(N, C, *spatial)``) as :func:`global_max_pool`; float dtype;
      bfloat16 and float16 accumulate in float32.
    data_format, keepdims: as :func:`global_max_pool`.

  Returns:
    ``(N, C)``, or ``(N, 1, ..., 1, C)`` (or channels first) with ``keepdims``; ``x``'s dtype.

  Example:
    >>> x = jnp.arange(8.).reshape(1, 2, 2, 2)                   # (N, H, W, C)
    >>> global_avg_pool(x)
    Array([[3., 4.]], dtype=float32)
    >>> global_avg_pool(x, data_format="channels_first", keepdims=True).shape
    (1, 2, 1, 1)
  """
  a, n, channels_last = _global_args(x, data_format, keepdims, allow_int=False)
  y = _backend("global", None, a, "global_avg_pool").global_avg_pool(a, n, channels_last)
  return _keepdims(y, n, channels_last) if keepdims else y
