"""The XLA backend: pooling on ``lax.reduce_window`` and tap loops, and its derivatives.

Max pooling plugs three functions into the shared rule (:mod:`jaxpool._src.autodiff`): the
forward is ``lax.reduce_window`` (the inference path, nothing kept); the forward with taps runs a
tap loop that finds each window's winner (an int8 tap offset where the window has at most 127
taps); the gather picks the tangent at the winner with ``lax.select_n``. That gather is linear in
the tangent; its transpose is the max-pool gradient, a scatter-add in which each input element
sums, in a fixed tap order, the cotangents of the windows that chose it. No atomics, so the bits
are the same on every run. On a CPU that transpose is written by stride phase
(:func:`scatter_to_taps`, through a pair of jaxpool's own primitives), elsewhere JAX derives it.
The residual that reverse mode keeps is the taps, not the input. Average and Lp pooling are
``custom_jvp``s of their own here.

Masked pooling (a bool ``mask``, True at real elements) runs here only: the max pool is the same
shared rule on the operand ``(x, mask)`` (:data:`MASKED_MAX_POOL_OPS`), whose tap loop reads the
mask per tap as it reads ``x`` (padding reads False), so a masked element never wins; the
average divides each window's sum of unmasked elements by their count.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.autodiff import MaxPoolOps, apply_activation
from jaxpool._src.dtypes import accumulator_dtype, beats, lowest
from jaxpool._src.linear import LinearPair
from jaxpool._src.windows import (Geometry, phase_taps, tap_valid_1d, taps_dtype,
                                  window_counts_1d)

__all__ = ["accumulator_dtype", "lowest"]  # (re-exported: the kernels' reference values)


def _window_args(geom: Geometry, ndim: int, *, with_extra: bool = True):
  pads = geom.full_padding if with_extra else geom.padding
  return dict(
      window_dimensions=geom.full_dims(ndim, geom.window, 1),
      window_strides=geom.full_dims(ndim, geom.strides, 1),
      padding=geom.full_dims(ndim, pads, (0, 0)),
      window_dilation=geom.full_dims(ndim, geom.dilation, 1),
  )


def _pad(x: jax.Array, geom: Geometry, fill) -> jax.Array:
  cfg = geom.full_dims(x.ndim, [(lo, hi, 0) for lo, hi in geom.full_padding], (0, 0, 0))
  return lax.pad(x, jnp.asarray(fill, x.dtype), cfg)


# ----------------------------------------------------------------------------- taps
#
# A window's taps are visited in row-major order, the order that breaks ties. Windows of at most
# UNROLL_TAPS taps run as straight-line code: one static slice per tap, which XLA fuses best.
# Larger windows (global pooling, say) run a loop over the taps whose body reads its tap with a
# dynamic slice: compile time and memory stay the same whatever the window's size. The loop body
# is rematerialised in reverse mode, so the transpose keeps no per-tap residuals: it adds each
# tap's cotangent into place (one output-sized update per tap).

# Compile time grows with the taps below these (benchmarks/probes/unroll_threshold.py measures both
# forms): the max's winner search and gather loop from 64 taps on; the sums (average and Lp
# tangents, Lp forward) run several times faster unrolled and compile fast, so they loop from 256.
UNROLL_TAPS = 64
UNROLL_SUM_TAPS = 256
TAPS_PER_TRIP = 8  # taps per trip of the loop

Tap = tuple  # one coordinate per spatial dim: Python ints (straight-line code) or int32 scalars


def _is_static(tap: Tap) -> bool:
  return all(isinstance(t, (int, np.integer)) for t in tap)


def _tap_coords(geom: Geometry, j: jax.Array) -> Tap:
  """The row-major coordinates of tap number ``j`` (an int32 scalar)."""
  coords = []
  for k in reversed(geom.window):
    coords.append(j % k)
    j = j // k
  return tuple(reversed(coords))


def _fold_taps(geom: Geometry, step, init, start: int = 0, limit: int | None = None):
  """``carry = step(j, tap, carry)`` for the taps ``j = start, start + 1, ...`` in row-major
  order, from ``carry = init()``: straight-line code up to ``limit`` (``UNROLL_TAPS``) taps,
  else a loop.

  The loop is rematerialised as a whole in reverse mode: its residuals are the arrays it closes
  over (never an output-sized value it makes, such as a zero start), and its trips recompute
  their tap offsets instead of saving them.
  """
  if geom.num_taps <= (UNROLL_TAPS if limit is None else limit):
    carry = init()
    for j, tap in enumerate(geom.taps()):
      if j >= start:
        carry = step(j, tap, carry)
    return carry
  # Each trip runs TAPS_PER_TRIP taps (fewer trips: a GPU pays a launch per trip); a second loop
  # runs the remainder one tap a trip, so no trip needs a bound check.
  count = geom.num_taps - start
  full, rest = divmod(count, TAPS_PER_TRIP)

  def trips(first: int, per_trip: int):
    def trip(i, c):
      for u in range(per_trip):
        j = first + i * per_trip + u
        c = step(j, _tap_coords(geom, j), c)
      return c
    return jax.checkpoint(trip, prevent_cse=False)

  def loop():
    carry = lax.fori_loop(0, full, trips(start, TAPS_PER_TRIP), init())
    return lax.fori_loop(0, rest, trips(start + full * TAPS_PER_TRIP, 1), carry)

  return jax.checkpoint(loop, prevent_cse=False)()


def _tap_slice(xp: jax.Array, geom: Geometry, tap: Tap) -> jax.Array:
  """The values tap ``tap`` reads for every output position (``xp`` already padded)."""
  ndim = xp.ndim
  start = geom.full_dims(ndim, [t * d for t, d in zip(tap, geom.dilation)], 0)
  strides = geom.full_dims(ndim, geom.strides, 1)
  out = geom.output_shape(xp.shape)
  size = tuple((o - 1) * s + 1 for o, s in zip(out, strides))
  if _is_static(tap):
    return lax.slice(xp, start, tuple(b + n for b, n in zip(start, size)), strides)
  return lax.slice(lax.dynamic_slice(xp, start, size), (0,) * ndim, size, strides)


def _phase_view(t: jax.Array, geom: Geometry) -> jax.Array:
  """The zero-padded ``t`` with each spatial dim split into ``(q, r)``, position ``q*s + r``.

  Tap ``j`` of output ``o`` reads ``o*s + j*d``: phase ``r = j*d % s`` at ``q = o + j*d // s``,
  a contiguous run over ``o``. Its slices equal the strided tap slices, but the transpose of a
  contiguous slice is a plain pad (or, in the loop, an in-place add of an output-sized block), so
  the transpose of a gather built on it (the max-pool gradient) is a sum of shifted planes with
  no interior padding: no division or remainder per element, several times faster on a CPU.
  """
  tp = _pad(t, geom, 0)
  ndim = tp.ndim
  axes = geom.spatial_axes(ndim)
  extra = [(0, 0, 0)] * ndim
  split: list[int] = []
  for d in range(ndim):
    if d in axes:
      s = geom.strides[axes.index(d)]
      q = -(-tp.shape[d] // s)
      extra[d] = (0, q * s - tp.shape[d], 0)
      split += [q, s]
    else:
      split.append(tp.shape[d])
  return lax.pad(tp, np.array(0, tp.dtype), extra).reshape(split)


def _phase_slice(tv: jax.Array, geom: Geometry, tap: Tap, out_shape) -> jax.Array:
  """Tap ``tap``'s values for every output position, from the phase view ``tv``."""
  axes = geom.spatial_axes(len(out_shape))
  start: list = []
  size: list[int] = []
  for d, n in enumerate(out_shape):
    if d in axes:
      i = axes.index(d)
      q0, r = divmod(tap[i] * geom.dilation[i], geom.strides[i])
      start += [q0, r]
      size += [geom.out_spatial[i], 1]
    else:
      start.append(0)
      size.append(n)
  if _is_static(tap):
    part = lax.slice(tv, start, [b + n for b, n in zip(start, size)])
  else:
    part = lax.dynamic_slice(tv, start, size)
  return part.reshape(out_shape)


