"""How a kernel call splits over devices: its partitioning rule, written beside the kernels.

A Pallas kernel reaches XLA as one custom call, which XLA's partitioner cannot split: left
alone, a sharded input is gathered onto every device and the kernel replicated. Each kernel call
of the Pallas backend therefore goes through :func:`call`, which gives the partitioner a rule:

- **Batch and channel dims** (and a ``vmap``'s mapped dims, which the kernels see as more batch
  dims) split freely: each device runs the kernel on its own block, with no communication. The
  output takes the input's sharding.
- **Spatial dims** (a volume split along depth, an image along height) split with halos: each
  device receives from its neighbours the rows its windows reach beyond its own block
  (collective-permutes of halo-sized slices, several hops when a window is wider than a block),
  runs the kernel on its block plus the halos, and keeps its share of the output. Blocks that
  XLA pads (a size the device count does not divide) are never read as data: each device's
  part of the problem is cut from the real rows only, with the global padding and ceil-mode
  overhang where the block touches the input's ends.

Under jit with an Auto mesh (sharding decided by the compiler) the rule is a
:func:`jax.experimental.custom_partitioning` with a Shardy sharding rule; with Explicit mesh
axes (sharding in the types) the same per-device function runs under :func:`jax.shard_map`;
inside a user's ``shard_map`` the kernel runs on the block it is given. The kernels' own
``pallas_call`` declares how its outputs vary over manual mesh axes (:func:`out_struct`), so
``shard_map(..., check_vma=True)`` accepts them.

The rule sits below jaxpool's differentiation and batching rules (``autodiff``, ``linear``,
``custom_vmap`` in ``ops``): those see one kernel call; only the primal kernels are
partitioned.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend import core as jex_core
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpool._src.pallas import tuning
from jaxpool._src.windows import Geometry, taps_dtype

# ----------------------------------------------------------------------------- out_struct


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """A ``pallas_call`` output's type: ``shape`` and ``dtype``, varying over the same manual
  mesh axes as ``like`` (inside ``shard_map(..., check_vma=True)``; nothing elsewhere).

  JAX 0.10 and later name this ``manual_axis_type`` (earlier ``vma``); both are accepted.
  """
  aval = jax.typeof(like)
  mat = getattr(aval, "mat", None)
  if mat is not None:
    try:
      return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    except TypeError:  # pragma: no cover - a JAX whose struct has no manual_axis_type
      pass
  vma = getattr(aval, "vma", None)
  if vma is not None:  # pragma: no cover - older JAX
    try:
      return jax.ShapeDtypeStruct(shape, dtype, vma=vma)  # type: ignore[call-arg]
    except TypeError:
      pass
  return jax.ShapeDtypeStruct(shape, dtype)


# ----------------------------------------------------------------------------- kernel calls


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One kernel call's static part (hashable: a static argument of the partitioning rule).

  Attributes:
    fn: ``fn(*operands, geom, **options) -> array or tuple of arrays``, a module-level function.
      A forward (``backward=False``) takes the input and returns output-shaped arrays (the
      pooled values, then the taps when ``n_out`` is 2); a backward takes output-shaped
      operands (the cotangent last) and returns the input-shaped gradient.
    xla_fn: the same computation in XLA ops, same signature and bits: what ``jax.export``
      serialises (a Pallas kernel is no stable part of an exported program).
    geom: the whole (global) problem's geometry.
    backward: which of the two kinds ``fn`` is.
    n_out: how many arrays ``fn`` returns (1: one array, not a tuple).
    options: ``fn``'s keyword options, as sorted ``(name, value)`` pairs.
    neutral_pads: (a backward) a padding row changes nothing for the real rows: the gradient
      of a real row is the same whether its window's other rows are padding or data (the max
      pool; the average pool that counts the padding or has a fixed divisor). A device's
      gradient block is then computed in place, its neighbours' rows standing as padding.
  """

  fn: Callable[..., Any]
  xla_fn: Callable[..., Any]
  geom: Geometry
  backward: bool
  n_out: int
  options: tuple[tuple[str, Any], ...]
  neutral_pads: bool = False

  def run(self, operands, geom: Geometry, fn: Callable[..., Any] | None = None):
    out = (fn or self.fn)(*operands, geom, **dict(self.options))
    return (out,) if self.n_out == 1 else tuple(out)


