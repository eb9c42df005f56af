"""The XLA backend: pooling on ``lax.reduce_window`` and tap loops, and its derivatives.

Max pooling plugs three functions into the shared rule (:mod:`jaxpool._src.autodiff`): the
forward is ``lax.reduce_window`` (the inference path, nothing kept; on a CPU the tap loop's
values, :func:`max_pool_values`); the forward with taps runs a tap loop that finds each window's
winner (an int8 tap offset where the window has at most 127 taps); the gather picks the tangent
at the winner with ``lax.select_n``. That gather is linear in
the tangent; its transpose is the max-pool gradient, a scatter-add in which each input element
sums, in a fixed tap order, the cotangents of the windows that chose it. No atomics, so the bits
are the same on every run. On a CPU that transpose is written by stride phase
(:func:`scatter_to_taps`, through a pair of jaxpool's own primitives), elsewhere JAX derives it.
The residual that reverse mode keeps is the taps, not the input.

Masked pooling (a bool ``mask``, True at real elements) runs here only: the max pool is the same
shared rule on the operand ``(x, mask)`` (:data:`MASKED_MAX_POOL_OPS`), whose tap loop reads the
mask per tap as it reads ``x`` (padding reads False), so a masked element never wins.

The window machinery (padding, tap loops, tap readers, the ``reduce_window`` forwards) is in
:mod:`jaxpool._src.xla_taps`; average and Lp pooling, ``custom_jvp``s of their own, in
:mod:`jaxpool._src.xla_avg_lp` (re-exported here).
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src import xla_separable, xla_taps
from jaxpool._src.autodiff import MaxPoolOps, apply_activation
from jaxpool._src.dtypes import accumulator_dtype, beats, lowest
from jaxpool._src.linear import LinearPair
from jaxpool._src.windows import Geometry, phase_taps, taps_dtype
from jaxpool._src.xla_avg_lp import avg_pool, lp_pool, masked_avg_pool
from jaxpool._src.xla_taps import (SEPARABLE_TAPS, UNROLL_TAPS, explicit_sharding, fold_taps,
                                   has_empty_windows, input_shape, is_separable, is_static,
                                   max_pool_forward, max_pool_reduce, pad, reader, tap_mask,
                                   tap_slice)

# Re-exported, so that the XLA backend's every op is ``xla.<name>`` (and the kernels' reference
# values, ``accumulator_dtype`` and ``lowest``, too).
__all__ = ["SEPARABLE_TAPS", "UNROLL_TAPS", "accumulator_dtype", "avg_pool", "explicit_sharding",
           "lowest", "lp_pool", "masked_avg_pool", "max_pool_forward", "max_pool_values"]


# ----------------------------------------------------------------------------- max


def max_pool_taps(x: jax.Array, geom: Geometry,
                  mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Max pooling that also returns the winning tap of each window.

  Returns ``(y, taps)``: ``taps`` is the row-major offset of the winner within the window
  (``taps_dtype``), chosen by :func:`jaxpool._src.dtypes.beats` (the first maximum; NaN beats
  every number; ``+0.0`` beats ``-0.0``); padding never wins, nor does an element where
  ``mask`` (bool, broadcastable to ``x``; None: every element) is False. A window with no real
  (unmasked) element gives ``y = lowest`` and ``taps = -1``.

  A window of more than ``SEPARABLE_TAPS`` taps runs separably (``xla_separable.py``), with
  the same bits; :func:`direct_max_pool_taps` is the tap loop over the whole window.
  """
  if is_separable(geom):
    return xla_separable.max_pool_taps(x, geom, mask)
  return direct_max_pool_taps(x, geom, mask)


