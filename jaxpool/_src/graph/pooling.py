"""Pooling nodes (MPS's ``MPSCNNPooling*Node``) through jaxpool's public functions:
:class:`MaxPool`, :class:`DilatedMaxPool`, :class:`AvgPool`, :class:`L2Pool` and their base.

Every forward and every gradient is one of the core's public functions (``jaxpool.max_pool``,
``jaxpool.max_pool_with_taps``, ``jaxpool.max_pool_grad_from_taps``, ``jaxpool.avg_pool_grad``,
``jaxpool.lp_pool_grad``...), so it goes through the core's dispatch: a training graph runs the
kernels that ``jax.grad`` runs, the Pallas ones on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxpool._src import api, checks, windows
from jaxpool._src.autodiff import ACTIVATIONS
from jaxpool._src.graph.base import GradientNode, Node, Ref, Spec, input_field
from jaxpool._src.graph.common import (POOL_PADDING_POLICIES, check_bool, check_image,
                                       check_padding, check_window, resolve_padding)


@dataclass(frozen=True)
class PoolingGradient(GradientNode):
  """A pooling node's gradient (MPS's ``MPSCNNPoolingGradientNode``): source gradient, source
  image, gradient state, and the forward's window, strides and padding."""

  def _pool(self) -> _Pool:
    fwd = self.forward_node
    if not isinstance(fwd, _Pool):
      raise self._fail(f"forward must be a pooling node; got {fwd!r}.", TypeError)
    return fwd

  @property
  def window(self) -> tuple[int, ...]:
    return self._pool().window

  @property
  def strides(self) -> tuple[int, ...]:
    strides = self._pool().strides
    if strides is None:  # set by the pooling node's _normalize
      raise self._fail("its forward node has no strides.")
    return strides

  @property
  def padding(self) -> Any:
    return self._pool().padding

  @property
  def offset(self) -> tuple[int, ...]:
    offset = self._pool().offset
    if offset is None:  # set by the pooling node's _normalize
      raise self._fail("its forward node has no offset.")
    return offset

  @property
  def dilation(self) -> tuple[int, ...]:
    return self._pool().dilation_

  @property
  def ceil_mode(self) -> bool:
    return self._pool().ceil_mode

  @property
  def data_format(self) -> str:
    return self._pool().data_format

  def describe(self):
    f = self._pool()
    pad = f.padding if isinstance(f.padding, str) else f"pad {f.padding}"
    return (f"{type(f).__name__}Gradient {'x'.join(map(str, f.window))}/"
            f"{'x'.join(map(str, f.strides))} {pad}")


