"""The JAX internals that ``jaxpool.optimize`` needs and ``jax.extend`` does not offer.

Everything else in this package uses JAX's public surface and ``jax.extend`` (``jax.extend.core``
for jaxprs, primitives and ``jaxprs_in_params``, ``jax.extend.linear_util.wrap_init``,
``jax.extend.source_info_util`` for the name stack and user context). The names below are
imported from ``jax._src`` because nothing public does their job; each JAX release can move
them, and ``tests/optimize/test_optimize_jax_private.py`` checks every one (it exists and does
what this package relies on), so an incompatible release fails there first, with the name.

* ``trace_to_jaxpr_dynamic``: traces a Python function on abstract values (``ShapedArray``
  avals, which may carry a weak type, a sharding or, under ``shard_map``, varying manual axes)
  to a jaxpr in the current trace context. ``jax.make_jaxpr`` takes only concrete or
  ``ShapeDtypeStruct`` arguments and drops what the avals of an enclosing ``shard_map`` carry.
  Used to rebuild a sub-jaxpr (of ``jit``, ``cond``, ``scan``, ...) around rewritten equations.
* ``convert_constvars_jaxpr``: turns a jaxpr's constants into leading inputs, the form in which
  ``scan``, ``while``, ``cond`` and ``remat`` take closed-over values (JAX's own control-flow
  rules do the same).
* ``user_frames``: the frames of a traceback that are not JAX's, for the report's source line.
  ``jax.extend.source_info_util.summarize`` gives only one line and no frame objects.
* ``flattree`` (JAX 0.11 and later only): ``scan`` describes its operands as a flat tree
  (``ft_in``); a rebuilt scan that takes new constants must extend that tree.
* ``shard_map_p``: the primitive of ``jax.shard_map``, the key by which the interpreter enters
  a ``shard_map`` body (``jax.extend.core.primitives`` does not list it). The body is rebuilt
  with the public ``jax.shard_map``; :func:`shard_map_manual_axes` reads which mesh axes the
  equation made manual (its ``axis_names=``) from the primitive's params.
* ``VARYING_CASTS``: the primitives that ``shard_map`` with ``check_vma=True`` inserts to make a
  value varying over manual axes (``pvary``; ``pcast`` in later JAX). They change a type, not a
  value, so a constant divisor or a ReLU's zero stays known through them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jax._src import core as _core
from jax._src import shard_map as _shard_map
from jax._src import source_info_util as _siu
from jax._src.interpreters import partial_eval as _pe



def trace_to_jaxpr_dynamic(fun: Any, in_avals: Any) -> tuple[Any, list, list]:
  """``(jaxpr, out_avals, consts)`` of ``fun`` traced on ``in_avals``.

  ``core.ClosedJaxpr(jaxpr, consts)`` binds the constants in every JAX this package supports;
  the interpreter uses only that form. (Up to JAX 0.10 the constants are the jaxpr's
  ``constvars``. From JAX 0.11 a jaxpr and a closed jaxpr are one class: a traced jaxpr comes
  back with its constants as leading inputs and nothing attached, so ``jaxpr.invars`` counts
  them until ``ClosedJaxpr`` attaches them.)"""
  jaxpr, out_avals, consts = _pe.trace_to_jaxpr_dynamic(fun, in_avals)
  return jaxpr, out_avals, list(consts)

convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
shard_map_p = _shard_map.shard_map_p
VARYING_CASTS: frozenset = frozenset(
    getattr(_core, name) for name in ("pvary_p", "pcast_p") if hasattr(_core, name))


def shard_map_manual_axes(params: dict[str, Any]) -> frozenset:
  """The mesh axes that a ``shard_map`` equation makes manual (what its caller passed as
  ``axis_names=``, all the mesh's axes by default)."""
  for key in ("newly_manual_axes", "manual_axes", "axis_names"):
    if key in params:
      return frozenset(params[key])
  raise KeyError(f"a shard_map equation without its manual axes: params {sorted(params)}")


def user_frames(traceback: Any) -> Iterator[Any]:
  """The frames of ``traceback`` outside JAX, innermost first (each has ``file_name``,
  ``start_line`` and ``function_name``)."""
  return _siu.user_frames(traceback)


def scan_operands_with_new_consts(ft_in: Any, n: int) -> Any:
  """``scan``'s flat operand tree (JAX >= 0.11) with ``n`` new leading constants."""
  from jax._src import flattree  # type: ignore[attr-defined,unused-ignore]  # JAX >= 0.11
  old, carry, xs = ft_in.unpack()
  return flattree.pack(((flattree.nones(n), old), carry, xs))
