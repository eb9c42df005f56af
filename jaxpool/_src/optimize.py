"""``jaxpool.optimize``: run an unmodified JAX function with jaxpool's pooling.

The returned function traces ``fn`` to a jaxpr (once per tree structure, static leaves and
abstract values of its arguments), plans the rewrites, and evaluates the jaxpr with a small
interpreter that binds every equation as JAX would, except the pooling it recognises:

* ``reduce_window_max`` (Flax ``max_pool``, Equinox ``MaxPool*``, ``lax.reduce_window`` with
  ``lax.max`` and ``-inf``) and a generic ``reduce_window`` whose computation is ``max`` and
  whose init value is max's identity -> :func:`jaxpool.max_pool`;
* ``reduce_window_sum`` divided by a constant (Flax ``avg_pool``, Equinox ``AvgPool*``) or by the
  window sum of ones (Flax ``avg_pool(count_include_pad=False)``) -> :func:`jaxpool.avg_pool`;
* in jaxprs that already hold a reverse or forward pass: ``select_and_scatter_add`` (XLA's
  max-pool gradient) -> :func:`jaxpool.max_pool_grad`, ``select_and_gather_add`` (its JVP) ->
  the JVP of :func:`jaxpool.max_pool`, and the transpose of a window sum (interior ``pad`` then
  ``reduce_window_sum``) -> :func:`jaxpool.avg_pool_grad`;
* ``jax.nn.relu`` (or ``relu6``) whose only reader is such a max pool: the pool reads the
  activation's input and the activation runs on the pooled values (same values and gradients,
  bit for bit; docs/optimize.md proves it).

Which dims are pooled is read from the window (a dim with window 1, stride 1 and no padding is a
batch or channel dim); other layouts are transposed to channels-first and back. The interpreter
enters ``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``cond``, ``scan`` and
``while``, rebuilding them around rewritten sub-jaxprs with their params kept. Everything else
runs unchanged, and :meth:`Optimized.report` says what was replaced and what was left alone and
why.

The interpreter uses the JAX internals that ``jax.core.eval_jaxpr`` and JAX's own control-flow
rules use (``jax._src.core``, ``partial_eval``, ``linear_util``, ``source_info_util``); they are
imported here only.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src import linear_util as lu
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe

from jaxpool._src import api
from jaxpool._src.windows import IMPLEMENTATIONS, check_choice, make_geometry

_JAXPOOL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CACHE_SIZE = 32

# Ops that only move or relabel elements: an elementwise activation commutes with them, and a
# constant divisor commutes with them, so a pattern may look through a chain of them.
_LAYOUT_OPS = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
                         "copy", "copy_p"})

# The names under which JAX's higher-order primitives appear across versions.
_JIT = frozenset({"jit", "pjit"})
_REMAT = frozenset({"remat2", "checkpoint", "remat"})
_POOLING = frozenset({"reduce_window_max", "reduce_window_min", "reduce_window_sum",
                      "reduce_window", "select_and_scatter_add", "select_and_gather_add"})


# ----------------------------------------------------------------------------- the report


@dataclasses.dataclass(frozen=True)
class Finding:
  """One pooling-related equation that :func:`optimize` saw.

  Attributes:
    where: the chain of calls that holds it, e.g. ``"loss/scan/jit(block)"``.
    op: the JAX primitive, e.g. ``"reduce_window_max"``.
    replaced: whether it now runs as jaxpool.
    detail: what it became (``replaced``) or why it was left alone.
    source: the user's source line that produced it, as JAX records it.
  """

  where: str
  op: str
  replaced: bool
  detail: str
  source: str = ""


@dataclasses.dataclass(frozen=True)
class OptimizeReport:
  """What :func:`optimize` replaced in one traced call, and what it left alone and why.

  ``str(report)`` is a table, one line per finding.
  """

  function: str
  findings: tuple[Finding, ...]

  @property
  def replaced(self) -> tuple[Finding, ...]:
    return tuple(f for f in self.findings if f.replaced)

  @property
  def left_alone(self) -> tuple[Finding, ...]:
    return tuple(f for f in self.findings if not f.replaced)

  def __str__(self) -> str:
    lines = [f"jaxpool.optimize({self.function}): {len(self.replaced)} replaced, "
             f"{len(self.left_alone)} left alone"]
    for f in self.findings:
      tag = "replaced  " if f.replaced else "left alone"
      src = f"  [{f.source}]" if f.source else ""
      lines.append(f"  {tag}  {f.where}: {f.op} -> {f.detail}{src}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How a ``lax`` window op's dims map onto a jaxpool call, and back.

  ``perm`` moves the batch/channel dims in front of the pooled dims (None: no transpose);
  ``expand`` adds a leading size-1 dim where there is no batch or channel dim at all.
  """

  perm: tuple[int, ...] | None
  expand: bool
  data_format: str
  window: tuple[int, ...]
  strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  dilation: tuple[int, ...]

  def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(shape)
    if self.perm is not None:
      shape = tuple(shape[p] for p in self.perm)
    return (1, *shape) if self.expand else shape

  def to(self, a: jax.Array) -> jax.Array:
    if self.perm is not None:
      a = jnp.transpose(a, self.perm)
    return a[None] if self.expand else a

  def back(self, a: jax.Array) -> jax.Array:
    if self.expand:
      a = a[0]
    if self.perm is not None:
      a = jnp.transpose(a, tuple(int(i) for i in np.argsort(self.perm)))
    return a

  def describe(self) -> str:
    how = self.data_format + (", transposed" if self.perm is not None else "")
    text = f"window {self.window}, strides {self.strides}, padding {self.padding}"
    if any(d != 1 for d in self.dilation):
      text += f", dilation {self.dilation}"
    return f"{text}, {how}"


