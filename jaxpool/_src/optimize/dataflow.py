"""Producers, readers and statically known values of the vars of one jaxpr."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core
from jax.extend.core import primitives as prims

from jaxpool._src.optimize import _jax_private
from jaxpool._src.optimize.interpreter import is_tracer

LAYOUT_OPS = frozenset({prims.transpose_p, prims.reshape_p, prims.squeeze_p,
                        prims.broadcast_in_dim_p, prims.copy_p})
"""Ops that only move or relabel elements: an elementwise activation commutes with them, and a
constant divisor commutes with them, so a pattern may look through a chain of them."""

VALUE_OPS = frozenset({prims.broadcast_in_dim_p, prims.convert_element_type_p,
                       *_jax_private.VARYING_CASTS})
"""Ops through which a statically known value stays known (inside ``shard_map``, a constant
made varying over the manual axes included)."""


def shape(atom) -> tuple[int, ...]:
  return tuple(atom.aval.shape)


class Dataflow:
  """Producers and readers of the vars of one jaxpr, and its known constants."""

  def __init__(self, jaxpr: core.Jaxpr, consts: Sequence[Any]):
    self.jaxpr = jaxpr
    self.eqns = jaxpr.eqns
    self.producer: dict = {}
    self.readers: dict = collections.defaultdict(list)
    self.consts = {v: c for v, c in zip(jaxpr.constvars, consts)}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if isinstance(v, core.Var):
          self.readers[v].append(i)
      for v in eqn.outvars:
        self.producer[v] = i
    for v in jaxpr.outvars:
      if isinstance(v, core.Var):
        self.readers[v].append(-1)  # read outside

  def only_reader(self, atom, idx: int) -> bool:
    return isinstance(atom, core.Var) and self.readers.get(atom) == [idx]

  def value(self, atom) -> np.ndarray | None:
    """A statically known value: a literal, a constant, or a broadcast of either."""
    if isinstance(atom, core.Literal):
      return np.asarray(atom.val)
    if atom in self.consts:
      c = self.consts[atom]
      return None if is_tracer(c) else np.asarray(c)
    i = self.producer.get(atom)
    if i is None:
      return None
    eqn = self.eqns[i]
    if eqn.primitive in VALUE_OPS and len(eqn.invars) == 1:
      v = self.value(eqn.invars[0])
      return None if v is None else v.astype(eqn.outvars[0].aval.dtype)
    return None

  def is_layout(self, eqn) -> bool:
    if eqn.primitive not in LAYOUT_OPS or len(eqn.invars) != 1:
      return False
    a, b = eqn.invars[0].aval, eqn.outvars[0].aval
    return a.dtype == b.dtype and math.prod(a.shape) == math.prod(b.shape)

  def raw_relu(self, eqn) -> bool:
    if eqn.primitive is not prims.max_p:
      return False
    vals = [self.value(v) for v in eqn.invars]
    return any(v is not None and v.size > 0 and np.all(v == 0) for v in vals)


def uniform(v: np.ndarray | None) -> float | None:
  """The one value of an array whose elements are all equal (None otherwise)."""
  if v is None or v.size == 0:
    return None
  flat = v.reshape(-1)
  return float(flat[0]) if np.all(flat == flat[0]) else None
