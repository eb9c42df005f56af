"""Window and padding arithmetic: the one place that normalises the window arguments.

Every public op calls :func:`make_geometry` first (its single values go through the checks of
``checks.py``); the result, :class:`Geometry`, is a frozen, hashable description of one pooling
configuration that the implementations (XLA, Pallas) take as a static argument. The formulas
that the rest of the package shares live here once: :func:`spatial_axes` (which dims of an array
are spatial) and :func:`effective_window` (the span ``d * (k - 1) + 1`` of a dilated window).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpool._src.checks import (MAX_SIZE, check_bool, check_choice, check_static, int_tuple,
                                 is_int)

DATA_FORMATS = ("channels_last", "channels_first")
IMPLEMENTATIONS = (None, "xla", "pallas")
PADDING_STRINGS = ("VALID", "SAME", "SAME_LOWER")


def effective_window(k: int, d: int) -> int:
  """The span of a window of ``k`` taps ``d`` elements apart: ``d * (k - 1) + 1``."""
  return d * (k - 1) + 1


def spatial_axes(ndim: int, n: int, channels_last: bool) -> tuple[int, ...]:
  """The ``n`` spatial axes of an ``ndim``-dim array: ``(*batch, *spatial, C)`` (channels
  last) or ``(*batch, C, *spatial)``."""
  if channels_last:
    return tuple(range(ndim - 1 - n, ndim - 1))
  return tuple(range(ndim - n, ndim))


@dataclasses.dataclass(frozen=True)
class Geometry:
  """A checked pooling configuration for one input shape.

  Attributes:
    in_spatial: the input's spatial sizes ``L``.
    window: taps per spatial dim ``k``.
    strides: ``s`` per spatial dim.
    dilation: ``d`` per spatial dim.
    padding: the user's ``(lo, hi)`` per spatial dim, resolved from any padding form.
    extra: the ceil-mode overhang added after ``hi`` (never real, never counted by
      ``count_include_pad``).
    out_spatial: output spatial sizes.
    channels_last: layout; the spatial dims are ``x.shape[-n-1:-1]`` if true, else
      ``x.shape[-n:]``.
  """

  in_spatial: tuple[int, ...]
  window: tuple[int, ...]
  strides: tuple[int, ...]
  dilation: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  extra: tuple[int, ...]
  out_spatial: tuple[int, ...]
  channels_last: bool

  @property
  def nspatial(self) -> int:
    return len(self.window)

  @property
  def effective_window(self) -> tuple[int, ...]:
    return tuple(effective_window(k, d) for k, d in zip(self.window, self.dilation, strict=True))

  @property
  def full_padding(self) -> tuple[tuple[int, int], ...]:
    """``(lo, hi + extra)`` per spatial dim: what the padded input really spans."""
    return tuple((lo, hi + e) for (lo, hi), e in zip(self.padding, self.extra, strict=True))

  @property
  def num_taps(self) -> int:
    return math.prod(self.window)

  @property
  def pad_lo(self) -> tuple[int, ...]:
    return tuple(lo for lo, _ in self.padding)

  @property
  def pad_hi(self) -> tuple[int, ...]:
    """The user's high padding (counted by ``count_include_pad``; the ceil overhang is not)."""
    return tuple(hi for _, hi in self.padding)

  def lift(self, n: int) -> Geometry:
    """The same pooling seen with ``n`` spatial dims: unit dims (window 1, stride 1, no
    padding) prepended. The kernels see every pool as 2-D or 3-D this way."""
    extra = n - self.nspatial
    if extra < 0:
      raise ValueError(f"cannot lift a {self.nspatial}-D geometry to {n}-D")
    ones = (1,) * extra
    return Geometry(in_spatial=ones + self.in_spatial, window=ones + self.window,
                    strides=ones + self.strides, dilation=ones + self.dilation,
                    padding=((0, 0),) * extra + self.padding, extra=(0,) * extra + self.extra,
                    out_spatial=ones + self.out_spatial, channels_last=self.channels_last)

  def spatial_axes(self, ndim: int) -> tuple[int, ...]:
    return spatial_axes(ndim, self.nspatial, self.channels_last)

  def taps(self) -> list[tuple[int, ...]]:
    """Window offsets (in taps, not elements) in row-major order: the tie-break order."""
    return [tuple(int(i) for i in t) for t in np.ndindex(*self.window)]

  def full_dims(self, ndim: int, spatial: Sequence[Any], fill: Any) -> tuple[Any, ...]:
    """Spreads one value per spatial dim over all ``ndim`` dims, ``fill`` elsewhere."""
    out = [fill] * ndim
    for ax, v in zip(self.spatial_axes(ndim), spatial, strict=True):
      out[ax] = v
    return tuple(out)

  def output_shape(self, in_shape: Sequence[int]) -> tuple[int, ...]:
    shape = list(in_shape)
    for ax, o in zip(self.spatial_axes(len(shape)), self.out_spatial, strict=True):
      shape[ax] = o
    return tuple(shape)

  def input_shape(self, out_shape: Sequence[int]) -> tuple[int, ...]:
    """The forward input's shape, from its output's (any batch dims): the inverse of
    :meth:`output_shape`."""
    shape = list(out_shape)
    for ax, n in zip(self.spatial_axes(len(shape)), self.in_spatial, strict=True):
      shape[ax] = n
    return tuple(shape)