def _layout(shape: Sequence[int], window: Sequence[int], strides: Sequence[int],
            padding: Sequence[tuple[int, int]], dilation: Sequence[int] | None) -> _Layout | str:
  """Maps per-dim ``lax`` window params onto jaxpool's layout; a string says why it cannot."""
  ndim = len(shape)
  dilation = tuple(dilation) if dilation is not None else (1,) * ndim
  padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  spatial = [i for i in range(ndim)
             if window[i] != 1 or strides[i] != 1 or padding[i] != (0, 0)]
  if not spatial:
    return "every window is a single element: nothing is pooled"
  k = len(spatial)
  other = [i for i in range(ndim) if i not in spatial]
  perm: tuple[int, ...] | None = None
  expand = False
  if spatial == list(range(ndim - 1 - k, ndim - 1)):
    data_format = "channels_last"
  elif spatial == list(range(ndim - k, ndim)):
    data_format, expand = "channels_first", ndim == k
  else:
    data_format, perm = "channels_first", tuple(other + spatial)
    expand = not other
  pick = lambda v: tuple(int(v[i]) for i in spatial)
  layout = _Layout(perm=perm, expand=expand, data_format=data_format, window=pick(window),
                   strides=pick(strides), padding=tuple(padding[i] for i in spatial),
                   dilation=pick(dilation))
  try:
    make_geometry(layout.shape(shape), layout.window, layout.strides, layout.padding,
                  layout.dilation, False, data_format)
  except (TypeError, ValueError) as e:
    return f"jaxpool does not take this window: {e}"
  return layout


# ----------------------------------------------------------------------------- rules


@dataclasses.dataclass
class _Rule:
  """Replaces one equation: reads ``inputs`` (vars or literals) and returns its outputs."""

  inputs: tuple[Any, ...]
  fn: Callable[..., Sequence[Any]]


def _alias(atom) -> _Rule:
  return _Rule((atom,), lambda v: [v])


_DROP = _Rule((), lambda: [None])  # dead after a rewrite: its only reader was replaced


def _read(env: dict, atom) -> Any:
  return atom.val if isinstance(atom, core.Literal) else env[atom]


def _eval(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
          rules: dict[int, _Rule]) -> list[Any]:
  """``jax.core.eval_jaxpr`` with some equations replaced by ``rules``."""
  env: dict = {}
  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  # Each value is dropped after its last reader (a rule may read a var its equation did not),
  # so an eager call holds no more intermediates than the original function would.
  last: dict = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for atom in (rules[i].inputs if i in rules else eqn.invars):
      if isinstance(atom, core.Var):
        last[atom] = i
  for atom in jaxpr.outvars:
    if isinstance(atom, core.Var):
      last.pop(atom, None)
  dead: dict[int, list] = collections.defaultdict(list)
  for var, i in last.items():
    dead[i].append(var)
  for i, eqn in enumerate(jaxpr.eqns):
    rule = rules.get(i)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
      if rule is None:
        params = eqn.primitive.get_bind_params(eqn.params)
        ans = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **params)
        outs = ans if eqn.primitive.multiple_results else [ans]
      else:
        outs = rule.fn(*(_read(env, v) for v in rule.inputs))
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
    for v in dead.pop(i, ()):
      env.pop(v, None)
  return [_read(env, v) for v in jaxpr.outvars]


def _retrace(closed: core.ClosedJaxpr, rules: dict[int, _Rule]) -> tuple[core.Jaxpr, list]:
  """Traces the rewritten ``closed`` on its own input types: a jaxpr and its constants."""
  fun = lu.wrap_init(lambda *args: _eval(closed.jaxpr, closed.consts, args, rules),
                     debug_info=closed.jaxpr.debug_info)
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, closed.in_avals)
  return jaxpr, list(consts)


def _hoisted(closed: core.ClosedJaxpr, rules: dict[int, _Rule]) -> tuple[core.Jaxpr, list]:
  """The rewritten jaxpr with its constants as leading inputs (as scan, while, cond and remat
  take their closed-over values), and those constants."""
  jaxpr, consts = _retrace(closed, rules)
  return pe.convert_constvars_jaxpr(jaxpr), consts


