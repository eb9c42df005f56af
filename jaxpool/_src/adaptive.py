"""Adaptive and global pooling: PyTorch's bins, jaxpool's max rule, deterministic gradients.

Adaptive pooling splits a spatial dim of size ``L`` into ``O`` bins; bin ``i`` spans
``[floor(i*L/O), ceil((i+1)*L/O))`` (PyTorch's rule). Neighbouring bins share one element where
``i*L/O`` is not an integer; with ``O > L`` an element lies in up to ``ceil(O/L) + 1`` bins.

How it runs. Every index table is NumPy arithmetic at trace time; the traced program has a fixed
number of operations per spatial dim, whatever the sizes (no loop over positions or taps):

* ``O == 1`` on every dim is global pooling: one reduction (below).
* ``L % O == 0`` on every dim, with at most ``FIXED_WINDOW_MAX_TAPS`` elements per bin (on an
  NVIDIA GPU, as many as the Pallas kernels take), is
  fixed-window pooling with window = stride = ``L // O``: :func:`jaxpool.max_pool` and
  :func:`jaxpool.avg_pool` serve it (the Pallas kernels on a GPU).
* Otherwise one *stage* per spatial dim, the last dim first. A stage views the dim as a slot
  table ``(O, K)``, ``K`` the longest bin (a reshape when ``L % O == 0``, else a gather whose
  slots past a bin's end read a fill that never wins and adds nothing), and reduces over ``K``.
  The max over a box is the max over each dim in turn; reducing the last dim first keeps the
  row-major tie rule: the winner is the first row that holds the maximum and, in it, the first
  column. An average is the box sum over the box size.

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

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src import api, dispatch
from jaxpool._src.api import (DataFormat, FloatIn, FloatOut, Implementation, IndicesOut, PoolIn,
                              PoolOut)
from jaxpool._src.dtypes import accumulator_dtype, beats, check_dtype, lowest, order_key
from jaxpool._src.checks import check_choice
from jaxpool._src.checks import is_int as _is_int
from jaxpool._src.windows import DATA_FORMATS, MAX_SIZE, taps_dtype
from jaxpool._src.windows import spatial_axes as _spatial_axes

# Evenly dividing sizes whose bins hold at most this many elements go to the fixed-window ops
# (tap loops, Pallas kernels); larger bins to the reshape-and-reduce stages, whose program does
# not grow with the bin. (On a CPU, 8x8 bins through max_pool's tap loop took 150 times as long
# forward and backward as through the stages; benchmarks/global_adaptive.py times both.)
FIXED_WINDOW_MAX_TAPS = 16


# ----------------------------------------------------------------------------- arguments


def _output_size(output_size: Any) -> tuple[int | None, ...]:
  """Checks ``output_size``: one int >= 1 or None per spatial dim."""
  if _is_int(output_size) or isinstance(output_size, (bool, np.bool_)):
    raise TypeError(
        "output_size must be a tuple with one entry (an int >= 1 or None) per spatial dim, "
        f"e.g. (7, 7); got {output_size!r}.")
  try:
    items = tuple(output_size)
  except TypeError:
    raise TypeError(
        f"output_size must be a tuple of ints >= 1 or None; got {output_size!r}.") from None
  if not items:
    raise ValueError(f"output_size must name at least one spatial dim; got {output_size!r}.")
  for v in items:
    if v is not None and not _is_int(v):
      raise TypeError(
          f"output_size entries must be ints >= 1 or None; got {v!r} in {output_size!r}.")
    if v is not None and v < 1:
      raise ValueError(
          f"output_size entries must be ints >= 1 or None; got {v!r} in {output_size!r}.")
    if v is not None and v > MAX_SIZE:
      raise ValueError(
          f"output_size entries must be at most 2**31 - 1; got {v!r} in {output_size!r}.")
  return tuple(None if v is None else int(v) for v in items)


def _check_nonempty(x: jax.Array, axes: tuple[int, ...]) -> None:
  if any(x.shape[a] == 0 for a in axes):
    raise ValueError(
        f"x must have non-empty spatial dims (axes {axes}); got shape {tuple(x.shape)}.")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static configuration of one adaptive call (hashable: a jit static argument)."""

  in_spatial: tuple[int, ...]
  out_spatial: tuple[int, ...]
  channels_last: bool

  @property
  def nspatial(self) -> int:
    return len(self.in_spatial)

  def axes(self, ndim: int) -> tuple[int, ...]:
    return _spatial_axes(ndim, self.nspatial, self.channels_last)

  def stages(self, ndim: int) -> list[tuple[int, _Table]]:
    """``(axis, table)`` per spatial dim, the last dim first (the row-major tie order)."""
    axes = self.axes(ndim)
    return [(axes[d], _table(self.in_spatial[d], self.out_spatial[d]))
            for d in reversed(range(self.nspatial))]

  def box_sizes(self, ndim: int, dtype) -> np.ndarray:
    """Elements per output bin (the average's divisor), shaped to broadcast on the output."""
    size = np.ones((), np.int64)
    for L, o in zip(self.in_spatial, self.out_spatial):
      start, end = bins(L, o)
      size = np.multiply.outer(size, end - start)
    shape = [1] * ndim
    for a, o in zip(self.axes(ndim), self.out_spatial):
      shape[a] = o
    return size.reshape(shape).astype(dtype)