@dataclass(frozen=True)
class _Pool(Node):
  """Shared config of the pooling nodes (MPS's ``MPSCNNPoolingNode``)."""

  source: Ref = input_field()
  _: KW_ONLY
  window: tuple[int, ...] = (2, 2)
  strides: tuple[int, ...] | None = None
  padding: Any = "VALID"
  offset: tuple[int, ...] | None = None
  ceil_mode: bool = False
  data_format: str = "channels_last"
  implementation: str | None = None
  gradient_class: ClassVar[type[GradientNode]] = PoolingGradient
  # MPS's pooling gradient node takes a gradient state for every pooling type.
  accepts_state: ClassVar[bool] = True

  def _normalize(self):
    self._set("window", check_window(self, self.window))
    n = len(self.window)
    # MPS's init(source:filterSize:) sets the stride to the filter size.
    strides = self.window if self.strides is None else self.strides
    self._set("strides", self._check(checks.int_tuple, "strides", strides, n))
    self._set("padding", check_padding(self, self.padding, n, POOL_PADDING_POLICIES))
    self._set("ceil_mode", check_bool(self, "ceil_mode", self.ceil_mode))
    self._check(checks.check_choice, "data_format", self.data_format, windows.DATA_FORMATS)
    self._check(checks.check_choice, "implementation", self.implementation,
                windows.IMPLEMENTATIONS)
    self._set("offset", self._check(checks.int_tuple, "offset", self.offset, n, default=0,
                                    minimum=-(2 ** 31)))
    if hasattr(self, "dilation"):
      self._set("dilation", self._check(checks.int_tuple, "dilation", self.dilation, n,
                                        default=1))

  @property
  def nspatial(self) -> int:
    return len(self.window)

  @property
  def dilation_(self) -> tuple[int, ...]:
    return getattr(self, "dilation", None) or (1,) * self.nspatial

  def spatial_axes(self, ndim: int) -> tuple[int, ...]:
    """The spatial axes of a ``(*batch, *per_example)`` array of ``ndim`` dims."""
    return windows.spatial_axes(ndim, self.nspatial, self.data_format == "channels_last")

  def spatial(self, spec: Spec) -> tuple[int, ...]:
    """The per-example spatial sizes of an input spec, ``(*spatial, C)`` or ``(C, *spatial)``."""
    return tuple(spec.shape[a] for a in self.spatial_axes(len(spec.shape)))

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
    for (lo, hi), o in zip(pads, offset, strict=True):
      lo, hi = lo - o, hi + o
      crop.append((max(-lo, 0), max(-hi, 0)))
      final.append((max(lo, 0), max(hi, 0)))
    return tuple(crop), tuple(final)

  def _crop(self, x: jax.Array, spec: Spec) -> tuple[jax.Array, tuple]:
    crop, pads = self.geometry(self.spatial(spec))
    if any(c != (0, 0) for c in crop):
      start = [0] * x.ndim
      limit = list(x.shape)
      for ax, (a, b) in zip(self.spatial_axes(x.ndim), crop, strict=True):
        start[ax], limit[ax] = a, x.shape[ax] - b
      x = lax.slice(x, start, limit)
    return x, pads

  def _uncrop(self, dx: jax.Array, spec: Spec) -> jax.Array:
    crop, _ = self.geometry(self.spatial(spec))
    if all(c == (0, 0) for c in crop):
      return dx
    cfg = [(0, 0, 0)] * dx.ndim
    for ax, (a, b) in zip(self.spatial_axes(dx.ndim), crop, strict=True):
      cfg[ax] = (a, b, 0)
    return lax.pad(dx, jnp.zeros((), dx.dtype), cfg)

  def check_inputs(self, in_specs):
    (x,) = in_specs
    check_image(self, x, self.window)
    crop, _ = self.geometry(self.spatial(x))
    for i, (L, (a, b)) in enumerate(zip(self.spatial(x), crop, strict=True)):
      if a + b >= L:
        raise self._fail(f"offset {self.offset} crops all of spatial dim {i} (size {L}).")

  def _kw(self, pads) -> dict[str, Any]:
    """The core's arguments for the (cropped) input: window, strides, padding and the rest."""
    kw = dict(window_shape=self.window, strides=self.strides, padding=pads,
              ceil_mode=self.ceil_mode, data_format=self.data_format)
    if self.dilation_ != (1,) * self.nspatial:
      kw["dilation"] = self.dilation_
    return kw

  def _call(self, fn, *args: Any, pads, **extra: Any) -> Any:
    """``fn(*args, **core arguments, implementation=..., **extra)``, a public core function;
    its argument errors are raised again naming this node."""
    return self._check(fn, *args, **self._kw(pads), implementation=self.implementation, **extra)

  def infer(self, in_specs):
    self.check_inputs(in_specs)
    (x,) = in_specs
    crop, pads = self.geometry(self.spatial(x))
    cropped = list(x.shape)
    for ax, (a, b) in zip(self.spatial_axes(len(cropped)), crop, strict=True):
      cropped[ax] -= a + b
    try:  # the core checks the window against the padded input, naming the argument
      windows.make_geometry(cropped, **self._kw(pads))
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
    if self.ceil_mode:
      s += " ceil"
    if self.data_format != "channels_last":
      s += f" {self.data_format}"
    if getattr(self, "activation", None):
      s += f" +{self.activation}"
    if self.implementation:
      s += f" [{self.implementation}]"
    return s


