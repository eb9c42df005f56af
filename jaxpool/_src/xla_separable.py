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
each a loop over that dim's taps with slices and selects (no scatter with duplicates). Each
input element's gradient sums, for each stage from the first spatial dim to the last, the
cotangents that reach it in descending tap order of that dim (docs/semantics.md, "Large
windows"). This order is not the direct form's, so the choice of form depends on the geometry
only: the Pallas kernels serve at most ``SEPARABLE_TAPS`` taps in one call, and larger max and
min pools a dim at a time in this same order (``pallas/ops.py``, ``stages``).

The gather is a pair of jaxpool primitives (``linear.LinearPair``) whose transpose,
:func:`scatter_to_taps`, is written by stride phase: along a dim of stride ``s``, the input
elements of one phase (``p + lo = b * s + r``) are reached only by the taps ``a`` with
``a * d % s == r``, each from an output-sized, shifted array, so a stage adds
``ceil(k * gcd(d, s) / s)`` terms an element, not ``k`` (JAX's own transpose of the gather adds
one full-size array per tap, ``+0.0`` off the element's phase: the phase form turns a ``-0.0``
sum into ``+0.0`` where it leaves taps out, which gives the same bits). The routing runs by
phase the same way. A dim of more than ``UNROLL_TAPS`` taps keeps its loop and JAX's transpose of
it.

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
from jaxpool._src.linear import LinearPair
from jaxpool._src.windows import Geometry, tap_valid_1d, taps_dtype
from jaxpool._src.xla_taps import (SEPARABLE_TAPS, UNROLL_SUM_TAPS, UNROLL_TAPS,
                                   explicit_sharding, fold_taps, input_shape,
                                   is_separable)

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


def _by_phase(like: jax.Array, geom: Geometry, i: int, term, combine, fill, dtype, *,
              fix_zero: bool = False) -> jax.Array:
  """An array at input resolution along spatial dim ``i`` (``like``: at output resolution), built
  by stride phase: input position ``p`` lies at padded position ``p + lo = b * s + r``, where
  tap ``a`` of window ``b - (a * d) // s`` lands exactly when ``(a * d) % s == r``. So phase
  ``r``'s plane (``b`` over the blocks) combines, over those taps in descending order, ``term(a)``
  (output-sized) shifted by ``(a * d) // s`` blocks (``fill`` outside the windows): the taps of
  one phase, ``ceil(k * gcd(d, s) / s)`` at most, not all ``k`` at input resolution. The planes
  are interleaved and cropped to the input (of ``dtype``, the terms').

  ``fix_zero``: the sum of a phase that leaves out some taps turns ``-0.0`` into ``+0.0``, as
  adding the left-out taps' ``+0.0`` would (the only bits a ``+0.0`` term can change).
  """
  ax, k, s, d, lo, _, out = _stage(geom, i, like.ndim)
  L = geom.in_spatial[i]
  blocks = L if s == 1 else -(-(lo + L) // s)
  shift = -lo if s == 1 else 0  # (stride 1: crop while shifting)
  fillv = np.array(fill, dtype)
  planes = []
  for r in range(s):
    taps = [a for a in reversed(range(k)) if (a * d) % s == r]
    acc = None
    for a in taps:
      q = (a * d) // s + shift
      cfg = [(0, 0, 0)] * like.ndim
      cfg[ax] = (q, blocks - out - q, 0)  # negative ends crop
      v = lax.pad(term(a), fillv, cfg)
      acc = v if acc is None else combine(acc, v)
    if acc is None:
      shape = list(like.shape)
      shape[ax] = blocks
      acc = _full(like, fill, dtype, shape)
    elif fix_zero and len(taps) < k:
      # (a select: XLA would fold away an added zero)
      acc = jnp.where(acc == 0, jnp.zeros((), acc.dtype), acc)
    planes.append(acc)
  if s == 1:
    return planes[0]
  shape = list(planes[0].shape)
  shape[ax] = blocks * s
  merged = jnp.stack(planes, axis=ax + 1).reshape(shape)
  return lax.slice_in_dim(merged, lo, lo + L, axis=ax)


def _route(ti: jax.Array, rem: jax.Array, geom: Geometry, i: int) -> jax.Array:
  """``rem`` moved from output to input resolution along spatial dim ``i``: at each input
  position the ``rem`` of the windows whose tap ``ti`` lands there (they agree: module
  docstring), ``-1`` where none does."""
  ax, k, s, d, lo, hi, out = _stage(geom, i, ti.ndim)
  neg = np.array(-1, rem.dtype)
  if k <= UNROLL_TAPS and explicit_sharding(ti) is None:
    return _by_phase(ti, geom, i, lambda a: jnp.where(ti == a, rem, neg), jnp.maximum, -1,
                     rem.dtype)
  L = geom.in_spatial[i]
  size = (out - 1) * s + 1
  shape = list(ti.shape)
  shape[ax] = L

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

  A pair of jaxpool primitives (:data:`GATHER`): its transpose, the gradient, is
  :func:`scatter_to_taps`; reverse mode keeps the taps only, and the transpose recomputes the
  routed taps from them. Under Explicit mesh axes (where the phase form's reshapes would need a
  sharding of their own) the gather is rematerialised as a whole and JAX transposes it.
  """
  if explicit_sharding(taps) is None and explicit_sharding(t) is None:
    return GATHER.forward(taps, t, geom=geom)
  return _remat_gather(t, taps, geom)


def _routed(taps: jax.Array, geom: Geometry) -> list[jax.Array]:
  """``parts[i]``: at input resolution in the dims before ``i`` and output resolution in the
  others, the offset of each winner among the taps of dims ``i`` and after."""
  inner = [math.prod(geom.window[i + 1:]) for i in range(geom.nspatial)]
  p = taps.astype(taps_dtype(geom.num_taps))  # (every offset fits: the forward's dtype)
  parts = [p]
  for i in range(geom.nspatial - 1):
    # (-1 // inner == -1: a window with no winner stays without one)
    p = _route(p // inner[i], jnp.where(p >= 0, p % inner[i], -1), geom, i)
    parts.append(p)
  return [part // n for part, n in zip(parts, inner, strict=True)]


def _gather_stage(g: jax.Array, ti: jax.Array, geom: Geometry, i: int) -> jax.Array:
  """Stage ``i`` of the gather: ``g`` (input resolution along dim ``i``) read at each window's
  tap ``ti`` of that dim, a fold over its taps."""
  ax, k, s, d, lo, hi, out = _stage(geom, i, g.ndim)
  gp = _pad_axis(g, ax, lo, hi, 0)

  def step(a, acc):
    return jnp.where(ti == a, _take(gp, ax, a * d, out, s), acc)

  return _fold(k, step, lambda: _full(ti, 0, g.dtype))


def _gather(t: jax.Array, taps: jax.Array, geom: Geometry) -> jax.Array:
  """:func:`gather_at_taps`'s computation: ``t`` read along the last dim, then the one before,
  each through that dim's taps."""
  parts = _routed(taps, geom)
  g = t
  for i in reversed(range(geom.nspatial)):
    g = _gather_stage(g, parts[i], geom, i)
  return g


_remat_gather = jax.checkpoint(_gather, static_argnums=(2,), prevent_cse=False)


def scatter_to_taps(taps: jax.Array, ct: jax.Array, geom: Geometry) -> jax.Array:
  """The transpose of :func:`gather_at_taps` (the gradient): the stages in reverse, the first
  spatial dim first, each moving the partial sums from output to input resolution along its
  dim.

  A stage of at most ``UNROLL_TAPS`` taps runs by stride phase (:func:`_by_phase`): each input
  element adds the terms of its phase's taps only, in descending tap order, where JAX's own
  transpose of the stage adds one full-size term per tap (``+0.0`` off the element's phase),
  then turns a ``-0.0`` sum into ``+0.0`` as those terms would: the same bits, in
  ``O(ceil(k * d / s))`` work per element instead of ``O(k)``. A longer stage (a loop over its
  taps) keeps JAX's transpose of the loop (its trips' grouping of the sums).
  """
  if explicit_sharding(ct) is not None or explicit_sharding(taps) is not None:
    # (a cotangent sharded where its tangent was not, under ``linearize``: JAX's transpose)
    like = jax.ShapeDtypeStruct(input_shape(ct.shape, geom), ct.dtype)
    return jax.linear_transpose(lambda v: _gather(v, taps, geom), like)(ct)[0]
  parts = _routed(taps, geom)
  g = ct
  for i in range(geom.nspatial):
    ti = parts[i]
    if geom.window[i] <= UNROLL_TAPS:
      zero = np.array(0, g.dtype)
      g = _by_phase(ti, geom, i, lambda a, g=g, ti=ti, zero=zero: jnp.where(ti == a, g, zero),
                    lax.add, 0, g.dtype, fix_zero=True)
    else:
      like = jax.ShapeDtypeStruct(_input_shape_1d(g.shape, geom, i), g.dtype)
      g = jax.linear_transpose(lambda v, ti=ti, i=i: _gather_stage(v, ti, geom, i), like)(g)[0]
  return g


def _input_shape_1d(shape: tuple[int, ...], geom: Geometry, i: int) -> tuple[int, ...]:
  out = list(shape)
  out[geom.spatial_axes(len(shape))[i]] = geom.in_spatial[i]
  return tuple(out)


GATHER = LinearPair(
    "xla_separable_gather",
    lambda taps, t, *, geom: _gather(t, taps, geom),
    lambda taps, ct, *, geom: scatter_to_taps(taps, ct, geom),
    lambda taps_shape, t_shape, **_: taps_shape,
    lambda taps_shape, ct_shape, *, geom: input_shape(ct_shape, geom))


def window_sum(t: jax.Array, geom: Geometry) -> jax.Array:
  """Each window's sum of real elements, one dim at a time, each a fixed-order sum of tap
  slices (linear in ``t``: for tangents). A pair of jaxpool primitives (:data:`WINDOW_SUM`)
  whose transpose adds by stride phase (:func:`_window_sum_transpose`); under Explicit mesh
  axes JAX transposes the sums into pads and adds."""
  if explicit_sharding(t) is None:
    return WINDOW_SUM.forward(t, geom=geom)
  return _window_sum(t, geom)


def _sum_stage(t: jax.Array, geom: Geometry, i: int) -> jax.Array:
  ax, k, s, d, lo, hi, out = _stage(geom, i, t.ndim)
  tp = _pad_axis(t, ax, lo, hi, 0)
  return _fold(k, lambda a, acc: acc + _take(tp, ax, a * d, out, s),
               lambda: _take(tp, ax, 0, out, s), start=1, limit=UNROLL_SUM_TAPS)


def _window_sum(t: jax.Array, geom: Geometry) -> jax.Array:
  for i in reversed(range(geom.nspatial)):
    t = _sum_stage(t, geom, i)
  return t


def _window_sum_transpose(ct: jax.Array, geom: Geometry) -> jax.Array:
  """The transpose of :func:`window_sum`, the first spatial dim first: by stride phase up to
  ``UNROLL_SUM_TAPS`` taps a dim (each element adds its phase's taps in descending order, as
  :func:`scatter_to_taps`: the bits of JAX's own transpose), a loop's transpose beyond."""
  if explicit_sharding(ct) is not None:  # (as in scatter_to_taps)
    like = jax.ShapeDtypeStruct(input_shape(ct.shape, geom), ct.dtype)
    return jax.linear_transpose(lambda v: _window_sum(v, geom), like)(ct)[0]
  for i in range(geom.nspatial):
    if geom.window[i] <= UNROLL_SUM_TAPS:
      ct = _by_phase(ct, geom, i, lambda a, ct=ct: ct, lax.add, 0, ct.dtype,
                     fix_zero=True)
    else:
      like = jax.ShapeDtypeStruct(_input_shape_1d(ct.shape, geom, i), ct.dtype)
      ct = jax.linear_transpose(lambda v, i=i: _sum_stage(v, geom, i), like)(ct)[0]
  return ct


WINDOW_SUM = LinearPair(
    "xla_separable_window_sum",
    lambda t, *, geom: _window_sum(t, geom),
    lambda ct, *, geom: _window_sum_transpose(ct, geom),
    lambda t_shape, *, geom: geom.output_shape(t_shape),
    lambda ct_shape, *, geom: input_shape(ct_shape, geom))
