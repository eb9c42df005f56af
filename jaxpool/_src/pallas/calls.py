"""A Pallas kernel call's static description, and the output type of its ``pallas_call``.

:class:`KernelCall` is what the partitioning rule (``sharding/partition.py``) and the halo plans
(``sharding/halo.py``) know of a kernel: a function of its operands and a geometry.
:func:`out_struct`
gives a kernel's outputs the manual mesh axes of its input, so that ``shard_map`` with
``check_vma=True`` accepts them; :func:`needs_devices` marks a primitive whose lowering reads the
program's devices, and :func:`one_device` tells such a lowering whether each device runs a
whole kernel call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxpool._src.windows import Geometry


def needs_devices(p: Any) -> None:
  """Tells JAX that lowering ``p`` needs the program's devices, as ``custom_partitioning``'s
  own primitive does (JAX lowers nested ``jit`` bodies without their devices otherwise, and
  ``custom_partitioning`` then fails). Every primitive whose lowering runs a kernel call or
  reads the devices (``sharding/partition.py``'s ``kernel_p``, the Pallas backend's linear
  primitives, the ROI kernels' primitive) is marked. JAX keeps that list in a private module,
  the one private name the kernels use; tests/sharding/test_partitioning.py fails if a JAX
  release moves it."""
  from jax._src import dispatch as jax_dispatch  # noqa: PLC0415
  jax_dispatch.prim_requires_devices_during_lowering.add(p)


def one_device(ctx) -> bool:
  """Whether each device runs a whole kernel call on what it holds (``ctx``: a lowering
  context): the program runs on one device, or inside a ``shard_map`` whose mesh axes left to
  the compiler have one device each (``custom_partitioning`` itself lowers the plain call when
  every axis is manual; with an automatic axis of one device, JAX 0.10-0.11 fail to read its
  shardings)."""
  axis_context = ctx.module_context.axis_context
  if getattr(axis_context, "num_devices", None) == 1:
    return True
  manual, mesh = getattr(axis_context, "manual_axes", ()), getattr(axis_context, "mesh", None)
  return bool(manual) and mesh is not None and all(
      size == 1 for name, size in mesh.shape.items() if name not in manual)


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
    pads_alike: (a backward) the kernel reads the padding and the ceil-mode overhang alike, and
      a window with a zero cotangent adds an exact zero (the max pool's): a device's part may
      then take extra windows past the input's end, so that every device runs one kernel call.
    sums_as_is: (a backward) each result element is a sum of operand elements as they are, in
      a fixed order (the max pool's): a few result rows recomputed from a small piece of the
      operands have the whole call's bits, whatever a compiler folds in the smaller program.
  """

  fn: Callable[..., Any]
  xla_fn: Callable[..., Any]
  geom: Geometry
  backward: bool
  n_out: int
  options: tuple[tuple[str, Any], ...]
  neutral_pads: bool = False
  pads_alike: bool = False
  sums_as_is: bool = False

  def run(self, operands, geom: Geometry, fn: Callable[..., Any] | None = None):
    out = (fn or self.fn)(*operands, geom, **dict(self.options))
    return (out,) if self.n_out == 1 else tuple(out)


def kernel_call(fn: Callable[..., Any], xla_fn: Callable[..., Any], geom: Geometry, *,
                backward: bool = False, n_out: int = 1, neutral_pads: bool = False,
                pads_alike: bool = False, sums_as_is: bool = False,
                **options: Any) -> KernelCall:
  return KernelCall(fn, xla_fn, geom, backward, n_out, tuple(sorted(options.items())),
                    neutral_pads, pads_alike, sums_as_is)
