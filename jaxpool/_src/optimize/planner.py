"""The planner: walks a jaxpr and the sub-jaxprs it enters, and decides the rewrites.

For each equation, the recogniser that :data:`PATTERNS` lists for its primitive offers a
replacement (a :class:`~.patterns.Site`) or notes why there is none; a higher-order primitive
in :data:`~.interpreter.HIGHER_ORDER` is entered. :meth:`Planner.offer` is where an offered site
is accepted or left to XLA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core
from jax.extend.core import primitives as prims

from jaxpool._src.optimize import patterns, window_sums
from jaxpool._src.optimize import cost as cost_model
from jaxpool._src.optimize.cost import Cost, default_cost
from jaxpool._src.optimize.dataflow import Dataflow
from jaxpool._src.optimize.interpreter import HIGHER_ORDER, Rules, src_info
from jaxpool._src.optimize.patterns import Note, Recogniser
from jaxpool._src.optimize.site import Site
from jaxpool._src.optimize.report import JAXPOOL_DIR, Finding, layer, source_line

PATTERNS: dict[core.Primitive, Recogniser] = {
    prims.reduce_window_max_p: patterns.max_pool,
    prims.reduce_window_p: patterns.max_pool,
    prims.reduce_window_sum_p: window_sums.window_sum,
    prims.reduce_window_min_p: patterns.min_pool,
    prims.select_and_scatter_add_p: patterns.max_pool_grad,
    prims.select_and_gather_add_p: patterns.max_pool_jvp,
}
"""The pooling primitives, each with its recogniser. A recogniser returns False where the
equation is none of its patterns yet (a window sum: noted after the whole jaxpr was seen)."""

_CUSTOM = frozenset({prims.custom_jvp_call_p, prims.custom_vjp_call_p})


def is_jaxpool(jaxpr: core.Jaxpr) -> bool:
  """Code of jaxpool itself (its ops' ``jit`` and ``custom_jvp``): never rewritten."""
  return f" at {JAXPOOL_DIR}" in src_info(jaxpr)


def holds_pooling(jaxpr: core.Jaxpr) -> bool:
  """Whether ``jaxpr`` or a sub-jaxpr of it holds a pooling primitive."""
  for eqn in jaxpr.eqns:
    if eqn.primitive in PATTERNS:
      return True
    if any(holds_pooling(s) for s in core.jaxprs_in_params(eqn.params)):
      return True
  return False


class Planner:
  """Walks a jaxpr (and the sub-jaxprs it enters), deciding the rewrites and the report."""

  def __init__(self, implementation, fold_relu: bool, cost: Cost = default_cost):
    self.implementation = implementation
    self.fold_relu = fold_relu
    self.cost = cost
    self.findings: list[Finding] = []
    self.notes: list[str] = []  # what the default cost model lacked measurements for
    self.scope = ""  # the layer path of the equation whose sub-jaxpr is being planned

  def note(self, where: str, eqn, replaced: bool, detail: str, op: str | None = None,
           cost: str = "") -> None:
    self.findings.append(Finding(where=where, op=op or eqn.primitive.name, replaced=replaced,
                                 detail=detail, source=source_line(eqn), cost=cost,
                                 layer=layer(eqn, self.scope)))

  def offer(self, where: str, eqn, site: Site, rules: Rules, new: Rules, detail: str,
            notes: tuple[Note, ...] = ()) -> bool:
    """A recogniser's replacement for ``site``: the cost decision. ``new`` joins ``rules``
    (True), or the site and the equations it absorbs (a folded ReLU) stay XLA's and the report
    says why (False)."""
    reason = self.cost(site)
    if self.cost is default_cost:
      text = cost_model.note(site)
      if text and text not in self.notes:
        self.notes.append(text)
    if reason is not None:
      if not isinstance(reason, str):
        raise TypeError(f"a cost function must return None or a str (the reason XLA keeps the "
                        f"site); got {reason!r} for {site}.")
      for n in notes:
        self.note(where, n.eqn, False, "not folded: the max pool after it is left to XLA",
                  op=n.op)
      self.note(where, eqn, False, f"left to XLA: {reason} (would be {detail})", cost=reason)
      return False
    rules.update(new)
    for n in notes:
      self.note(where, n.eqn, n.replaced, n.detail, op=n.op)
    self.note(where, eqn, True, detail)
    return True

  # -- one jaxpr

  def plan(self, jaxpr: core.Jaxpr, consts: Sequence[Any], where: str) -> Rules:
    g = Dataflow(jaxpr, consts)
    rules: Rules = {}
    unmatched_sums: list[int] = []
    for i, eqn in enumerate(jaxpr.eqns):
      if i in rules:
        continue
      recognise = PATTERNS.get(eqn.primitive)
      if recognise is not None:
        if not recognise(self, g, i, rules, where):
          unmatched_sums.append(i)
      else:
        self._enter(g, i, rules, where)
    for i in unmatched_sums:
      if i in rules:
        continue
      if window_sums.counts_ones(g, jaxpr.eqns[i]):
        self.note(where, jaxpr.eqns[i], False, "the window counts of count_include_pad=False "
                  "(a window sum of ones, a constant that other equations read)")
      else:
        self.note(where, jaxpr.eqns[i], False, "a window sum that is not divided by a constant "
                  "or by the window count of ones (not an average pool)")
    return rules

  # -- higher-order primitives

  def _enter(self, g: Dataflow, i: int, rules: Rules, where: str) -> None:
    eqn = g.eqns[i]
    entry = HIGHER_ORDER.get(eqn.primitive)
    if entry is None:
      for inner in core.jaxprs_in_params(eqn.params):
        if holds_pooling(inner):
          what = Finding(where, eqn.primitive.name, False, "").what
          self.note(where, eqn, False, f"optimize does not enter {what}; call optimize on the "
                    "function inside it")
          return
      return
    bodies = entry.bodies(eqn)
    custom = eqn.primitive in _CUSTOM
    calls = custom or eqn.primitive is prims.jit_p
    if calls and is_jaxpool(bodies[0][1].jaxpr) or (custom and patterns.activation(eqn)):
      return  # jaxpool's own ops, and an activation that a max pool may fold
    before = len(self.findings)
    outer, self.scope = self.scope, layer(eqn, self.scope)
    try:
      subs = [self.plan(b.jaxpr, b.consts, f"{where}/{label}") for label, b in bodies]
    finally:
      self.scope = outer
    if not any(subs):
      return
    rules[i] = entry.rebuild(eqn, subs)
    if custom:
      rule = "JVP" if eqn.primitive is prims.custom_jvp_call_p else "forward and backward"
      self.findings.insert(before, Finding(
          where, eqn.primitive.name, False, f"its custom {rule} rule is the user's and runs "
          "unchanged; only its primal (no differentiation) uses what is replaced below",
          source_line(eqn), layer=layer(eqn, self.scope)))
