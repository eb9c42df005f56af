"""A jaxpr interpreter with replaceable equations, on ``jax.extend``.

:func:`eval_jaxpr` is ``jax.core.eval_jaxpr`` with some equations replaced by :class:`Rule`\\ s.
A higher-order primitive whose sub-jaxprs hold replaced equations is rebuilt around its rewritten
sub-jaxprs by the entry for its primitive object in :data:`HIGHER_ORDER` (``jit``,
``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``scan``, ``while``, ``cond``,
``shard_map``): its params are kept, and constants that a rewrite creates become operands, as
JAX's own control-flow rules add them. What ``jax.extend`` lacks comes from :mod:`._jax_private`
only.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.extend import linear_util as lu
from jax.extend import source_info_util
from jax.extend.core import primitives as prims

from jaxpool._src.optimize import _jax_private

Rules = dict[int, "Rule"]


@dataclasses.dataclass
class Rule:
  """Replaces one equation: reads ``inputs`` (vars or literals) and returns its outputs."""

  inputs: tuple[Any, ...]
  fn: Callable[..., Sequence[Any]]


def alias(atom) -> Rule:
  """An equation whose output is ``atom`` itself."""
  return Rule((atom,), lambda v: [v])


DROP = Rule((), lambda: [None])  # dead after a rewrite: its only reader was replaced


def _read(env: dict, atom) -> Any:
  return atom.val if isinstance(atom, core.Literal) else env[atom]


def is_tracer(value: Any) -> bool:
  return isinstance(value, jax.core.Tracer)


def eval_jaxpr(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
               rules: Rules) -> list[Any]:
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


def retrace(closed: core.ClosedJaxpr, rules: Rules) -> tuple[core.Jaxpr, list]:
  """Traces the rewritten ``closed`` on its own input types: a jaxpr and its constants."""
  fun = lu.wrap_init(lambda *args: eval_jaxpr(closed.jaxpr, closed.consts, args, rules),
                     debug_info=closed.jaxpr.debug_info)
  jaxpr, _, consts = _jax_private.trace_to_jaxpr_dynamic(fun, closed.in_avals)
  return jaxpr, list(consts)


def hoisted(closed: core.ClosedJaxpr, rules: Rules) -> tuple[core.Jaxpr, list]:
  """The rewritten jaxpr with its constants as leading inputs (as scan, while, cond and remat
  take their closed-over values), and those constants."""
  jaxpr, consts = retrace(closed, rules)
  return _jax_private.convert_constvars_jaxpr(jaxpr), consts


def _unchanged(closed: core.ClosedJaxpr) -> tuple[core.Jaxpr, list]:
  return _jax_private.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def memo(make: Callable[[], Any]) -> Callable[[], Any]:
  """Calls ``make`` once; a rebuilt sub-jaxpr is reused, so ``jit`` caches keep hitting."""
  box: list = []

  def get():
    if not box:
      value = make()
      if any(is_tracer(c) for c in jax.tree.leaves(value)):
        return value  # never keep a tracer
      box.append(value)
    return box[0]
  return get


def _bind(eqn, params: dict, *args) -> list:
  ans = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
  return list(ans) if eqn.primitive.multiple_results else [ans]


def as_closed(jaxpr) -> core.ClosedJaxpr:
  """A sub-jaxpr as a closed one: JAX 0.10 keeps remat's open, JAX 0.11 merged the two types."""
  return jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else core.ClosedJaxpr(jaxpr, ())


# ----------------------------------------------------------------------------- rebuilders


def rebuild_call(eqn, key: str, closed: core.ClosedJaxpr, rules: Rules) -> Rule:
  """``jit``, ``custom_jvp_call``, ``custom_vjp_call``: a new closed ``key`` jaxpr, the rest of
  the params kept (a custom rule stays the user's)."""
  get = memo(lambda: core.ClosedJaxpr(*retrace(closed, rules)))
  return Rule(tuple(eqn.invars), lambda *a: _bind(eqn, dict(eqn.params, **{key: get()}), *a))


def rebuild_remat(eqn, rules: Rules) -> Rule:
  closed = as_closed(eqn.params["jaxpr"])
  get = memo(lambda: hoisted(closed, rules))

  def run(*args):
    jaxpr, consts = get()
    return _bind(eqn, dict(eqn.params, jaxpr=jaxpr), *consts, *args)
  return Rule(tuple(eqn.invars), run)


def rebuild_scan(eqn, rules: Rules) -> Rule:
  get = memo(lambda: hoisted(as_closed(eqn.params["jaxpr"]), rules))

  def run(*args):
    jaxpr, consts = get()
    params = dict(eqn.params, jaxpr=core.ClosedJaxpr(jaxpr, ()))
    if consts and "ft_in" in params:
      # JAX 0.11 describes the operands (consts, carry, xs) as a flat tree; new constants join
      # the consts, as JAX's own scan rules add residuals.
      params["ft_in"] = _jax_private.scan_operands_with_new_consts(params["ft_in"], len(consts))
    elif consts:
      params["num_consts"] += len(consts)
      if "linear" in params:
        params["linear"] = (False,) * len(consts) + tuple(params["linear"])
    return _bind(eqn, params, *consts, *args)
  return Rule(tuple(eqn.invars), run)