@dataclass(frozen=True)
class MaxPool(_Pool):
  """Max pooling (MPS's ``MPSCNNPoolingMaxNode``) through :func:`jaxpool.max_pool`.

  Attributes:
    source: the input node, ``(*spatial, C)`` per example (``(C, *spatial)`` with
      ``data_format="channels_first"``).
    window: ``k`` per spatial dim (MPS's ``kernelWidth``/``kernelHeight``).
    strides: per spatial dim; default ``window`` (MPS's ``init(source:filterSize:)``).
    padding: ``"VALID"``, ``"SAME"``, ``"SAME_LOWER"``, ``"FULL"`` or explicit ``(lo, hi)``
      pairs.
    offset: MPS's kernel offset per spatial dim: windows move ``o`` elements toward the end
      (``docs/graph.md`` gives the exact mapping to ``(lo, hi)``).
    ceil_mode: round the output size up (the core's ``ceil_mode``, PyTorch's rule).
    data_format: ``"channels_last"`` (default) or ``"channels_first"``.
    implementation: the core's ``implementation=`` (``None``, ``"xla"`` or ``"pallas"``) for
      the forward and the gradient.
    activation: ``None`` or ``"relu"``: ``relu`` after the pool, fused into it (the core's
      ``activation=``); the graph's rewrite pass sets it when it folds a ReLU into the pool.

  The gradient state is the core's 1-byte argmax: each window's winning tap
  (:func:`jaxpool.max_pool_with_taps`, int8 for windows of at most 127 taps); the gradient node
  scatters the source gradient there with :func:`jaxpool.max_pool_grad_from_taps`, the same
  kernels and bits as ``jax.grad``.
  """

  activation: str | None = field(default=None, kw_only=True)
  keeps_state: ClassVar[bool] = True
  state_doc: ClassVar[str] = "argmax taps, 1 byte"

  def _normalize(self):
    super()._normalize()
    self._check(checks.check_choice, "activation", self.activation, ACTIVATIONS)

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return self._call(api.max_pool, x, pads=pads, activation=self.activation)

  def forward_with_state(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return self._call(api.max_pool_with_taps, x, pads=pads, activation=self.activation)

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    dy = jnp.asarray(dy).astype(x.dtype)
    dx = self._call(api.max_pool_grad_from_taps, dy, state, x.shape, pads=pads)
    return (self._uncrop(dx, in_specs[0]),), None


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

  Attributes: as :class:`MaxPool` (no ``activation``), plus ``count_include_pad`` (PyTorch's
  rule: divide by the taps inside the padded input, or only by the real ones). Its gradient
  (:func:`jaxpool.avg_pool_grad`) needs only the source image's shape, so it keeps no state;
  as in MPS, its gradient node still takes one (``gradient_state()``), which carries nothing
  (its value is ``None``).
  """

  count_include_pad: bool = field(default=False, kw_only=True)
  state_doc: ClassVar[str] = "nothing: the gradient needs only the input's shape"

  def _normalize(self):
    super()._normalize()
    self._set("count_include_pad", check_bool(self, "count_include_pad",
                                               self.count_include_pad))

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return self._call(api.avg_pool, x, pads=pads, count_include_pad=self.count_include_pad)

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    dx = self._call(api.avg_pool_grad, jnp.asarray(dy).astype(x.dtype), x.shape, pads=pads,
                    count_include_pad=self.count_include_pad)
    return (self._uncrop(dx, in_specs[0]),), None


@dataclass(frozen=True)
class L2Pool(_Pool):
  """L2-norm pooling (MPS's ``MPSCNNPoolingL2NormNode``) through :func:`jaxpool.l2_pool`.

  Attributes: as :class:`MaxPool` (no ``activation``). The gradient is the core's,
  :func:`jaxpool.lp_pool_grad` with ``p=2`` at the source image (``jax.vjp`` of
  :func:`jaxpool.l2_pool`, which recomputes the window norms), so it keeps no state; its
  gradient node takes one as MPS's does (it carries nothing).
  """

  state_doc: ClassVar[str] = "nothing: the gradient recomputes the norms from the input"

  def forward(self, params, xs, in_specs):
    x, pads = self._crop(xs[0], in_specs[0])
    return self._call(api.l2_pool, x, pads=pads)

  def backward(self, xs, state, dy, in_specs, wrt):
    if not wrt[0]:
      return (None,), None
    x, pads = self._crop(xs[0], in_specs[0])
    dx = self._call(api.lp_pool_grad, x, jnp.asarray(dy).astype(x.dtype), 2, pads=pads)
    return (self._uncrop(dx, in_specs[0]),), None
