"""Pooling nodes (MPS's ``MPSCNNPooling*Node``) through jaxpool's public functions:
:class:`MaxPool`, :class:`DilatedMaxPool`, :class:`AvgPool`, :class:`L2Pool` and their base."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpool
from jaxpool._src import windows, xla
from jaxpool._src.graph.base import (Node, Ref, Spec, check_bool, check_image, check_padding,
                                     check_window, input_field, resolve_padding)
from jaxpool._src.windows import taps_dtype


@dataclass(frozen=True)
class _Pool(Node):
  """Shared config of the pooling nodes (MPS's ``MPSCNNPoolingNode``)."""

  source: Ref = input_field()
  _: KW_ONLY
  window: tuple[int, ...] = (2, 2)
  strides: tuple[int, ...] | None = None
  padding: Any = "VALID"
  offset: tuple[int, ...] | None = None
  gradient_kind: ClassVar[str] = "PoolingGradient"

  def _normalize(self):
    self._set("window", check_window(self, self.window))
    n = len(self.window)
    # MPS's init(source:filterSize:) sets the stride to the filter size.
    strides = self.window if self.strides is None else self.strides
    self._set("strides", self._check(windows.int_tuple, "strides", strides, n))
    self._set("padding", check_padding(self, self.padding, n))
    self._set("offset", self._check(windows.int_tuple, "offset", self.offset, n, default=0,
                                    minimum=-(2 ** 31)))
    if hasattr(self, "dilation"):
      self._set("dilation", self._check(windows.int_tuple, "dilation", self.dilation, n,
                                        default=1))

  @property
  def nspatial(self) -> int:
    return len(self.window)

  @property
  def dilation_(self) -> tuple[int, ...]:
    return getattr(self, "dilation", None) or (1,) * self.nspatial

  def geometry(self, spatial: Sequence[int]):
    """``(crop, pads)``: what to cut from each side of the input, then jaxpool's ``(lo, hi)``.

    The policy gives ``(lo, hi)`` for the input; the kernel offset ``o`` moves every window by
    ``o`` elements toward the end, keeping the number of windows: ``(lo - o, hi + o)``. A
    negative entry means the windows start inside the input: that many elements are cropped.
    """
    strides, offset = self.strides, self.offset
    if strides is None or offset is None:  # both set by _normalize
      raise self._fail("strides and offset are unset; build the node through its constructor.")
    pads = resolve_padding(self.padding, spatial, self.window, strides, self.dilation_)
    crop, final = [], []
    for (lo, hi), o in zip(pads, offset):
      lo, hi = lo - o, hi + o
      crop.append((max(-lo, 0), max(-hi, 0)))
      final.append((max(lo, 0), max(hi, 0)))
    return tuple(crop), tuple(final)

  def _crop(self, x: jax.Array, spec: Spec) -> tuple[jax.Array, tuple]:
    crop, pads = self.geometry(spec.shape[:-1])
    if any(c != (0, 0) for c in crop):
      n = self.nspatial
      start = [0] * x.ndim
      limit = list(x.shape)
      for i, (a, b) in enumerate(crop):
        ax = x.ndim - 1 - n + i
        start[ax], limit[ax] = a, x.shape[ax] - b
      x = lax.slice(x, start, limit)
    return x, pads

  def _uncrop(self, dx: jax.Array, spec: Spec) -> jax.Array:
    crop, _ = self.geometry(spec.shape[:-1])
    if all(c == (0, 0) for c in crop):
      return dx
    n = self.nspatial
    cfg = [(0, 0, 0)] * dx.ndim
    for i, (a, b) in enumerate(crop):
      cfg[dx.ndim - 1 - n + i] = (a, b, 0)
    return lax.pad(dx, jnp.zeros((), dx.dtype), cfg)

  def check_inputs(self, in_specs):
    (x,) = in_specs
    check_image(self, x, self.window)
    crop, _ = self.geometry(x.shape[:-1])
    for i, (L, (a, b)) in enumerate(zip(x.shape, crop)):
      if a + b >= L:
        raise self._fail(f"offset {self.offset} crops all of spatial dim {i} (size {L}).")

  def _kw(self, pads) -> dict[str, Any]:
    kw = dict(window_shape=self.window, strides=self.strides, padding=pads)
    if self.dilation_ != (1,) * self.nspatial:
      kw["dilation"] = self.dilation_
    return kw

  def infer(self, in_specs):
    self.check_inputs(in_specs)
    (x,) = in_specs
    crop, pads = self.geometry(x.shape[:-1])
    cropped = tuple(L - a - b for L, (a, b) in zip(x.shape[:-1], crop)) + x.shape[-1:]
    try:  # the core checks the window against the padded input, naming the argument
      jaxpool.make_geometry(cropped, **self._kw(pads))
    except (TypeError, ValueError) as e:
      raise self._fail(f"{e} (padding policy {self.padding!r}, offset {self.offset})") from None
    return super().infer(in_specs)

  def describe(self):
    pad = self.padding if isinstance(self.padding, str) else f"pad {self.padding}"
    s = (f"{type(self).__name__} {'x'.join(map(str, self.window))}/"
         f"{'x'.join(map(str, self.strides))} {pad}")
    if any(self.offset):
      s += f" offset {self.offset}"
    if self.dilation_ != (1,) * self.nspatial:
      s += f" dilation {self.dilation_}"
    return s


def taps_from_indices(indices: jax.Array, geom) -> jax.Array:
  """jaxpool's flat argmax indices -> the core's window tap offsets (``-1`` stays ``-1``).

  The inverse of the core's ``flat_indices``: for each spatial dim the input position is
  ``o * s - lo + t * d``, so ``t = (pos - (o * s - lo)) // d``; taps are row-major in the window.
  """
  ndim, n = indices.ndim, geom.nspatial
  tap = jnp.zeros(indices.shape, jnp.int32)
  inner_plane = 1
  for dim in reversed(range(n)):
    pos = (indices // inner_plane) % geom.in_spatial[dim]
    shape = geom.full_dims(ndim, [geom.out_spatial[dim] if i == dim else 1 for i in range(n)], 1)
    start = (np.arange(geom.out_spatial[dim], dtype=np.int32) * geom.strides[dim]
             - geom.padding[dim][0]).reshape(shape)
    t = (pos - start) // geom.dilation[dim]
    tap = tap + t * int(np.prod(geom.window[dim + 1:], dtype=np.int64))
    inner_plane *= geom.in_spatial[dim]
  return jnp.where(indices < 0, -1, tap).astype(taps_dtype(geom.num_taps))


@dataclass(frozen=True)
class MaxPool(_Pool):
  """Max pooling (MPS's ``MPSCNNPoolingMaxNode``) through :func:`jaxpool.max_pool`.

  Attributes:
    source: the input node, ``(*spatial, C)`` per example.
    window: ``k`` per spatial dim (MPS's ``kernelWidth``/``kernelHeight``).
    strides: per spatial dim; default ``window`` (MPS's ``init(source:filterSize:)``).
    padding: ``"VALID"``, ``"SAME"``, ``"FULL"`` or explicit ``(lo, hi)`` pairs.
    offset: MPS's kernel offset per spatial dim: windows move ``o`` elements toward the end
      (``docs/graph.md`` gives the exact mapping to ``(lo, hi)``).

  The gradient state is the argmax (:func:`jaxpool.max_pool_with_indices`); the gradient node
  sends each window's cotangent there with the core's deterministic scatter (the same bits as
  ``jax.grad``).
  """

  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "argmax indices"

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.max_pool(x, **self._kw(pads))

  def forward_with_state(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.max_pool_with_indices(x, **self._kw(pads))

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    dy = jnp.asarray(dy).astype(x.dtype)
    kw = self._kw(pads)
    geom = jaxpool.make_geometry(x.shape, kw["window_shape"], kw["strides"], kw["padding"],
                                 kw.get("dilation"))
    if state.shape != dy.shape:
      raise self._fail(f"gradient state of shape {state.shape} does not match the source "
                       f"gradient {dy.shape}.")
    tap = taps_from_indices(state, geom)
    _, vjp = jax.vjp(lambda t: xla.gather_at_taps(t, tap, geom), jnp.zeros_like(x))
    return (self._uncrop(vjp(dy)[0], in_specs[0]),), None


@dataclass(frozen=True)
class DilatedMaxPool(MaxPool):
  """Dilated max pooling (MPS's ``MPSCNNDilatedPoolingMaxNode``): :class:`MaxPool` plus
  ``dilation`` (MPS's ``dilationRateX``/``dilationRateY``), default 2 per spatial dim."""

  dilation: tuple[int, ...] | None = field(default=None, kw_only=True)

  def _normalize(self):
    n = len(self.window)
    if self.dilation is None:
      self._set("dilation", (2,) * n)
    super()._normalize()


@dataclass(frozen=True)
class AvgPool(_Pool):
  """Average pooling (MPS's ``MPSCNNPoolingAverageNode``) through :func:`jaxpool.avg_pool`.

  Attributes: as :class:`MaxPool`, plus ``count_include_pad`` (PyTorch's rule: divide by the
  taps inside the padded input, or only by the real ones). Its gradient needs no state, only the
  source image's shape (:func:`jaxpool.avg_pool_grad`).
  """

  count_include_pad: bool = field(default=False, kw_only=True)

  def _normalize(self):
    super()._normalize()
    self._set("count_include_pad", check_bool(self, "count_include_pad",
                                               self.count_include_pad))

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.avg_pool(x, **self._kw(pads), count_include_pad=self.count_include_pad)

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    dx = jaxpool.avg_pool_grad(jnp.asarray(dy).astype(x.dtype), x.shape, **self._kw(pads),
                               count_include_pad=self.count_include_pad)
    return (self._uncrop(dx, in_specs[0]),), None


@dataclass(frozen=True)
class L2Pool(_Pool):
  """L2-norm pooling (MPS's ``MPSCNNPoolingL2NormNode``) through :func:`jaxpool.l2_pool`.

  Attributes: as :class:`MaxPool`. The gradient state is the forward's output ``y`` (the window
  norms): ``dx = x * sum over windows of dy / y``, zero where ``y == 0``.
  """

  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "window norms"

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return jaxpool.l2_pool(x, **self._kw(pads))

  def forward_with_state(self, params, xs, in_specs):
    y = self.forward(params, xs, in_specs)
    return y, y

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    kw = self._kw(pads)
    acc = xla.accumulator_dtype(x.dtype)
    xa, y = x.astype(acc), state.astype(acc)
    positive = y > 0
    denom = jnp.where(positive, y, 1)

    def lin(t):  # the tangent map of l2_pool, with y taken from the state; avg_pool with
      # divisor 1 is the window sum, so its transpose is the core's (the same bits as jax.grad)
      s = jaxpool.avg_pool(xa * t.astype(acc), **kw, divisor_override=1)
      return jnp.where(positive, s / denom, 0)

    _, vjp = jax.vjp(lin, jnp.zeros_like(x))
    dx = vjp(jnp.asarray(dy).astype(acc))[0]
    return (self._uncrop(dx.astype(x.dtype), in_specs[0]),), None