def _memo(make: Callable[[], Any]) -> Callable[[], Any]:
  """Calls ``make`` once; a rebuilt sub-jaxpr is reused, so ``jit`` caches keep hitting."""
  box: list = []

  def get():
    if not box:
      value = make()
      if any(isinstance(c, core.Tracer) for c in jax.tree.leaves(value)):
        return value  # never keep a tracer
      box.append(value)
    return box[0]
  return get


def _bind(eqn, params: dict, *args) -> list:
  ans = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
  return list(ans) if eqn.primitive.multiple_results else [ans]


def _rebuild_call(eqn, key: str, closed: core.ClosedJaxpr, rules) -> _Rule:
  """``jit``, ``custom_jvp_call``, ``custom_vjp_call``: a new closed ``key`` jaxpr, the rest of
  the params kept (a custom rule stays the user's)."""
  get = _memo(lambda: core.ClosedJaxpr(*_retrace(closed, rules)))
  return _Rule(tuple(eqn.invars), lambda *a: _bind(eqn, dict(eqn.params, **{key: get()}), *a))


def _as_closed(jaxpr) -> core.ClosedJaxpr:
  """A sub-jaxpr as a closed one: JAX 0.10 keeps remat's open, JAX 0.11 merged the two types."""
  return jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else core.ClosedJaxpr(jaxpr, ())


def _rebuild_remat(eqn, rules) -> _Rule:
  closed = _as_closed(eqn.params["jaxpr"])
  get = _memo(lambda: _hoisted(closed, rules))

  def run(*args):
    jaxpr, consts = get()
    return _bind(eqn, dict(eqn.params, jaxpr=jaxpr), *consts, *args)
  return _Rule(tuple(eqn.invars), run)


def _rebuild_scan(eqn, rules) -> _Rule:
  get = _memo(lambda: _hoisted(_as_closed(eqn.params["jaxpr"]), rules))

  def run(*args):
    jaxpr, consts = get()
    params = dict(eqn.params, jaxpr=core.ClosedJaxpr(jaxpr, ()))
    if consts and "ft_in" in params:
      # JAX 0.11 describes the operands (consts, carry, xs) as a flat tree; new constants join
      # the consts, as JAX's own scan rules add residuals.
      from jax._src import flattree  # type: ignore[attr-defined,unused-ignore]
      old, carry, xs = params["ft_in"].unpack()
      params["ft_in"] = flattree.pack(((flattree.nones(len(consts)), old), carry, xs))
    elif consts:
      params["num_consts"] += len(consts)
      if "linear" in params:
        params["linear"] = (False,) * len(consts) + tuple(params["linear"])
    return _bind(eqn, params, *consts, *args)
  return _Rule(tuple(eqn.invars), run)


def _rebuild_while(eqn, cond_rules, body_rules) -> _Rule:
  p = eqn.params

  def make():
    cond = (_hoisted(p["cond_jaxpr"], cond_rules) if cond_rules
            else (pe.convert_constvars_jaxpr(p["cond_jaxpr"].jaxpr), list(p["cond_jaxpr"].consts)))
    body = (_hoisted(p["body_jaxpr"], body_rules) if body_rules
            else (pe.convert_constvars_jaxpr(p["body_jaxpr"].jaxpr), list(p["body_jaxpr"].consts)))
    return cond, body
  get = _memo(make)

  def run(*args):
    (cj, cc), (bj, bc) = get()
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = args[:nc], args[nc:nc + nb], args[nc + nb:]
    params = dict(p, cond_jaxpr=core.ClosedJaxpr(cj, ()), body_jaxpr=core.ClosedJaxpr(bj, ()),
                  cond_nconsts=nc + len(cc), body_nconsts=nb + len(bc))
    return _bind(eqn, params, *cc, *cond_consts, *bc, *body_consts, *carry)
  return _Rule(tuple(eqn.invars), run)


def _rebuild_cond(eqn, branch_rules: list[dict[int, _Rule]]) -> _Rule:
  branches = eqn.params["branches"]

  def make():
    built = [_hoisted(b, r) if r else (pe.convert_constvars_jaxpr(b.jaxpr), list(b.consts))
             for b, r in zip(branches, branch_rules)]
    all_consts = [c for _, cs in built for c in cs]
    if not all_consts:
      return [core.ClosedJaxpr(j, ()) for j, _ in built], []
    # Every branch takes the same operands: all branches' constants, then the old operands.
    const_avals = [jax.typeof(c) for c in all_consts]
    new, start = [], 0
    for (jaxpr, consts), b in zip(built, branches):
      lo, hi = start, start + len(consts)
      start = hi

      def f(*a, jaxpr=jaxpr, lo=lo, hi=hi):
        n = len(all_consts)
        return core.eval_jaxpr(jaxpr, (), *a[lo:hi], *a[n:])
      fun = lu.wrap_init(f, debug_info=b.jaxpr.debug_info._replace(arg_names=None))
      j, _, c = pe.trace_to_jaxpr_dynamic(fun, [*const_avals, *b.in_avals])
      new.append(core.ClosedJaxpr(j, c))
    return new, all_consts
  get = _memo(make)

  def run(index, *ops):
    new, consts = get()
    return _bind(eqn, dict(eqn.params, branches=tuple(new)), index, *consts, *ops)
  return _Rule(tuple(eqn.invars), run)


