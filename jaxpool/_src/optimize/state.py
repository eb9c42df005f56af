"""State written inside an optimized function: Flax NNX ``Variable``\\ s of its arguments.

``optimize`` traces ``fn`` on copies of its arguments (unflattened from their leaves), so a
write into an ``nnx.Variable`` of an argument (BatchNorm's running statistics, an ``Rngs``
counter, any ``Variable`` set inside) lands in the copy. :func:`traced_writes` finds those
writes after the trace; their values become extra outputs of the jaxpr, and :func:`write_back`
puts them into the caller's own ``Variable``\\ s after each call, as the function without optimize
would have left them. A write that cannot be carried (a ``Variable`` added, removed or replaced,
or set to something that is not an array, or a write into a module that the function carries
rather than takes as an argument) raises.

Flax is never imported here: without ``flax.nnx`` loaded, no argument holds a ``Variable``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def _variable_type() -> type | None:
  nnx = sys.modules.get("flax.nnx")
  return getattr(nnx, "Variable", None)


def variables(tree: Any) -> list[Any]:
  """The ``nnx.Variable``\\ s in ``tree``, in the order of ``jax.tree.flatten``."""
  cls = _variable_type()
  if cls is None:
    return []
  return [v for v in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, cls))
          if isinstance(v, cls)]


def _get(v: Any) -> Any:
  return v.get_value() if hasattr(v, "get_value") else v.value


def _set(v: Any, value: Any) -> None:
  if hasattr(v, "set_value"):
    v.set_value(value)
  else:
    v.value = value


def snapshot(tree: Any) -> tuple[list[Any], list[Any]]:
  """The ``Variable``\\ s of ``tree`` and their values, before ``fn`` runs on it."""
  vs = variables(tree)
  return vs, [_get(v) for v in vs]


def traced_writes(tree: Any, before: tuple[list[Any], list[Any]], name: str
                  ) -> tuple[tuple[int, ...], list[Any]]:
  """Which ``Variable``\\ s of ``tree`` (by position) ``fn`` wrote while it was traced, and
  their new values.

  Raises:
    ValueError: ``fn`` added, removed or replaced a ``Variable`` of its arguments.
    TypeError: ``fn`` set a ``Variable`` to a value that is not an array.
  """
  old_vars, old_values = before
  new_vars = variables(tree)
  if len(new_vars) != len(old_vars) or any(a is not b for a, b in zip(new_vars, old_vars)):
    raise ValueError(
        f"jaxpool.optimize({name}): the function adds or removes nnx.Variables of its arguments "
        f"(it had {len(old_vars)}, it left {len(new_vars)}, or replaced one with a new object); "
        "optimize can carry out writes into existing Variables only. Create the Variables "
        "before calling the optimized function.")
  idx, values = [], []
  for i, (v, old) in enumerate(zip(new_vars, old_values)):
    new = _get(v)
    if new is old:
      continue
    if not isinstance(new, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
          f"jaxpool.optimize({name}): the function set {type(v).__name__} #{i} of its "
          f"arguments to {type(new).__name__} {new!r}, not an array; optimize can carry out "
          "array values only. Store a jnp array in the Variable.")
    idx.append(i)
    values.append(new)
  return tuple(idx), values


def carried_write_error(error: BaseException, name: str) -> ValueError | None:
  """Flax's error for a write into a ``Variable`` created outside the trace: the function wrote
  into a module it carries (``optimize(model)``, a bound method, a closure), not into one of its
  arguments. optimize cannot carry that write out; the error says how to pass the module."""
  if type(error).__name__ != "TraceContextError" or not type(error).__module__.startswith(
      "flax"):
    return None
  return ValueError(
      f"jaxpool.optimize({name}): the function writes nnx.Variables of a module that it carries "
      "(the function is the module, a bound method or a closure over it), not of its arguments: "
      "optimize can carry out writes into its arguments only. Pass the module as an argument: "
      "jaxpool.optimize(lambda model, x: model(x))(model, x).")


def write_back(tree: Any, written: Sequence[int], values: Sequence[Any]) -> None:
  """Sets the caller's ``Variable``\\ s at positions ``written`` to ``values``."""
  if not written:
    return
  vs = variables(tree)
  for i, value in zip(written, values):
    _set(vs[i], value)
