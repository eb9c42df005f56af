"""The function that :func:`jaxpool.optimize` returns: traces once per signature, caches the
plan, and runs the jaxpr through the interpreter with the plan's rules."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core

from jaxpool._src import api
from jaxpool._src.optimize import state
from jaxpool._src.optimize.cost import Cost, default_cost
from jaxpool._src.optimize.interpreter import Rules, eval_jaxpr, is_tracer
from jaxpool._src.optimize.planner import Planner
from jaxpool._src.optimize.report import OptimizeReport
from jaxpool._src.checks import check_bool
from jaxpool._src.windows import IMPLEMENTATIONS, check_choice

_CACHE_SIZE = 32


@dataclasses.dataclass
class _Entry:
  closed: core.ClosedJaxpr
  rules: Rules
  out_tree: Any
  report: OptimizeReport
  written: tuple[int, ...] = ()  # the arguments' nnx.Variables that fn writes (state.py)


def _is_array(leaf: Any) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _static_key(leaf: Any) -> Any:
  try:
    hash(leaf)
  except TypeError:
    return ("unhashable", id(leaf))
  return ("static", type(leaf), leaf)


class Optimized:
  """The function that :func:`optimize` returns: ``fn`` with jaxpool's pooling.

  Call it as ``fn``; ``report(*args, **kwargs)`` says what a call with those arguments
  replaces. Its ``__wrapped__`` is ``fn``.
  """

  def __init__(self, fn: Callable, implementation, report: bool, fold_relu: bool,
               cost: Cost = default_cost):
    functools.update_wrapper(self, fn)
    self._fn = fn
    self._implementation = implementation
    self._print = report
    self._fold_relu = fold_relu
    self._cost = cost
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._name = getattr(fn, "__name__", type(fn).__name__)

  def __repr__(self) -> str:
    return f"jaxpool.optimize({self._name})"

  def _entry(self, args, kwargs) -> tuple[_Entry, list]:
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn_idx = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    dyn = [leaves[i] for i in dyn_idx]
    key: Any = (treedef, tuple(_static_key(leaf) for leaf in leaves if not _is_array(leaf)),
           tuple(jax.typeof(leaf) for leaf in dyn))
    try:
      entry = self._cache.get(key)
    except TypeError:  # a static leaf whose __eq__ fails: trace every time
      entry, key = None, None
    if entry is not None:
      self._cache.move_to_end(key)
      return entry, dyn

    def flat_fn(*values):
      full = list(leaves)
      for i, v in zip(dyn_idx, values):
        full[i] = v
      a, k = jax.tree.unflatten(treedef, full)
      before = state.snapshot((a, k))
      try:
        out = self._fn(*a, **k)
      except Exception as e:
        carried = state.carried_write_error(e, self._name)
        if carried is None:
          raise
        raise carried from e
      written[:], values = state.traced_writes((a, k), before, self._name)
      return out, values
    written: list[int] = []
    closed, (out_shape, _) = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    planner = Planner(self._implementation, self._fold_relu, self._cost)
    rules = planner.plan(closed.jaxpr, closed.consts, self._name)
    entry = _Entry(closed, rules, jax.tree.structure(out_shape),
                   OptimizeReport(self._name, tuple(planner.findings),
                                  tuple(planner.notes)), tuple(written))
    if self._print:
      print(entry.report, flush=True)
    if key is not None and not any(is_tracer(c) for c in closed.consts):
      self._cache[key] = entry
      while len(self._cache) > _CACHE_SIZE:
        self._cache.popitem(last=False)
    return entry, dyn

  def __call__(self, *args, **kwargs):
    entry, dyn = self._entry(args, kwargs)
    outs = eval_jaxpr(entry.closed.jaxpr, entry.closed.consts, dyn, entry.rules)
    n = entry.out_tree.num_leaves
    state.write_back((args, kwargs), entry.written, outs[n:])
    return jax.tree.unflatten(entry.out_tree, outs[:n])

  def report(self, *args, **kwargs) -> OptimizeReport:
    """What a call with these arguments replaces, and what it leaves alone and why.

    Arrays may be :class:`jax.ShapeDtypeStruct`; nothing runs but the trace.
    """
    entry, _ = self._entry(args, kwargs)
    return entry.report


def optimize(fn: Callable, *, implementation: api.Implementation = None, report: bool = False,
             fold_relu: bool = True, cost: Cost | None = None) -> Optimized:
  """Returns ``fn`` computing the same thing with jaxpool's pooling.

  ``fn`` is traced to a jaxpr on each new combination of argument structure, static leaves and
  shapes/dtypes (arrays are traced; every other leaf is static, as in ``equinox.filter_jit``),
  and the jaxpr is evaluated with jaxpool in place of the pooling it recognises: max pools
  (``reduce_window_max``), average pools (a window sum divided by a constant or by the window
  count), XLA's max-pool gradient (``select_and_scatter_add``) and JVP, the transpose of a
  window sum, inside ``jit``, ``custom_jvp``/``custom_vjp`` primals, ``remat``, ``cond``,
  ``scan`` and ``while``. ``jax.nn.relu`` (or ``relu6``) whose only reader is a max pool runs
  after the pool instead (same values and gradients); in a function that holds its gradient
  (``optimize(jax.grad(f))``), the pool's own gradient masked by ReLU's derivative is no other
  reader, so a ReLU folds under either order. ``cost`` decides per recognised site
  whether jaxpool's call pays off; a site it declines stays XLA's and the report says why.
  Writes into the Flax NNX variables of the arguments (batch statistics, RNG counters) reach
  the caller's module as without optimize. See docs/optimize.md.

  Args:
    fn: a function of pytrees of arrays (Flax ``apply``, an Equinox model, a loss, a gradient).
    implementation: passed to every jaxpool op: ``None``, ``"xla"`` or ``"pallas"``.
    report: print the report (what was replaced, what was left alone and why) each time a new
      signature is traced.
    fold_relu: move a ReLU whose only reader is a max pool (and that pool's gradient) after
      the pool.
    cost: decides per recognised site whether jaxpool's call pays off: a function of the site
      (op, shape, dtype, window, neighbours, whether the kernels run, the device kind) that
      returns ``None`` (replace) or the reason XLA keeps it. ``None``: jaxpool's cost model,
      with the measured table of this GPU kind where one ships (docs/optimize.md, "Never
      slower"). It must give the same answer in every process of a job.

  Returns:
    An :class:`Optimized` function with ``fn``'s signature; ``.report(*args)`` returns the
    :class:`OptimizeReport` of a call (``str(report)``: a table of 100 columns, a row a site;
    ``report.long()``: a line a site with JAX's primitive and the full source path). It
    composes with ``jit``, ``grad``, ``vmap``, ``shard_map`` both ways
    (``optimize(jax.grad(f))`` replaces the pooling of the reverse pass too; a ``shard_map``
    inside ``fn`` is entered, its body's pooling run per device).
    Max-pool gradients follow jaxpool's rule (the first maximum in row-major window order, the
    first NaN), where XLA's may differ on ties and NaN.

  Raises:
    TypeError: ``fn`` or ``cost`` is not callable, or ``report``/``fold_relu`` is not a bool.
    ValueError: ``implementation`` is not ``None``, ``"xla"`` or ``"pallas"``.

  Example:
    >>> import jax.numpy as jnp
    >>> def f(x):  # x: (batch, H, W, C)
    ...   y = jax.nn.relu(x)
    ...   return jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
    ...                                "VALID")
    >>> g = optimize(f)
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1) - 8.0
    >>> g(x)[0, ..., 0]
    Array([[0., 0.],
           [5., 7.]], dtype=float32)
    >>> [(d.op, d.replaced) for d in g.report(x).findings]
    [('custom_jvp_call(relu)', True), ('reduce_window_max', True)]
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable; got {type(fn).__name__}: {fn!r}.")
  check_choice("implementation", implementation, IMPLEMENTATIONS)
  report = check_bool("report", report)
  fold_relu = check_bool("fold_relu", fold_relu)
  if cost is not None and not callable(cost):
    raise TypeError(f"cost must be None or a function of a site; got {cost!r}.")
  return Optimized(fn, implementation, report, fold_relu,
                   default_cost if cost is None else cost)