# ----------------------------------------------------------------------------- recognisers


def _src_info(jaxpr: core.Jaxpr) -> str:
  info = getattr(jaxpr, "debug_info", None)
  return getattr(info, "func_src_info", None) or ""


def _is_jaxpool(jaxpr: core.Jaxpr) -> bool:
  """Code of jaxpool itself (its ops' ``jit`` and ``custom_jvp``): never rewritten."""
  return f" at {_JAXPOOL_DIR}" in _src_info(jaxpr)


@functools.cache
def _activation_sources() -> dict[str, str]:
  """The source info that JAX records for ``jax.nn.relu`` and ``relu6``: identifies them."""
  out = {}
  for name in ("relu", "relu6"):
    jaxpr = jax.make_jaxpr(getattr(jax.nn, name))(np.float32(1)).jaxpr
    eqn = jaxpr.eqns[0]
    if eqn.primitive.name == "custom_jvp_call":
      out[_src_info(eqn.params["call_jaxpr"].jaxpr)] = name
  return out


@functools.cache
def _fused_activations() -> bool:
  """Whether :func:`jaxpool.max_pool` takes ``activation=`` (a ReLU fused into the kernel)."""
  return "activation" in inspect.signature(api.max_pool).parameters


def _lowest(dtype) -> Any:
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return -np.inf
  if jnp.issubdtype(dtype, jnp.integer):
    return np.iinfo(dtype).min
  return None


def _shape(atom) -> tuple[int, ...]:
  return tuple(atom.aval.shape)


def _summary(eqn) -> str:
  """The line of the user's own code that made ``eqn`` (not Flax's or Equinox's)."""
  try:
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
  except Exception:  # noqa: BLE001  (a report line, never an error)
    return ""
  frames = [f for f in frames if not f.file_name.startswith(_JAXPOOL_DIR)]
  own = [f for f in frames if "site-packages" not in f.file_name
         and "dist-packages" not in f.file_name]
  if not frames:
    return ""
  f = (own or frames)[0]
  return f"{f.file_name}:{f.start_line} ({f.function_name})"


class _Graph:
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
      return None if isinstance(c, core.Tracer) else np.asarray(c)
    i = self.producer.get(atom)
    if i is None:
      return None
    eqn = self.eqns[i]
    if eqn.primitive.name in ("broadcast_in_dim", "convert_element_type") and len(eqn.invars) == 1:
      v = self.value(eqn.invars[0])
      return None if v is None else v.astype(eqn.outvars[0].aval.dtype)
    return None

  def is_layout(self, eqn) -> bool:
    if eqn.primitive.name not in _LAYOUT_OPS or len(eqn.invars) != 1:
      return False
    a, b = eqn.invars[0].aval, eqn.outvars[0].aval
    return a.dtype == b.dtype and math.prod(a.shape) == math.prod(b.shape)

  def raw_relu(self, eqn) -> bool:
    if eqn.primitive.name != "max":
      return False
    vals = [self.value(v) for v in eqn.invars]
    return any(v is not None and v.size > 0 and np.all(v == 0) for v in vals)


def _uniform(v: np.ndarray | None) -> float | None:
  if v is None or v.size == 0:
    return None
  flat = v.reshape(-1)
  return float(flat[0]) if np.all(flat == flat[0]) else None