def spatial_rank(window_shape: Any, name: str = "window_shape") -> int:
  check_static(name, window_shape)
  if is_int(window_shape):
    raise TypeError(
        f"{name} must be a tuple of ints, one per spatial dim (e.g. (2, 2)); got the "
        f"int {window_shape!r}.")
  try:
    n = len(window_shape)
  except TypeError:
    raise TypeError(f"{name} must be a tuple of ints; got {window_shape!r}.") from None
  if n == 0:
    raise ValueError(f"{name} must name at least one spatial dim; got ().")
  return n


def check_rank(name: str, shape: Sequence[int], n: int, data_format: str) -> None:
  if len(shape) < n + 1:
    layout = "(*batch, *spatial, C)" if data_format == "channels_last" else "(*batch, C, *spatial)"
    raise ValueError(
        f"{name} must have at least {n + 1} dims, {layout} with {n} spatial dims; got shape "
        f"{tuple(shape)}.")


def padding_string(padding: str, allowed: Sequence[str] = PADDING_STRINGS, *,
                   what: str | None = None) -> str:
  """A padding string in the canonical upper case: ``"same"``, ``"Same"`` and ``"SAME"`` are
  one padding, as for ``lax.reduce_window``, Flax and Keras. The one place that normalises it
  (the ops, the graph nodes and the interop layers all call it).

  Raises:
    ValueError: ``padding`` is none of ``allowed`` in any case (``what``, if given, replaces
      the list of allowed forms in the message).
  """
  name = padding.upper()
  if name not in allowed:
    forms = what or (", ".join(repr(a) for a in allowed) + " (in any case)")
    raise ValueError(f"padding must be {forms}; got {padding!r}.")
  return name


