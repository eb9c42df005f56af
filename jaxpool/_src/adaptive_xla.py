"""Adaptive and global pooling on XLA: reshape-and-reduce stages and one reduction, with
deterministic gradients (the XLA backend's adaptive and global ops, ``xla_backend.py``).

How it runs. Every index table is NumPy arithmetic at trace time (``adaptive_plan.py``); the
traced program has a fixed number of operations per spatial dim, whatever the sizes (no loop over
positions or taps):

* Global pooling (``O == 1`` on every dim, or ``global_*_pool``) is one reduction
  (:func:`global_max`, :func:`global_avg`).
* Adaptive pooling is one *stage* per spatial dim, the last dim first. A stage views the dim as
  a slot table ``(O, K)``, ``K`` the longest bin (a reshape when ``L % O == 0``, else a gather
  whose slots past a bin's end read a fill that never wins and adds nothing), and reduces over
  ``K``. The max over a box is the max over each dim in turn; reducing the last dim first keeps
  the row-major tie rule: the winner is the first row that holds the maximum and, in it, the
  first column. An average is the box sum over the box size. (Evenly dividing sizes with small
  bins go to the fixed-window ops instead: ``adaptive.py`` routes.)

Gradients. Max is a ``custom_jvp``: its JVP finds each stage's first maximum (``tap``, a slot in
``[0, K)``, NaN beating every number; two reductions: the max, then the least slot holding it)
and picks the tangent there.
Average is a ``custom_jvp`` too, with a linear tangent. JAX transposes these tangents into the
gradient, and each stage's tangent has one of two forms chosen so that the gradient's bits do
not depend on the order of atomic additions (XLA's GPU scatter-add):

* gather form (``O <= L``): gather the tangent into the slot table, keep the winning slot (max)
  or every slot (average), sum over ``K``. The transpose is a scatter-add into the input, where
  an element gets at most two values (with ``O <= L`` an element lies in at most two bins), and
  ``(0 + a) + b == (0 + b) + a`` exactly in floating point.
* scatter form (``O > L``): written input-major, each input element copied into ``M`` slots
  (one per bin that holds it), masked, and scatter-added into the outputs (at most two values
  per output: bins hold at most two elements when ``O > L``). Its transpose, the gradient, is a
  gather from the cotangent and a reduction over ``M`` (XLA's reductions use no atomics): no
  scatter at all.

Global max has the same JVP over the flattened spatial dims; its transpose is an elementwise
select (each input element gets its output's cotangent or zero). Global average is a sum in the
accumulator dtype over a constant.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.adaptive_plan import Plan, Table
from jaxpool._src.dtypes import accumulator_dtype, beats, exact_max, lowest, order_key
from jaxpool._src.windows import spatial_axes as _spatial_axes


# ----------------------------------------------------------------------------- stages


def _split(a: jax.Array, ax: int, tab: Table, fill) -> jax.Array:
  """``(..., size, ...)`` -> the slot table ``(..., out, k, ...)`` of the stage's bins."""
  shape = a.shape[:ax] + (tab.out, tab.k) + a.shape[ax + 1:]
  if tab.kind == "reshape":
    return a.reshape(shape)
  assert tab.gather is not None
  g = jnp.take(a, tab.gather, axis=ax, mode="fill", fill_value=np.asarray(fill).item())
  return g.reshape(shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def first_max(v: jax.Array, axis: int, index_dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
  """The maximum over ``axis`` and the index of its first occurrence.

  NaN beats every number (the first NaN wins); ties go to the lowest index; ``+0.0`` beats
  ``-0.0`` (as in :func:`jaxpool.max_pool`, where the value at the index is the output).
  Differentiable (a ``custom_jvp``: the tangent at the index), so second order works.

  Along at most ``SCAN_MAX`` elements (an adaptive pool's bins): a scan of the slots in order
  (:func:`first_max_scan`, one fused elementwise pass). Longer axes (global pooling): on a CPU,
  two plain reductions (:func:`first_max_two_pass`); elsewhere one variadic reduction
  (:func:`first_max_keyed`). On an H100 the variadic one made a global max pool's forward and
  backward 1.1-1.5x faster than ``x.max``'s autodiff in GPU time, where two reductions were
  0.6-0.9x (docs/design/global-max.md); XLA:CPU runs it 4-15x slower.
  """
  if v.shape[axis] <= SCAN_MAX:
    return first_max_scan(v, axis, index_dtype)
  return lax.platform_dependent(
      v, cpu=functools.partial(first_max_two_pass, axis=axis, index_dtype=index_dtype),
      default=functools.partial(first_max_keyed, axis=axis, index_dtype=index_dtype))


# The longest axis first_max scans slot by slot (a short window's taps, as the max pools' XLA
# path unrolls them); longer ones are reduced.
SCAN_MAX = 8


def first_max_scan(v: jax.Array, axis: int, index_dtype: np.dtype):
  """:func:`first_max` as a scan of the slots along ``axis`` in order, with
  :func:`dtypes.beats` (elementwise: XLA fuses the steps into one pass)."""
  best = lax.index_in_dim(v, 0, axis, keepdims=False)
  idx = jnp.zeros(best.shape, index_dtype)
  for k in range(1, v.shape[axis]):
    slot = lax.index_in_dim(v, k, axis, keepdims=False)
    better = beats(slot, best)
    best = jnp.where(better, slot, best)
    idx = jnp.where(better, np.array(k, index_dtype), idx)
  return best, idx


def first_max_two_pass(v: jax.Array, axis: int, index_dtype: np.dtype):
  """:func:`first_max` as the largest :func:`dtypes.order_key`, then the least index holding
  it, and the values at the indices. (Integer keys: XLA:CPU treats subnormal floats as zero
  in float comparisons, so a float max could name a value that no element holds.)"""
  key = order_key(v)
  top = jnp.max(key, axis=axis, keepdims=True)
  iota = lax.broadcasted_iota(index_dtype, v.shape, axis)
  none = np.array(np.iinfo(index_dtype).max, index_dtype)  # never taken: every max is hit
  idx = jnp.min(jnp.where(key == top, iota, none), axis=axis)
  return _at_index(v, idx, axis), idx


def first_max_keyed(v: jax.Array, axis: int, index_dtype: np.dtype):
  """:func:`first_max` as one reduction (``jnp.argmax`` of :func:`dtypes.order_key`), and
  the values at the indices."""
  idx = jnp.argmax(order_key(v), axis=axis).astype(index_dtype)
  return _at_index(v, idx, axis), idx


def _at_index(v: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
  return jnp.squeeze(jnp.take_along_axis(v, jnp.expand_dims(idx, axis), axis=axis), axis)


@first_max.defjvp
def _first_max_jvp(axis, index_dtype, primals, tangents):
  (v,), (t,) = primals, tangents
  y, idx = first_max(v, axis, index_dtype)
  return (y, idx), (_pick_slot(t, idx, axis), np.zeros(idx.shape, jax.dtypes.float0))


def _pick_slot(g: jax.Array, tap: jax.Array, axis: int) -> jax.Array:
  """``g`` at slot ``tap`` along ``axis`` (which it drops): linear in ``g``, no gather."""
  iota = lax.broadcasted_iota(tap.dtype, g.shape, axis)
  return jnp.sum(jnp.where(iota == jnp.expand_dims(tap, axis), g, 0), axis=axis)


def _scatter_to_bins(v: jax.Array, ax: int, tab: Table) -> jax.Array:
  """Input-major slots ``(..., size, m, ...)`` summed into their bins ``(..., out, ...)``."""
  assert tab.slot_out is not None
  flat = v.reshape(v.shape[:ax] + (tab.size * tab.m,) + v.shape[ax + 2:])
  out = jnp.zeros(v.shape[:ax] + (tab.out,) + v.shape[ax + 2:], v.dtype)
  return out.at[(slice(None),) * ax + (tab.slot_out,)].add(flat, mode="drop")


def _broadcast_slots(t: jax.Array, ax: int, tab: Table) -> jax.Array:
  """``t`` copied into its ``m`` input-major slots: ``(..., size, m, ...)``."""
  t = jnp.expand_dims(t, ax + 1)
  return jnp.broadcast_to(t, t.shape[:ax + 1] + (tab.m,) + t.shape[ax + 2:])


def _slot_mask_shape(ndim: int, ax: int, tab: Table) -> tuple[int, ...]:
  return (1,) * ax + (tab.size, tab.m) + (1,) * (ndim - ax - 1)


def _max_stages(x: jax.Array, plan: Plan) -> jax.Array:
  """The adaptive max without the argmax (the inference path; NaN and signed zeros as
  :func:`dtypes.exact_max` keeps them on a CPU)."""
  def stages(v, low):
    for ax, tab in plan.stages(v.ndim):
      if tab.kind != "identity":
        v = jnp.max(_split(v, ax, tab, low), axis=ax + 1)
    return v
  return exact_max(stages, x)


def _argmax_stages(x: jax.Array, plan: Plan) -> tuple[jax.Array, tuple[Any, ...]]:
  """The adaptive max and each stage's winning slot (``None`` for an identity stage)."""
  taps: list[Any] = []
  for ax, tab in plan.stages(x.ndim):
    if tab.kind == "identity":
      taps.append(None)
      continue
    x, tap = first_max(_split(x, ax, tab, lowest(x.dtype)), ax + 1, tab.tap_dtype)
    taps.append(tap)
  return x, tuple(taps)


def _at_argmax(t: jax.Array, taps: tuple[Any, ...], plan: Plan) -> jax.Array:
  """``t`` at each output's argmax: linear in ``t`` (the max's tangent map)."""
  ndim = t.ndim
  for (ax, tab), tap in zip(plan.stages(ndim), taps, strict=True):
    if tap is None:
      continue
    if tab.kind != "scatter":  # gather form
      t = _pick_slot(_split(t, ax, tab, 0), tap, ax + 1)
      continue
    # Scatter form: input slot (j, m) is live when its bin chose j, i.e. the bin's tap equals
    # j's offset in the bin.
    assert tab.slot_out is not None and tab.slot_offset is not None
    bin_tap = jnp.take(tap, tab.slot_out, axis=ax, mode="fill", fill_value=-1)
    bin_tap = bin_tap.reshape(tap.shape[:ax] + (tab.size, tab.m) + tap.shape[ax + 1:])
    offset = tab.slot_offset.astype(tap.dtype).reshape(_slot_mask_shape(ndim, ax, tab))
    t = _scatter_to_bins(jnp.where(bin_tap == offset, _broadcast_slots(t, ax, tab), 0), ax, tab)
  return t


def _sum_stages(x: jax.Array, plan: Plan, *, tangent: bool) -> jax.Array:
  """The sum over each output's bin; ``tangent``: in the forms whose transposes are safe."""
  for ax, tab in plan.stages(x.ndim):
    if tab.kind == "identity":
      continue
    if tangent and tab.kind == "scatter":
      x = _scatter_to_bins(_broadcast_slots(x, ax, tab), ax, tab)
    else:
      x = jnp.sum(_split(x, ax, tab, 0), axis=ax + 1)
  return x


def _flat_iota(shape: tuple[int, ...], axes: tuple[int, ...]) -> jax.Array:
  """The flat row-major index within the spatial plane, for every element of ``shape``."""
  flat = jnp.zeros(shape, jnp.int32)
  stride = 1
  for a in reversed(axes):
    flat = flat + lax.broadcasted_iota(jnp.int32, shape, a) * stride
    stride *= shape[a]
  return flat


# ----------------------------------------------------------------------------- adaptive cores


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def adaptive_max(x: jax.Array, plan: Plan) -> jax.Array:
  return _max_stages(x, plan)


@adaptive_max.defjvp
def _adaptive_max_jvp(plan, primals, tangents):
  (x,), (t,) = primals, tangents
  y, taps = _argmax_stages(x, plan)
  return y, _at_argmax(t, taps, plan)


def _max_with_indices(x: jax.Array, plan: Plan) -> tuple[jax.Array, jax.Array]:
  y, taps = _argmax_stages(x, plan)
  return y, _at_argmax(_flat_iota(x.shape, plan.axes(x.ndim)), taps, plan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def adaptive_max_indices(x: jax.Array, plan: Plan) -> tuple[jax.Array, jax.Array]:
  return _max_with_indices(x, plan)


@adaptive_max_indices.defjvp
def _adaptive_max_indices_jvp(plan, primals, tangents):
  (x,), (t,) = primals, tangents
  y, taps = _argmax_stages(x, plan)
  idx = _at_argmax(_flat_iota(x.shape, plan.axes(x.ndim)), taps, plan)
  return (y, idx), (_at_argmax(t, taps, plan), np.zeros(idx.shape, jax.dtypes.float0))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def adaptive_avg(x: jax.Array, plan: Plan) -> jax.Array:
  acc = accumulator_dtype(x.dtype)
  s = _sum_stages(x.astype(acc), plan, tangent=False)
  return (s / plan.box_sizes(x.ndim, acc)).astype(x.dtype)


@adaptive_avg.defjvp
def _adaptive_avg_jvp(plan, primals, tangents):
  (x,), (t,) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  s = _sum_stages(t.astype(acc), plan, tangent=True)
  return adaptive_avg(x, plan), (s / plan.box_sizes(x.ndim, acc)).astype(x.dtype)


adaptive_max_jit = jax.jit(adaptive_max, static_argnums=(1,))
adaptive_max_indices_jit = jax.jit(adaptive_max_indices, static_argnums=(1,))
adaptive_avg_jit = jax.jit(adaptive_avg, static_argnums=(1,))


# ----------------------------------------------------------------------------- global cores


def _flatten_spatial(x: jax.Array, n: int, channels_last: bool) -> tuple[jax.Array, int]:
  """``(*batch, *spatial, C)`` -> ``(*batch, S, C)`` (or channels first); the ``S`` axis."""
  axes = _spatial_axes(x.ndim, n, channels_last)
  shape = x.shape[:axes[0]] + (math.prod(x.shape[a] for a in axes),) + x.shape[axes[-1] + 1:]
  return x.reshape(shape), axes[0]


def _global_argmax(x: jax.Array, n: int, channels_last: bool):
  xf, ax = _flatten_spatial(x, n, channels_last)
  y, idx = first_max(xf, ax, np.dtype(np.int32))
  return y, idx, ax


def _global_at(t: jax.Array, idx: jax.Array, n: int, channels_last: bool) -> jax.Array:
  tf, ax = _flatten_spatial(t, n, channels_last)
  return _pick_slot(tf, idx, ax)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def global_max(x: jax.Array, n: int, channels_last: bool) -> jax.Array:
  return exact_max(lambda v, _: jnp.max(v, axis=_spatial_axes(v.ndim, n, channels_last)), x)


@global_max.defjvp
def _global_max_jvp(n, channels_last, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx, _ = _global_argmax(x, n, channels_last)
  return y, _global_at(t, idx, n, channels_last)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def global_max_indices(x: jax.Array, n: int, channels_last: bool):
  y, idx, _ = _global_argmax(x, n, channels_last)
  return y, idx


@global_max_indices.defjvp
def _global_max_indices_jvp(n, channels_last, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx, _ = _global_argmax(x, n, channels_last)
  return (y, idx), (_global_at(t, idx, n, channels_last),
                    np.zeros(idx.shape, jax.dtypes.float0))


def global_avg(x: jax.Array, n: int, channels_last: bool) -> jax.Array:
  axes = _spatial_axes(x.ndim, n, channels_last)
  acc = accumulator_dtype(x.dtype)
  count = math.prod(x.shape[a] for a in axes)
  return (jnp.sum(x.astype(acc), axis=axes) / np.asarray(count, acc)).astype(x.dtype)


global_max_jit = jax.jit(global_max, static_argnums=(1, 2))
global_max_indices_jit = jax.jit(global_max_indices, static_argnums=(1, 2))
global_avg_jit = jax.jit(global_avg, static_argnums=(1, 2))
