"""A framework's own pooling functions run through ``jaxpool.optimize``, each call's report kept.

The tests that run Keras's and Flax's own test suites under ``optimize``
(``test_interop_keras_optimize.py``, ``test_flax_own_tests_optimize.py``) replace the
frameworks' pooling functions with :meth:`Recorder.wrap` of the functions themselves (not
jaxpool's): every call then runs ``jaxpool.optimize(fn)`` with a cost source that replaces every
recognised site, so the frameworks' tests check the values (and, where they differentiate, the
gradients) of optimize's program, and the recorder counts the pooling sites that optimize did not
recognise. The cost decision (which recognised sites pay off) is tested elsewhere
(``test_optimize_cost.py``).

Not counted as unrecognised, as in ``test_optimize_frameworks.py``: the window counts of an
average without padded elements (a constant of the shapes, not a pool of the input), windows of
a single element (nothing is pooled), and reductions that are no pooling jaxpool offers (a
``reduce_window`` with a user's own reduction, e.g. a product); those are counted apart.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import jax
import numpy as np
from jax.extend import core

import jaxpool

POOLING_OPS = ("reduce_window_max", "reduce_window_sum", "reduce_window_min", "reduce_window",
               "select_and_scatter_add", "select_and_gather_add")


def replace_every_site(site: Any) -> None:
  """A cost source that replaces every recognised site (see the module docstring)."""
  del site


def _not_a_jaxpool_pool(detail: str) -> bool:
  """The detail of a generic ``reduce_window`` whose reduction is a user's own (JAX emits
  ``reduce_window_max``/``_min``/``_sum`` for max, min and sum)."""
  return detail.startswith("its computation is not")


def unrecognised(report) -> list[str]:
  """The pooling sites ``report`` left alone but should have replaced."""
  return [f"{d.op}: {d.detail}" for d in report.left_alone
          if d.op in POOLING_OPS and "window counts" not in d.detail
          and "single element" not in d.detail and not getattr(d, "cost", None)
          and not (d.op == "reduce_window" and _not_a_jaxpool_pool(d.detail))]


def pooling_equations(fn: Callable[..., Any], args: tuple, kwargs: dict) -> int:
  """The pooling equations (:data:`POOLING_OPS`) in ``fn``'s jaxpr for these arguments, nested
  jaxprs included, counted independently of optimize (arrays are traced, other leaves static,
  as optimize does)."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dyn = [i for i, leaf in enumerate(leaves)
         if isinstance(leaf, (jax.Array, np.ndarray, np.generic))]

  def flat(*values: Any) -> Any:
    full = list(leaves)
    for i, v in zip(dyn, values, strict=True):
      full[i] = v
    a, k = jax.tree.unflatten(treedef, full)
    return fn(*a, **k)

  def count(jaxpr: core.Jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name in POOLING_OPS
      n += sum(count(inner) for inner in core.jaxprs_in_params(eqn.params))
    return n

  return count(jax.make_jaxpr(flat)(*(leaves[i] for i in dyn)).jaxpr)


class Recorder:
  """Wraps pooling functions in ``jaxpool.optimize`` and keeps what each call's report says.

  Attributes:
    calls: calls per wrapped function's name.
    replaced: the sites replaced, by op.
    unrecognised: each unrecognised site once (``"name: op: detail"``) with its call count.
    other: sites left alone that are no pooling jaxpool offers (a user's own reduction).
  """

  def __init__(self) -> None:
    self.calls: collections.Counter[str] = collections.Counter()
    self.replaced: collections.Counter[str] = collections.Counter()
    self.unrecognised: collections.Counter[str] = collections.Counter()
    self.other: collections.Counter[str] = collections.Counter()
    self._inside = threading.local()

  def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` computed by ``jaxpool.optimize(fn)``; a call made from inside another wrapped
    call (Flax's ``avg_pool`` calls ``pool``) runs ``fn`` itself, inside the outer one."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
      if getattr(self._inside, "depth", 0):
        return fn(*args, **kwargs)
      self._inside.depth = 1
      try:
        optimized = jaxpool.optimize(fn, cost=replace_every_site)
        report = optimized.report(*args, **kwargs)   # (traced once: the call reuses it)
        self.calls[name] += 1
        self.replaced.update(d.op for d in report.replaced)
        missed = unrecognised(report)
        # Every pooling equation must be in the report, replaced or left alone with a reason:
        # one that the planner passed over without a word is unrecognised too.
        # (An average over the real elements covers two: the sum and the window count of ones.)
        seen = sum((2 if "divided by the window count of ones" in d.detail else 1)
                   for d in report.findings if d.op in POOLING_OPS)
        silent = pooling_equations(fn, args, kwargs) - seen
        if silent > 0:
          missed.append(f"{silent} pooling equation(s) absent from the report")
        self.unrecognised.update(f"{name}: {m}" for m in missed)
        self.other.update(f"{name}: {d.op}: {d.detail}" for d in report.left_alone
                          if d.op == "reduce_window" and f"{d.op}: {d.detail}" not in missed
                          and _not_a_jaxpool_pool(d.detail))
        return optimized(*args, **kwargs)
      finally:
        self._inside.depth = 0

    return wrapped

  def patch(self, modules: Iterable[ModuleType], names: Iterable[str]) -> None:
    """Replaces ``names`` in every one of ``modules`` that holds the same function as the
    first module (re-exports included) with its wrapped form."""
    modules = list(modules)
    for name in names:
      own = getattr(modules[0], name)
      wrapped = self.wrap(own, name)
      for module in modules:
        if getattr(module, name, None) is own:
          setattr(module, name, wrapped)

  def summary(self) -> dict[str, Any]:
    """JSON-ready counts."""
    return dict(calls=dict(self.calls), replaced=dict(self.replaced),
                unrecognised=dict(self.unrecognised), other=dict(self.other))
