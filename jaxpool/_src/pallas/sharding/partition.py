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

The halo plans are in ``halo.py``, what each device runs in ``halo_inplace.py`` (its part along
one split dim in place) and ``halo.py`` (any split); a kernel call's description
(:class:`KernelCall`) and :func:`out_struct` in ``calls.py``.

The rule sits below jaxpool's differentiation and batching rules (``autodiff``, ``linear``,
``custom_vmap`` in ``ops``): those see one kernel call; only the primal kernels are
partitioned.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend import core as jex_core
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpool._src import xla
from jaxpool._src.pallas.tuning import tuner as tuning
from jaxpool._src.pallas.calls import (KernelCall, kernel_call, needs_devices, one_device,
                                       out_struct)
from jaxpool._src.pallas.sharding.halo import plan, spec_dims
from jaxpool._src.pallas.sharding.halo_inplace import per_device
from jaxpool._src.windows import Geometry, taps_dtype

__all__ = ["KernelCall", "call", "explicit_unsupported", "kernel_call", "kernel_p",
           "needs_devices", "out_struct"]


def call(kc: KernelCall, *operands: jax.Array):
  """Runs ``kc`` on ``operands``, split over the devices they live on (see the module doc).

  Returns one array, or a tuple when ``kc.n_out > 1``.
  """
  explicit = xla.explicit_sharding(operands[-1])
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


def _lowering(ctx, *operands, kc: KernelCall):
  if getattr(ctx.module_context.lowering_parameters, "for_export", False):
    fn = functools.partial(lambda *o: kc.run(o, kc.geom, kc.xla_fn))
  elif one_device(ctx):
    fn = functools.partial(_whole, kc)  # nothing to split
  else:
    with tuning.cached_only():  # (the whole problem's kernel is traced, never run)
      return mlir.lower_fun(functools.partial(_partitioned, kc),
                            multiple_results=True)(ctx, *operands)
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


needs_devices(kernel_p)
kernel_p.def_impl(lambda *operands, kc: _whole(kc, *operands))
kernel_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(kernel_p, _lowering)


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
    elif L == O * s and O > 1:  # (Shardy refuses a compound factor with a factor of size 1)
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
  results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
  dims = None
  if not mesh.empty:
    # A forward's input, else its output (a backward's likewise); where neither sharding can
    # be said over the mesh, the spatial dims are taken whole and the others split as given.
    for shape, whole in ((base, ()), *((r, ()) for r in results),
                         (base, kc.geom.spatial_axes(ndim))):
      dims = _named_dims(mesh, shape, whole)
      if dims is not None:
        break
  if dims is None:
    return _partition_unnamed(kc, mesh, arg_shapes, result_shape)
  plans = plan(kc, dims, dict(mesh.shape), ndim)
  sharding = NamedSharding(mesh, P(*[d if d else None for d in dims]))
  results = (sharding,) * kc.n_out  # (``_whole`` returns a tuple, one array too)
  lower = functools.partial(_per_device_cached, kc, plans)
  return mesh, lower, results, (sharding,) * len(arg_shapes)


def _named_dims(mesh, shape, whole=()) -> list[tuple[str, ...]] | None:
  """The mesh axes that split each dim of ``shape`` under its sharding, or None where no
  :class:`PartitionSpec` over ``mesh`` gives that sharding (part of a mesh axis on a dim, or
  manual axes). With ``whole`` (dims), the spec that leaves those dims whole and splits the
  others as the sharding does. Tries the specs over the mesh's axes that split each dim as
  many ways as the sharding does."""
  sharding, ndim = shape.sharding, len(shape.shape)
  if isinstance(sharding, NamedSharding) and not whole:
    return spec_dims(sharding.spec, ndim)

  ways = _split_ways(sharding, ndim)  # (the search tries only axes that split a dim as many)
  if ways is None:
    return None
  size = dict(mesh.shape)

  def specs(d: int, free: tuple[str, ...]):
    if d == ndim:
      yield []
      return
    for k in range(1 if d in whole else len(free) + 1):  # (a whole dim: no axes)
      for axes in itertools.permutations(free, k):
        if d not in whole and math.prod(size[a] for a in axes) != ways[d]:
          continue
        for tail in specs(d + 1, tuple(a for a in free if a not in axes)):
          yield [axes, *tail]

  keep = [d for d in range(ndim) if d not in whole]

  def same(candidate: NamedSharding) -> bool:
    try:
      if not whole:
        return candidate.is_equivalent_to(sharding, ndim)
      divisible = (len(sharding.device_set),) * ndim  # (as in _split_ways)
      mine, given = (s.devices_indices_map(divisible) for s in (candidate, sharding))
    except Exception:  # noqa: BLE001 - JAX cannot read it (manual subgroups, another device count)
      return False
    return all([mine[dev][d] for d in keep] == [given[dev][d] for d in keep] for dev in given)

  for dims in specs(0, tuple(mesh.axis_names)):
    if same(NamedSharding(mesh, P(*[d if d else None for d in dims]))):
      return dims
  return None


