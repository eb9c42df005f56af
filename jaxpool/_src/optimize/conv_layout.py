"""A pooling site after a convolution that XLA lays out channels-first: pool the transposed view.

XLA's GPU compiler picks the physical layout of every convolution it hands to cuDNN (its layout
assignment, ``HeuristicLayoutAssignment`` in XLA's ``gpu/transforms/layout_assignment.cc``):
on NVIDIA GPUs of compute capability 9.0 and above (Hopper on) a convolution with 3 or more
spatial dims, or in float64, is laid out channels-first (``NCDHW``); below 9.0 every
convolution is, except a float16/bfloat16 convolution with 2 spatial dims on compute capability
7.0 and above. A Pallas kernel's custom call takes its operands in the row-major layout of their
logical shape, so a ``channels_last`` pool of such a convolution's output makes XLA transpose
the activations into ``NDHWC`` and back (and every mask that XLA fuses with them).

:func:`view` gives such a site the ``channels_first`` layout of the transposed view instead
(:class:`~.layout.Layout`'s ``perm``): XLA then lowers the logical transposes to bitcasts of the
convolution's channels-first buffer. jaxpool's results do not depend on the data format, so
the optimized function computes the same bits.

The decision is a pure function of the jaxpr, the ``implementation=``, the platform and the
GPU's compute capability: every process of a multi-process job (the same program on the same
kind of GPU) decides the same, so they compile the same program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.extend.core import primitives as prims

from jaxpool._src import dispatch, platforms
from jaxpool._src.backend import Op
from jaxpool._src.optimize import _jax_private
from jaxpool._src.optimize.cost import kernels_by_default
from jaxpool._src.optimize.dataflow import Dataflow
from jaxpool._src.optimize.layout import Layout
from jaxpool._src.windows import make_geometry

MAX_STEPS = 32
"""How many ops the walk from a pool's input back to a convolution goes through at most."""

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "square", "integer_pow",
    "pow", "erf", "erfc", "sin", "cos", "clamp", "convert_element_type", "reduce_precision",
    "copy", *(p.name for p in _jax_private.VARYING_CASTS)})
"""Elementwise primitives (by name) that the walk goes through: each output element is made
from the same element of an operand of the output's shape, so it keeps that operand's layout."""

_CALLS = frozenset({prims.jit_p, prims.custom_jvp_call_p, prims.custom_vjp_call_p})
_CALL_JAXPR = {prims.jit_p: "jaxpr", prims.custom_jvp_call_p: "call_jaxpr",
               prims.custom_vjp_call_p: "call_jaxpr"}

WHY = "XLA lays the convolution before it out channels-first"
"""What the report says of a transposed site (after ``channels_first on the transposed view``)."""


def conv_is_channels_first(compute_capability: tuple[int, int], spatial_dims: int,
                           dtype) -> bool:
  """Whether XLA lays out a convolution channels-first on an NVIDIA GPU.

  Mirrors XLA's GPU layout assignment (``HeuristicLayoutAssignment``): from compute capability
  9.0 on, a convolution with 3 or more spatial dims or in float64 is channels-first (``NCHW``-
  style), others channels-last; below 9.0 every convolution is channels-first, except a
  float16/bfloat16 one with 2 spatial dims on compute capability 7.0 and above.

  Args:
    compute_capability: the GPU's ``(major, minor)``, e.g. ``(9, 0)`` for an H100.
    spatial_dims: the convolution's number of spatial dims (3 for a 3-D convolution).
    dtype: the convolution's input dtype.

  Returns:
    True where XLA lays the convolution out channels-first.
  """
  dtype = np.dtype(dtype)
  if tuple(compute_capability) >= (9, 0):
    return spatial_dims >= 3 or dtype == np.float64
  half = dtype in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
  return not (half and spatial_dims == 2 and tuple(compute_capability) >= (7, 0))


def compute_capability() -> tuple[int, int] | None:
  """The lowest compute capability among the devices of JAX's default platform, where they
  say one (NVIDIA GPUs: ``"9.0"`` becomes ``(9, 0)``); None elsewhere. Tests replace this
  function."""
  return platforms.compute_capability()


def _cc_of_kernels(implementation) -> tuple[int, int] | None:
  """The compute capability of the GPU where jaxpool's Pallas kernels run for
  ``implementation``; None where they do not run on an NVIDIA GPU (CPUs, TPUs, ROCm)."""
  if not kernels_by_default(implementation) or dispatch.platform() != "cuda":
    return None
  return compute_capability()


Producer = Callable[[core.Var], "core.JaxprEqn | None"]


