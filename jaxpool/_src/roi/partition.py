"""How ROI align's per-image form splits over devices on the GPU kernels.

The per-image form (boxes ``(N, K, 4)`` with a mask: ``batched=True`` binds of the kernels'
primitive, ``kernels.py``) gives every operand and the result a leading batch axis, and each
image's boxes read and write only that image's table. So it splits along that axis with no
communication: under ``jit`` with a batch-sharded mesh, :func:`split` gives XLA's partitioner a
rule (:func:`jax.experimental.custom_partitioning`, with a Shardy rule that makes the batch
axis one factor of every operand and of the result), and each device runs the kernels on its
own images, exactly as one device runs them on all (the same boxes on the same tables: the
same bits). The other axes are kept whole on every device; a sharding that splits them is
undone first (XLA moves the data), and a batch axis that no mesh axis names is not split.
Inside a ``shard_map`` over every mesh axis that splits the batch, the kernels run on the block
they are given (``kernels.py`` asks :func:`jaxpool._src.pallas.calls.one_device`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _whole(impl: Callable, params: tuple, *operands) -> tuple:
  # (under ``jit``: ``custom_partitioning`` takes a function whose trace holds no constants of
  # its own, and the kernels' tables of static numbers would be such constants)
  return tuple(jax.jit(functools.partial(impl, **dict(params)))(*operands))


_partitioned = custom_partitioning(_whole, static_argnums=(0, 1))


def split(impl: Callable, params: dict, *operands) -> list:
  """``impl(*operands, **params)`` (a ``batched=True`` bind's implementation: a list of
  results), split along the operands' and the results' leading (batch) axis over the devices
  the program runs on."""
  return list(_partitioned(impl, tuple(sorted(params.items())), *operands))


def _rule(impl, params, mesh, operand_types, result_types):
  """The Shardy rule: the batch axis ``b`` is one factor of every operand and result; every
  other axis its own factor."""
  del impl, params, mesh
  dims = lambda name, t: " ".join(["b", *(f"{name}{d}" for d in range(1, len(t.shape)))])
  operands = ", ".join(dims(f"o{i}_", t) for i, t in enumerate(operand_types))
  results = ", ".join(dims(f"r{i}_", t) for i, t in enumerate(result_types))
  return f"{operands} -> {results}"


def _batch_axes(shapes):
  """The mesh axes that split the leading axis of the first of ``shapes`` whose sharding names
  them (None: the batch is not split by named axes)."""
  for shape in shapes:
    sharding = getattr(shape, "sharding", None)
    if isinstance(sharding, NamedSharding) and len(sharding.spec) and sharding.spec[0]:
      return sharding.spec[0]
  return None


def _partition(impl, params, mesh, arg_shapes, result_shape):
  """Called by XLA's partitioner: every operand and result split along the batch as the
  first result (else the first operand that says how), the rest whole; each device runs
  ``impl`` on its images."""
  results = tuple(result_shape) if isinstance(result_shape, (tuple, list)) else (result_shape,)
  axes = _batch_axes((*results, *arg_shapes)) if not mesh.empty else None

  def sharding(shape):
    return NamedSharding(mesh, P(axes, *((None,) * (len(shape.shape) - 1))))

  lower = functools.partial(_whole, impl, params)
  return (mesh, lower, tuple(sharding(r) for r in results),
          tuple(sharding(a) for a in arg_shapes))


_partitioned.def_partition(partition=_partition, sharding_rule=_rule)
