"""What a graph checks when it runs: the inputs it is given (names, shapes, dtypes) and the
parameter (or model-state) pytree, each error naming the node and what was expected."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpool._src.graph.base import Node
from jaxpool._src.graph.inputs import Input


def check_inputs(input_nodes: Sequence[Input], inputs: Mapping[str, Any],
                 require_all: bool = True) -> dict[str, jax.Array]:
  """The ``inputs`` of a run, checked against the graph's ``input_nodes`` (names, the
  per-example shape after the batch dims, one batch shape for all, the kind of dtype) and cast
  to the nodes' dtypes.

  Raises:
    ValueError: an unknown or (``require_all``) a missing input, a wrong shape, batch dims that
      differ between inputs.
    TypeError: a float input for an integer node or the other way round.
  """
  names = {n.name: n for n in input_nodes}
  unknown = sorted(set(inputs) - set(names))
  if unknown:
    raise ValueError(f"unknown input(s) {unknown}; this graph's inputs are {sorted(names)}.")
  missing = sorted(set(names) - set(inputs))
  if require_all and missing:
    raise ValueError(f"missing input(s) {missing}; this graph's inputs are {sorted(names)}.")
  out, batch = {}, None
  for name, value in inputs.items():
    node = names[name]
    x = jnp.asarray(value)
    k = x.ndim - len(node.shape)
    if k < 0 or tuple(x.shape[k:]) != node.shape:
      raise ValueError(f"input {name!r} must have shape (*batch, *{node.shape}); got "
                       f"{tuple(x.shape)}.")
    if batch is not None and tuple(x.shape[:k]) != batch[1]:
      raise ValueError(f"inputs {batch[0]!r} and {name!r} have different batch dims: "
                       f"{batch[1]} and {tuple(x.shape[:k])}.")
    batch = batch or (name, tuple(x.shape[:k]))
    if (jnp.issubdtype(x.dtype, jnp.floating) != jnp.issubdtype(node.dtype, jnp.floating)
        and not (x.dtype == bool and not jnp.issubdtype(node.dtype, jnp.floating))):
      raise TypeError(f"input {name!r} must have a {node.dtype} dtype; got {x.dtype}.")
    out[name] = x.astype(node.dtype)
  return out


def check_params(params: Any, specs: Mapping[str, Any], by_name: Mapping[str, Node],
                 what: str = "params", maker: str = "init()") -> None:
  """Checks ``params`` against ``specs`` (a graph's ``param_specs()``, or the specs of its model
  state; ``by_name``: the graph's nodes): one entry per node with parameters,
  holding exactly that node's parameters, arrays of the expected shapes and a float dtype.
  Entries for nodes this graph does not have are ignored (a sub-graph can take the whole
  model's parameters).

  Raises:
    TypeError: ``params`` (or a node's entry) is not a dict, a parameter is not a float array.
    ValueError: a node's entry or parameter is missing, unexpected or of the wrong shape; the
      message names the node, the parameter and the expected and received shapes.
  """
  if not isinstance(params, Mapping):
    raise TypeError(f"{what} must be a dict {{node name: {{parameter name: array}}}} as "
                    f"{maker} returns ({{}} for a graph without {what}); got "
                    f"{type(params).__name__}.")
  for name, pspecs in specs.items():
    node = by_name[name]
    where = f"node {name!r} ({type(node).__name__})"
    want = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in pspecs.items())
    if name not in params:
      raise ValueError(f"{where}: {what} has no entry {name!r} (expected {{{want}}}); it has "
                       f"entries for {sorted(map(str, params))}. {what.capitalize()} from "
                       f"{maker} of another graph?")
    p = params[name]
    if not isinstance(p, Mapping):
      raise TypeError(f"{where}: {what}[{name!r}] must be a dict {{{want}}}; got "
                      f"{type(p).__name__}.")
    for k in pspecs:
      if k not in p:
        raise ValueError(f"{where}: {what}[{name!r}] has no parameter {k!r} (expected "
                         f"{{{want}}}); got {sorted(map(str, p))}.")
    extra = sorted(str(k) for k in p if k not in pspecs)
    if extra:
      raise ValueError(f"{where}: {what}[{name!r}] has unexpected parameter(s) {extra} "
                       f"(expected {{{want}}}; use_bias={getattr(node, 'use_bias', None)}).")
    for k, spec in pspecs.items():
      v = p[k]
      shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
      if shape is None or dtype is None:
        raise TypeError(f"{where}: parameter {k!r} must be an array of shape "
                        f"{tuple(spec.shape)}; got {type(v).__name__}.")
      if tuple(shape) != tuple(spec.shape):
        hint = (" (transposed?)" if sorted(shape) == sorted(spec.shape) and len(shape) > 1
                else "")
        raise ValueError(f"{where}: parameter {k!r} must have shape {tuple(spec.shape)}; got "
                         f"{tuple(shape)}{hint}.")
      if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where}: parameter {k!r} must have a float dtype ({maker} makes "
                        f"{spec.dtype}); got {dtype}.")