def kernel_call(fn: Callable[..., Any], xla_fn: Callable[..., Any], geom: Geometry, *,
                backward: bool = False, n_out: int = 1, neutral_pads: bool = False,
                **options: Any) -> KernelCall:
  return KernelCall(fn, xla_fn, geom, backward, n_out, tuple(sorted(options.items())),
                    neutral_pads)


def call(kc: KernelCall, *operands: jax.Array):
  """Runs ``kc`` on ``operands``, split over the devices they live on (see the module doc).

  Returns one array, or a tuple when ``kc.n_out > 1``.
  """
  explicit = _explicit_spec(operands[-1])
  if explicit is not None:
    outs = _explicit_call(kc, explicit[0], explicit[1], operands)
  else:
    outs = kernel_p.bind(*operands, kc=kc)
  return outs[0] if kc.n_out == 1 else tuple(outs)


# A kernel call is one primitive, so that its lowering can choose: the plain kernel on one
# device (a program JAX's persistent compilation cache can key), the partitioned kernel on
# several (``custom_partitioning`` keys its rule by a Python object, so such programs miss that
# cache in a new process), the XLA ops when ``jax.export`` serialises the program.
kernel_p = jex_core.Primitive("jaxpool_pallas_kernel")
kernel_p.multiple_results = True


def _abstract_eval(*avals, kc: KernelCall):
  base = avals[-1]
  if kc.backward:
    return [base.update(shape=kc.geom.input_shape(base.shape))]
  shape = kc.geom.output_shape(base.shape)
  outs = [base.update(shape=shape)]
  if kc.n_out == 2:
    outs.append(base.update(shape=shape, dtype=np.dtype(taps_dtype(kc.geom.num_taps)),
                            weak_type=False))
  return outs


def _whole(kc: KernelCall, *operands):
  return kc.run(operands, kc.geom)


_partitioned = custom_partitioning(_whole, static_argnums=(0,))


def _one_device(ctx) -> bool:
  """Whether the program being lowered runs on one device (inside ``shard_map``: not known
  here, and ``custom_partitioning`` sorts out the manual axes itself)."""
  return getattr(ctx.module_context.axis_context, "num_devices", None) == 1


def _lowering(ctx, *operands, kc: KernelCall):
  if getattr(ctx.module_context.lowering_parameters, "for_export", False):
    fn = functools.partial(lambda *o: kc.run(o, kc.geom, kc.xla_fn))
  elif _one_device(ctx):
    fn = functools.partial(_whole, kc)  # nothing to split
  else:
    with tuning.cached_only():  # (the whole problem's kernel is traced, never run)
      return mlir.lower_fun(functools.partial(_partitioned, kc),
                            multiple_results=True)(ctx, *operands)
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


def needs_devices(p: jex_core.Primitive) -> None:
  """Tells JAX that lowering ``p`` needs the program's devices, as ``custom_partitioning``'s
  own primitive does (JAX lowers nested ``jit`` bodies without their devices otherwise, and
  ``custom_partitioning`` then fails). Every primitive whose lowering runs a kernel call
  (:data:`kernel_p`, and the Pallas backend's linear primitives) is marked. JAX keeps that
  list in a private module, the one private name the kernels use; tests/test_partitioning.py
  fails if a JAX release moves it."""
  from jax._src import dispatch as jax_dispatch  # noqa: PLC0415
  jax_dispatch.prim_requires_devices_during_lowering.add(p)


needs_devices(kernel_p)
kernel_p.def_impl(lambda *operands, kc: _whole(kc, *operands))
kernel_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(kernel_p, _lowering)


# ----------------------------------------------------------------------------- the plan