def resolve_string_padding(padding: str, in_spatial: Sequence[int], window: Sequence[int],
                           strides: Sequence[int], dilation: Sequence[int]
                           ) -> tuple[tuple[int, int], ...]:
  """A padding string (any case) as ``(lo, hi)`` pairs, one per spatial dim.

  ``"VALID"``: none. ``"SAME"``: ``ceil(L / s)`` outputs; the total padding
  ``max((ceil(L / s) - 1) * s + e - L, 0)``, ``e`` the effective window ``d * (k - 1) + 1``,
  is split with the odd element at the end (``lax.padtype_to_pads``, TensorFlow, Keras, ONNX
  SAME_UPPER); ``"SAME_LOWER"``: the odd element at the start. ``"FULL"`` (the graph nodes'
  policy, not the ops'): ``e - 1`` on both sides: every window that touches a real element.
  """
  padding = padding_string(padding, (*PADDING_STRINGS, "FULL"))
  eff = [effective_window(k, d) for k, d in zip(window, dilation, strict=True)]
  if padding == "VALID":
    return ((0, 0),) * len(eff)
  if padding == "FULL":
    return tuple((e - 1, e - 1) for e in eff)
  pads = []
  for L, s, e in zip(in_spatial, strides, eff, strict=True):
    out = -(-L // s)
    total = max((out - 1) * s + e - L, 0)
    small, large = total // 2, total - total // 2
    pads.append((small, large) if padding == "SAME" else (large, small))
  return tuple(pads)


PADDING_FORMS = ("'VALID', 'SAME' or 'SAME_LOWER' (any case), an int (both sides of every "
                 "spatial dim) or one (lo, hi) pair per spatial dim")


def padding_hint(pairs: tuple[Any, ...], n: int) -> str:
  """What a sequence of ints given as ``padding`` probably meant (``padding=(1, 1)``)."""
  ints = [int(p) for p in pairs]
  hints: dict[Any, str] = {}
  if len(set(ints)) == 1:
    hints[ints[0]] = f"{ints[0]} on both sides of every spatial dim"
  if len(ints) == 2:
    lo, hi = ints
    hints.setdefault(((lo, hi),) * n, f"{lo} before and {hi} after in every spatial dim")
  if len(ints) == n:
    hints.setdefault(tuple((p, p) for p in ints), "a (lo, hi) pair per spatial dim")
  return "; did you mean " + ", or ".join(f"padding={v!r} ({w})" for v, w in hints.items()) + "?"


def padding_pairs(padding: Any, n: int) -> tuple[tuple[int, int], ...]:
  """Checks explicit padding: a sequence of ``n`` ``(lo, hi)`` pairs of ints >= 0."""
  check_static("padding", padding)
  try:
    pairs = tuple(padding)
  except TypeError:
    raise TypeError(f"padding must be {PADDING_FORMS}; got {padding!r}.") from None
  if pairs and all(is_int(p) for p in pairs):
    raise TypeError(f"padding must be {PADDING_FORMS}; got {padding!r}, ints where (lo, hi) "
                    f"pairs go{padding_hint(pairs, n)}")
  if len(pairs) != n:
    raise ValueError(
        f"padding must have one (lo, hi) pair per spatial dim ({n}); got {padding!r}.")
  resolved: list[tuple[int, int]] = []
  for p in pairs:
    try:
      lo, hi = p
    except (TypeError, ValueError):
      raise TypeError(f"padding must be a sequence of (lo, hi) pairs; got {padding!r}.") from None
    if not (is_int(lo) and is_int(hi)):
      raise TypeError(f"padding pairs must hold ints; got {padding!r}.")
    if lo < 0 or hi < 0:
      raise ValueError(f"padding must be >= 0; got {padding!r}.")
    if lo > MAX_SIZE or hi > MAX_SIZE:
      raise ValueError(f"padding must be at most 2**31 - 1; got {padding!r}.")
    resolved.append((int(lo), int(hi)))
  return tuple(resolved)


def _resolve_padding(padding: Any, in_spatial: tuple[int, ...], window: tuple[int, ...],
                     strides: tuple[int, ...], dilation: tuple[int, ...]
                     ) -> tuple[tuple[int, int], ...]:
  n = len(in_spatial)
  check_static("padding", padding)
  if isinstance(padding, str):
    padding_string(padding)  # the ops take no "FULL"
    return resolve_string_padding(padding, in_spatial, window, strides, dilation)
  if is_int(padding):
    if padding < 0:
      raise ValueError(f"padding must be >= 0; got {padding!r}.")
    if padding > MAX_SIZE:
      raise ValueError(f"padding must be at most 2**31 - 1; got {padding!r}.")
    return ((int(padding), int(padding)),) * n
  return padding_pairs(padding, n)


def check_window_fits(dim: int, size: int, pads: tuple[int, int], eff: int, window: Any,
                      dilation: Any, *, name: str = "window_shape") -> None:
  """Raises ValueError if the effective window ``eff`` is larger than the padded input along
  spatial dim ``dim`` (``window`` and ``dilation`` as the caller got them, for the message)."""
  lo, hi = pads
  if size + lo + hi < eff:
    raise ValueError(
        f"window larger than the padded input in spatial dim {dim}: effective window {eff}, "
        f"padded size {size + lo + hi} (input {size}, padding {pads}); {name}={window!r}, "
        f"dilation={dilation!r}.")


def _shape(name: str, shape: Any) -> tuple[int, ...]:
  """Checks a shape: a sequence of ints >= 0 (NumPy integers too; not bools, floats or str)."""
  if isinstance(shape, (str, bytes)):
    raise TypeError(f"{name} must be a shape, a tuple of ints >= 0; got {shape!r}.")
  try:
    items = tuple(shape)
  except TypeError:
    raise TypeError(f"{name} must be a shape, a tuple of ints >= 0; got {shape!r}.") from None
  if not all(is_int(v) for v in items):
    bad = next(v for v in items if not is_int(v))
    raise TypeError(f"{name} must be a shape, a tuple of ints >= 0; got {shape!r}, whose entry "
                    f"{bad!r} is a {type(bad).__name__}.")
  if any(v < 0 for v in items):
    raise ValueError(f"{name} entries must be >= 0; got {shape!r}.")
  return tuple(int(v) for v in items)


def make_geometry(x_shape: Sequence[int], window_shape: Any, strides: Any = None,
                  padding: Any = "VALID", dilation: Any = None, ceil_mode: bool = False,
                  data_format: str = "channels_last", *, name: str = "x") -> Geometry:
  """Checks a pooling configuration against an input shape and resolves it.

  ``x_shape`` (named ``name`` in errors) must be a tuple of ints >= 0: a float such as ``8.5``
  or a bool is refused, not truncated.

  Raises:
    TypeError, ValueError: naming the argument, the value received and what is allowed.
  """
  check_choice("data_format", data_format, DATA_FORMATS)
  check_bool("ceil_mode", ceil_mode)
  n = spatial_rank(window_shape)
  window = int_tuple("window_shape", window_shape, n)
  strides_t = int_tuple("strides", strides, n, default=1)
  dilation_t = int_tuple("dilation", dilation, n, default=1)
  # (An array's shape is always ints: a bad one is an x_shape passed to make_geometry itself.)
  x_shape = _shape("x_shape" if name == "x" else name, x_shape)
  check_rank(name, x_shape, n, data_format)
  channels_last = data_format == "channels_last"
  in_spatial = tuple(int(x_shape[a]) for a in spatial_axes(len(x_shape), n, channels_last))
  if any(L > MAX_SIZE for L in in_spatial):
    raise ValueError(f"{name}'s spatial sizes must each be at most 2**31 - 1; got shape "
                     f"{x_shape} (spatial {in_spatial}).")
  eff = tuple(effective_window(k, d) for k, d in zip(window, dilation_t, strict=True))
  pads = _resolve_padding(padding, in_spatial, window, strides_t, dilation_t)
  out_spatial, extra = [], []
  for i, (L, (lo, hi), e, s) in enumerate(zip(in_spatial, pads, eff, strides_t, strict=True)):
    if lo >= e or hi >= e:
      raise ValueError(
          f"padding must be smaller than the effective window (dilation*(window-1)+1 = {e}) "
          f"on each side; got {(lo, hi)} for spatial dim {i} (padding={padding!r}).")
    span = L + lo + hi
    if span > MAX_SIZE or e > MAX_SIZE:
      raise ValueError(
          f"the padded input ({span}) and the effective window ({e}) must each be at most "
          f"2**31 - 1 in spatial dim {i}; got window_shape={window_shape!r}, "
          f"dilation={dilation!r}, padding={padding!r}.")
    check_window_fits(i, L, (lo, hi), e, window_shape, dilation)
    if ceil_mode:
      out = -(-(span - e) // s) + 1
      if (out - 1) * s >= L + lo:  # PyTorch: the last window must start inside input or lo pad
        out -= 1
    else:
      out = (span - e) // s + 1
    out_spatial.append(out)
    extra.append(max(0, (out - 1) * s + e - span))
  if math.prod(window) > MAX_SIZE:
    raise ValueError(
        f"window_shape must have at most 2**31 - 1 taps in all; got {window_shape!r} "
        f"({math.prod(window)} taps).")
  return Geometry(in_spatial=in_spatial, window=window, strides=strides_t, dilation=dilation_t,
                  padding=pads, extra=tuple(extra), out_spatial=tuple(out_spatial),
                  channels_last=channels_last)


def tap_valid_1d(geom: Geometry, dim: int, tap: int) -> np.ndarray:
  """Whether tap ``tap`` of each output position along ``dim`` lands on a real element."""
  o = np.arange(geom.out_spatial[dim], dtype=np.int64)
  pos = o * geom.strides[dim] + tap * geom.dilation[dim] - geom.padding[dim][0]
  return (pos >= 0) & (pos < geom.in_spatial[dim])


def real_taps(geom: Geometry, dim: int, o: Any, include_pad: bool = False,
              xp: Any = np) -> tuple[Any, Any]:
  """The first and the last tap of window ``o`` along ``dim`` inside the input (or the
  user-padded input): ``first > last`` where there is none. ``o`` is an int array of output
  positions; ``xp`` is ``numpy`` (static) or ``jax.numpy`` (inside kernels)."""
  s, d, k = geom.strides[dim], geom.dilation[dim], geom.window[dim]
  pad_lo, pad_hi = geom.padding[dim]
  lo = -pad_lo if include_pad else 0
  hi = geom.in_spatial[dim] + (pad_hi if include_pad else 0)
  # Tap t of window o reads o*s + t*d - pad_lo; the t in [0, k) landing in [lo, hi).
  first = xp.maximum(-((o * s - pad_lo - lo) // d), 0)  # ceil((lo - o*s + pad_lo) / d)
  last = xp.minimum((hi - 1 - o * s + pad_lo) // d, k - 1)
  return first, last


def window_count(geom: Geometry, dim: int, o: Any, include_pad: bool, xp: Any = np) -> Any:
  """Taps of window ``o`` along ``dim`` inside the input (or the user-padded input).

  Counted in closed form (:func:`real_taps`), so the cost is the same whatever the window.
  """
  first, last = real_taps(geom, dim, o, include_pad, xp)
  return xp.maximum(last - first + 1, 0)


def window_counts_1d(geom: Geometry, dim: int, include_pad: bool) -> np.ndarray:
  """:func:`window_count` of every output position along ``dim``."""
  return window_count(geom, dim, np.arange(geom.out_spatial[dim], dtype=np.int64), include_pad)


def phase_taps(geom: Geometry, dim: int, r: int) -> list[tuple[int, int]]:
  """The backward's plan along ``dim`` for input phase ``r``: ``(tap, q)`` for every tap that
  can hold the element ``m * s + r``, which lies at tap ``a`` of window ``m + q`` exactly when
  ``r + pad_lo - a * d = q * s``. Ascending taps."""
  out = []
  for a in range(geom.window[dim]):
    q, rem = divmod(r + geom.padding[dim][0] - a * geom.dilation[dim], geom.strides[dim])
    if not rem:
      out.append((a, q))
  return out


def phase_offsets(geom: Geometry, dim: int) -> set[int]:
  """The offsets ``q`` (:func:`phase_taps`) of every input phase along ``dim``: the windows,
  relative to a block of the backward's rows, that the block reads (more than one where
  neighbouring blocks read the same windows)."""
  return {q for r in range(geom.strides[dim]) for _, q in phase_taps(geom, dim, r)}


def taps_dtype(num_taps: int) -> np.dtype:
  """The narrowest signed int holding a tap index and the "no real element" sentinel."""
  if num_taps <= np.iinfo(np.int8).max:
    return np.dtype(np.int8)
  if num_taps <= np.iinfo(np.int16).max:
    return np.dtype(np.int16)
  return np.dtype(np.int32)