class _Planner:
  """Walks a jaxpr (and the sub-jaxprs it enters), deciding the rewrites and the report."""

  def __init__(self, implementation, fold_relu: bool):
    self.implementation = implementation
    self.fold_relu = fold_relu
    self.findings: list[Finding] = []

  def note(self, where, eqn, replaced, detail, op=None):
    self.findings.append(Finding(where=where, op=op or eqn.primitive.name, replaced=replaced,
                                 detail=detail, source=_summary(eqn)))

  # -- one jaxpr

  def plan(self, jaxpr: core.Jaxpr, consts: Sequence[Any], where: str) -> dict[int, _Rule]:
    g = _Graph(jaxpr, consts)
    rules: dict[int, _Rule] = {}
    unmatched_sums: list[int] = []
    for i, eqn in enumerate(jaxpr.eqns):
      if i in rules:
        continue
      name = eqn.primitive.name
      if name in ("reduce_window_max", "reduce_window"):
        self._max_pool(g, i, rules, where)
      elif name == "reduce_window_sum":
        if not (self._sum_transpose(g, i, rules, where) or self._avg_pool(g, i, rules, where)):
          unmatched_sums.append(i)
      elif name == "reduce_window_min":
        self.note(where, eqn, False, "min pooling: jaxpool has none")
      elif name == "select_and_scatter_add":
        self._max_pool_grad(g, i, rules, where)
      elif name == "select_and_gather_add":
        self._max_pool_jvp(g, i, rules, where)
      else:
        self._enter(g, i, rules, where)
    for i in unmatched_sums:
      if i in rules:
        continue
      if self._counts_ones(g, jaxpr.eqns[i]):
        self.note(where, jaxpr.eqns[i], False, "the window counts of count_include_pad=False "
                  "(a window sum of ones, a constant that other equations read)")
      else:
        self.note(where, jaxpr.eqns[i], False, "a window sum that is not divided by a constant "
                  "or by the window count of ones (not an average pool)")
    return rules

  # -- max pooling

  def _max_pool(self, g: _Graph, i: int, rules, where) -> None:
    eqn = g.eqns[i]
    p = eqn.params
    x = eqn.invars[0]
    if eqn.primitive.name == "reduce_window":
      reason = self._generic_max(g, eqn)
      if reason:
        self.note(where, eqn, False, reason)
        return
    reason = self._common_checks(p, x, allow_int=True)
    layout = reason or _layout(_shape(x), p["window_dimensions"], p["window_strides"],
                               p["padding"], p["window_dilation"])
    if isinstance(layout, str):
      self.note(where, eqn, False, layout)
      return
    post, fused, how = self._relu_before(g, i, x, rules, where)
    impl = self.implementation
    kw = {"activation": "relu"} if fused else {}

    def run(x):
      y = api.max_pool(layout.to(x), layout.window, layout.strides, layout.padding,
                       dilation=layout.dilation, data_format=layout.data_format,
                       implementation=impl, **kw)
      y = layout.back(y)
      return [post(y) if post is not None else y]
    rules[i] = _Rule((x,), run)
    self.note(where, eqn, True, f"jaxpool.max_pool({layout.describe()}){how}")

  def _generic_max(self, g: _Graph, eqn) -> str | None:
    """Why a generic ``reduce_window`` is not a max pool (None: it is one)."""
    comp = eqn.params["jaxpr"]
    comp = comp.jaxpr if isinstance(comp, core.ClosedJaxpr) else comp
    if len(eqn.invars) != 2:
      return "a reduce_window over several operands"
    body = comp.eqns
    if not (len(body) == 1 and body[0].primitive.name == "max"
            and list(body[0].invars) == list(comp.invars) and
            list(comp.outvars) == list(body[0].outvars)):
      return "its computation is not max(a, b)"
    init = g.value(eqn.invars[1])
    lowest = _lowest(eqn.invars[0].aval.dtype)
    if init is None or lowest is None or not np.all(init == lowest):
      return (f"init value {init if init is None else init.item()!r} is not max's identity "
              f"{lowest!r}: not a max pool")
    return None

  def _common_checks(self, p: dict, x, *, allow_int: bool) -> str | None:
    if any(b != 1 for b in p.get("base_dilation", ())):
      return f"base_dilation {p['base_dilation']} (input dilation) is not covered"
    dt = x.aval.dtype
    if not (jnp.issubdtype(dt, jnp.floating) or (allow_int and jnp.issubdtype(dt, jnp.integer))):
      return f"dtype {dt} is not covered"
    return None

  def _relu_before(self, g: _Graph, i: int, x, rules, where):
    """Folds a ReLU whose only reader is this pool: ``(post, fused, text)``."""
    if not self.fold_relu:
      return None, False, ""
    cur, reader, alone = x, i, True
    while isinstance(cur, core.Var) and cur in g.producer:
      alone = alone and g.only_reader(cur, reader)
      j = g.producer[cur]
      src = g.eqns[j]
      act = self._activation(src)
      if act is not None:
        if not alone:
          self.note(where, src, False, f"jax.nn.{act} before a max pool: not folded, its result "
                    "has other readers", op=f"custom_jvp_call({act})")
          return None, False, ""
        rules[j] = _alias(src.invars[-1])
        self.note(where, src, True, f"folded: the max pool after it reads its input and "
                  f"jax.nn.{act} runs on the pooled values", op=f"custom_jvp_call({act})")
        if act == "relu" and _fused_activations():
          return None, True, " with activation='relu' (ReLU folded)"
        return getattr(jax.nn, act), False, f" then jax.nn.{act} ({act} folded)"
      if g.raw_relu(src):
        self.note(where, src, False, "max(x, 0) before a max pool: not folded (its gradient at "
                  "x == 0 is 1/2, which a pool that moved before it would send to another "
                  "element; jax.nn.relu's is 0)")
        return None, False, ""
      if not g.is_layout(src):
        break
      cur, reader = src.invars[0], j
    return None, False, ""

  def _activation(self, eqn) -> str | None:
    if eqn.primitive.name != "custom_jvp_call" or eqn.params.get("num_consts", 0):
      return None
    if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
      return None
    return _activation_sources().get(_src_info(eqn.params["call_jaxpr"].jaxpr))

  def _max_pool_grad(self, g: _Graph, i: int, rules, where) -> None:
    eqn = g.eqns[i]
    p = eqn.params
    dy, x = eqn.invars
    if getattr(p["select_prim"], "name", None) != "ge":
      self.note(where, eqn, False, f"select_prim {p['select_prim']} (not a max pool's gradient)")
      return
    reason = self._common_checks(p, x, allow_int=False)
    layout = reason or _layout(_shape(x), p["window_dimensions"], p["window_strides"],
                               p["padding"], None)
    if isinstance(layout, str):
      self.note(where, eqn, False, layout)
      return
    impl = self.implementation

    def run(dy, x):
      dx = api.max_pool_grad(layout.to(x), layout.to(dy), layout.window, layout.strides,
                             layout.padding, dilation=layout.dilation,
                             data_format=layout.data_format, implementation=impl)
      return [layout.back(dx)]
    rules[i] = _Rule((dy, x), run)
    self.note(where, eqn, True, f"jaxpool.max_pool_grad({layout.describe()})")

  def _max_pool_jvp(self, g: _Graph, i: int, rules, where) -> None:
    eqn = g.eqns[i]
    p = eqn.params
    t, x = eqn.invars
    if getattr(p["select_prim"], "name", None) != "ge":
      self.note(where, eqn, False, f"select_prim {p['select_prim']} (not a max pool's JVP)")
      return
    reason = self._common_checks(p, x, allow_int=False)
    layout = reason or _layout(_shape(x), p["window_dimensions"], p["window_strides"],
                               p["padding"], p["window_dilation"])
    if isinstance(layout, str):
      self.note(where, eqn, False, layout)
      return
    impl = self.implementation

    def run(t, x):
      pool = functools.partial(api.max_pool, window_shape=layout.window, strides=layout.strides,
                               padding=layout.padding, dilation=layout.dilation,
                               data_format=layout.data_format, implementation=impl)
      _, ty = jax.jvp(pool, (layout.to(x),), (layout.to(t),))
      return [layout.back(ty)]
    rules[i] = _Rule((t, x), run)
    self.note(where, eqn, True, f"the JVP of jaxpool.max_pool({layout.describe()})")

  # -- average pooling

  def _avg_pool(self, g: _Graph, i: int, rules, where) -> bool:
    """``div(layout(reduce_window_sum(x)), c)`` or ``div(rws(x), rws(ones))``."""
    eqn = g.eqns[i]
    p = eqn.params
    x = eqn.invars[0]
    cur = eqn.outvars[0]
    readers = g.readers.get(cur, [])
    div_idx = None
    while len(readers) == 1 and readers[0] >= 0:
      nxt = g.eqns[readers[0]]
      if nxt.primitive.name == "div" and nxt.invars[0] is cur:
        div_idx = readers[0]
        break
      if not g.is_layout(nxt):
        break
      cur = nxt.outvars[0]
      readers = g.readers.get(cur, [])
    if div_idx is None:
      return False
    div = g.eqns[div_idx]
    den = div.invars[1]
    chained = cur is not eqn.outvars[0]
    reason = self._common_checks(p, x, allow_int=False)
    layout = reason or _layout(_shape(x), p["window_dimensions"], p["window_strides"],
                               p["padding"], p["window_dilation"])
    count_include_pad, divisor, drop = True, None, None
    c = _uniform(g.value(den))
    if c is not None:
      nwin = math.prod(layout.window) if not isinstance(layout, str) else None
      if c == nwin:
        how = f"divisor {c:g} = the window size"
      elif c >= 1 and c == int(c) and c < 2**31:
        divisor, how = int(c), f"divisor_override={int(c)}"
      else:
        layout, how = f"divided by {c!r}, not a positive int: not an average pool", ""
    elif not chained and self._is_count(g, den, eqn):
      count_include_pad = False
      if g.only_reader(den, div_idx):
        drop = g.producer[den]
      how = "count_include_pad=False: divided by the window count of ones"
    else:
      return False
    if isinstance(layout, str):
      self.note(where, eqn, False, layout)
      return True
    impl = self.implementation

    def run(x):
      y = api.avg_pool(layout.to(x), layout.window, layout.strides, layout.padding,
                       dilation=layout.dilation, count_include_pad=count_include_pad,
                       divisor_override=divisor, data_format=layout.data_format,
                       implementation=impl)
      return [layout.back(y)]
    rules[i] = _Rule((x,), run)
    rules[div_idx] = _alias(div.invars[0])
    if drop is not None:
      rules[drop] = _DROP
    self.note(where, eqn, True, f"jaxpool.avg_pool({layout.describe()}; {how})")
    return True

  def _is_count(self, g: _Graph, den, num_eqn) -> bool:
    """Whether ``den`` is the same window sum over ones (the window counts)."""
    j = g.producer.get(den)
    if j is None:
      return False
    e = g.eqns[j]
    if not self._counts_ones(g, e) or e.params != num_eqn.params:
      return False
    num_shape, den_shape = _shape(num_eqn.outvars[0]), _shape(e.outvars[0])
    return len(num_shape) == len(den_shape) and all(
        d == n or d == 1 for d, n in zip(den_shape, num_shape))

  def _counts_ones(self, g: _Graph, eqn) -> bool:
    if eqn.primitive.name != "reduce_window_sum":
      return False
    ones = g.value(eqn.invars[0])
    return ones is not None and ones.size > 0 and bool(np.all(ones == 1))

  def _sum_transpose(self, g: _Graph, i: int, rules, where) -> bool:
    """JAX's transpose of a window sum: ``reduce_window_sum(pad(ct, interior=s-1))``."""
    eqn = g.eqns[i]
    p = eqn.params
    src = eqn.invars[0]
    j = g.producer.get(src)
    if (j is None or g.eqns[j].primitive.name != "pad" or not g.only_reader(src, i)
        or any(s != 1 for s in p["window_strides"]) or any(q != (0, 0) for q in p["padding"])):
      return False
    pad = g.eqns[j]
    fill = g.value(pad.invars[1])
    config = pad.params["padding_config"]
    if fill is None or not np.all(fill == 0) or not any(any(c) for c in config):
      return False
    ct = pad.invars[0]
    in_shape = _shape(eqn.outvars[0])
    strides, padding = [], []
    reason = self._common_checks(p, ct, allow_int=False)
    for d in range(len(in_shape)):
      lo_p, hi_p, interior = (int(v) for v in config[d])
      k, dil, s = p["window_dimensions"][d], p["window_dilation"][d], interior + 1
      eff = dil * (k - 1) + 1
      lo, hi = eff - 1 - lo_p, max(eff - 1 - hi_p, 0)
      n, size = _shape(ct)[d], in_shape[d]
      if lo < 0 or size + lo + hi < eff or (size + lo + hi - eff) // s + 1 != n:
        reason = reason or "a padded window sum that is not the transpose of a window sum"
      strides.append(s)
      padding.append((lo, hi))
    layout = reason or _layout(in_shape, p["window_dimensions"], strides, padding,
                               p["window_dilation"])
    if isinstance(layout, str):
      self.note(where, eqn, False, f"(the transpose of a window sum) {layout}")
      return True
    impl = self.implementation
    shape = layout.shape(in_shape)

    def run(ct):
      dx = api.avg_pool_grad(layout.to(ct), shape, layout.window, layout.strides,
                             layout.padding, dilation=layout.dilation, divisor_override=1,
                             data_format=layout.data_format, implementation=impl)
      return [layout.back(dx)]
    rules[i] = _Rule((ct,), run)
    rules[j] = _DROP
    self.note(where, eqn, True, "(the transpose of a window sum) "
              f"jaxpool.avg_pool_grad({layout.describe()}; divisor_override=1)")
    return True

  # -- higher-order primitives

  def _enter(self, g: _Graph, i: int, rules, where) -> None:
    eqn = g.eqns[i]
    name = eqn.primitive.name
    p = eqn.params
    if name in _JIT:
      closed = p["jaxpr"]
      if _is_jaxpool(closed.jaxpr):
        return
      sub = self.plan(closed.jaxpr, closed.consts, f"{where}/jit({p.get('name', '?')})")
      if sub:
        rules[i] = _rebuild_call(eqn, "jaxpr", closed, sub)
    elif name in ("custom_jvp_call", "custom_vjp_call"):
      closed = p["call_jaxpr"]
      if _is_jaxpool(closed.jaxpr) or self._activation(eqn):
        return
      label = f"{name}({_src_info(closed.jaxpr).split(' at ')[0] or '?'})"
      before = len(self.findings)
      sub = self.plan(closed.jaxpr, closed.consts, f"{where}/{label}")
      if sub:
        rules[i] = _rebuild_call(eqn, "call_jaxpr", closed, sub)
        rule = "JVP" if name == "custom_jvp_call" else "forward and backward"
        self.findings.insert(before, Finding(
            where, name, False, f"its custom {rule} rule is the user's and runs unchanged; "
            "only its primal (no differentiation) uses what is replaced below", _summary(eqn)))
    elif name in _REMAT:
      closed = _as_closed(p["jaxpr"])
      sub = self.plan(closed.jaxpr, closed.consts, f"{where}/remat")
      if sub:
        rules[i] = _rebuild_remat(eqn, sub)
    elif name == "scan":
      closed = p["jaxpr"]
      sub = self.plan(closed.jaxpr, closed.consts, f"{where}/scan")
      if sub:
        rules[i] = _rebuild_scan(eqn, sub)
    elif name == "while":
      c, b = p["cond_jaxpr"], p["body_jaxpr"]
      cond = self.plan(c.jaxpr, c.consts, f"{where}/while(cond)")
      body = self.plan(b.jaxpr, b.consts, f"{where}/while(body)")
      if cond or body:
        rules[i] = _rebuild_while(eqn, cond, body)
    elif name == "cond":
      subs = [self.plan(b.jaxpr, b.consts, f"{where}/cond[{k}]")
              for k, b in enumerate(p["branches"])]
      if any(subs):
        rules[i] = _rebuild_cond(eqn, subs)
    else:
      for inner in core.jaxprs_in_params(p):
        if _holds_pooling(inner):
          self.note(where, eqn, False, f"optimize does not enter {name}; call optimize on the "
                    "function inside it")
          return