def _make_plan(x: jax.Array, output_size: Any, data_format: str) -> _Plan:
  sizes = _output_size(output_size)
  check_choice("data_format", data_format, DATA_FORMATS)
  n = len(sizes)
  if x.ndim < n + 1:
    layout = "(*batch, *spatial, C)" if data_format == "channels_last" else "(*batch, C, *spatial)"
    raise ValueError(
        f"x must have at least {n + 1} dims, {layout} with len(output_size) = {n} spatial dims "
        f"(output_size={output_size!r}); got shape {tuple(x.shape)}.")
  channels_last = data_format == "channels_last"
  axes = _spatial_axes(x.ndim, n, channels_last)
  _check_nonempty(x, axes)
  in_spatial = tuple(int(x.shape[a]) for a in axes)
  out_spatial = tuple(L if o is None else o for L, o in zip(in_spatial, sizes))
  # Before any bin table (whose size grows with output_size) is built.
  api.check_plane(f"output_size={output_size!r}", out_spatial, "the output plane")
  return _Plan(in_spatial, out_spatial, channels_last)


# ----------------------------------------------------------------------------- bins


def bins(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
  """PyTorch's adaptive bins of a dim: ``(start, end)``, each of length ``out``."""
  i = np.arange(out, dtype=np.int64)
  return (i * size) // out, -((-(i + 1) * size) // out)


@dataclasses.dataclass(frozen=True, eq=False)
class _Table:
  """The static index tables of one stage (one spatial dim, ``size`` -> ``out``).

  ``kind``: ``"identity"`` (``out == size``), ``"reshape"`` (``size % out == 0``: the slot table
  is a reshape), ``"gather"`` (``out < size``) or ``"scatter"`` (``out > size``; its tangent is
  in scatter form). ``gather``: ``(out*k,)`` input index of each slot (``size``: past the bin's
  end). For the scatter form, ``slot_out``: ``(size*m,)`` the output (bin) of each input slot
  (``out``: none), ``slot_offset``: the slot's element's offset in that bin (-2: none).
  """

  size: int
  out: int
  kind: str
  k: int
  gather: np.ndarray | None = None
  m: int = 0
  slot_out: np.ndarray | None = None
  slot_offset: np.ndarray | None = None

  @property
  def tap_dtype(self) -> np.dtype:
    return taps_dtype(self.k)


@functools.lru_cache(maxsize=512)
def _table(size: int, out: int) -> _Table:
  start, end = bins(size, out)
  lens = end - start
  k = int(lens.max())
  if out == size:
    return _Table(size, out, "identity", 1)
  if size % out == 0:
    return _Table(size, out, "reshape", k)
  slot = np.arange(k)[None, :]
  gather = np.where(slot < lens[:, None], start[:, None] + slot, size).astype(np.int32)
  if out < size:
    return _Table(size, out, "gather", k, gather.reshape(-1))
  # Input-major slots: element j lies in bins first[j] .. first[j] + count[j] - 1.
  j = np.arange(size)
  first = np.searchsorted(end, j, side="right")  # the first bin whose end is past j
  count = np.searchsorted(start, j, side="right") - first
  m = int(count.max())
  slot = np.arange(m)[None, :]
  live = slot < count[:, None]
  owner = first[:, None] + slot
  slot_out = np.where(live, owner, out).astype(np.int32)
  slot_offset = np.where(live, j[:, None] - start[np.minimum(owner, out - 1)], -2)
  return _Table(size, out, "scatter", k, gather.reshape(-1), m, slot_out.reshape(-1),
                slot_offset.astype(np.int32))


# ----------------------------------------------------------------------------- stages


def _split(a: jax.Array, ax: int, tab: _Table, fill) -> jax.Array:
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
  0.6-0.9x (``benchmarks/probes/first_max_gpu.py``); XLA:CPU runs it 4-15x slower.
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


def _scatter_to_bins(v: jax.Array, ax: int, tab: _Table) -> jax.Array:
  """Input-major slots ``(..., size, m, ...)`` summed into their bins ``(..., out, ...)``."""
  assert tab.slot_out is not None
  flat = v.reshape(v.shape[:ax] + (tab.size * tab.m,) + v.shape[ax + 2:])
  out = jnp.zeros(v.shape[:ax] + (tab.out,) + v.shape[ax + 2:], v.dtype)
  return out.at[(slice(None),) * ax + (tab.slot_out,)].add(flat, mode="drop")


def _broadcast_slots(t: jax.Array, ax: int, tab: _Table) -> jax.Array:
  """``t`` copied into its ``m`` input-major slots: ``(..., size, m, ...)``."""
  t = jnp.expand_dims(t, ax + 1)
  return jnp.broadcast_to(t, t.shape[:ax + 1] + (tab.m,) + t.shape[ax + 2:])


def _slot_mask_shape(ndim: int, ax: int, tab: _Table) -> tuple[int, ...]:
  return (1,) * ax + (tab.size, tab.m) + (1,) * (ndim - ax - 1)


def _max_stages(x: jax.Array, plan: _Plan) -> jax.Array:
  """The adaptive max without the argmax (the inference path)."""
  for ax, tab in plan.stages(x.ndim):
    if tab.kind != "identity":
      x = jnp.max(_split(x, ax, tab, lowest(x.dtype)), axis=ax + 1)
  return x


def _argmax_stages(x: jax.Array, plan: _Plan) -> tuple[jax.Array, tuple[Any, ...]]:
  """The adaptive max and each stage's winning slot (``None`` for an identity stage)."""
  taps: list[Any] = []
  for ax, tab in plan.stages(x.ndim):
    if tab.kind == "identity":
      taps.append(None)
      continue
    x, tap = first_max(_split(x, ax, tab, lowest(x.dtype)), ax + 1, tab.tap_dtype)
    taps.append(tap)
  return x, tuple(taps)


def _at_argmax(t: jax.Array, taps: tuple[Any, ...], plan: _Plan) -> jax.Array:
  """``t`` at each output's argmax: linear in ``t`` (the max's tangent map)."""
  ndim = t.ndim
  for (ax, tab), tap in zip(plan.stages(ndim), taps):
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


def _sum_stages(x: jax.Array, plan: _Plan, *, tangent: bool) -> jax.Array:
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
def _adaptive_max(x: jax.Array, plan: _Plan) -> jax.Array:
  return _max_stages(x, plan)


@_adaptive_max.defjvp
def _adaptive_max_jvp(plan, primals, tangents):
  (x,), (t,) = primals, tangents
  y, taps = _argmax_stages(x, plan)
  return y, _at_argmax(t, taps, plan)


def _max_with_indices(x: jax.Array, plan: _Plan) -> tuple[jax.Array, jax.Array]:
  y, taps = _argmax_stages(x, plan)
  return y, _at_argmax(_flat_iota(x.shape, plan.axes(x.ndim)), taps, plan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _adaptive_max_indices(x: jax.Array, plan: _Plan) -> tuple[jax.Array, jax.Array]:
  return _max_with_indices(x, plan)


@_adaptive_max_indices.defjvp
def _adaptive_max_indices_jvp(plan, primals, tangents):
  (x,), (t,) = primals, tangents
  y, taps = _argmax_stages(x, plan)
  idx = _at_argmax(_flat_iota(x.shape, plan.axes(x.ndim)), taps, plan)
  return (y, idx), (_at_argmax(t, taps, plan), np.zeros(idx.shape, jax.dtypes.float0))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _adaptive_avg(x: jax.Array, plan: _Plan) -> jax.Array:
  acc = accumulator_dtype(x.dtype)
  s = _sum_stages(x.astype(acc), plan, tangent=False)
  return (s / plan.box_sizes(x.ndim, acc)).astype(x.dtype)


@_adaptive_avg.defjvp
def _adaptive_avg_jvp(plan, primals, tangents):
  (x,), (t,) = primals, tangents
  acc = accumulator_dtype(x.dtype)
  s = _sum_stages(t.astype(acc), plan, tangent=True)
  return _adaptive_avg(x, plan), (s / plan.box_sizes(x.ndim, acc)).astype(x.dtype)


_adaptive_max_jit = jax.jit(_adaptive_max, static_argnums=(1,))
_adaptive_max_indices_jit = jax.jit(_adaptive_max_indices, static_argnums=(1,))
_adaptive_avg_jit = jax.jit(_adaptive_avg, static_argnums=(1,))


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
def _global_max(x: jax.Array, n: int, channels_last: bool) -> jax.Array:
  return jnp.max(x, axis=_spatial_axes(x.ndim, n, channels_last))


@_global_max.defjvp
def _global_max_jvp(n, channels_last, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx, _ = _global_argmax(x, n, channels_last)
  return y, _global_at(t, idx, n, channels_last)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _global_max_indices(x: jax.Array, n: int, channels_last: bool):
  y, idx, _ = _global_argmax(x, n, channels_last)
  return y, idx


@_global_max_indices.defjvp
def _global_max_indices_jvp(n, channels_last, primals, tangents):
  (x,), (t,) = primals, tangents
  y, idx, _ = _global_argmax(x, n, channels_last)
  return (y, idx), (_global_at(t, idx, n, channels_last),
                    np.zeros(idx.shape, jax.dtypes.float0))


def _global_avg(x: jax.Array, n: int, channels_last: bool) -> jax.Array:
  axes = _spatial_axes(x.ndim, n, channels_last)
  acc = accumulator_dtype(x.dtype)
  count = math.prod(x.shape[a] for a in axes)
  return (jnp.sum(x.astype(acc), axis=axes) / np.asarray(count, acc)).astype(x.dtype)


def _keepdims(y: jax.Array, n: int, channels_last: bool) -> jax.Array:
  """Puts back ``n`` spatial dims of size 1 where the reduction removed them."""
  at = y.ndim - 1 if channels_last else y.ndim
  return y.reshape(y.shape[:at] + (1,) * n + y.shape[at:])


_global_max_jit = jax.jit(_global_max, static_argnums=(1, 2))
_global_max_indices_jit = jax.jit(_global_max_indices, static_argnums=(1, 2))
_global_avg_jit = jax.jit(_global_avg, static_argnums=(1, 2))


# ----------------------------------------------------------------------------- routing


def _route(plan: _Plan) -> str:
  """``"global"``, ``"fixed"`` (the fixed-window ops) or ``"stages"``."""
  if all(o == 1 for o in plan.out_spatial):
    return "global"
  if all(L % o == 0 for L, o in zip(plan.in_spatial, plan.out_spatial)):
    taps = math.prod(L // o for L, o in zip(plan.in_spatial, plan.out_spatial))
    # Where the Pallas kernels serve the fixed window by default (an NVIDIA GPU), they beat the
    # stages up to their tap limit (8x8 bins on an H100: 0.175 against 0.281 ms fwd+bwd).
    kernels = dispatch.platform() == "cuda" and taps <= pallas_max_taps()
    if taps <= FIXED_WINDOW_MAX_TAPS or kernels:
      return "fixed"
  return "stages"


def pallas_max_taps() -> int:
  """The largest window the Pallas kernels take (0 where Pallas cannot be imported)."""
  try:
    from jaxpool._src.pallas import ops
  except ImportError:  # pragma: no cover - a jaxlib without Pallas
    return 0
  return ops.MAX_TAPS


def _xla_only(implementation: Any, op: str, route: str) -> None:
  """Routes other than "fixed" run XLA ops: ``implementation="pallas"`` is refused, as every
  op refuses a backend that cannot serve it."""
  check_choice("implementation", implementation, (None, "xla", "pallas"))
  if implementation == "pallas":
    what = "global pooling" if route == "global" else "bins that are not one fixed window"
    raise ValueError(
        f"implementation='pallas' cannot serve {op} for this call: there is no Pallas kernel "
        f"for {what}. Use implementation=None or 'xla'.")


def _fixed_window(plan: _Plan) -> tuple[int, ...]:
  return tuple(L // o for L, o in zip(plan.in_spatial, plan.out_spatial))


# ----------------------------------------------------------------------------- public API


def adaptive_max_pool(x: PoolIn, output_size: Sequence[int | None], *,
                      data_format: DataFormat = "channels_last",
                      implementation: Implementation = None) -> PoolOut:
  """Adaptive max pooling: the max over PyTorch's bins, with the DirectML gradient.

  Spatial dim ``d`` of size ``L`` is split into ``O = output_size[d]`` bins, bin ``i`` spanning
  ``[floor(i*L/O), ceil((i+1)*L/O))``; neighbouring bins may share an element, and ``O > L`` is
  allowed (bins then repeat elements), as in PyTorch's ``AdaptiveMaxPool``.

  Args:
    x: ``(*batch, *spatial, C)`` (``channels_last``) or ``(*batch, C, *spatial)``
      (``channels_first``); float or integer dtype; spatial dims non-empty.
    output_size: one entry per spatial dim (its length is the number of spatial dims): an int
      ``>= 1``, or ``None`` to keep that dim's input size. Each entry and the output plane
      ``prod(output_size)`` are at most ``2**31 - 1`` (a ValueError before anything is built).
    data_format: ``"channels_last"`` or ``"channels_first"``.
    implementation: as :func:`jaxpool.max_pool`, for evenly dividing sizes (``L % O == 0`` on
      every dim), which run as fixed-window pooling; other sizes always run on XLA.

  Returns:
    ``y``: ``(*batch, *output_size, C)`` (or channels first), ``x``'s dtype. Ties go to the
    first element of the bin in row-major order; NaN beats every number (the first NaN wins).

  The gradient sends each output's cotangent to its argmax only and sums where bins share an
  element (:func:`jaxpool.max_pool`'s rule); the same bits on every run. ``jax.jvp``,
  ``jax.vmap`` and second order work.

  Raises:
    ValueError, TypeError: for a bad argument, naming it and the value received.

  Example:
    >>> x = jnp.array([1., 5., 2., 2., 7.]).reshape(1, 5, 1)   # (N, L, C)
    >>> adaptive_max_pool(x, (3,))[0, :, 0]                    # bins [0,2) [1,4) [3,5)
    Array([5., 5., 7.], dtype=float32)
  """
  x = api._as_array("x", x)
  check_dtype("x", x, allow_int=True)
  plan = _make_plan(x, output_size, data_format)
  route = _route(plan)
  if route == "global":
    _xla_only(implementation, "adaptive_max_pool", route)
    y = _global_max_jit(x, plan.nspatial, plan.channels_last)
    return _keepdims(y, plan.nspatial, plan.channels_last)
  if route == "fixed":
    w = _fixed_window(plan)
    return api.max_pool(x, w, w, data_format=data_format, implementation=implementation)
  _xla_only(implementation, "adaptive_max_pool", route)
  return _adaptive_max_jit(x, plan)


def adaptive_max_pool_with_indices(
    x: PoolIn, output_size: Sequence[int | None], *,
    data_format: DataFormat = "channels_last",
    implementation: Implementation = None) -> tuple[PoolOut, IndicesOut]:
  """Adaptive max pooling that also returns where each maximum came from.

  Args: as :func:`adaptive_max_pool`.

  Returns:
    ``(y, indices)``: ``y`` as :func:`adaptive_max_pool` (differentiable); ``indices`` int32 of
    ``y``'s shape, the flat row-major index of the argmax within the input's spatial plane, per
    (batch..., channel), as PyTorch's ``return_indices`` and :func:`jaxpool.max_pool_with_indices`
    (so :func:`jaxpool.max_unpool` takes them).

  Example:
    >>> x = jnp.array([[9., 2., 3.], [4., 5., 9.], [7., 8., 1.]])[None, :, :, None]
    >>> y, i = adaptive_max_pool_with_indices(x, (2, 2))        # bins [0,2) [1,3) per dim
    >>> i[0, ..., 0]                                            # the 9 at (1, 2) wins twice
    Array([[0, 5],
           [7, 5]], dtype=int32)
  """
  x = api._as_array("x", x)
  check_dtype("x", x, allow_int=True)
  plan = _make_plan(x, output_size, data_format)
  api.check_plane(f"x of shape {tuple(x.shape)}", plan.in_spatial,
                  "the input plane that indices address")
  route = _route(plan)
  if route == "fixed":
    w = _fixed_window(plan)
    return api.max_pool_with_indices(x, w, w, data_format=data_format,
                                     implementation=implementation)
  _xla_only(implementation, "adaptive_max_pool_with_indices", route)
  if route == "global":
    y, idx = _global_max_indices_jit(x, plan.nspatial, plan.channels_last)
    return (_keepdims(y, plan.nspatial, plan.channels_last),
            _keepdims(idx, plan.nspatial, plan.channels_last))
  return _adaptive_max_indices_jit(x, plan)


def adaptive_avg_pool(x: FloatIn, output_size: Sequence[int | None], *,
                      data_format: DataFormat = "channels_last",
                      implementation: Implementation = None) -> FloatOut:
  """Adaptive average pooling: the mean over PyTorch's bins.

  Bins as :func:`adaptive_max_pool`; each output is the mean of its bin's elements (all real:
  there is no padding).

  Args:
    x: ``(*batch, *spatial, C)`` (or channels first), float dtype; bfloat16 and float16
      accumulate in float32.
    output_size, data_format, implementation: as :func:`adaptive_max_pool`.

  Returns:
    ``(*batch, *output_size, C)`` (or channels first), ``x``'s dtype. The gradient spreads
    each output's cotangent evenly over its bin, summed where bins share an element; the same
    bits on every run.

  Example:
    >>> x = jnp.arange(1., 6.).reshape(1, 5, 1)                 # [1, 2, 3, 4, 5]
    >>> adaptive_avg_pool(x, (3,))[0, :, 0]                     # [1 2] [2 3 4] [4 5]
    Array([1.5, 3. , 4.5], dtype=float32)
  """
  x = api._as_array("x", x)
  check_dtype("x", x, allow_int=False)
  plan = _make_plan(x, output_size, data_format)
  route = _route(plan)
  if route == "global":
    _xla_only(implementation, "adaptive_avg_pool", route)
    y = _global_avg_jit(x, plan.nspatial, plan.channels_last)
    return _keepdims(y, plan.nspatial, plan.channels_last)
  if route == "fixed":
    w = _fixed_window(plan)
    return api.avg_pool(x, w, w, data_format=data_format, implementation=implementation)
  _xla_only(implementation, "adaptive_avg_pool", route)
  return _adaptive_avg_jit(x, plan)


def _global_args(x: Any, data_format: Any, keepdims: Any, *, allow_int: bool):
  x = api._as_array("x", x)
  check_dtype("x", x, allow_int=allow_int)
  check_choice("data_format", data_format, DATA_FORMATS)
  if not isinstance(keepdims, (bool, np.bool_)):
    raise TypeError(f"keepdims must be a bool; got {keepdims!r}.")
  if x.ndim < 3:
    layout = "(N, *spatial, C)" if data_format == "channels_last" else "(N, C, *spatial)"
    raise ValueError(
        f"x must have at least 3 dims, {layout} with one batch dim and at least one spatial "
        f"dim; got shape {tuple(x.shape)}.")
  n = x.ndim - 2
  channels_last = data_format == "channels_last"
  _check_nonempty(x, _spatial_axes(x.ndim, n, channels_last))
  return x, n, channels_last


def global_max_pool(x: PoolIn, *, data_format: DataFormat = "channels_last",
                    keepdims: bool = False) -> PoolOut:
  """Global max pooling: the max over every spatial dim, with the DirectML gradient.

  Args:
    x: ``(N, *spatial, C)`` (``channels_last``) or ``(N, C, *spatial)`` (``channels_first``):
      exactly one batch dim and at least one spatial dim (every dim but the batch and channel
      dims is pooled). Float or integer dtype. For an input without a batch dim use ``x[None]``;
      for several, ``jax.vmap`` or a reshape.
    data_format: ``"channels_last"`` or ``"channels_first"``.
    keepdims: keep the pooled dims with size 1: ``(N, 1, ..., 1, C)`` (or channels first).

  Returns:
    ``(N, C)``, or with ``keepdims`` the shape above; ``x``'s dtype. NaN beats every number.

  The gradient sends each output's cotangent to its first argmax in row-major order (the first
  NaN if any), not split among ties as ``jax.grad`` of ``jnp.max`` does.

  Example:
    >>> x = jnp.array([[3., 1.], [3., 2.]])[None, :, :, None]   # (1, 2, 2, 1)
    >>> global_max_pool(x)
    Array([[3.]], dtype=float32)
    >>> jax.grad(lambda v: global_max_pool(v).sum())(x)[0, ..., 0]
    Array([[1., 0.],
           [0., 0.]], dtype=float32)
  """
  x, n, channels_last = _global_args(x, data_format, keepdims, allow_int=True)
  y = _global_max_jit(x, n, channels_last)
  return _keepdims(y, n, channels_last) if keepdims else y


def global_avg_pool(x: FloatIn, *, data_format: DataFormat = "channels_last",
                    keepdims: bool = False) -> FloatOut:
  """Global average pooling: the mean over every spatial dim.

  Args:
    x: ``(N, *spatial, C)`` (or ``(N, C, *spatial)``) as :func:`global_max_pool`; float dtype;
      bfloat16 and float16 accumulate in float32.
    data_format, keepdims: as :func:`global_max_pool`.

  Returns:
    ``(N, C)``, or ``(N, 1, ..., 1, C)`` (or channels first) with ``keepdims``; ``x``'s dtype.

  Example:
    >>> x = jnp.arange(8.).reshape(1, 2, 2, 2)                   # (N, H, W, C)
    >>> global_avg_pool(x)
    Array([[3., 4.]], dtype=float32)
    >>> global_avg_pool(x, data_format="channels_first", keepdims=True).shape
    (1, 2, 1, 1)
  """
  x, n, channels_last = _global_args(x, data_format, keepdims, allow_int=False)
  y = _global_avg_jit(x, n, channels_last)
  return _keepdims(y, n, channels_last) if keepdims else y
