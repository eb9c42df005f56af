"""How a ``lax`` window op's dims map onto a jaxpool call (which dims are pooled), and back."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src.windows import effective_window, make_geometry, spatial_axes


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a ``lax`` window op's dims map onto a jaxpool call, and back.

  ``perm`` moves the batch/channel dims in front of the pooled dims (None: no transpose);
  ``expand`` adds a leading size-1 dim where there is no batch or channel dim at all;
  ``why`` says why a layout that needs no transpose was transposed anyway (for the report).
  """

  perm: tuple[int, ...] | None
  expand: bool
  data_format: str
  window: tuple[int, ...]
  strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  dilation: tuple[int, ...]
  why: str = ""

  def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(shape)
    if self.perm is not None:
      shape = tuple(shape[p] for p in self.perm)
    return (1, *shape) if self.expand else shape

  def to(self, a: jax.Array) -> jax.Array:
    if self.perm is not None:
      a = jnp.transpose(a, self.perm)
    return a[None] if self.expand else a

  def back(self, a: jax.Array) -> jax.Array:
    if self.expand:
      a = a[0]
    if self.perm is not None:
      a = jnp.transpose(a, tuple(int(i) for i in np.argsort(self.perm)))
    return a

  def describe(self) -> str:
    how = self.data_format + (", transposed" if self.perm is not None else "")
    if self.why:
      how = f"{self.data_format} on the transposed view: {self.why}"
    text = f"window {self.window}, strides {self.strides}, padding {self.padding}"
    if any(d != 1 for d in self.dilation):
      text += f", dilation {self.dilation}"
    return f"{text}, {how}"


def layout(shape: Sequence[int], window: Sequence[int], strides: Sequence[int],
           padding: Sequence[tuple[int, int]], dilation: Sequence[int] | None) -> Layout | str:
  """Maps per-dim ``lax`` window params onto jaxpool's layout; a string says why it cannot."""
  ndim = len(shape)
  dilation = tuple(dilation) if dilation is not None else (1,) * ndim
  padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  spatial = [i for i in range(ndim)
             if window[i] != 1 or strides[i] != 1 or padding[i] != (0, 0)]
  if not spatial:
    return "every window is a single element: nothing is pooled"
  k = len(spatial)
  other = [i for i in range(ndim) if i not in spatial]
  perm: tuple[int, ...] | None = None
  expand = False
  if tuple(spatial) == spatial_axes(ndim, k, True):
    data_format = "channels_last"
  elif tuple(spatial) == spatial_axes(ndim, k, False):
    data_format, expand = "channels_first", ndim == k
  else:
    data_format, perm = "channels_first", tuple(other + spatial)
    expand = not other
  pick = lambda v: tuple(int(v[i]) for i in spatial)
  out = Layout(perm=perm, expand=expand, data_format=data_format, window=pick(window),
               strides=pick(strides), padding=tuple(_trim(shape[i], window[i], strides[i],
                                                          padding[i], dilation[i])
                                                    for i in spatial),
               dilation=pick(dilation))
  try:
    make_geometry(out.shape(shape), out.window, out.strides, out.padding, out.dilation, False,
                  data_format)
  except (TypeError, ValueError) as e:
    return f"jaxpool does not take this window: {e}"
  return out


def _trim(size: int, k: int, s: int, pad: tuple[int, int], d: int) -> tuple[int, int]:
  """``pad`` without the end padding that no window reaches (Equinox's ``use_ceil`` pads a
  whole stride more than its last window needs): the same windows, so the same results."""
  lo, hi = pad
  eff = effective_window(k, d)
  if size + lo + hi < eff:
    return pad
  n = (size + lo + hi - eff) // s + 1
  return lo, min(hi, max(0, (n - 1) * s + eff - size - lo))