def _follow(eqn, producer: Producer) -> int | None:
  """The operand of an elementwise ``eqn`` that the walk follows: the only one of the output's
  shape that is not a broadcast, the others broadcast along it (a bias, a scalar); None for
  anything else."""
  if len(eqn.outvars) != 1 or eqn.primitive.name not in ELEMENTWISE:
    return None
  out = tuple(eqn.outvars[0].aval.shape)
  same = []
  for k, v in enumerate(eqn.invars):
    s = tuple(getattr(v.aval, "shape", ()))
    if s and (len(s) != len(out) or any(a not in (1, b) for a, b in zip(s, out))):
      return None
    made = producer(v) if isinstance(v, core.Var) else None
    if s == out and not (made is not None and made.primitive is prims.broadcast_in_dim_p):
      same.append(k)
  if len(same) != 1 or not isinstance(eqn.invars[same[0]], core.Var):
    return None
  return same[0]


def _through_call(eqn, budget: list[int]) -> int | None:
  """The operand of a ``jit``/``custom_jvp_call``/``custom_vjp_call`` whose body only passes
  it through elementwise ops to its one output (``jax.nn.relu``); None otherwise."""
  if eqn.primitive not in _CALLS or len(eqn.outvars) != 1:
    return None
  closed = eqn.params.get(_CALL_JAXPR[eqn.primitive])
  jaxpr = getattr(closed, "jaxpr", closed)
  if not isinstance(jaxpr, core.Jaxpr) or len(jaxpr.invars) != len(eqn.invars):
    return None
  made = {v: e for e in jaxpr.eqns for v in e.outvars}
  end = _walk(made.get, jaxpr.outvars[0], budget)
  if not isinstance(end, core.Var) or end not in jaxpr.invars:
    return None
  k = jaxpr.invars.index(end)
  return k if isinstance(eqn.invars[k], core.Var) else None


def _walk(producer: Producer, atom, budget: list[int]):
  """Walks back from ``atom`` through at most ``budget[0]`` elementwise ops and calls of them
  (the ops inside a call count too): the var where the walk stops (one that ``producer`` knows
  no equation of), or the equation that stops it."""
  while isinstance(atom, core.Var):
    eqn = producer(atom)
    if eqn is None:
      return atom
    k = _follow(eqn, producer)
    if k is None and budget[0] > 0:
      k = _through_call(eqn, budget)
    if k is None or budget[0] <= 0:
      return eqn
    budget[0] -= 1
    atom = eqn.invars[k]
  return atom


def conv_before(g: Dataflow, atom):
  """The ``conv_general_dilated`` equation that makes ``atom`` through elementwise ops (a bias
  added, an activation, a conversion), at most :data:`MAX_STEPS` of them; None if none does.
  A transpose, a reshape or any other op on the way stops the walk."""
  def producer(v):
    i = g.producer.get(v)
    return None if i is None else g.eqns[i]
  end = _walk(producer, atom, [MAX_STEPS])
  if isinstance(end, core.JaxprEqn) and end.primitive is prims.conv_general_dilated_p:
    return end
  return None


def view(g: Dataflow, x, lay: Layout, implementation) -> Layout:
  """``lay``, or the ``channels_first`` layout of its transposed view where the pool's input
  ``x`` is a convolution's output (through elementwise ops) that XLA lays out channels-first
  on the NVIDIA GPU where jaxpool's kernels run.

  Only a ``channels_last`` layout of a batch dim, the pooled dims and the channel dim whose
  convolution has the same dims in the same order (``dimension_numbers.out_spec``: batch
  first, feature last) is transposed: its ``(N, C, *spatial)`` view is then the convolution's
  physical layout.
  """
  ndim = len(x.aval.shape)
  if (lay.data_format != "channels_last" or lay.perm is not None or lay.expand
      or ndim != len(lay.window) + 2):
    return lay
  # The same in every process of a multi-process job: a pure function of the jaxpr, the
  # implementation, the platform and the GPU's compute capability (the same GPUs, the same
  # program), never of a timing or anything else that differs between processes.
  cc = _cc_of_kernels(implementation)
  if cc is None:
    return lay
  conv = conv_before(g, x)
  if conv is None:
    return lay
  out_spec = tuple(getattr(conv.params.get("dimension_numbers"), "out_spec", ()))
  if out_spec != (0, ndim - 1, *range(1, ndim - 1)):
    return lay
  if not conv_is_channels_first(cc, ndim - 2, conv.invars[0].aval.dtype):
    return lay
  moved = dataclasses.replace(lay, perm=(0, ndim - 1, *range(1, ndim - 1)),
                              data_format="channels_first", why=WHY)
  # Only where the kernels serve the pool (a dtype they take, few enough taps): elsewhere
  # jaxpool runs its XLA path, whose layout XLA chooses, and a transpose would only be written.
  shape = moved.shape(x.aval.shape)
  geom = make_geometry(shape, moved.window, moved.strides, moved.padding, moved.dilation, False,
                       moved.data_format)
  # (The backend reads only the operand's shape, dtype and type: a ShapeDtypeStruct serves.)
  operand = cast(jax.Array, jax.ShapeDtypeStruct(shape, x.aval.dtype))
  if dispatch.pallas().supports(Op.MAX_POOL, operand, geom) is not None:
    return lay
  return moved