def _names(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _spec_dims(spec, ndim: int) -> list[tuple[str, ...]]:
  dims = [_names(e) for e in tuple(spec)[:ndim]]
  return dims + [()] * (ndim - len(dims))


@dataclasses.dataclass(frozen=True)
class _Work:
  """One device's part of the problem along one spatial dim (all static)."""

  start: int  # where its operand rows start in the halo-extended block
  rows: int  # operand rows it reads (input rows for a forward, windows for a backward)
  dim: tuple  # (in, out, pad_lo, pad_hi, extra): the local geometry along this dim
  place: tuple[int, int]  # backward: pad (may be negative: crop) of the local gradient


@dataclasses.dataclass(frozen=True)
class _DimPlan:
  """How one sharded spatial dim splits: the halo exchange and each device's work."""

  axis: int  # the array dim
  spatial: int  # its index among the spatial dims
  names: tuple[str, ...]  # the mesh axes it is sharded over
  n: int  # devices along it
  tile: int  # rows of the operand block each device holds
  left: int  # halo rows received from the left neighbours
  right: int  # ... and from the right
  out_tile: int  # rows of the result block each device holds
  works: tuple[_Work | None, ...]  # per device (None: no window touches its block)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _local_dim(geom: Geometry, j: int, oa: int, ob: int) -> tuple[int, int, tuple]:
  """The input rows ``[a, b)`` that windows ``[oa, ob)`` of spatial dim ``j`` read, and the
  local geometry ``(in, out, pad_lo, pad_hi, extra)`` of that piece."""
  L, s = geom.in_spatial[j], geom.strides[j]
  ek = geom.effective_window[j]
  lo, hi = geom.padding[j]
  first, end = oa * s - lo, (ob - 1) * s - lo + ek
  a, b = max(0, first), min(L, end)
  over = end - b  # rows past the input's end: the user's padding first, then the overhang
  pad_hi = min(hi, over)
  return a, b, (b - a, ob - oa, a - first, pad_hi, over - pad_hi)


def _plan_dim(geom: Geometry, axis: int, j: int, names: tuple[str, ...], n: int,
              backward: bool) -> _DimPlan:
  L, O = geom.in_spatial[j], geom.out_spatial[j]  # noqa: E741
  s, lo, ek = geom.strides[j], geom.padding[j][0], geom.effective_window[j]
  in_tile, out_tile = _cdiv(L, n), _cdiv(O, n)
  works: list[_Work | None] = []
  spans = []  # (first operand row needed, end) per device, for the halo sizes
  for i in range(n):
    if backward:  # the gradient rows [ra, rb) this device holds; the windows that touch them
      ra, rb = min(i * in_tile, L), min((i + 1) * in_tile, L)
      oa = max(0, _cdiv(ra + lo - ek + 1, s))
      ob = min(O, (rb - 1 + lo) // s + 1) if rb > ra else oa
      if oa >= ob:
        works.append(None)
        continue
      a, b, dim = _local_dim(geom, j, oa, ob)
      spans.append((oa, ob, i * out_tile, out_tile))
      works.append(_Work(start=oa - i * out_tile, rows=ob - oa, dim=dim,
                         place=(a - i * in_tile, (i + 1) * in_tile - b)))
    else:  # the output rows this device holds; the input rows they read
      oa, ob = min(i * out_tile, O), min((i + 1) * out_tile, O)
      if oa >= ob:
        works.append(None)
        continue
      a, b, dim = _local_dim(geom, j, oa, ob)
      spans.append((a, b, i * in_tile, in_tile))
      works.append(_Work(start=a - i * in_tile, rows=b - a, dim=dim, place=(0, 0)))
  left = max([0] + [own - need for need, _, own, _ in spans])
  right = max([0] + [end - (own + t) for _, end, own, t in spans])
  works = [None if w is None else dataclasses.replace(w, start=w.start + left) for w in works]
  return _DimPlan(axis=axis, spatial=j, names=names, n=n,
                  tile=out_tile if backward else in_tile, left=left, right=right,
                  out_tile=in_tile if backward else out_tile, works=tuple(works))


def _plan(kc: KernelCall, dims: list[tuple[str, ...]], mesh_shape: dict[str, int],
          ndim: int) -> tuple[_DimPlan, ...]:
  spatial = kc.geom.spatial_axes(ndim)
  plans = []
  for j, ax in enumerate(spatial):
    if dims[ax]:
      n = int(np.prod([mesh_shape[a] for a in dims[ax]]))
      if n > 1:
        plans.append(_plan_dim(kc.geom, ax, j, dims[ax], n, kc.backward))
  return tuple(plans)


# ----------------------------------------------------------------------------- per device


def _exchange(x: jax.Array, p: _DimPlan) -> jax.Array:
  """``x``'s block with ``p.left`` rows of its left neighbours' blocks before it and
  ``p.right`` of its right neighbours' after it (zeros past the ends), along ``p.axis``."""
  parts = [x]
  need, hop = p.left, 1
  while need > 0:  # hop h brings the last rows of the block h devices to the left
    c = min(p.tile, need)
    piece = lax.slice_in_dim(x, p.tile - c, p.tile, axis=p.axis)
    parts.insert(0, lax.ppermute(piece, p.names, [(k, k + hop) for k in range(p.n - hop)]))
    need, hop = need - c, hop + 1
  need, hop = p.right, 1
  while need > 0:
    c = min(p.tile, need)
    piece = lax.slice_in_dim(x, 0, c, axis=p.axis)
    parts.append(lax.ppermute(piece, p.names, [(k, k - hop) for k in range(hop, p.n)]))
    need, hop = need - c, hop + 1
  return parts[0] if len(parts) == 1 else lax.concatenate(parts, p.axis)


def _local_geometry(geom: Geometry, plans, works) -> Geometry:
  in_sp, out_sp = list(geom.in_spatial), list(geom.out_spatial)
  padding, extra = list(geom.padding), list(geom.extra)
  for p, w in zip(plans, works):
    n_in, n_out, lo, hi, ex = w.dim
    j = p.spatial
    in_sp[j], out_sp[j], padding[j], extra[j] = n_in, n_out, (lo, hi), ex
  return dataclasses.replace(geom, in_spatial=tuple(in_sp), out_spatial=tuple(out_sp),
                             padding=tuple(padding), extra=tuple(extra))


def _tile_shape(shape, plans) -> list[int]:
  out = list(shape)
  for p in plans:
    out[p.axis] = p.out_tile
  return out


def _branch(kc: KernelCall, plans, works, result_shapes, operands):
  """One class of devices' work: the kernel on its piece, placed in its result block."""
  if any(w is None for w in works):  # no window touches this block
    return tuple(jnp.zeros(s, d) for s, d in result_shapes)
  pieces = list(operands)
  for p, w in zip(plans, works):
    pieces = [lax.slice_in_dim(o, w.start, w.start + w.rows, axis=p.axis) for o in pieces]
  outs = kc.run(pieces, _local_geometry(kc.geom, plans, works))
  placed = []
  for o, (shape, _) in zip(outs, result_shapes):
    cfg = [(0, 0, 0)] * o.ndim
    for p, w in zip(plans, works):
      lo, hi = w.place if kc.backward else (0, p.out_tile - w.dim[1])
      cfg[p.axis] = (lo, hi, 0)
    placed.append(lax.pad(o, jnp.zeros((), o.dtype), cfg))
    assert placed[-1].shape == tuple(shape), (placed[-1].shape, shape)
  return tuple(placed)


def _per_device(kc: KernelCall, plans: tuple[_DimPlan, ...], *operands):
  """What each device runs: its blocks in, its result blocks out (inside a manual context)."""
  if not plans:
    return kc.run(operands, kc.geom)
  if len(plans) == 1:
    fast = _fast_plan(kc, plans[0])
    if fast is not None:
      return _fast(kc, plans[0], fast, operands)
  ext = list(operands)
  for p in plans:
    ext = [_exchange(o, p) for o in ext]
  # Devices doing the same work share a branch: per dim, a class per distinct work.
  classes = [sorted(set(p.works), key=repr) for p in plans]
  block_shapes = _result_blocks(kc, operands, plans)
  branches = [functools.partial(_branch, kc, plans, combo, block_shapes)
              for combo in itertools.product(*classes)]
  if len(branches) == 1:
    return branches[0](ext)
  index = jnp.zeros((), jnp.int32)
  for p, cls in zip(plans, classes):
    table = jnp.asarray([cls.index(w) for w in p.works], jnp.int32)
    index = index * len(cls) + table[lax.axis_index(p.names)]
  return lax.switch(index, branches, ext)


def _result_blocks(kc: KernelCall, operands, plans) -> list[tuple[tuple[int, ...], Any]]:
  """Each result's block shape and dtype on one device: the whole problem's result shapes,
  with each split spatial dim at its block size."""
  whole = []
  for o in operands:
    shape = list(o.shape)
    for p in plans:  # a forward's operands are input-shaped, a backward's output-shaped
      j = p.spatial
      shape[p.axis] = kc.geom.out_spatial[j] if kc.backward else kc.geom.in_spatial[j]
    whole.append(jax.ShapeDtypeStruct(tuple(shape), o.dtype))
  avals = jax.eval_shape(lambda *o: kc.run(o, kc.geom), *whole)
  return [(tuple(_tile_shape(a.shape, plans)), a.dtype) for a in avals]


# ----------------------------------------------------------------------------- Auto meshes


def _rule(kc: KernelCall, mesh, operand_types, result_types):
  """The Shardy sharding rule: batch and channel dims are shared factors of every operand and
  result; a spatial dim is one factor when the output keeps the input's size, one factor times
  the stride when the input is the output times the stride (the common "same" pooling, so that
  Shardy carries a spatial sharding through), else two unrelated factors."""
  del mesh, result_types
  geom = kc.geom
  ndim = len(operand_types[0].shape)
  spatial = geom.spatial_axes(ndim)
  in_dims, out_dims, sizes = [], [], {}
  for ax in range(ndim):
    if ax not in spatial:
      in_dims.append(f"d{ax}")
      out_dims.append(f"d{ax}")
      continue
    j = spatial.index(ax)
    L, O, s = geom.in_spatial[j], geom.out_spatial[j], geom.strides[j]  # noqa: E741
    if L == O:
      in_dims.append(f"s{j}")
    elif L == O * s:
      in_dims.append(f"(s{j} k{j})")
      sizes[f"k{j}"] = s
    else:
      in_dims.append(f"h{j}")
      out_dims.append(f"o{j}")
      continue
    out_dims.append(f"s{j}")
  in_map, out_map = " ".join(in_dims), " ".join(out_dims)
  if kc.backward:
    operands, results = [out_map] * len(operand_types), [in_map]
  else:
    operands, results = [in_map], [out_map] * kc.n_out
  return f"{', '.join(operands)} -> {', '.join(results)}", sizes


def _partition(kc: KernelCall, mesh, arg_shapes, result_shape):
  """Called by XLA's partitioner with the shardings it chose: the shardings the kernel takes
  and gives, and the function each device runs."""
  base = arg_shapes[-1]  # the input of a forward, the cotangent of a backward
  ndim = len(base.shape)
  if not isinstance(base.sharding, NamedSharding) or mesh.empty:
    return _partition_unnamed(kc, mesh, arg_shapes, result_shape)
  dims = _spec_dims(base.sharding.spec, ndim)
  plans = _plan(kc, dims, dict(mesh.shape), ndim)
  sharding = NamedSharding(mesh, P(*[d if d else None for d in dims]))
  results = (sharding,) * kc.n_out  # (``_whole`` returns a tuple, one array too)
  lower = functools.partial(_per_device_cached, kc, plans)
  return mesh, lower, results, (sharding,) * len(arg_shapes)


def _per_device_cached(kc: KernelCall, plans, *operands):
  """:func:`_per_device`, traced while XLA compiles: no launch configuration is tuned then."""
  with tuning.cached_only():
    return _per_device(kc, plans, *operands)


def _partition_unnamed(kc: KernelCall, mesh, arg_shapes, result_shape):
  """Shardings without mesh axis names (inside a ``shard_map`` over some of the mesh's axes):
  batch and channel blocks run as they are; a spatial split, which needs the names for its
  halos, is undone (the block gathered) first."""
  base = arg_shapes[-1]
  sharding = base.sharding
  ndim = len(base.shape)
  block = sharding.shard_shape(tuple(base.shape))
  if any(block[ax] != base.shape[ax] for ax in kc.geom.spatial_axes(ndim)):
    sharding = _replicated_like(sharding)
  results = (sharding,) * kc.n_out
  lower = functools.partial(_per_device_cached, kc, ())
  return mesh, lower, results, (sharding,) * len(arg_shapes)


def _replicated_like(sharding):
  devices = sharding._device_assignment  # noqa: SLF001 - the only way to the device list
  return type(sharding).get_replicated(devices)


_partitioned.def_partition(partition=_partition, sharding_rule=_rule)


# ----------------------------------------------------------------------------- Explicit meshes


def _explicit_spec(a: jax.Array):
  """``(mesh, spec)`` when ``a`` is sharded over Explicit mesh axes (sharding in its type)."""
  sharding: Any = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    return None
  return sharding.mesh, spec


def explicit_unsupported(geom: Geometry, shape, a: jax.Array) -> str | None:
  """Why an Explicit-sharded call cannot keep its sharding (None when it can): the input and
  the output of a spatially split dim must divide over the same devices, as ``shard_map``
  blocks are equal (a gradient's result is input-sized)."""
  explicit = _explicit_spec(a)
  if explicit is None:
    return None
  mesh, spec = explicit
  dims = _spec_dims(spec, len(shape))
  for j, ax in enumerate(geom.spatial_axes(len(shape))):
    n = int(np.prod([mesh.shape[name] for name in dims[ax]])) if dims[ax] else 1
    for what, size in (("output", geom.out_spatial[j]), ("input", geom.in_spatial[j])):
      if n > 1 and size % n:
        return (f"spatial dim {ax} is split over {n} devices of an Explicit mesh, and its "
                f"{what} size {size} does not divide over them")
  return None


def _explicit_call(kc: KernelCall, mesh, spec, operands):
  ndim = operands[-1].ndim
  dims = _spec_dims(spec, ndim)
  plans = _plan(kc, dims, dict(mesh.shape), ndim)
  pspec = P(*[d if d else None for d in dims])
  fn = functools.partial(_per_device, kc, plans)
  return jax.shard_map(fn, mesh=mesh, in_specs=(pspec,) * len(operands),
                       out_specs=(pspec,) * kc.n_out, check_vma=False)(*operands)


# ----------------------------------------------------------------------------- in place
#
# With one spatial dim split, most of a device's work needs no copy of its block. A forward runs
# the kernel on the block itself, its neighbours' rows standing as padding, and recomputes only
# the few outputs whose windows reach those rows from small slices with the halos (written over
# the block's result in place). A backward whose padding rows are neutral computes its gradient
# block in place from the cotangent's rows with their (small) halos. Where a device's part does
# not fit this (a window starting inside the block with no output before it, an edge window
# wider than the block, ...), every device takes the general path above.


@dataclasses.dataclass(frozen=True)
class _Edge:
  """Outputs ``[first, first + count)`` of a device's block, recomputed with the halos."""

  first: int  # the first output, counted in the block's outputs
  count: int
  halo: tuple[int, int]  # rows taken from the halo: (start, stop) in the left or right halo
  own: tuple[int, int]  # rows taken from the block: (start, stop)
  dim: tuple  # their local geometry (in, out, pad_lo, pad_hi, extra)


@dataclasses.dataclass(frozen=True)
class _InPlace:
  """One device's in-place part along the split dim (all static)."""

  rows: int  # the block's real rows (fewer than a block only where the input ends)
  dim: tuple  # the block's local geometry (in, out, pad_lo, pad_hi, extra)
  keep: int  # its outputs that are this device's (a forward), or the cotangent rows it reads
  start: int  # a backward: where those cotangent rows start in the halo-extended block
  lo: _Edge | None
  hi: _Edge | None


def _block_dim(geom: Geometry, j: int, first: int, rows: int, oa: int, ob: int):
  """The local geometry of windows ``[oa, ob)`` over the block's rows ``[first, first+rows)``,
  rows before and after it standing as padding (the input's own padding at its ends); None when
  that geometry cannot give exactly those windows."""
  L, s, ek = geom.in_spatial[j], geom.strides[j], geom.effective_window[j]
  lo, hi = geom.padding[j]
  pad_lo = first + lo - oa * s
  over = (ob - 1) * s - lo + ek - (first + rows)
  if first + rows == L:  # the input's end: its own padding, then the ceil-mode overhang
    pad_hi = min(hi, max(over, 0))
    extra = max(over, 0) - pad_hi
  else:
    pad_hi, extra = max(over, 0), 0
  span = rows + pad_lo + pad_hi + extra
  if pad_lo < 0 or span < ek:
    return None
  return (rows, (span - ek) // s + 1, pad_lo, pad_hi, extra)


def _fast_plan(kc: KernelCall, p: _DimPlan) -> tuple[_InPlace | None, ...] | None:
  if kc.backward and not kc.neutral_pads:
    return None
  geom, j = kc.geom, p.spatial
  L, O = geom.in_spatial[j], geom.out_spatial[j]  # noqa: E741
  s, lo, ek = geom.strides[j], geom.padding[j][0], geom.effective_window[j]
  in_tile = p.out_tile if kc.backward else p.tile
  out_tile = p.tile if kc.backward else p.out_tile
  plans: list[_InPlace | None] = []
  for i in range(p.n):
    first, rows = i * in_tile, min(in_tile, L - i * in_tile)
    if kc.backward:
      w = p.works[i]
      if w is None:
        plans.append(None)
        continue
      oa = w.start - p.left + i * out_tile
      ob = oa + w.rows
      if rows <= 0:
        return None
      dim = _block_dim(geom, j, first, rows, oa, ob)
      if dim is None or dim[1] != ob - oa:
        return None
      plans.append(_InPlace(rows, dim, ob - oa, w.start, None, None))
      continue
    oa, ob = min(i * out_tile, O), min((i + 1) * out_tile, O)
    if oa >= ob:
      plans.append(None)
      continue
    if rows <= 0:
      return None
    dim = _block_dim(geom, j, first, rows, oa, ob)
    if dim is None or dim[1] < ob - oa:
      return None
    # Outputs whose windows reach rows before the block (not the input's own padding) ...
    n_lo = 0 if first == 0 else max(0, min(ob, _cdiv(first + lo, s)) - oa)
    # ... or after it.
    last_inside = (first + rows + lo - ek) // s  # the last window ending inside the block
    n_hi = 0 if first + rows == L else max(0, ob - max(oa, last_inside + 1))
    if n_lo + n_hi > ob - oa:
      n_hi = ob - oa - n_lo
    edges: list[_Edge | None] = []
    for e_first, count, left in ((0, n_lo, True), (ob - oa - n_hi, n_hi, False)):
      if count == 0:
        edges.append(None)
        continue
      a, b, edim = _local_dim(geom, j, oa + e_first, oa + e_first + count)
      if left:
        if b > first + rows or first - a > p.left:
          return None
        halo, own = (p.left - (first - a), p.left), (0, b - first)
      else:
        if a < first or b - (first + rows) > p.right:
          return None
        halo, own = (0, b - (first + rows)), (a - first, rows)
      edges.append(_Edge(e_first, count, halo, own, edim))
    plans.append(_InPlace(rows, dim, ob - oa, 0, edges[0], edges[1]))
  return tuple(plans)


def _halos(x: jax.Array, p: _DimPlan) -> tuple[jax.Array | None, jax.Array | None]:
  """The ``p.left`` rows before ``x``'s block and the ``p.right`` rows after it."""
  ext = _exchange(x, p)
  left = lax.slice_in_dim(ext, 0, p.left, axis=p.axis) if p.left else None
  right = (lax.slice_in_dim(ext, p.left + p.tile, p.left + p.tile + p.right, axis=p.axis)
           if p.right else None)
  return left, right


def _fast(kc: KernelCall, p: _DimPlan, plans, operands):
  block_shapes = _result_blocks(kc, operands, (p,))
  if kc.backward:  # the cotangent rows with their halos (output-sized: small)
    ext = [_exchange(o, p) for o in operands]
    args: tuple = (ext,)
  else:  # the block itself, and small halos beside it
    x = operands[0]
    left, right = _halos(x, p) if (p.left or p.right) else (None, None)
    args = (x, left, right)
  classes = sorted(set(plans), key=repr)
  branches = [functools.partial(_fast_branch, kc, p, w, block_shapes) for w in classes]
  if len(branches) == 1:
    return branches[0](*args)
  table = jnp.asarray([classes.index(w) for w in plans], jnp.int32)
  return lax.switch(table[lax.axis_index(p.names)], branches, *args)


def _with_dim(geom: Geometry, j: int, dim: tuple) -> Geometry:
  n_in, n_out, lo, hi, ex = dim
  in_sp, out_sp = list(geom.in_spatial), list(geom.out_spatial)
  padding, extra = list(geom.padding), list(geom.extra)
  in_sp[j], out_sp[j], padding[j], extra[j] = n_in, n_out, (lo, hi), ex
  return dataclasses.replace(geom, in_spatial=tuple(in_sp), out_spatial=tuple(out_sp),
                             padding=tuple(padding), extra=tuple(extra))


def _fit(a: jax.Array, axis: int, size: int) -> jax.Array:
  """``a`` cut or zero-padded to ``size`` rows along ``axis``."""
  if a.shape[axis] == size:
    return a
  cfg = [(0, 0, 0)] * a.ndim
  cfg[axis] = (0, size - a.shape[axis], 0)
  return lax.pad(a, jnp.zeros((), a.dtype), cfg)


def _fast_branch(kc: KernelCall, p: _DimPlan, w: _InPlace | None, block_shapes, *args):
  if w is None:
    return tuple(jnp.zeros(shape, dtype) for shape, dtype in block_shapes)
  geom, ax, j = kc.geom, p.axis, p.spatial
  if kc.backward:
    (ext,) = args
    pieces = [lax.slice_in_dim(o, w.start, w.start + w.keep, axis=ax) for o in ext]
    outs = kc.run(pieces, _with_dim(geom, j, w.dim))
    return tuple(_fit(o, ax, p.out_tile) for o in outs)
  x, left, right = args
  block = x if w.rows == p.tile else lax.slice_in_dim(x, 0, w.rows, axis=ax)
  outs = [_fit(o, ax, w.keep) for o in kc.run([block], _with_dim(geom, j, w.dim))]
  for edge, halo in ((w.lo, left), (w.hi, right)):
    if edge is None:
      continue
    own = lax.slice_in_dim(x, edge.own[0], edge.own[1], axis=ax)
    side = lax.slice_in_dim(halo, edge.halo[0], edge.halo[1], axis=ax)
    piece = lax.concatenate([side, own] if edge is w.lo else [own, side], ax)
    fixed = kc.run([piece], _with_dim(geom, j, edge.dim))
    outs = [lax.dynamic_update_slice_in_dim(o, f, edge.first, axis=ax)
            for o, f in zip(outs, fixed)]
  return tuple(_fit(o, ax, p.out_tile) for o in outs)