def rebuild_while(eqn, cond_rules: Rules, body_rules: Rules) -> Rule:
  p = eqn.params

  def make():
    cond = hoisted(p["cond_jaxpr"], cond_rules) if cond_rules else _unchanged(p["cond_jaxpr"])
    body = hoisted(p["body_jaxpr"], body_rules) if body_rules else _unchanged(p["body_jaxpr"])
    return cond, body
  get = memo(make)

  def run(*args):
    (cj, cc), (bj, bc) = get()
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = args[:nc], args[nc:nc + nb], args[nc + nb:]
    params = dict(p, cond_jaxpr=core.ClosedJaxpr(cj, ()), body_jaxpr=core.ClosedJaxpr(bj, ()),
                  cond_nconsts=nc + len(cc), body_nconsts=nb + len(bc))
    return _bind(eqn, params, *cc, *cond_consts, *bc, *body_consts, *carry)
  return Rule(tuple(eqn.invars), run)


def rebuild_cond(eqn, branch_rules: list[Rules]) -> Rule:
  branches = eqn.params["branches"]

  def make():
    built = [hoisted(b, r) if r else _unchanged(b) for b, r in zip(branches, branch_rules)]
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
        return core.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, ()))(*a[lo:hi], *a[n:])
      fun = lu.wrap_init(f, debug_info=b.jaxpr.debug_info._replace(arg_names=None))
      j, _, c = _jax_private.trace_to_jaxpr_dynamic(fun, [*const_avals, *b.in_avals])
      new.append(core.ClosedJaxpr(j, c))
    return new, all_consts
  get = memo(make)

  def run(index, *ops):
    new, consts = get()
    return _bind(eqn, dict(eqn.params, branches=tuple(new)), index, *consts, *ops)
  return Rule(tuple(eqn.invars), run)


def rebuild_shard_map(eqn, rules: Rules) -> Rule:
  """``shard_map``: the body runs through :func:`eval_jaxpr` with ``rules``, inside a new
  ``jax.shard_map`` with the equation's mesh, specs, ``check_vma`` and manual axes.

  Calling the public ``jax.shard_map`` (rather than binding the primitive with a retraced body)
  lets JAX trace the body in the context it needs: the manual axes bound for collectives, the
  manual abstract mesh under which jaxpool's kernels run per device, and ``check_vma``'s
  varying-axes types. Constants that the rewrite creates are closed over, and JAX makes them
  replicated operands, as it does for the user's own.
  """
  p = eqn.params
  body = p["jaxpr"]
  manual = _jax_private.shard_map_manual_axes(p)

  def run(*args):
    def per_device(*a):
      return tuple(eval_jaxpr(body, (), a, rules))
    fn = jax.shard_map(per_device, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                       out_specs=tuple(p["out_specs"]), axis_names=manual,
                       check_vma=p["check_vma"])
    return list(fn(*args))
  return Rule(tuple(eqn.invars), run)


# ----------------------------------------------------------------------------- the registry


def src_info(jaxpr: core.Jaxpr) -> str:
  """The function (and file) that JAX recorded for a traced sub-jaxpr."""
  info = getattr(jaxpr, "debug_info", None)
  return getattr(info, "func_src_info", None) or ""


@dataclasses.dataclass(frozen=True)
class HigherOrder:
  """How the interpreter enters one higher-order primitive.

  Attributes:
    bodies: the sub-jaxprs of an equation, each with its label in the report's ``where``.
    rebuild: the equation rebuilt from one rule dict per body (an empty dict: unchanged).
  """

  bodies: Callable[[core.JaxprEqn], list[tuple[str, core.ClosedJaxpr]]]
  rebuild: Callable[[core.JaxprEqn, list[Rules]], Rule]


def _custom_label(eqn) -> str:
  name = src_info(eqn.params["call_jaxpr"].jaxpr).split(" at ")[0] or "?"
  return f"{eqn.primitive.name}({name})"


HIGHER_ORDER: dict[core.Primitive, HigherOrder] = {
    prims.jit_p: HigherOrder(
        lambda e: [(f"jit({e.params.get('name', '?')})", e.params["jaxpr"])],
        lambda e, r: rebuild_call(e, "jaxpr", e.params["jaxpr"], r[0])),
    prims.custom_jvp_call_p: HigherOrder(
        lambda e: [(_custom_label(e), e.params["call_jaxpr"])],
        lambda e, r: rebuild_call(e, "call_jaxpr", e.params["call_jaxpr"], r[0])),
    prims.custom_vjp_call_p: HigherOrder(
        lambda e: [(_custom_label(e), e.params["call_jaxpr"])],
        lambda e, r: rebuild_call(e, "call_jaxpr", e.params["call_jaxpr"], r[0])),
    prims.remat_p: HigherOrder(
        lambda e: [("remat", as_closed(e.params["jaxpr"]))],
        lambda e, r: rebuild_remat(e, r[0])),
    prims.scan_p: HigherOrder(
        lambda e: [("scan", as_closed(e.params["jaxpr"]))],
        lambda e, r: rebuild_scan(e, r[0])),
    prims.while_p: HigherOrder(
        lambda e: [("while(cond)", e.params["cond_jaxpr"]),
                   ("while(body)", e.params["body_jaxpr"])],
        lambda e, r: rebuild_while(e, r[0], r[1])),
    prims.cond_p: HigherOrder(
        lambda e: [(f"cond[{k}]", b) for k, b in enumerate(e.params["branches"])],
        rebuild_cond),
    _jax_private.shard_map_p: HigherOrder(
        lambda e: [("shard_map", as_closed(e.params["jaxpr"]))],
        lambda e, r: rebuild_shard_map(e, r[0])),
}
"""The higher-order primitives the interpreter enters, by primitive object."""
