"""Separable max, min and average pooling: windows of more than ``SEPARABLE_TAPS`` taps.

A window's maximum is the maximum over its rows of each row's maximum, so a pool can reduce one
spatial dim at a time: the last first (W, then H, then D), each stage a loop over that dim's
``k`` taps. The work per output grows with ``k`` per dim instead of the window's ``k^d`` taps.

**The winner.** Each stage keeps the first of equal maxima under :func:`dtypes.beats` (NaN above
every number, the first NaN; ``+0.0`` above ``-0.0``), and padding and the ceil-mode overhang
never win. Stage W gives, for every input row and output column, the first maximum of that
row's window part; stage H then keeps the first row whose maximum is the window's. The tap it
returns, ``th * kw + tw``, is the window's first maximum in row-major order: the smallest
``(th, tw)`` among the maxima, which is what the direct tap loop finds. (Reducing H first would
find the smallest ``(tw, th)``: column-major order, another element on ties.) So values, taps
and indices are the direct form's, bit for bit.

**The gradient** is the transpose of a gather that runs the stages backwards from the taps
alone. Every window that picks an element of a given input row at a given output column picks
it through the same row maximum (the row's window part is the same whichever window reads it),
so each window's taps can be routed, one dim at a time, to an intermediate array at input
resolution in that dim (:func:`_route`); the gather then reads ``t`` along W, then H, then D,
each a loop over that dim's taps with slices and selects, and JAX transposes it into pads and
adds (no scatter with duplicates). Each input element's gradient sums, for each stage from the
first spatial dim to the last, the cotangents that reach it in descending tap order of that dim
(docs/semantics.md, "Large windows"). This order is not the direct form's, so the choice of form
depends on the geometry only: the Pallas kernels serve at most ``SEPARABLE_TAPS`` taps.

Average pooling's sums (and their tangents) run the same way, one dim at a time, in the
accumulator dtype; their rounding differs from the direct sums' within float32 rounding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.dtypes import beats, lowest
from jaxpool._src.windows import Geometry, tap_valid_1d, taps_dtype
from jaxpool._src.xla_taps import SEPARABLE_TAPS, UNROLL_SUM_TAPS, fold_taps, is_separable

__all__ = ["SEPARABLE_TAPS", "gather_at_taps", "is_separable", "max_pool_taps", "window_sum"]


def _counter(k: int) -> Geometry:
  """A 1-D geometry of ``k`` taps: :func:`fold_taps` counts its taps."""
  return Geometry(in_spatial=(k,), window=(k,), strides=(1,), dilation=(1,), padding=((0, 0),),
                  extra=(0,), out_spatial=(1,), channels_last=True)


def _fold(k: int, step, init, *, start: int = 0, limit: int | None = None):
  """``carry = step(a, carry)`` for ``a = start, ..., k - 1``: Python ints in straight-line code
  up to ``UNROLL_TAPS`` (or ``limit``) taps, else int32 scalars in a loop (``fold_taps``)."""
  return fold_taps(_counter(k), lambda j, tap, c: step(tap[0], c), init, start=start,
                   limit=limit)


def _static(a) -> bool:
  return isinstance(a, (int, np.integer))


def _full(like: jax.Array, fill, dtype=None, shape=None) -> jax.Array:
  """``lax.full_like`` that keeps ``like``'s sharding where it is in its type (Explicit mesh
  axes), with a new shape too (pooling keeps every dim's role)."""
  sharding = getattr(jax.typeof(like), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    sharding = None
  return lax.full_like(like, fill, dtype, shape=shape, sharding=sharding)


def _pad_axis(a: jax.Array, ax: int, lo: int, hi: int, fill) -> jax.Array:
  cfg = [(0, 0, 0)] * a.ndim
  cfg[ax] = (lo, hi, 0)
  return lax.pad(a, jnp.asarray(fill, a.dtype), cfg)


def _take(a: jax.Array, ax: int, start, count: int, stride: int) -> jax.Array:
  """``count`` elements along ``ax`` from ``start`` (an int or an int32 scalar), ``stride``
  apart."""
  size = (count - 1) * stride + 1
  if _static(start):
    return lax.slice_in_dim(a, start, start + size, stride, ax)
  return lax.slice_in_dim(lax.dynamic_slice_in_dim(a, start, size, ax), 0, size, stride, ax)


def _stage(geom: Geometry, i: int, ndim: int):
  """Spatial dim ``i``'s axis, taps, stride, dilation, full padding and output size."""
  lo, hi = geom.full_padding[i]
  return (geom.spatial_axes(ndim)[i], geom.window[i], geom.strides[i], geom.dilation[i], lo, hi,
          geom.out_spatial[i])


def _tap_valid(geom: Geometry, i: int, a, ndim: int, ax: int):
  """Where tap ``a`` of dim ``i`` reads a real element, shaped to broadcast along ``ax``; None
  where it always does."""
  out, s, d = geom.out_spatial[i], geom.strides[i], geom.dilation[i]
  lo, L = geom.padding[i][0], geom.in_spatial[i]
  shape = [1] * ndim
  shape[ax] = out
  if _static(a):
    valid = tap_valid_1d(geom, i, a)
    return None if valid.all() else valid.reshape(shape)
  if lo == 0 and (out - 1) * s + (geom.window[i] - 1) * d < L:
    return None  # every tap of every window is real along this dim
  pos = lax.iota(np.int32, out) * s + a * d - lo
  return ((pos >= 0) & (pos < L)).reshape(shape)


def max_pool_taps(x: jax.Array, geom: Geometry,
                  mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """``(y, taps)`` as ``xla.max_pool_taps`` gives them (the same bits), one dim at a time.

  Stage ``i`` carries each partial window's maximum and the row-major offset of its winner
  among the dims it has reduced (``-1``: no real element yet, which never wins); ``mask`` (bool,
  broadcastable to ``x``; None: every element) is read by the first stage.
  """
  ndim = x.ndim
  adt = taps_dtype(geom.num_taps)
  low = lowest(x.dtype)
  v, part = x, None
  m = None if mask is None else jnp.broadcast_to(mask, x.shape)
  for i in reversed(range(geom.nspatial)):
    ax, k, s, d, lo, hi, out = _stage(geom, i, ndim)
    inner = math.prod(geom.window[i + 1:])
    vp = _pad_axis(v, ax, lo, hi, low)
    pp = None if part is None else _pad_axis(part, ax, lo, hi, -1)
    mp = None if m is None else _pad_axis(m, ax, lo, hi, False)

    def step(a, carry, i=i, ax=ax, s=s, d=d, out=out, inner=inner, vp=vp, pp=pp, mp=mp):
      best, win = carry
      xt = _take(vp, ax, a * d, out, s)
      cand = jnp.asarray(a * inner).astype(adt)
      if pp is None:
        valid = (_tap_valid(geom, i, a, ndim, ax) if mp is None
                 else _take(mp, ax, a * d, out, s))
      else:
        pt = _take(pp, ax, a * d, out, s)
        valid, cand = pt >= 0, cand + pt
      better = (win < 0) | beats(xt, best)
      if valid is not None:
        better = better & valid
      return jnp.where(better, xt, best), jnp.where(better, cand, win)

    like = _take(vp, ax, 0, out, s)
    v, part = _fold(k, step, lambda like=like: (_full(like, low), _full(like, -1, adt)))
    m = None
  assert part is not None
  return v, part


def _route(ti: jax.Array, rem: jax.Array, geom: Geometry, i: int) -> jax.Array:
  """``rem`` moved from output to input resolution along spatial dim ``i``: at each input
  position the ``rem`` of the windows whose tap ``ti`` lands there (they agree: module
  docstring), ``-1`` where none does."""
  ax, k, s, d, lo, hi, out = _stage(geom, i, ti.ndim)
  L = geom.in_spatial[i]
  size = (out - 1) * s + 1
  shape = list(ti.shape)
  shape[ax] = L
  neg = np.array(-1, rem.dtype)

  def step(a, acc):
    sel = jnp.where(ti == a, rem, neg)
    cfg = [(0, 0, 0)] * ti.ndim
    if _static(a):
      cfg[ax] = (a * d - lo, L - (a * d - lo) - size, s - 1)  # negative ends crop
      placed = lax.pad(sel, neg, cfg)
    else:
      cfg[ax] = (0, 0, s - 1)
      spread = lax.pad(sel, neg, cfg)
      full = list(shape)
      full[ax] = lo + L + hi
      placed = lax.dynamic_update_slice_in_dim(_full(ti, -1, rem.dtype, full), spread, a * d,
                                               ax)
      placed = lax.slice_in_dim(placed, lo, lo + L, axis=ax)
    return jnp.maximum(acc, placed)

  return _fold(k, step, lambda: _full(ti, -1, rem.dtype, shape))


def gather_at_taps(t: jax.Array, taps: jax.Array, geom: Geometry) -> jax.Array:
  """``t`` at each window's winner (``taps`` as :func:`max_pool_taps` gives them), zero where
  ``taps < 0``: the stages run backwards, linear in ``t`` (module docstring).

  Rematerialised as a whole: reverse mode keeps the taps, not the routed taps or the selects'
  masks, and its transpose recomputes them.
  """
  return _remat_gather(t, taps, geom)


def _gather(t: jax.Array, taps: jax.Array, geom: Geometry) -> jax.Array:
  """:func:`gather_at_taps`'s computation.

  ``parts[i]`` holds, at input resolution in the dims before ``i`` and output resolution in the
  others, the offset of each winner among the taps of dims ``i`` and after; ``t`` is then read
  along the last dim, then the one before, each through that dim's taps.
  """
  n = geom.nspatial
  inner = [math.prod(geom.window[i + 1:]) for i in range(n)]
  p = taps.astype(taps_dtype(geom.num_taps))  # (every offset fits: the forward's dtype)
  parts = [p]
  for i in range(n - 1):
    # (-1 // inner == -1: a window with no winner stays without one)
    p = _route(p // inner[i], jnp.where(p >= 0, p % inner[i], -1), geom, i)
    parts.append(p)
  g = t
  for i in reversed(range(n)):
    ax, k, s, d, lo, hi, out = _stage(geom, i, t.ndim)
    ti = parts[i] // inner[i]
    gp = _pad_axis(g, ax, lo, hi, 0)

    def step(a, acc, ax=ax, s=s, d=d, out=out, ti=ti, gp=gp):
      return jnp.where(ti == a, _take(gp, ax, a * d, out, s), acc)

    g = _fold(k, step, lambda ti=ti: _full(ti, 0, t.dtype))
  return g


_remat_gather = jax.checkpoint(_gather, static_argnums=(2,), prevent_cse=False)


def window_sum(t: jax.Array, geom: Geometry) -> jax.Array:
  """Each window's sum of real elements, one dim at a time, each a fixed-order sum of tap
  slices (linear in ``t``: for tangents; JAX transposes it into pads and adds)."""
  for i in reversed(range(geom.nspatial)):
    ax, k, s, d, lo, hi, out = _stage(geom, i, t.ndim)
    tp = _pad_axis(t, ax, lo, hi, 0)
    t = _fold(k, lambda a, acc, ax=ax, s=s, d=d, out=out, tp=tp: acc + _take(tp, ax, a * d,
                                                                            out, s),
              lambda ax=ax, s=s, out=out, tp=tp: _take(tp, ax, 0, out, s), start=1,
              limit=UNROLL_SUM_TAPS)
  return t