def _split_ways(sharding, ndim: int) -> list[int] | None:
  """How many ways ``sharding`` splits each dim, or None where JAX cannot read it (manual
  subgroups, another device count). Read on a shape that every split divides (the device
  count on each dim): the real sizes need not divide (XLA pads the blocks)."""
  tiles = (len(sharding.device_set),) * ndim
  try:
    return [t // b for t, b in zip(tiles, sharding.shard_shape(tiles), strict=True)]
  except Exception:  # noqa: BLE001 - any failure to read it means: not readable
    return None


def _per_device_cached(kc: KernelCall, plans, *operands):
  """:func:`halo_inplace.per_device`, traced while XLA compiles: no launch configuration is
  tuned then."""
  with tuning.cached_only():
    return per_device(kc, plans, *operands)


def _partition_unnamed(kc: KernelCall, mesh, arg_shapes, result_shape):
  """Shardings that no mesh axis names say (inside a ``shard_map`` over some of the mesh's
  axes, or with manual subgroups): batch and channel blocks run as they are; a spatial split,
  which needs the names for its halos, or a sharding JAX cannot read, is undone (the block
  gathered) first."""
  base = arg_shapes[-1]
  sharding = base.sharding
  ways = _split_ways(sharding, len(base.shape))
  if ways is None or any(ways[ax] > 1 for ax in kc.geom.spatial_axes(len(base.shape))):
    sharding = _replicated_like(sharding)
  results = (sharding,) * kc.n_out
  lower = functools.partial(_per_device_cached, kc, ())
  return mesh, lower, results, (sharding,) * len(arg_shapes)


def _replicated_like(sharding):
  devices = sharding._device_assignment  # noqa: SLF001 - the only way to the device list
  return type(sharding).get_replicated(devices)


# The shardings reach :func:`_partition` as XLA gives them (``decode_shardings=False``), and
# :func:`_named_dims` reads them: JAX's own reading fails on a sharding that gives a dim part of
# a mesh axis, which Shardy may choose for an output with fewer rows than devices.
_partitioned.def_partition(partition=_partition, sharding_rule=_rule, decode_shardings=False)


# ----------------------------------------------------------------------------- Explicit meshes


def explicit_unsupported(geom: Geometry, shape, a: jax.Array) -> str | None:
  """Why an Explicit-sharded call cannot keep its sharding (None when it can): the input and
  the output of a spatially split dim must divide over the same devices, as ``shard_map``
  blocks are equal (a gradient's result is input-sized)."""
  explicit = xla.explicit_sharding(a)
  if explicit is None:
    return None
  mesh, spec = explicit
  dims = spec_dims(spec, len(shape))
  for j, ax in enumerate(geom.spatial_axes(len(shape))):
    n = int(np.prod([mesh.shape[name] for name in dims[ax]])) if dims[ax] else 1
    for what, size in (("output", geom.out_spatial[j]), ("input", geom.in_spatial[j])):
      if n > 1 and size % n:
        return (f"spatial dim {ax} is split over {n} devices of an Explicit mesh, and its "
                f"{what} size {size} does not divide over them")
  return None


def _explicit_call(kc: KernelCall, mesh, spec, operands):
  ndim = operands[-1].ndim
  dims = spec_dims(spec, ndim)
  plans = plan(kc, dims, dict(mesh.shape), ndim)
  pspec = P(*[d if d else None for d in dims])
  fn = functools.partial(per_device, kc, plans)
  return jax.shard_map(fn, mesh=mesh, in_specs=(pspec,) * len(operands),
                       out_specs=(pspec,) * kc.n_out, check_vma=False)(*operands)
