"""Nodes that only rearrange their input: :class:`Flatten`, :class:`Reshape`, :class:`Pad`,
:class:`Concat` (MPS's ``MPSNNConcatenationNode``) and :class:`Upsample` (MPS's
``MPSCNNUpsamplingNearestNode`` and ``MPSCNNUpsamplingBilinearNode``)."""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src import checks, windows
from jaxpool._src.graph.base import Node, Ref, Spec, input_field
from jaxpool._src.graph.common import (array_axis, axis_in_range, batch_shape, channel_axis,
                                       check_axis, check_choice, check_data_format, check_image,
                                       flatten_example, spatial_axes, spatial_shape)

PAD_MODES = ("constant", "edge", "reflect", "symmetric")
UPSAMPLE_METHODS = ("nearest", "bilinear")


def _check_out_spatial(node: Node, name: str, value: Any, in_spatial: tuple[int, ...],
                       out_spatial: tuple[int, ...]) -> None:
  """The spatial sizes a node makes from ``value`` (its ``padding`` or ``scale``): each, and
  their plane, at most ``windows.MAX_SIZE`` (2**31 - 1) elements, as the pooling ops' planes;
  checked when the graph is built, before any array of that size exists."""
  plane = math.prod(out_spatial)
  if max(out_spatial) > windows.MAX_SIZE or plane > windows.MAX_SIZE:
    raise node._fail(
        f"{name}={value!r} turns the spatial shape {in_spatial} into {out_spatial} ({plane} "
        f"elements); each size and the plane must be at most 2**31 - 1.")


@dataclass(frozen=True)
class Flatten(Node):
  """Flattens the per-example dims: ``(*batch, *shape) -> (*batch, prod(shape))``.

  Attributes:
    source: the input node.
    data_format: the layout of an image input. The order is always channels-last: with
      ``"channels_first"`` a ``(C, *spatial)`` input is flattened as ``(*spatial, C)``, so the
      output (and a following :class:`~jaxpool._src.graph.conv.Dense`'s parameters) equals the
      channels-last graph's. The default flattens in memory order (for a ``(C, *spatial)`` array,
      PyTorch's ``flatten``).
  """

  source: Ref = input_field()
  _: KW_ONLY
  data_format: str = "channels_last"

  def _normalize(self):
    self._set("data_format", check_data_format(self, self.data_format))

  def forward(self, params, xs, in_specs):
    return flatten_example(xs[0], in_specs[0], self.data_format)