def _reader(t: jax.Array, geom: Geometry, *, phase: bool):
  """``read(tap)``: tap ``tap``'s values of the zero-padded ``t`` for every output position,
  through the phase view (fast transposes) or strided slices. Under Explicit mesh axes the phase
  view's reshape would need an out_sharding for every split; the strided slices need none and
  give the same values."""
  out_shape = geom.output_shape(t.shape)
  if phase and explicit_sharding(t) is None:
    tv = _phase_view(t, geom)
    return lambda tap: _phase_slice(tv, geom, tap, out_shape)
  tp = _pad(t, geom, 0)
  return lambda tap: _tap_slice(tp, geom, tap)


def _tap_mask(geom: Geometry, tap: Tap, ndim: int):
  """Mask of the output positions where ``tap`` reads a real element; None: all do."""
  mask = None
  static = _is_static(tap)
  for dim, t in enumerate(tap):
    if static:
      valid = tap_valid_1d(geom, dim, t)
      if valid.all():
        continue
    else:
      lo, _ = geom.padding[dim]
      out, s, d = geom.out_spatial[dim], geom.strides[dim], geom.dilation[dim]
      if lo == 0 and (out - 1) * s + (geom.window[dim] - 1) * d < geom.in_spatial[dim]:
        continue  # every tap of every window is real along this dim
      pos = np.arange(out, dtype=np.int32) * s + t * d - lo
      valid = (pos >= 0) & (pos < geom.in_spatial[dim])
    shape = geom.full_dims(ndim, [out_n if i == dim else 1
                                  for i, out_n in enumerate(geom.out_spatial)], 1)
    m = valid.reshape(shape)
    mask = m if mask is None else (mask & m)
  return mask


