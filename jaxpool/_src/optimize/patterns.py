"""The pooling patterns that :func:`jaxpool.optimize` recognises, as a table of recognisers.

:data:`PATTERNS` maps each pooling primitive (the object) to its recogniser. A recogniser reads
one equation of a :class:`~.dataflow.Dataflow`, and either offers its replacement to the planner
(:meth:`Context.offer`: a :class:`Site`, the rules that replace the equation and the equations
it absorbs, and what it becomes) or notes why it left the equation alone. The planner decides
whether an offered site is replaced (:mod:`.planner`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.extend.core import primitives as prims

from jaxpool._src import api, dtypes
from jaxpool._src import platforms, relu_fold
from jaxpool._src.optimize import conv_layout
from jaxpool._src.optimize.cost import kernels_by_default
from jaxpool._src.optimize.dataflow import Dataflow, shape
from jaxpool._src.optimize.interpreter import Rule, Rules, alias, src_info
from jaxpool._src.optimize.layout import Layout, layout
from jaxpool._src.optimize.site import Site


@dataclasses.dataclass(frozen=True)
class Note:
  """A finding that belongs to an offered site (a folded ReLU), kept or dropped with it."""

  eqn: Any
  replaced: bool
  detail: str
  op: str


class Context(Protocol):
  """What a recogniser needs from the planner."""

  implementation: Any
  fold_relu: bool

  def note(self, where: str, eqn, replaced: bool, detail: str, op: str | None = None) -> None:
    ...

  def offer(self, where: str, eqn, site: Site, rules: Rules, new: Rules, detail: str,
            notes: tuple[Note, ...] = ()) -> bool:
    ...


Recogniser = Callable[[Context, Dataflow, int, Rules, str], bool]


def common_checks(p: dict, x, *, allow_int: bool) -> str | None:
  if any(b != 1 for b in p.get("base_dilation", ())):
    return f"base_dilation {p['base_dilation']} (input dilation) is not covered"
  dt = x.aval.dtype
  if not (jnp.issubdtype(dt, jnp.floating) or (allow_int and jnp.issubdtype(dt, jnp.integer))):
    return f"dtype {dt} is not covered"
  return None


def window_layout(ctx: Context, g: Dataflow, p: dict, x, *, allow_int: bool,
                  dilation: bool = True) -> Layout | str:
  """The layout of a ``lax`` window op's params ``p`` on ``x`` (a string says why there is
  none), transposed where ``x`` comes from a convolution that XLA lays out channels-first
  (:func:`.conv_layout.view`)."""
  lay = common_checks(p, x, allow_int=allow_int) or layout(
      shape(x), p["window_dimensions"], p["window_strides"], p["padding"],
      p["window_dilation"] if dilation else None)
  return lay if isinstance(lay, str) else conv_layout.view(g, x, lay, ctx.implementation)


def _passes(g: Dataflow, eqn) -> bool:
  return g.is_layout(eqn) or (eqn.primitive is prims.convert_element_type_p)


def producer(g: Dataflow, atom) -> str:
  """The primitive that makes ``atom``, through element-moving ops and conversions."""
  while isinstance(atom, core.Var) and atom in g.producer:
    e = g.eqns[g.producer[atom]]
    if not _passes(g, e):
      return e.primitive.name
    atom = e.invars[0]
  return ""


def readers(g: Dataflow, atom) -> tuple[str, ...]:
  """The primitives that read ``atom``, through element-moving ops and conversions."""
  out: list[str] = []
  todo = [atom]
  while todo and len(out) < 8:
    for r in g.readers.get(todo.pop(), []):
      if r < 0:
        out.append("")  # an output of the jaxpr
        continue
      e = g.eqns[r]
      if _passes(g, e):
        todo.append(e.outvars[0])
      else:
        out.append(e.primitive.name)
  return tuple(out)


def make_site(ctx: Context, g: Dataflow, i: int, op: str, lay: Layout, x, fused_relu=False,
              full: tuple[int, ...] | None = None, out=None) -> Site:
  """The :class:`Site` of equation ``i`` (``full``: the shape jaxpool is called on, where it is
  not ``x``'s; ``out``: the site's output, where it is not equation ``i``'s)."""
  return Site(op, full or lay.shape(shape(x)), str(x.aval.dtype), lay, fused_relu,
              ctx.implementation, kernels_by_default(ctx.implementation),
              producer(g, x), readers(g, g.eqns[i].outvars[0] if out is None else out),
              platforms.device_kind())


# ----------------------------------------------------------------------------- activations


@functools.cache
def _activation_sources() -> dict[str, str]:
  """The source info that JAX records for ``jax.nn.relu`` and ``relu6``: identifies them."""
  out = {}
  for name in relu_fold.FOLDABLE:
    jaxpr = jax.make_jaxpr(getattr(jax.nn, name))(np.float32(1)).jaxpr
    eqn = jaxpr.eqns[0]
    if eqn.primitive is prims.custom_jvp_call_p:
      out[src_info(eqn.params["call_jaxpr"].jaxpr)] = name
  return out


def activation(eqn) -> str | None:
  """The name of the ``jax.nn`` activation that ``eqn`` calls, if it is a foldable one."""
  if eqn.primitive is not prims.custom_jvp_call_p or eqn.params.get("num_consts", 0):
    return None
  if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
    return None
  return _activation_sources().get(src_info(eqn.params["call_jaxpr"].jaxpr))


def _relu_before(ctx: Context, g: Dataflow, i: int, x, where: str):
  """Folds a ReLU whose only reader is this pool: ``(post, fused, text, rules, notes)``."""
  none: tuple = (None, False, "", {}, ())
  if not ctx.fold_relu:
    return none
  cur, reader, alone = x, i, True
  while isinstance(cur, core.Var) and cur in g.producer:
    j = g.producer[cur]
    src = g.eqns[j]
    act = activation(src)
    alone = alone and (g.only_reader(cur, reader) or (
        act == "relu" and reader == i and _read_by_pool_and_its_masked_gradient(g, cur, i, src)))
    if act is not None:
      fold = relu_fold.fold(act, only_reader=alone)
      if isinstance(fold, str):
        ctx.note(where, src, False, f"jax.nn.{act} before a max pool: {fold}",
                 op=f"custom_jvp_call({act})")
        return none
      notes = (Note(src, True, f"folded: the max pool after it reads its input and "
                    f"jax.nn.{act} runs on the pooled values", f"custom_jvp_call({act})"),)
      rules = {j: alias(src.invars[-1])}
      if fold.fused is not None:
        return None, True, f" with activation='{fold.fused}' (ReLU folded)", rules, notes
      return fold.after_pool, False, f" then jax.nn.{act} ({act} folded)", rules, notes
    if g.raw_relu(src):
      ctx.note(where, src, False, "max(x, 0) before a max pool: not folded (its gradient at "
               "x == 0 is 1/2, which a pool that moved before it would send to another "
               "element; jax.nn.relu's is 0)")
      return none
    if not g.is_layout(src):
      break
    cur, reader = src.invars[0], j
  return none


def _is_zero(g: Dataflow, atom) -> bool:
  v = g.value(atom)
  return v is not None and v.size > 0 and bool(np.all(v == 0))


def _relu_mask_of(g: Dataflow, pred, relu_in) -> bool:
  """Whether ``pred`` is ``relu_in > 0``: the mask of ``jax.nn.relu``'s JVP."""
  e = g.eqns[g.producer[pred]] if pred in g.producer else None
  return (e is not None and e.primitive is prims.gt_p and e.invars[0] is relu_in
          and _is_zero(g, e.invars[1]))


def _read_by_pool_and_its_masked_gradient(g: Dataflow, r, i: int, relu) -> bool:
  """Whether the readers of ``r``, the result of ``jax.nn.relu`` (equation ``relu``), are the
  max pool ``i`` and that pool's gradient, masked by ReLU's derivative: what ``jax.grad`` of
  ``max_pool(relu(x))`` builds (``select_and_scatter_add(ct, r)``, then ``select_n(x > 0, 0,
  .)``). Folding stays exact there: the max pool's gradient run on ``x`` instead of
  ``relu(x)`` picks the same element in every window whose maximum is positive, and the mask
  zeroes the others (docs/optimize.md, "Under a transformation")."""
  readers_ = g.readers.get(r, [])
  others = [k for k in readers_ if k != i]
  if i not in readers_ or not others or -1 in others:
    return False
  pool = g.eqns[i].params
  if any(d != 1 for d in pool.get("window_dilation", ())):
    return False
  for k in others:
    e = g.eqns[k]
    p = e.params
    if (e.primitive is not prims.select_and_scatter_add_p or e.invars[1] is not r
        or getattr(p.get("select_prim"), "name", None) != "ge"
        or tuple(p["window_dimensions"]) != tuple(pool["window_dimensions"])
        or tuple(p["window_strides"]) != tuple(pool["window_strides"])
        or tuple(map(tuple, p["padding"])) != tuple(map(tuple, pool["padding"]))):
      return False
    grad = e.outvars[0]
    (m, *rest) = g.readers.get(grad, [-1]) or [-1]
    if rest or m < 0:
      return False
    sel = g.eqns[m]
    if not (sel.primitive is prims.select_n_p and len(sel.invars) == 3
            and sel.invars[2] is grad and _is_zero(g, sel.invars[1])
            and _relu_mask_of(g, sel.invars[0], relu.invars[0])):
      return False
  return True


# ----------------------------------------------------------------------------- max pooling


def _generic_max(g: Dataflow, eqn) -> str | None:
  """Why a generic ``reduce_window`` is not a max pool (None: it is one)."""
  comp = eqn.params["jaxpr"]
  comp = comp.jaxpr if isinstance(comp, core.ClosedJaxpr) else comp
  if len(eqn.invars) != 2:
    return "a reduce_window over several operands"
  body = comp.eqns
  if not (len(body) == 1 and body[0].primitive is prims.max_p
          and list(body[0].invars) == list(comp.invars) and
          list(comp.outvars) == list(body[0].outvars)):
    return "its computation is not max(a, b)"
  init = g.value(eqn.invars[1])
  dtype = eqn.invars[0].aval.dtype
  covered = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  lowest = dtypes.lowest(dtype).item() if covered else None
  if init is None or lowest is None or not np.all(init == lowest):
    return (f"init value {init if init is None else init.item()!r} is not max's identity "
            f"{lowest!r}: not a max pool")
  return None


def max_pool(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``reduce_window_max``, or a generic ``reduce_window`` of ``max`` from max's identity."""
  eqn = g.eqns[i]
  x = eqn.invars[0]
  if eqn.primitive is prims.reduce_window_p:
    reason = _generic_max(g, eqn)
    if reason:
      ctx.note(where, eqn, False, reason)
      return True
  lay = window_layout(ctx, g, eqn.params, x, allow_int=True)
  if isinstance(lay, str):
    ctx.note(where, eqn, False, lay)
    return True
  post, fused, how, new, notes = _relu_before(ctx, g, i, x, where)
  impl = ctx.implementation
  kw = {"activation": "relu"} if fused else {}

  def run(x):
    y = api.max_pool(lay.to(x), lay.window, lay.strides, lay.padding, dilation=lay.dilation,
                     data_format=lay.data_format, implementation=impl, **kw)
    y = lay.back(y)
    return [post(y) if post is not None else y]
  new = {**new, i: Rule((x,), run)}
  ctx.offer(where, eqn, make_site(ctx, g, i, "max_pool", lay, x, fused), rules, new,
            f"jaxpool.max_pool({lay.describe()}){how}", notes)
  return True


def _max_select_layout(ctx: Context, g: Dataflow, eqn, where: str, x, what: str, **layout):
  """The window layout of XLA's max-pool ``select_and_*`` op (``select_prim`` ``ge``), or None
  after noting why the site is left alone."""
  p = eqn.params
  name = str(getattr(p["select_prim"], "name", p["select_prim"]))
  if name != "ge":
    picks = {"le": "<= (a min pool's)", "lt": "<", "gt": ">"}.get(name, name)
    ctx.note(where, eqn, False, f"not a max pool's {what}: it picks by {picks}, a max pool's "
             "by >=")
    return None
  lay = window_layout(ctx, g, p, x, allow_int=False, **layout)
  if isinstance(lay, str):
    ctx.note(where, eqn, False, lay)
    return None
  return lay


def max_pool_grad(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``select_and_scatter_add`` with ``ge``: XLA's max-pool gradient."""
  eqn = g.eqns[i]
  dy, x = eqn.invars
  lay = _max_select_layout(ctx, g, eqn, where, x, "gradient", dilation=False)
  if lay is None:
    return True
  impl = ctx.implementation

  def run(dy, x):
    dx = api.max_pool_grad(lay.to(x), lay.to(dy), lay.window, lay.strides, lay.padding,
                           dilation=lay.dilation, data_format=lay.data_format,
                           implementation=impl)
    return [lay.back(dx)]
  site = make_site(ctx, g, i, "max_pool_grad", lay, x)
  ctx.offer(where, eqn, site, rules, {i: Rule((dy, x), run)},
            f"jaxpool.max_pool_grad({lay.describe()})")
  return True


def max_pool_jvp(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``select_and_gather_add`` with ``ge``: the JVP of XLA's max pool."""
  eqn = g.eqns[i]
  t, x = eqn.invars
  lay = _max_select_layout(ctx, g, eqn, where, x, "JVP")
  if lay is None:
    return True
  impl = ctx.implementation

  def run(t, x):
    pool = functools.partial(api.max_pool, window_shape=lay.window, strides=lay.strides,
                             padding=lay.padding, dilation=lay.dilation,
                             data_format=lay.data_format, implementation=impl)
    _, ty = jax.jvp(pool, (lay.to(x),), (lay.to(t),))
    return [lay.back(ty)]
  site = make_site(ctx, g, i, "max_pool_jvp", lay, x)
  ctx.offer(where, eqn, site, rules, {i: Rule((t, x), run)},
            f"the JVP of jaxpool.max_pool({lay.describe()})")
  return True


def min_pool(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``reduce_window_min``: left alone."""
  ctx.note(where, g.eqns[i], False, "min pooling: jaxpool has none")
  return True