@dataclass(frozen=True)
class Reshape(Node):
  """Reshapes each example: ``(*batch, *in_shape) -> (*batch, *shape)``.

  Attributes:
    source: the input node.
    shape: the per-example output shape; one entry may be ``-1`` (inferred). Its product must
      equal ``prod(in_shape)``.
  """

  source: Ref = input_field()
  _: KW_ONLY
  shape: tuple[int, ...] = ()

  def _normalize(self):
    shape = self._check(checks.int_tuple, "shape", self.shape, None, minimum=-1)
    if shape.count(-1) > 1:
      raise self._fail(f"shape may hold -1 once; got {self.shape!r}.")
    self._set("shape", shape)

  def _out_shape(self, spec: Spec) -> tuple[int, ...]:
    size, known = math.prod(spec.shape), math.prod(v for v in self.shape if v != -1)
    if -1 in self.shape:
      if known == 0 or size % known:
        raise self._fail(f"cannot reshape input {self.inputs[0]!r} of per-example shape "
                         f"{spec.shape} ({size} elements) to {self.shape}.")
      return tuple(size // known if v == -1 else v for v in self.shape)
    if known != size:
      raise self._fail(f"cannot reshape input {self.inputs[0]!r} of per-example shape "
                       f"{spec.shape} ({size} elements) to {self.shape} ({known} elements).")
    return self.shape

  def check_inputs(self, in_specs):
    self._out_shape(in_specs[0])

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    return x.reshape((*batch_shape(x, spec), *self._out_shape(spec)))

  def describe(self):
    return f"Reshape {self.shape}"


@dataclass(frozen=True)
class Pad(Node):
  """Pads the spatial dims of an image (MPS's padding policies, ``jnp.pad``'s modes).

  ``x: (*batch, *spatial, C) -> (*batch, *(L + lo + hi), C)`` (channels-first:
  ``(*batch, C, *spatial)``).

  Attributes:
    source: the input node, an image.
    padding: one ``(lo, hi)`` pair of ints >= 0 per spatial dim (its length is the number of
      spatial dims).
    mode: ``"constant"`` (``value``; MPS's zero/constant), ``"edge"`` (the border element
      repeated; MPS's clamp-to-edge), ``"reflect"`` (mirrored without the border element, ``lo``
      and ``hi`` < L; MPS's mirror) or ``"symmetric"`` (mirrored with it, ``lo`` and ``hi`` <= L;
      MPS's mirror-with-edge), as ``jnp.pad``.
    value: the constant of ``mode="constant"`` (a real number; 0 otherwise).
    data_format: ``"channels_last"`` (default) or ``"channels_first"``.
  """

  source: Ref = input_field()
  _: KW_ONLY
  padding: tuple[tuple[int, int], ...] = ((1, 1), (1, 1))
  mode: str = "constant"
  value: float = 0.0
  data_format: str = "channels_last"

  def _normalize(self):
    try:
      n = len(self.padding)
    except TypeError:
      raise self._fail(f"padding must be (lo, hi) pairs, one per spatial dim; got "
                       f"{self.padding!r}.", TypeError) from None
    if n == 0:
      raise self._fail("padding must name at least one spatial dim; got ().")
    self._set("padding", self._check(windows.padding_pairs, self.padding, n))
    self._set("mode", check_choice(self, "mode", self.mode, PAD_MODES))
    if (not isinstance(self.value, (int, float, np.integer, np.floating))
        or isinstance(self.value, (bool, np.bool_))):
      raise self._fail(f"value must be a real number; got {self.value!r}.", TypeError)
    self._set("value", float(self.value))
    if self.mode != "constant" and self.value != 0:
      raise self._fail(f"value applies to mode='constant' only; got value={self.value} with "
                       f"mode={self.mode!r}.")
    self._set("data_format", check_data_format(self, self.data_format))

  def check_inputs(self, in_specs):
    (x,) = in_specs
    check_image(self, x, self.padding, self.data_format, "padding")
    in_spatial = spatial_shape(x.shape, self.data_format)
    _check_out_spatial(self, "padding", self.padding, in_spatial,
                       tuple(L + lo + hi
                             for L, (lo, hi) in zip(in_spatial, self.padding, strict=True)))
    if self.mode in ("reflect", "symmetric"):
      limit = 0 if self.mode == "reflect" else 1
      for i, (L, (lo, hi)) in enumerate(zip(spatial_shape(x.shape, self.data_format),
                                            self.padding, strict=True)):
        if max(lo, hi) > L - 1 + limit:
          raise self._fail(f"mode {self.mode!r} needs padding {'<' if limit == 0 else '<='} "
                           f"the input size; spatial dim {i} has size {L}, padding {(lo, hi)}.")

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    widths = [(0, 0)] * x.ndim
    for ax, p in zip(spatial_axes(x, spec, self.data_format), self.padding, strict=True):
      widths[ax] = p
    if self.mode == "constant":
      return jnp.pad(x, widths, constant_values=jnp.asarray(self.value, x.dtype))
    return jnp.pad(x, widths, mode=self.mode)

  def describe(self):
    return f"Pad {self.mode} {self.padding}"


@dataclass(frozen=True)
class Concat(Node):
  """Concatenates several nodes along one per-example axis (MPS's ``MPSNNConcatenationNode``).

  ``xs[k]: (*batch, *spatial, C_k) -> (*batch, *spatial, sum C_k)`` by default (the channel
  axis; ``(*batch, sum C_k, *spatial)`` channels-first). The inputs must agree on every other
  dim; their dtypes are promoted as ``jnp.concatenate`` does.

  Attributes:
    sources: the input nodes (one or more), in order.
    axis: the per-example axis (negative from the end); default the channel axis of
      ``data_format`` (``-1`` channels-last, ``0`` channels-first).
    data_format: ``"channels_last"`` (default) or ``"channels_first"``.
  """

  sources: Any = input_field()
  _: KW_ONLY
  axis: int | None = None
  data_format: str = "channels_last"
  _input_fields: ClassVar[tuple[str, ...]] = ("sources",)

  def _normalize(self):
    if not self.inputs:
      raise self._fail("sources must hold at least one node; got none.")
    self._set("data_format", check_data_format(self, self.data_format))
    if self.axis is not None:
      self._set("axis", check_axis(self, "axis", self.axis))

  @property
  def concat_axis(self) -> int:
    return channel_axis(self.data_format) if self.axis is None else self.axis

  def check_inputs(self, in_specs):
    first = in_specs[0]
    ax = axis_in_range(self, "axis", self.concat_axis, first, self.inputs[0])
    for name, s in zip(self.inputs[1:], in_specs[1:], strict=True):
      if (len(s.shape) != len(first.shape)
          or any(a != b for k, (a, b) in enumerate(zip(s.shape, first.shape, strict=True))
                 if k != ax)):
        raise self._fail(f"inputs {self.inputs[0]!r} {first.shape} and {name!r} {s.shape} must "
                         f"have the same shape except along axis {self.concat_axis}.")

  def forward(self, params, xs, in_specs):
    return jnp.concatenate(xs, axis=array_axis(xs[0], in_specs[0], self.concat_axis))

  def describe(self):
    return f"Concat axis {self.concat_axis}"


@dataclass(frozen=True)
class Upsample(Node):
  """Upsamples the spatial dims by integer factors (MPS's ``MPSCNNUpsamplingNearestNode`` and
  ``MPSCNNUpsamplingBilinearNode``).

  ``x: (*batch, *spatial, C) -> (*batch, *(L * scale), C)`` (channels-first:
  ``(*batch, C, *spatial)``).

  ``"nearest"`` repeats each element ``scale`` times along each spatial dim. ``"bilinear"``
  (multilinear for 1 or 3 spatial dims) uses half-pixel centres, ``align_corners=False``:
  output ``o`` samples the input at ``(o + 0.5) / scale - 0.5``, clamped to ``[0, L - 1]``
  (PyTorch's ``interpolate(mode="bilinear", align_corners=False)``, ``jax.image.resize``'s
  ``"linear"``, which computes it).

  Attributes:
    source: the input node, an image.
    scale: one int >= 1 per spatial dim (its length is the number of spatial dims).
    method: ``"nearest"`` or ``"bilinear"``.
    data_format: ``"channels_last"`` (default) or ``"channels_first"``.
  """

  source: Ref = input_field()
  _: KW_ONLY
  scale: tuple[int, ...] = (2, 2)
  method: str = "nearest"
  data_format: str = "channels_last"

  def _normalize(self):
    n = self._check(windows.spatial_rank, self.scale, "scale")
    self._set("scale", self._check(checks.int_tuple, "scale", self.scale, n))
    self._set("method", check_choice(self, "method", self.method, UPSAMPLE_METHODS))
    self._set("data_format", check_data_format(self, self.data_format))

  def check_inputs(self, in_specs):
    check_image(self, in_specs[0], self.scale, self.data_format, "scale")
    in_spatial = spatial_shape(in_specs[0].shape, self.data_format)
    _check_out_spatial(self, "scale", self.scale, in_spatial,
                       tuple(L * s for L, s in zip(in_spatial, self.scale, strict=True)))

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    axes = spatial_axes(x, spec, self.data_format)
    if self.method == "nearest":
      for ax, s in zip(axes, self.scale, strict=True):
        x = jnp.repeat(x, s, axis=ax)
      return x
    shape = list(x.shape)
    for ax, s in zip(axes, self.scale, strict=True):
      shape[ax] *= s
    y = jax.image.resize(x.astype(jnp.promote_types(x.dtype, jnp.float32)), shape, "linear")
    return y.astype(x.dtype)

  def describe(self):
    return f"Upsample {self.method} x{'x'.join(map(str, self.scale))}"