def has_empty_windows(geom: Geometry) -> bool:
  return any((window_counts_1d(geom, d, include_pad=False) == 0).any()
             for d in range(geom.nspatial))


# ----------------------------------------------------------------------------- max


def max_pool_forward(x: jax.Array, geom: Geometry) -> jax.Array:
  """Max pooling without the taps: one ``lax.reduce_window``."""
  return lax.reduce_window(x, lowest(x.dtype), lax.max, **_window_args(geom, x.ndim))


def max_pool_taps(x: jax.Array, geom: Geometry,
                  mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Max pooling that also returns the winning tap of each window.

  Returns ``(y, taps)``: ``taps`` is the row-major offset of the winner within the window
  (``taps_dtype``), chosen by :func:`jaxpool._src.dtypes.beats` (the first maximum; NaN beats
  every number; ``+0.0`` beats ``-0.0``); padding never wins, nor does an element where
  ``mask`` (bool, broadcastable to ``x``; None: every element) is False. A window with no real
  (unmasked) element gives ``y = lowest`` and ``taps = -1``.
  """
  ndim = x.ndim
  xp = _pad(x, geom, lowest(x.dtype))
  # The mask is read per tap like x; its padding (and ceil-mode overhang) reads False, so it
  # also says where a tap reads padding.
  mp = None if mask is None else _pad(jnp.broadcast_to(mask, x.shape), geom, False)
  adt = taps_dtype(geom.num_taps)
  first = _tap_slice(xp, geom, (0,) * geom.nspatial)

  def step(j, tap, carry):
    best, winner = carry
    xt = first if _is_static(tap) and j == 0 else _tap_slice(xp, geom, tap)
    better = (winner < 0) | beats(xt, best)
    valid = _tap_mask(geom, tap, ndim) if mp is None else _tap_slice(mp, geom, tap)
    if valid is not None:
      better = better & valid
    return jnp.where(better, xt, best), jnp.where(better, jnp.asarray(j).astype(adt), winner)

  # full_like, not full: the running values inherit the input's sharding (Explicit meshes).
  init = lambda: (lax.full_like(first, lowest(x.dtype)), lax.full_like(first, -1, adt))
  return _fold_taps(geom, step, init)


def gather_at_taps(t: jax.Array, taps: jax.Array, geom: Geometry,
                   activation: str | None = None, *, masked: bool = False) -> jax.Array:
  """``y_t[o] = t[winner(o)]``; zero where ``taps < 0`` (a window with no real element, with
  an activation no positive maximum, with ``masked`` no unmasked element).

  Linear in ``t``; its transpose is the max-pool gradient (a deterministic scatter-add of each
  window's cotangent into its winner). With straight-line taps and no Explicit sharding the
  gather is a pair of jaxpool primitives (:data:`GATHER`) whose transpose on a CPU is
  :func:`scatter_to_taps`; elsewhere JAX transposes :func:`_gather_at_taps` by itself.
  """
  if (geom.num_taps <= UNROLL_TAPS and explicit_sharding(taps) is None
      and explicit_sharding(t) is None):
    return GATHER.forward(taps, t, geom=geom, activation=activation, masked=masked)
  return _gather_at_taps(t, taps, geom, activation, masked=masked)


def _gather_at_taps(t: jax.Array, taps: jax.Array, geom: Geometry,
                    activation: str | None = None, *, masked: bool = False) -> jax.Array:
  """:func:`gather_at_taps` in ``lax`` ops, which JAX transposes by itself."""
  # (``taps`` is checked too: under ``linearize`` a tangent's type may not carry the sharding
  # that its cotangent has when the transpose runs, as in JAX 0.11.)
  read = _reader(t, geom, phase=explicit_sharding(taps) is None)
  if geom.num_taps > UNROLL_TAPS:
    # -1 matches no tap: such a window stays zero.
    return _fold_taps(geom, lambda j, tap, acc: jnp.where(taps == j, read(tap), acc),
                      lambda: lax.full_like(taps, 0, t.dtype))
  cases = [read(tap) for tap in geom.taps()]
  if activation is not None or masked:  # a window with taps -1 may read real elements
    out = cases[0] if len(cases) == 1 else lax.select_n(jnp.maximum(taps, 0), *cases)
    return jnp.where(taps >= 0, out, jnp.zeros_like(out))
  # An empty window has taps == -1 and its taps all read padding, which is zero in the padded
  # ``t`` and dropped by the transpose of the pad: tap 0 serves it with no extra case.
  which = jnp.maximum(taps, 0) if has_empty_windows(geom) else taps
  if len(cases) == 1:
    return cases[0]
  return lax.select_n(which, *cases)


def scatter_to_taps(taps: jax.Array, ct: jax.Array, geom: Geometry) -> jax.Array:
  """The transpose of :func:`gather_at_taps`: each window's cotangent added into its winner.

  Built by stride phase, as the kernels' backward: along each spatial dim the input elements
  ``m * s + r`` of one phase ``r`` are the taps ``windows.phase_taps`` names of windows ``m + q``,
  so a phase's plane is a sum of output-sized, shifted, masked copies of ``ct``, one per tap
  that reaches it (``len(phase_taps)`` over the phases: the window's taps in all, not the window's
  taps per phase). The planes are interleaved once. JAX's own transpose instead adds every tap's
  copy into the whole input; on a 2-core CPU this form was 3.5x faster (16x112x112x64, 3x3/s2).
  Each element sums its windows' cotangents in descending tap order, as JAX's transpose does:
  the same bits.
  """
  ndim = ct.ndim
  axes = geom.spatial_axes(ndim)
  n = geom.nspatial
  planes_m = [-(-L // s) for L, s in zip(geom.in_spatial, geom.strides)]
  plane_shape = list(ct.shape)
  for ax, m in zip(axes, planes_m):
    plane_shape[ax] = m
  planes = {}
  for phase in itertools.product(*(range(s) for s in geom.strides)):
    plans = [phase_taps(geom, i, phase[i]) for i in range(n)]
    reach = sorted(itertools.product(*plans),
                   key=lambda c: -int(np.ravel_multi_index([a for a, _ in c], geom.window)))
    acc = None
    for c in reach:
      tap = np.ravel_multi_index([a for a, _ in c], geom.window)
      v = jnp.where(taps == np.array(tap, taps.dtype), ct, jnp.zeros((), ct.dtype))
      # plane element m takes window m + q: shift by -q, crop or zero-fill to the plane's size
      cfg = geom.full_dims(ndim, [(-q, m - o + q, 0) for (_, q), m, o in
                                  zip(c, planes_m, geom.out_spatial)], (0, 0, 0))
      v = lax.pad(v, jnp.zeros((), ct.dtype), cfg)
      acc = v if acc is None else acc + v
    if acc is not None and len(reach) < geom.num_taps:
      # JAX's transpose adds the other taps' zeros too, so a zero sum is +0.0 (a select: XLA
      # would fold away an added zero)
      acc = jnp.where(acc == 0, jnp.zeros((), ct.dtype), acc)
    planes[phase] = acc if acc is not None else jnp.zeros(plane_shape, ct.dtype)

  def interleave(prefix: tuple[int, ...]) -> jax.Array:
    # dims >= len(prefix) already carry their phase axis right after them
    k = len(prefix)
    if k == n:
      return planes[prefix]
    return jnp.stack([interleave(prefix + (r,)) for r in range(geom.strides[k])],
                     axis=axes[k] + 1)

  full = interleave(())  # (..., m_0, s_0, m_1, s_1, ...)
  merged = list(ct.shape)
  for ax, m, s in zip(axes, planes_m, geom.strides):
    merged[ax] = m * s
  dx = full.reshape(merged)
  limits = list(dx.shape)
  for ax, L in zip(axes, geom.in_spatial):
    limits[ax] = L
  return lax.slice(dx, (0,) * ndim, limits)


def _derived_transpose(taps: jax.Array, ct: jax.Array, *, geom: Geometry,
                       activation: str | None, masked: bool) -> jax.Array:
  """JAX's own transpose of :func:`_gather_at_taps` (off a CPU: the phase form was not measured
  against it on a GPU or TPU)."""
  t = jax.ShapeDtypeStruct(_input_shape(ct.shape, geom), ct.dtype)
  return jax.linear_transpose(
      lambda v: _gather_at_taps(v, taps, geom, activation, masked=masked), t)(ct)[0]


def _input_shape(out_shape: tuple[int, ...], geom: Geometry) -> tuple[int, ...]:
  shape = list(out_shape)
  for ax, L in zip(geom.spatial_axes(len(shape)), geom.in_spatial):
    shape[ax] = L
  return tuple(shape)


GATHER = LinearPair(
    "xla_max_pool_gather",
    lambda taps, t, *, geom, activation, masked: _gather_at_taps(t, taps, geom, activation,
                                                                 masked=masked),
    _derived_transpose,
    lambda taps_shape, t_shape, **_: taps_shape,
    lambda taps_shape, ct_shape, *, geom, **_: _input_shape(ct_shape, geom),
    transpose_on={"cpu": lambda taps, ct, *, geom, **_: scatter_to_taps(taps, ct, geom)})


def _cpu_barrier(y: jax.Array, taps: jax.Array) -> tuple[jax.Array, jax.Array]:
  # XLA:CPU drops optimization barriers before fusion, and then fuses the whole tap loop into
  # every tap of the scatter that reads the taps: k-fold recomputation and a 10x slower
  # backward. A conditional is a real fusion boundary; its predicate is always true (a tap
  # offset is below its dtype's max), but XLA cannot prove it, so it writes (y, taps) once.
  # One element, indexed without a reshape (a reshape would merge sharded dims).
  pred = taps[(0,) * taps.ndim] < jnp.iinfo(taps.dtype).max
  # (The branches must differ, or XLA folds the conditional away.)
  return lax.cond(pred, lambda a: a, lambda a: jax.tree.map(jnp.zeros_like, a), (y, taps))


def explicit_sharding(a: jax.Array):
  """``(mesh, spec)`` when ``a`` is sharded over Explicit mesh axes (sharding in types)."""
  sharding: Any = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    return None
  return sharding.mesh, spec


def _taps_materialized(x: jax.Array, geom: Geometry,
                       mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """``max_pool_taps`` whose outputs XLA writes once, rather than fusing into each reader."""
  y, taps = max_pool_taps(x, geom, mask)
  if taps.size == 0:
    return y, taps
  if explicit_sharding(taps) is not None:
    # Explicit sharding: the predicate's element lives on one device; keep the plain barrier.
    return lax.optimization_barrier((y, taps))
  return lax.platform_dependent(y, taps, cpu=_cpu_barrier,
                                default=lambda y, taps: lax.optimization_barrier((y, taps)))


def _forward(x: jax.Array, geom: Geometry, activation: str | None) -> jax.Array:
  return apply_activation(max_pool_forward(x, geom), None, activation)[0]


def _forward_with_taps(x: jax.Array, geom: Geometry, activation: str | None):
  return apply_activation(*_taps_materialized(x, geom), activation)


MAX_POOL_OPS = MaxPoolOps(forward=_forward, forward_with_taps=_forward_with_taps,
                          gather=gather_at_taps)


# Masked max pooling: the operand is ``(x, mask)``, its tangent ``(t, float0 zeros)``.


def _masked_forward(xm: tuple[jax.Array, jax.Array], geom: Geometry,
                    activation: str | None) -> jax.Array:
  # Masked elements replaced by the identity cannot change a window's maximum, so the value
  # equals the value at the tap loop's winner (lowest where no unmasked element): one
  # reduce_window, with nothing kept, serves inference.
  x, mask = xm
  kept = jnp.where(jnp.broadcast_to(mask, x.shape), x, lowest(x.dtype))
  return apply_activation(max_pool_forward(kept, geom), None, activation)[0]


def _masked_forward_with_taps(xm: tuple[jax.Array, jax.Array], geom: Geometry,
                              activation: str | None):
  x, mask = xm
  return apply_activation(*_taps_materialized(x, geom, mask), activation)


def _masked_gather(tm: tuple[jax.Array, Any], taps: jax.Array, geom: Geometry,
                   activation: str | None) -> jax.Array:
  return gather_at_taps(tm[0], taps, geom, activation, masked=True)


MASKED_MAX_POOL_OPS = MaxPoolOps(forward=_masked_forward,
                                 forward_with_taps=_masked_forward_with_taps,
                                 gather=_masked_gather)


def flat_indices(taps: jax.Array, geom: Geometry) -> jax.Array:
  """Tap offsets -> flat row-major index in the input's spatial plane (int32; -1: none)."""
  ndim = taps.ndim
  taps32 = taps.astype(jnp.int32)
  flat = lax.full_like(taps32, 0)
  row = 1
  for dim in reversed(range(geom.nspatial)):
    inner = int(np.prod(geom.window[dim + 1:], dtype=np.int64))
    tap_d = (taps32 // inner) % geom.window[dim]
    shape = geom.full_dims(ndim, [geom.out_spatial[dim] if i == dim else 1
                                  for i in range(geom.nspatial)], 1)
    start = (np.arange(geom.out_spatial[dim], dtype=np.int32) * geom.strides[dim]
             - geom.padding[dim][0]).reshape(shape)
    flat = flat + (start + tap_d * geom.dilation[dim]) * row
    row *= geom.in_spatial[dim]
  return jnp.where(taps < 0, -1, flat)


# ----------------------------------------------------------------------------- average


def avg_divisor(geom: Geometry, count_include_pad: bool, divisor_override: int | None,
                ndim: int, dtype) -> np.ndarray:
  """The static divisor of every output position, shaped to broadcast against the output."""
  if divisor_override is not None:
    return np.asarray(divisor_override, dtype)
  div = np.ones((), np.int64)
  for d in range(geom.nspatial):
    counts = window_counts_1d(geom, d, include_pad=count_include_pad)
    div = np.multiply.outer(div, counts)
  div = np.where(div == 0, 1, div)  # a window with no real element outputs 0 (its sum is 0)
  shape = geom.full_dims(ndim, geom.out_spatial, 1)
  return div.reshape(shape).astype(dtype)


def window_sum(x: jax.Array, geom: Geometry) -> jax.Array:
  """Sum over each window's real elements: one ``lax.reduce_window`` (the forward path)."""
  return lax.reduce_window(x, np.array(0, x.dtype), lax.add, **_window_args(geom, x.ndim))


def window_sum_linear(t: jax.Array, geom: Geometry) -> jax.Array:
  """The same sum as a fixed-order sum of tap slices: for tangents.

  It is linear in ``t`` and built from pad, slice and add, so JAX transposes it into pads that
  XLA fuses into one gather-like pass: several times faster than the transpose of
  ``reduce_window`` (a padded reduce-window over the dilated cotangent), and deterministic.
  """
  read = _reader(t, geom, phase=geom.num_taps > UNROLL_SUM_TAPS)
  return _fold_taps(geom, lambda j, tap, acc: acc + read(tap),
                    lambda: read((0,) * geom.nspatial), start=1, limit=UNROLL_SUM_TAPS)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def avg_pool(x: jax.Array, geom: Geometry, count_include_pad: bool,
             divisor_override: int | None) -> jax.Array:
  acc = accumulator_dtype(x.dtype)
  s = window_sum(x.astype(acc), geom)
  div = avg_divisor(geom, count_include_pad, divisor_override, x.ndim, acc)
  return (s / div).astype(x.dtype)


@avg_pool.defjvp
def _avg_pool_jvp(geom, count_include_pad, divisor_override, primals, tangents):
  (x,), (t,) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  div = avg_divisor(geom, count_include_pad, divisor_override, x.ndim, acc)
  y = avg_pool(x, geom, count_include_pad, divisor_override)
  return y, (window_sum_linear(t.astype(acc), geom) / div).astype(x.dtype)


def _masked_divisor(mask: jax.Array, geom: Geometry, count_include_pad: bool,
                    divisor_override: int | None, dtype) -> jax.Array:
  """The divisor of a masked average: the unmasked real elements of each window, plus its
  padding taps with ``count_include_pad`` (masked elements never count); 1 where that is 0
  (the window's sum is 0 there); ``divisor_override`` replaces it."""
  if divisor_override is not None:
    return jnp.asarray(divisor_override, dtype)
  if count_include_pad:
    static = avg_divisor(geom, True, None, mask.ndim, dtype)  # real and padding taps
    div = jnp.asarray(static) - window_sum(jnp.logical_not(mask).astype(dtype), geom)
  else:
    div = window_sum(mask.astype(dtype), geom)
  return jnp.where(div > 0, div, jnp.ones_like(div))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def masked_avg_pool(x: jax.Array, mask: jax.Array, geom: Geometry, count_include_pad: bool,
                    divisor_override: int | None) -> jax.Array:
  """Average pooling of the elements where ``mask`` (bool, broadcastable to ``x``) is True."""
  acc = accumulator_dtype(x.dtype)
  mask = jnp.broadcast_to(mask, x.shape)
  div = _masked_divisor(mask, geom, count_include_pad, divisor_override, _real(acc))
  s = window_sum(jnp.where(mask, x.astype(acc), jnp.zeros((), acc)), geom)
  return (s / div).astype(x.dtype)


@masked_avg_pool.defjvp
def _masked_avg_pool_jvp(geom, count_include_pad, divisor_override, primals, tangents):
  (x, mask), (t, _) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  mask = jnp.broadcast_to(mask, x.shape)
  div = _masked_divisor(mask, geom, count_include_pad, divisor_override, _real(acc))
  y = masked_avg_pool(x, mask, geom, count_include_pad, divisor_override)
  ts = window_sum_linear(jnp.where(mask, t.astype(acc), jnp.zeros((), acc)), geom)
  return y, (ts / div).astype(x.dtype)


def _real(dtype) -> np.dtype:
  """The real dtype of ``dtype`` (float32 for complex64): divisors are counts."""
  dtype = np.dtype(dtype)
  return np.dtype(jnp.finfo(dtype).dtype) if jnp.issubdtype(dtype, jnp.complexfloating) else dtype


# ----------------------------------------------------------------------------- Lp
#
# ``(sum |x|^p)^(1/p)`` computed as written overflows for large |x| (1e20**3 in float32) and
# underflows for small |x| (1e-30**2). Each window is scaled by its largest |x|, m:
# ``y = m * (sum (|x|/m)^p)^(1/p)``, where every term is at most 1 and the largest is 1, so y is
# right to rounding wherever it is representable. The gradient is written the same way,
# ``dy = sum sign(x) (|x|/y)^(p-1) dx``, whose factors are at most 1.
#
# Infinities and NaN. A window with a NaN outputs NaN; else one with an infinite element outputs
# inf. Its weights (the factor of each element's tangent) are finite, so that a zero cotangent
# always sends exactly 0 (a NaN or infinite weight would make 0 * w = NaN in the transpose):
# NaN counts as larger than every number, infinities included (as in the max pool), and the
# window's largest elements, its NaNs or else its infinities, get ``sign(x)`` (1 for NaN), the
# limit of ``sign(x) (|x|/y)^(p-1)`` as they grow; every other element of the window gets that
# limit too, ``(|x|/y)^(p-1) -> 0`` for p > 1 and ``sign(x)`` for p == 1.


def _lp_sum_scaled(x: jax.Array, m: jax.Array, geom: Geometry, p: float) -> jax.Array:
  """``sum (|x|/m)^p`` over each window's real elements (``m > 0``)."""
  read = _reader(x, geom, phase=geom.num_taps > UNROLL_SUM_TAPS)

  def step(j, tap, acc):
    r = jnp.abs(read(tap)) / m
    return acc + (r * r if p == 2 else r ** p)

  return _fold_taps(geom, step, lambda: jnp.zeros_like(m), limit=UNROLL_SUM_TAPS)


def _lp_forward(xa: jax.Array, geom: Geometry, p: float) -> jax.Array:
  """Lp pooling of ``xa`` (already in the accumulator dtype)."""
  if p == 1:
    return window_sum(jnp.abs(xa), geom)
  # The scale is any positive number (y does not depend on it), so it is not differentiated.
  m = lax.stop_gradient(max_pool_forward(jnp.abs(xa), geom))  # NaN in, NaN; -inf if empty
  finite = (m > 0) & jnp.isfinite(m)
  scale = jnp.where(finite, m, 1)
  s = _lp_sum_scaled(xa, scale, geom, p)
  y = scale * (jnp.sqrt(s) if p == 2 else s ** (1.0 / p))
  # inf and NaN pass through (m is NaN where the window holds one); 0 and empty windows give 0.
  return jnp.where(finite, y, jnp.where(jnp.isnan(m) | (m > 0), m, 0))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def lp_pool(x: jax.Array, geom: Geometry, p: float) -> jax.Array:
  """``(sum |x|^p)^(1/p)`` over the real elements of each window."""
  return _lp_forward(x.astype(accumulator_dtype(x.dtype)), geom, p).astype(x.dtype)


def _lp_weight(xt: jax.Array, d: jax.Array, p: float) -> jax.Array:
  """The finite weight ``sign(x) (|x|/y)^(p-1)`` of element ``xt`` in a window whose output
  is ``d`` (1 where the output is 0), with the limits for inf and NaN (see above)."""
  finite = jnp.isfinite(d)
  # The formula on finite values only (a finite window holds finite elements), so that neither
  # this value nor its derivative (second order) is NaN where the select below drops it.
  xs = jnp.where(finite, xt, jnp.zeros((), xt.dtype))
  r = jnp.abs(xs) / jnp.where(finite, d, jnp.ones((), d.dtype))
  regular = jnp.sign(xs) * (r if p == 2 else r ** (p - 1))
  # A window whose output is NaN or inf: its largest elements (its NaNs, else its infinities).
  top = jnp.where(jnp.isnan(d), jnp.isnan(xt), jnp.isinf(xt))
  signs = jnp.where(jnp.isnan(xt), jnp.ones((), xt.dtype), jnp.sign(xt))
  return jnp.where(finite, regular, jnp.where(top, signs, jnp.zeros((), xt.dtype)))


def _lp_tangent(xa: jax.Array, d: jax.Array, t: jax.Array, geom: Geometry, p: float):
  """``sum w t`` over each window, ``w`` the finite weights of :func:`_lp_weight` (linear in
  ``t``; ``d``: the output, with 1 where it is 0)."""
  xread = _reader(xa, geom, phase=geom.num_taps > UNROLL_SUM_TAPS)
  tread = _reader(t, geom, phase=geom.num_taps > UNROLL_SUM_TAPS)

  def step(j, tap, acc):
    return acc + _lp_weight(xread(tap), d, p) * tread(tap)

  return _fold_taps(geom, step, lambda: jnp.zeros_like(d), limit=UNROLL_SUM_TAPS)


@lp_pool.defjvp
def _lp_pool_jvp(geom, p, primals, tangents):
  (x,), (t,) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  xa, ta = x.astype(acc), t.astype(acc)
  y = _lp_forward(xa, geom, p)
  if p == 1:
    # Each element's weight is its own sign whatever the window holds (1 for NaN: finite).
    one = jnp.ones((), acc)
    dy = window_sum_linear(jnp.sign(jnp.where(jnp.isnan(xa), one, xa)) * ta, geom)
  else:
    # 0 where y == 0 (never NaN), and where y overflowed to inf from finite elements (every
    # |x|/y is 0 there); finite weights where the window holds inf or NaN (see above).
    # Rematerialised: reverse mode keeps x and y, not one weight per tap and output.
    tangent = jax.checkpoint(functools.partial(_lp_tangent, geom=geom, p=p), prevent_cse=False)
    dy = tangent(xa, jnp.where(y == 0, jnp.ones((), acc), y), ta)
  return y.astype(x.dtype), dy.astype(x.dtype)
