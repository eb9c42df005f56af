"""Max and min pooling with large windows that cannot overlap: the disjoint form.

Where every spatial dim's window span fits in its stride (``d * (k - 1) + 1 <= s``), each input
element lies in at most one window. Then the windows are a view of the (padded) input: pad or
crop each spatial dim to ``out * s`` elements, split it into ``(out, s)`` and keep the first
span's elements, ``d`` apart: ``(..., out, k, ...)`` per dim, a pad, a reshape and a slice. On
that view:

- **the forward with taps** is one variadic ``lax.reduce`` over the window axes carrying
  ``(value, tap)``, whose combiner keeps the better of two by :func:`dtypes.beats` (NaN above
  every number, ``+0.0`` above ``-0.0``), the lower tap on ties, and never an element that is
  padding, ceil-mode overhang or masked (tap ``-1``). That is a total order on a window's
  elements, so the order in which XLA combines them does not matter: the winner is the first
  maximum in row-major order, the separable form's and the direct form's, with its bits (NaN
  payloads included). A window with no real element gives ``lowest`` and tap ``-1``.
- **the gather at the taps** (forward mode) selects each window's element at its tap from the
  view, bit for bit (an OR of the bits, zero elsewhere); tap ``-1`` gives ``+0.0``.
- **its transpose, the gradient**, writes each window's cotangent at its winner and zero
  elsewhere, and places the view back into the input's shape (a select, a pad, a reshape and a
  pad): no sums, so no summation order. The separable form's stages turn a ``-0.0`` into
  ``+0.0`` (a sum that leaves out some taps); so does this form, for the same bits.

Each is a few XLA ops that fuse into about one pass, and the program is the same size
whatever the window. Average pooling keeps the separable sums. Under Explicit mesh axes (the
view's reshapes would need shardings of their own) the separable form runs, with the same bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src import xla_separable
from jaxpool._src.dtypes import beats, bits, lowest
from jaxpool._src.linear import LinearPair
from jaxpool._src.windows import Geometry, taps_dtype
from jaxpool._src.xla_taps import explicit_sharding, input_shape

__all__ = ["gather_at_taps", "is_disjoint", "max_pool_taps"]


def is_disjoint(geom: Geometry) -> bool:
  """Whether no two windows of ``geom`` share an element: in every spatial dim the window's
  span ``d * (k - 1) + 1`` is at most the stride."""
  return all(e <= s for e, s in zip(geom.effective_window, geom.strides, strict=True))


def _window_axes(geom: Geometry, ndim: int) -> tuple[int, ...]:
  """The window axes of the view of an ``ndim``-dim array (each right after its output axis)."""
  return tuple(ax + i + 1 for i, ax in enumerate(geom.spatial_axes(ndim)))


def _view(a: jax.Array, geom: Geometry, fill) -> jax.Array:
  """``a`` (input shape) as its windows: each spatial dim ``L`` becomes ``(out, k)``, element
  ``(o, j)`` the one at padded position ``o * s + j * d``; ``fill`` where that is padding."""
  axes = geom.spatial_axes(a.ndim)
  cfg = [(0, 0, 0)] * a.ndim
  for ax, L, (lo, _), o, s in zip(axes, geom.in_spatial, geom.padding, geom.out_spatial,
                                  geom.strides, strict=True):
    cfg[ax] = (lo, o * s - lo - L, 0)  # (a negative end crops)
  a = lax.pad(a, np.asarray(fill, a.dtype), cfg)
  split: list[int] = []
  for ax, n in enumerate(a.shape):
    if ax in axes:
      i = axes.index(ax)
      split += [geom.out_spatial[i], geom.strides[i]]
    else:
      split.append(n)
  a = a.reshape(split)
  limits, steps = list(a.shape), [1] * a.ndim
  for wax, e, d in zip(_window_axes(geom, a.ndim - len(axes)), geom.effective_window,
                       geom.dilation, strict=True):
    limits[wax], steps[wax] = e, d
  return lax.slice(a, (0,) * a.ndim, limits, steps)


def _unview(w: jax.Array, geom: Geometry) -> jax.Array:
  """The transpose of :func:`_view` (its padding dropped): the view's elements placed back at
  their input positions, zero at the elements no window reads."""
  ndim = w.ndim - geom.nspatial
  waxes = _window_axes(geom, ndim)
  cfg = [(0, 0, 0)] * w.ndim
  for wax, e, s, d in zip(waxes, geom.effective_window, geom.strides, geom.dilation,
                          strict=True):
    cfg[wax] = (0, s - e, d - 1)  # k taps -> s positions
  w = lax.pad(w, np.zeros((), w.dtype), cfg)
  merged = [n for ax, n in enumerate(w.shape) if ax not in waxes]
  axes = geom.spatial_axes(ndim)
  for ax, o, s in zip(axes, geom.out_spatial, geom.strides, strict=True):
    merged[ax] = o * s
  g = w.reshape(merged)
  cfg = [(0, 0, 0)] * ndim
  for ax, L, (lo, _), o, s in zip(axes, geom.in_spatial, geom.padding, geom.out_spatial,
                                  geom.strides, strict=True):
    cfg[ax] = (-lo, L + lo - o * s, 0)
  return lax.pad(g, np.zeros((), g.dtype), cfg)


def _local_taps(geom: Geometry, ndim: int, *, valid: bool) -> jax.Array:
  """Each view element's row-major tap number in its window (int32, broadcastable to the view
  of an ``ndim``-dim array); with ``valid``, ``-1`` where it reads padding or the ceil-mode
  overhang. One small constant per spatial dim, added in the program."""
  axes = geom.spatial_axes(ndim)
  out = None
  for i, (ax, k, s, d, (lo, _), o, L) in enumerate(zip(
      axes, geom.window, geom.strides, geom.dilation, geom.padding, geom.out_spatial,
      geom.in_spatial, strict=True)):
    a = np.arange(k)
    term = np.broadcast_to(a * math.prod(geom.window[i + 1:]), (o, k))
    if valid:
      pos = np.arange(o)[:, None] * s + a[None, :] * d - lo
      real = (pos >= 0) & (pos < L)
      # (an invalid tap sends the sum below -1 whatever the other dims add)
      term = np.where(real, term, -geom.num_taps)
    shape = [1] * (ndim + geom.nspatial)
    shape[ax + i], shape[ax + i + 1] = o, k
    c = jnp.asarray(term.astype(np.int32).reshape(shape))
    out = c if out is None else out + c
  assert out is not None
  return jnp.maximum(out, -1) if valid else out


def _better(a, b):
  """The combiner: of two ``(value, tap)`` pairs the one that wins a window (module
  docstring). A total order: ``beats`` is a strict weak order on values, the taps in a window
  are distinct, and every tap ``-1`` pair holds ``lowest``."""
  (va, ta), (vb, tb) = a, b
  take_a = (tb < 0) | ((ta >= 0) & (beats(va, vb) | (~beats(vb, va) & (ta < tb))))
  return jnp.where(take_a, va, vb), jnp.where(take_a, ta, tb)


def max_pool_taps(x: jax.Array, geom: Geometry,
                  mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """``(y, taps)`` as ``xla.max_pool_taps`` gives them (the same bits): one reduction over
  the windows' view (module docstring); ``mask`` (bool, broadcastable to ``x``; None: every
  element) marks the elements that may win."""
  if explicit_sharding(x) is not None or (mask is not None and explicit_sharding(mask)):
    return xla_separable.max_pool_taps(x, geom, mask)
  adt = taps_dtype(geom.num_taps)
  low = lowest(x.dtype)
  xw = _view(x, geom, low)
  tw = _local_taps(geom, x.ndim, valid=True)
  if mask is not None:
    mw = _view(jnp.broadcast_to(mask, x.shape), geom, False)
    tw = jnp.where(mw, tw, -1)
    xw = jnp.where(mw, xw, low)  # (a pair of tap -1 holds lowest)
  tw = jnp.broadcast_to(tw, xw.shape).astype(adt)
  y, taps = lax.reduce((xw, tw), (low, np.array(-1, adt)), _better,
                       _window_axes(geom, x.ndim))
  return y, taps


def gather_at_taps(t: jax.Array, taps: jax.Array, geom: Geometry) -> jax.Array:
  """``t`` at each window's winner (``taps`` as :func:`max_pool_taps` gives them), ``+0.0``
  where ``taps < 0``: a pair of jaxpool primitives (:data:`GATHER`) whose transpose, the
  gradient, is :func:`scatter_to_taps`; reverse mode keeps the taps only. Under Explicit mesh
  axes the separable form's gather (the same bits, and JAX's transpose of it)."""
  if explicit_sharding(taps) is None and explicit_sharding(t) is None:
    return GATHER.forward(taps, t, geom=geom)
  return xla_separable.gather_at_taps(t, taps, geom)


def _hits(taps: jax.Array, geom: Geometry) -> jax.Array:
  """Where each view element is its window's winner (bool, the view's shape broadcastable)."""
  local = _local_taps(geom, taps.ndim, valid=False)
  return local == jnp.expand_dims(taps.astype(jnp.int32), _window_axes(geom, taps.ndim))


def _gather(taps: jax.Array, t: jax.Array, geom: Geometry) -> jax.Array:
  """:func:`gather_at_taps`'s computation: an OR over each window of the bits of ``t`` at its
  winner and zeros (exact: NaN payloads and zero signs kept)."""
  as_bits = jnp.issubdtype(t.dtype, jnp.floating)
  u = lax.bitcast_convert_type(t, jnp.dtype(f"uint{bits(t.dtype)}")) if as_bits else t
  uw = _view(u, geom, 0)
  sel = jnp.where(_hits(taps, geom), uw, np.zeros((), u.dtype))
  g = lax.reduce(sel, np.zeros((), u.dtype), lax.bitwise_or, _window_axes(geom, t.ndim))
  return lax.bitcast_convert_type(g, t.dtype) if as_bits else g


def scatter_to_taps(taps: jax.Array, ct: jax.Array, geom: Geometry) -> jax.Array:
  """The transpose of :func:`gather_at_taps` (the gradient): each window's cotangent at its
  winner, zero elsewhere; a ``-0.0`` cotangent gives ``+0.0``, as the separable form's sums
  do. (Under Explicit mesh axes: the separable form's transpose.)"""
  if explicit_sharding(ct) is not None or explicit_sharding(taps) is not None:
    return xla_separable.scatter_to_taps(taps, ct, geom)
  c = jnp.expand_dims(ct, _window_axes(geom, ct.ndim))
  zero = np.zeros((), ct.dtype)
  # (a select, not ``+ 0.0``: XLA folds away an added zero)
  w = jnp.where(_hits(taps, geom) & (c != zero), c, zero)
  return _unview(w, geom)


GATHER = LinearPair(
    "xla_disjoint_gather",
    lambda taps, t, *, geom: _gather(taps, t, geom),
    lambda taps, ct, *, geom: scatter_to_taps(taps, ct, geom),
    lambda taps_shape, t_shape, **_: taps_shape,
    lambda taps_shape, ct_shape, *, geom: input_shape(ct_shape, geom))