def _holds_pooling(jaxpr: core.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _POOLING:
      return True
    if any(_holds_pooling(s) for s in core.jaxprs_in_params(eqn.params)):
      return True
  return False


# ----------------------------------------------------------------------------- optimize


@dataclasses.dataclass
class _Entry:
  closed: core.ClosedJaxpr
  rules: dict[int, _Rule]
  out_tree: Any
  report: OptimizeReport


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

  def __init__(self, fn: Callable, implementation, report: bool, fold_relu: bool):
    functools.update_wrapper(self, fn)
    self._fn = fn
    self._implementation = implementation
    self._print = report
    self._fold_relu = fold_relu
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
      return self._fn(*a, **k)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    planner = _Planner(self._implementation, self._fold_relu)
    rules = planner.plan(closed.jaxpr, closed.consts, self._name)
    entry = _Entry(closed, rules, jax.tree.structure(out_shape),
                   OptimizeReport(self._name, tuple(planner.findings)))
    if self._print:
      print(entry.report, flush=True)
    if key is not None and not any(isinstance(c, core.Tracer) for c in closed.consts):
      self._cache[key] = entry
      while len(self._cache) > _CACHE_SIZE:
        self._cache.popitem(last=False)
    return entry, dyn

  def __call__(self, *args, **kwargs):
    entry, dyn = self._entry(args, kwargs)
    outs = _eval(entry.closed.jaxpr, entry.closed.consts, dyn, entry.rules)
    return jax.tree.unflatten(entry.out_tree, outs)

  def report(self, *args, **kwargs) -> OptimizeReport:
    """What a call with these arguments replaces, and what it leaves alone and why.

    Arrays may be :class:`jax.ShapeDtypeStruct`; nothing runs but the trace.
    """
    entry, _ = self._entry(args, kwargs)
    return entry.report


def optimize(fn: Callable, *, implementation: api.Implementation = None, report: bool = False,
             fold_relu: bool = True) -> Optimized:
  """Returns ``fn`` computing the same thing with jaxpool's pooling.

  ``fn`` is traced to a jaxpr on each new combination of argument structure, static leaves and
  shapes/dtypes (arrays are traced; every other leaf is static, as in ``equinox.filter_jit``),
  and the jaxpr is evaluated with jaxpool in place of the pooling it recognises: max pools
  (``reduce_window_max``), average pools (a window sum divided by a constant or by the window
  count), XLA's max-pool gradient (``select_and_scatter_add``) and JVP, the transpose of a
  window sum, inside ``jit``, ``custom_jvp``/``custom_vjp`` primals, ``remat``, ``cond``,
  ``scan`` and ``while``. ``jax.nn.relu`` (or ``relu6``) whose only reader is a max pool runs
  after the pool instead (same values and gradients). See docs/optimize.md.

  Args:
    fn: a function of pytrees of arrays (Flax ``apply``, an Equinox model, a loss, a gradient).
    implementation: passed to every jaxpool op: ``None``, ``"xla"`` or ``"pallas"``.
    report: print the report (what was replaced, what was left alone and why) each time a new
      signature is traced.
    fold_relu: move a ReLU whose only reader is a max pool after the pool.

  Returns:
    An :class:`Optimized` function with ``fn``'s signature; ``.report(*args)`` returns the
    :class:`OptimizeReport` of a call. It composes with ``jit``, ``grad``, ``vmap``,
    ``shard_map`` both ways (``optimize(jax.grad(f))`` replaces the pooling of the reverse
    pass too). Max-pool gradients follow jaxpool's rule (the first maximum in row-major window
    order, the first NaN), where XLA's may differ on ties and NaN.

  Raises:
    TypeError: ``fn`` is not callable, or ``report``/``fold_relu`` is not a bool.
    ValueError: ``implementation`` is not ``None``, ``"xla"`` or ``"pallas"``.

  Example:
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
  if not isinstance(report, (bool, np.bool_)):
    raise TypeError(f"report must be a bool; got {report!r}.")
  if not isinstance(fold_relu, (bool, np.bool_)):
    raise TypeError(f"fold_relu must be a bool; got {fold_relu!r}.")
  return Optimized(fn, implementation, bool(report), bool(fold_relu))