def direct_max_pool_taps(x: jax.Array, geom: Geometry,
                         mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """:func:`max_pool_taps` as one loop over the whole window's taps, whatever its size."""
  ndim = x.ndim
  xp = pad(x, geom, lowest(x.dtype))
  # The mask is read per tap like x; its padding (and ceil-mode overhang) reads False, so it
  # also says where a tap reads padding.
  mp = None if mask is None else pad(jnp.broadcast_to(mask, x.shape), geom, False)
  adt = taps_dtype(geom.num_taps)
  first = tap_slice(xp, geom, (0,) * geom.nspatial)

  def step(j, tap, carry):
    best, winner = carry
    xt = first if is_static(tap) and j == 0 else tap_slice(xp, geom, tap)
    better = (winner < 0) | beats(xt, best)
    valid = tap_mask(geom, tap, ndim) if mp is None else tap_slice(mp, geom, tap)
    if valid is not None:
      better = better & valid
    return jnp.where(better, xt, best), jnp.where(better, jnp.asarray(j).astype(adt), winner)

  # full_like, not full: the running values inherit the input's sharding (Explicit meshes).
  init = lambda: (lax.full_like(first, lowest(x.dtype)), lax.full_like(first, -1, adt))
  return fold_taps(geom, step, init)


def gather_at_taps(t: jax.Array, taps: jax.Array, geom: Geometry,
                   activation: str | None = None, *, masked: bool = False) -> jax.Array:
  """``y_t[o] = t[winner(o)]``; zero where ``taps < 0`` (a window with no real element, with
  an activation no positive maximum, with ``masked`` no unmasked element).

  Linear in ``t``; its transpose is the max-pool gradient (a deterministic scatter-add of each
  window's cotangent into its winner). With straight-line taps and no Explicit sharding the
  gather is a pair of jaxpool primitives (:data:`GATHER`) whose transpose on a CPU is
  :func:`scatter_to_taps`; elsewhere JAX transposes :func:`_gather_at_taps` by itself. A
  separable window (more than ``SEPARABLE_TAPS`` taps) gathers one dim at a time
  (``xla_separable.gather_at_taps``), whose transpose sums in that form's order.
  """
  if is_separable(geom):
    return xla_separable.gather_at_taps(t, taps, geom)
  if (geom.num_taps <= xla_taps.UNROLL_TAPS and explicit_sharding(taps) is None
      and explicit_sharding(t) is None):
    return GATHER.forward(taps, t, geom=geom, activation=activation, masked=masked)
  return _gather_at_taps(t, taps, geom, activation, masked=masked)


def _gather_at_taps(t: jax.Array, taps: jax.Array, geom: Geometry,
                    activation: str | None = None, *, masked: bool = False) -> jax.Array:
  """:func:`gather_at_taps` in ``lax`` ops, which JAX transposes by itself."""
  # (``taps`` is checked too: under ``linearize`` a tangent's type may not carry the sharding
  # that its cotangent has when the transpose runs, as in JAX 0.11.)
  read = reader(t, geom, phase=explicit_sharding(taps) is None)
  if geom.num_taps > xla_taps.UNROLL_TAPS:
    # -1 matches no tap: such a window stays zero.
    return fold_taps(geom, lambda j, tap, acc: jnp.where(taps == j, read(tap), acc),
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
  planes_m = [-(-L // s) for L, s in zip(geom.in_spatial, geom.strides, strict=True)]
  plane_shape = list(ct.shape)
  for ax, m in zip(axes, planes_m, strict=True):
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
                                  zip(c, planes_m, geom.out_spatial, strict=True)], (0, 0, 0))
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
  for ax, m, s in zip(axes, planes_m, geom.strides, strict=True):
    merged[ax] = m * s
  dx = full.reshape(merged)
  limits = list(dx.shape)
  for ax, L in zip(axes, geom.in_spatial, strict=True):
    limits[ax] = L
  return lax.slice(dx, (0,) * ndim, limits)


def _derived_transpose(taps: jax.Array, ct: jax.Array, *, geom: Geometry,
                       activation: str | None, masked: bool) -> jax.Array:
  """JAX's own transpose of :func:`_gather_at_taps` (off a CPU: the phase form was not measured
  against it on a GPU or TPU)."""
  t = jax.ShapeDtypeStruct(input_shape(ct.shape, geom), ct.dtype)
  return jax.linear_transpose(
      lambda v: _gather_at_taps(v, taps, geom, activation, masked=masked), t)(ct)[0]



GATHER = LinearPair(
    "xla_max_pool_gather",
    lambda taps, t, *, geom, activation, masked: _gather_at_taps(t, taps, geom, activation,
                                                                 masked=masked),
    _derived_transpose,
    lambda taps_shape, t_shape, **_: taps_shape,
    lambda taps_shape, ct_shape, *, geom, **_: input_shape(ct_shape, geom),
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


# The longest spatial output dim whose forward the CPU runs as the tap loop: the loop's masks of
# padded taps are host constants as long as the output dim (xla_taps.tap_mask).
FOLD_MAX_OUT = 1 << 20


def max_pool_values(x: jax.Array, geom: Geometry) -> jax.Array:
  """Max pooling's values without the taps (inference): ``lax.reduce_window``
  (:func:`xla_taps.max_pool_reduce`), except on a CPU.

  XLA:CPU's float max reductions drop NaN and return ``-0.0`` beside ``+0.0`` on larger
  arrays (docs/semantics.md). On a CPU this takes the tap loop's values instead
  (:func:`max_pool_taps`, its taps unused: XLA removes them), whose elementwise comparisons
  (:func:`dtypes.beats`) keep the rules and give the values the gradient's forward gives; it
  ran about as fast as ``lax.reduce_window`` there or faster ((16, 64, 64, 64) float32: 2x2/s2
  0.68 against 0.57 ms, 3x3/s1 2.7 against 10.3 ms, 3x3/s2 0.9 against 2.7 ms). An output
  dim longer than ``FOLD_MAX_OUT`` reduces integer keys instead
  (:func:`xla_taps.max_pool_forward`), so that no host constant grows with the input; so does
  a program for a CPU traced where the default backend is not one (a GPU host's CPU device,
  an export for several platforms), so that a GPU's first call does not trace the tap loop.
  ``lax.platform_dependent`` picks the form when the program is lowered."""
  default = lambda v: max_pool_reduce(v, geom)  # noqa: E731
  if jax.default_backend() == "cpu" and max(geom.out_spatial, default=0) <= FOLD_MAX_OUT:
    return lax.platform_dependent(x, cpu=lambda v: max_pool_taps(v, geom)[0], default=default)
  return lax.platform_dependent(x, cpu=lambda v: max_pool_forward(v, geom), default=default)


def _forward(x: jax.Array, geom: Geometry, activation: str | None) -> jax.Array:
  return apply_activation(max_pool_values(x, geom), None, activation)[0]


def _forward_with_taps(x: jax.Array, geom: Geometry, activation: str | None):
  return apply_activation(*_taps_materialized(x, geom), activation)


MAX_POOL_OPS = MaxPoolOps(forward=_forward, forward_with_taps=_forward_with_taps,
                          gather=gather_at_taps)


# Masked max pooling: the operand is ``(x, mask)``, its tangent ``(t, float0 zeros)``.


def _masked_forward(xm: tuple[jax.Array, jax.Array], geom: Geometry,
                    activation: str | None) -> jax.Array:
  # Masked elements replaced by the identity cannot change a window's maximum, so the value
  # equals the value at the tap loop's winner (lowest where no unmasked element): one
  # reduce_window (on a CPU the tap loop's values), with nothing kept, serves inference.
  x, mask = xm
  kept = jnp.where(jnp.broadcast_to(mask, x.shape), x, lowest(x.dtype))
  return apply_activation(max_pool_values(kept, geom), None, activation)[0]


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
