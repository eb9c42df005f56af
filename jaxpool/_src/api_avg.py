"""The public sum-type pools: ``avg_pool``, ``lp_pool``, ``l2_pool`` and their gradients
(``avg_pool_grad``, ``lp_pool_grad``).

Each checks its arguments, asks the backend registry (``dispatch.choose``) which backend
serves the call, and calls that backend's method for the op.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp  # noqa: F401 (the docstrings' examples use jnp)
from jax import lax

from jaxpool._src import dispatch
from jaxpool._src.api_args import (AvgIn, AvgOut, DataFormat, FloatGrad, FloatIn, FloatOut,
                                   FloatOutIn, Implementation, MaskIn, Padding, PoolIn, as_array,
                                   check_dy, check_input_shape, check_mask, check_p, check_plane,
                                   grad_through)
from jaxpool._src.backend import Op
from jaxpool._src.checks import check_bool, check_divisor
from jaxpool._src.dtypes import average_dtype, check_avg_dtype, check_dtype
from jaxpool._src.windows import make_geometry


# ----------------------------------------------------------------------------- average


def avg_pool(x: AvgIn, window_shape: Sequence[int],
             strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
             dilation: Sequence[int] | None = None, ceil_mode: bool = False,
             count_include_pad: bool = True, divisor_override: int | None = None,
             data_format: DataFormat = "channels_last", mask: MaskIn = None,
             implementation: Implementation = None) -> AvgOut:
  """Average pooling with PyTorch's divisors.

  Args:
    x: ``(*batch, *spatial, C)`` (or channels first); float, complex, integer or bool dtype.
      bfloat16 and float16 accumulate in float32; integers and bool are averaged in JAX's
      default float dtype (float32; float64 with ``jax_enable_x64``), as Flax's ``avg_pool``.
    window_shape, strides, padding, dilation, ceil_mode, data_format, implementation: as
      :func:`max_pool`.
    count_include_pad: if true, divide by the taps inside the padded input (the ceil-mode
      overhang never counts); if false, by the taps on real elements.
    divisor_override: a positive int that replaces either divisor.
    mask: ``None`` or a bool array broadcastable to ``x``, True at real elements: a masked
      element is left out of the sum and of the divisor (with ``count_include_pad`` the
      divisor is the unmasked elements plus the padding taps); ``divisor_override`` still
      replaces it. Served by the XLA backend only.

  Returns:
    ``(*batch, *out_spatial, C)`` (or channels first), of ``x``'s dtype (JAX's default float
    for integers and bool). A window with no real (unmasked) element gives 0.

  Example:
    >>> x = jnp.ones((1, 3, 3, 1))
    >>> avg_pool(x, (2, 2), padding=1, strides=(2, 2), count_include_pad=True)[0, ..., 0]
    Array([[0.25, 0.5 ],
           [0.5 , 1.  ]], dtype=float32)
  """
  x = as_array("x", x)
  check_avg_dtype("x", x)
  count_include_pad = check_bool("count_include_pad", count_include_pad)
  divisor_override = check_divisor("divisor_override", divisor_override)
  mask = check_mask(mask, x)
  geom = make_geometry(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  x = x.astype(average_dtype(x.dtype))
  backend = dispatch.choose(Op.AVG_POOL, implementation, x, geom, mask)
  return backend.avg_pool(x, geom, count_include_pad=count_include_pad,
                          divisor_override=divisor_override, mask=mask)


def avg_pool_grad(dy: FloatOutIn, input_shape: Sequence[int],
                  window_shape: Sequence[int], strides: Sequence[int] | None = None,
                  padding: Padding = "VALID", *, dilation: Sequence[int] | None = None,
                  ceil_mode: bool = False, count_include_pad: bool = True,
                  divisor_override: int | None = None,
                  data_format: DataFormat = "channels_last",
                  implementation: Implementation = None) -> FloatGrad:
  """The average-pooling gradient: ``dx`` of shape ``input_shape``.

  Args:
    dy: the cotangent of the forward output, float dtype.
    input_shape: the forward input's full shape.
    Others: as :func:`avg_pool`.

  Returns:
    ``dx``: each window's ``dy / divisor`` spread over its real elements, summed over windows.
    The same bits as ``jax.vjp`` of :func:`avg_pool`.
  """
  dy = as_array("dy", dy)
  check_dtype("dy", dy, allow_int=False)
  input_shape = check_input_shape(input_shape)
  geom = make_geometry(input_shape, window_shape, strides, padding, dilation, ceil_mode,
                       data_format, name="input_shape")
  check_plane(f"input_shape={input_shape!r}", geom.in_spatial, "the gradient's plane")
  check_dy(dy, geom.output_shape(input_shape))
  fwd = functools.partial(avg_pool, window_shape=window_shape, strides=strides, padding=padding,
                          dilation=dilation, ceil_mode=ceil_mode,
                          count_include_pad=count_include_pad, divisor_override=divisor_override,
                          data_format=data_format, implementation=implementation)
  # The primal example comes from dy (full_like) so that it carries dy's varying axes inside
  # shard_map; a bare ShapeDtypeStruct would not, and the transpose would reject dy.
  # jax.vjp, not jax.linear_transpose: avg_pool is a custom_jvp whose tangent map (a fixed-order
  # tap sum) is what jax.grad transposes; linear_transpose would transpose the primal
  # reduce_window instead and round differently.
  _, vjp = jax.vjp(fwd, lax.full_like(dy, 0, shape=input_shape))
  return vjp(dy)[0]


# ----------------------------------------------------------------------------- Lp


def lp_pool(x: PoolIn, p: float, window_shape: Sequence[int],
            strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
            dilation: Sequence[int] | None = None, ceil_mode: bool = False,
            data_format: DataFormat = "channels_last",
            implementation: Implementation = None) -> FloatOut:
  """Lp-norm pooling: ``(sum |x|^p)^(1/p)`` over the real elements of each window.

  Args:
    x: ``(*batch, *spatial, C)`` (or channels first); float dtype (sums in float32 at least),
      or integer or bool (pooled in JAX's default float dtype, as :func:`avg_pool`).
    p: a finite number ``>= 1`` (``p=inf`` is :func:`max_pool` of ``|x|``).
    Others: as :func:`max_pool`.

  Returns:
    ``(*batch, *out_spatial, C)`` (or channels first). The gradient is 0 where the output is 0.

  Example:
    >>> x = jnp.array([3., 4., 0., 0.]).reshape(1, 4, 1)
    >>> lp_pool(x, 2, (2,), strides=(2,))[0, :, 0]
    Array([5., 0.], dtype=float32)
  """
  p = check_p(p)
  x = as_array("x", x)
  check_dtype("x", x, allow_int=True, allow_bool=True,
              complex_reason="lp_pool takes real inputs (for complex x, pool jnp.abs(x))")
  geom = make_geometry(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  x = x.astype(average_dtype(x.dtype))
  # Lp pooling is a window sum between two elementwise maps: XLA serves it on every backend
  # (see docs/pallas.md); implementation="pallas" raises, saying so.
  return dispatch.choose(Op.LP_POOL, implementation, x, geom).lp_pool(x, geom, p=p)


def l2_pool(x: PoolIn, window_shape: Sequence[int],
            strides: Sequence[int] | None = None, padding: Padding = "VALID", *,
            dilation: Sequence[int] | None = None, ceil_mode: bool = False,
            data_format: DataFormat = "channels_last",
            implementation: Implementation = None) -> FloatOut:
  """L2-norm pooling (MPS's ``MPSCNNPoolingL2Norm``): :func:`lp_pool` with ``p=2``."""
  return lp_pool(x, 2, window_shape, strides, padding, dilation=dilation, ceil_mode=ceil_mode,
                 data_format=data_format, implementation=implementation)


def lp_pool_grad(x: FloatIn, dy: FloatOutIn, p: float,
                 window_shape: Sequence[int], strides: Sequence[int] | None = None,
                 padding: Padding = "VALID", *, dilation: Sequence[int] | None = None,
                 ceil_mode: bool = False, data_format: DataFormat = "channels_last",
                 implementation: Implementation = None) -> FloatGrad:
  """The Lp-pooling gradient: ``dx = sum over windows of dy * sign(x) |x|^(p-1) / y^(p-1)``.

  Zero where the window's output is 0. The same bits as ``jax.vjp`` of :func:`lp_pool`.
  """
  p = check_p(p)
  fwd = functools.partial(lp_pool, p=p, window_shape=window_shape, strides=strides,
                          padding=padding, dilation=dilation, ceil_mode=ceil_mode,
                          data_format=data_format, implementation=implementation)
  return grad_through(fwd, x, dy, window_shape, strides, padding, dilation, ceil_mode,
                      data_format)
