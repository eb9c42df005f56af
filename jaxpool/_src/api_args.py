"""The public functions' argument types and the checks they share beyond ``checks.py``.

The jaxtyping shapes: "*batch_spatial_c" is ``(*batch, *spatial, C)`` for ``channels_last`` and
``(*batch, C, *spatial)`` for ``channels_first``; "*batch_out_c" is the same with the pooled
spatial sizes. Only the layout tells which dims are spatial, so the annotations name them
together.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Literal, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxtyping import Array, ArrayLike, Bool, Float, Int, Num, Real, Shaped

from jaxpool._src.checks import check_norm
from jaxpool._src.windows import MAX_SIZE

Padding = Union[str, int, Sequence[tuple[int, int]]]

PoolIn = Shaped[ArrayLike, "*batch_spatial_c"]  # real (float, integer) or bool
AvgIn = Num[ArrayLike, "*batch_spatial_c"]  # float, integer, bool or complex
MaskIn = Bool[ArrayLike, "..."] | None  # broadcastable to x's shape
FloatIn = Float[ArrayLike, "*batch_spatial_c"]
FloatOutIn = Float[ArrayLike, "*batch_out_c"]
PoolOut = Shaped[Array, "*batch_out_c"]
AvgOut = Num[Array, "*batch_out_c"]
FloatOut = Float[Array, "*batch_out_c"]
FloatGrad = Float[Array, "*batch_spatial_c"]
IndicesOut = Int[Array, "*batch_out_c"]
IndicesIn = Int[ArrayLike, "*batch_out_c"]
TapsOut = Int[Array, "*batch_out_c"]
TapsIn = Int[ArrayLike, "*batch_out_c"]
PooledIn = Real[ArrayLike, "*batch_out_c"]
UnpooledOut = Real[Array, "*batch_spatial_c"]
Implementation = Literal["xla", "pallas"] | None
Activation = Literal["relu"] | None
DataFormat = Literal["channels_last", "channels_first"]


def as_array(name: str, x: Any) -> jax.Array:
  if x is None:
    raise TypeError(f"{name} must be an array; got None.")
  try:
    x = jnp.asarray(x)
  except (TypeError, ValueError) as e:  # ragged lists, strings, objects
    raise TypeError(f"{name} must be an array; got {type(x).__name__}: {e}") from None
  return x


def check_dy(dy: jax.Array, expected: tuple[int, ...], where: str = "") -> None:
  if tuple(dy.shape) != tuple(expected):
    raise ValueError(f"dy must have the shape of the forward output{where}, {tuple(expected)}; "
                     f"got {tuple(dy.shape)}.")


def grad_through(forward: Any, x: Any, dy: Any, window_shape: Any, strides: Any, padding: Any,
                 dilation: Any, ceil_mode: Any, data_format: Any) -> jax.Array:
  """``dx`` of ``forward`` (a pooling of ``x`` alone, with these window arguments) for the
  cotangent ``dy``, once ``x`` (a float array) and ``dy`` (of the forward output's shape) are
  checked: the same bits as ``jax.vjp`` of the forward."""
  from jaxpool._src.dtypes import check_dtype
  from jaxpool._src.windows import make_geometry
  x = as_array("x", x)
  dy = as_array("dy", dy)
  check_dtype("x", x, allow_int=False)
  check_dtype("dy", dy, allow_int=True)  # a complex dy would lose its imaginary part
  geom = make_geometry(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  check_dy(dy, geom.output_shape(x.shape))
  _, vjp = jax.vjp(forward, x)
  return vjp(dy.astype(x.dtype))[0]


# Why max and min pooling refuse complex inputs.
NO_ORDER = "complex numbers have no order, so a window of them has no maximum or minimum"


def check_mask(mask: Any, x: jax.Array) -> jax.Array | None:
  """``mask`` as a bool array broadcastable to ``x`` (None stays None)."""
  if mask is None:
    return None
  mask = as_array("mask", mask)
  if mask.dtype != np.dtype(np.bool_):
    raise TypeError(f"mask must be a bool array (True marks a real element); got dtype "
                    f"{mask.dtype}.")
  try:
    shape = tuple(np.broadcast_shapes(tuple(mask.shape), tuple(x.shape)))
  except ValueError:
    shape = None
  if shape != tuple(x.shape):
    raise ValueError(f"mask must have x's shape {tuple(x.shape)} or a shape that broadcasts "
                     f"to it; got {tuple(mask.shape)}.")
  return mask


def check_p(p: Any) -> float:
  return check_norm("p", p)


def check_input_shape(input_shape: Any) -> tuple[int, ...]:
  """A gradient's ``input_shape`` (the forward input's full shape) as a tuple of ints >= 0."""
  try:
    shape = tuple(operator.index(s) for s in input_shape)  # no silent int(1.5) or int("1")
  except TypeError:
    raise TypeError(f"input_shape must be a tuple of ints; got {input_shape!r}.") from None
  if any(isinstance(s, (bool, np.bool_)) for s in input_shape):
    raise TypeError(f"input_shape must be a tuple of ints, not bools; got {input_shape!r}.")
  if any(s < 0 for s in shape):
    raise ValueError(f"input_shape entries must be >= 0; got {input_shape!r}.")
  return shape


def check_plane(shown: str, spatial: Sequence[int], what: str) -> None:
  """A spatial plane that a call indexes or creates holds at most ``MAX_SIZE`` (2**31 - 1)
  elements, as flat indices are int32: checked before anything of that size is built.
  ``shown`` names the argument and its value, e.g. ``"output_size=(4, 4)"``."""
  plane = math.prod(spatial)
  if plane > MAX_SIZE:
    raise ValueError(
        f"{what} must hold at most 2**31 - 1 elements (flat indices are int32); {shown} gives "
        f"the spatial plane {tuple(spatial)} of {plane} elements.")
