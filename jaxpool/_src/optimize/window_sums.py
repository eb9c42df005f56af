"""The window-sum patterns: average pools and the transpose of a window sum (its gradient)."""

from __future__ import annotations

import math

import numpy as np
from jax.extend.core import primitives as prims

from jaxpool._src import api
from jaxpool._src.optimize.dataflow import Dataflow, shape, uniform
from jaxpool._src.optimize.interpreter import DROP, Rule, Rules, alias
from jaxpool._src.optimize.layout import layout
from jaxpool._src.optimize.patterns import Context, Site, common_checks, make_site, window_layout


def window_sum(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``reduce_window_sum``: the transpose of a window sum, or an average pool. False: neither
  (the planner notes it once every other pattern of the jaxpr has had its turn)."""
  return sum_transpose(ctx, g, i, rules, where) or avg_pool(ctx, g, i, rules, where)


def avg_pool(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``div(layout(reduce_window_sum(x)), c)`` or ``div(rws(x), rws(ones))``."""
  eqn = g.eqns[i]
  p = eqn.params
  x = eqn.invars[0]
  cur = eqn.outvars[0]
  readers = g.readers.get(cur, [])
  div_idx = None
  while len(readers) == 1 and readers[0] >= 0:
    nxt = g.eqns[readers[0]]
    if nxt.primitive is prims.div_p and nxt.invars[0] is cur:
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
  lay = window_layout(p, x, allow_int=False)
  count_include_pad, divisor, drop = True, None, None
  c = uniform(g.value(den))
  if c is not None:
    nwin = math.prod(lay.window) if not isinstance(lay, str) else None
    if c == nwin:
      how = f"divisor {c:g} = the window size"
    elif c >= 1 and c == int(c) and c < 2**31:
      divisor, how = int(c), f"divisor_override={int(c)}"
    else:
      lay, how = f"divided by {c!r}, not a positive int: not an average pool", ""
  elif not chained and is_count(g, den, eqn):
    count_include_pad = False
    if g.only_reader(den, div_idx):
      drop = g.producer[den]
    how = "count_include_pad=False: divided by the window count of ones"
  else:
    return False
  if isinstance(lay, str):
    ctx.note(where, eqn, False, lay)
    return True
  impl = ctx.implementation

  def run(x):
    y = api.avg_pool(lay.to(x), lay.window, lay.strides, lay.padding, dilation=lay.dilation,
                     count_include_pad=count_include_pad, divisor_override=divisor,
                     data_format=lay.data_format, implementation=impl)
    return [lay.back(y)]
  new = {i: Rule((x,), run), div_idx: alias(div.invars[0])}
  if drop is not None:
    new[drop] = DROP
  ctx.offer(where, eqn, make_site("avg_pool", lay, x), rules, new,
            f"jaxpool.avg_pool({lay.describe()}; {how})")
  return True


def is_count(g: Dataflow, den, num_eqn) -> bool:
  """Whether ``den`` is the same window sum over ones (the window counts)."""
  j = g.producer.get(den)
  if j is None:
    return False
  e = g.eqns[j]
  if not counts_ones(g, e) or e.params != num_eqn.params:
    return False
  num_shape, den_shape = shape(num_eqn.outvars[0]), shape(e.outvars[0])
  return len(num_shape) == len(den_shape) and all(
      d == n or d == 1 for d, n in zip(den_shape, num_shape))


def counts_ones(g: Dataflow, eqn) -> bool:
  """Whether ``eqn`` is a window sum over ones."""
  if eqn.primitive is not prims.reduce_window_sum_p:
    return False
  ones = g.value(eqn.invars[0])
  return ones is not None and ones.size > 0 and bool(np.all(ones == 1))


def sum_transpose(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """JAX's transpose of a window sum: ``reduce_window_sum(pad(ct, interior=s-1))``."""
  eqn = g.eqns[i]
  p = eqn.params
  src = eqn.invars[0]
  j = g.producer.get(src)
  if (j is None or g.eqns[j].primitive is not prims.pad_p or not g.only_reader(src, i)
      or any(s != 1 for s in p["window_strides"]) or any(q != (0, 0) for q in p["padding"])):
    return False
  pad = g.eqns[j]
  fill = g.value(pad.invars[1])
  config = pad.params["padding_config"]
  if fill is None or not np.all(fill == 0) or not any(any(c) for c in config):
    return False
  ct = pad.invars[0]
  in_shape = shape(eqn.outvars[0])
  strides, padding = [], []
  reason = common_checks(p, ct, allow_int=False)
  for d in range(len(in_shape)):
    lo_p, hi_p, interior = (int(v) for v in config[d])
    k, dil, s = p["window_dimensions"][d], p["window_dilation"][d], interior + 1
    eff = dil * (k - 1) + 1
    lo, hi = eff - 1 - lo_p, max(eff - 1 - hi_p, 0)
    n, size = shape(ct)[d], in_shape[d]
    if lo < 0 or size + lo + hi < eff or (size + lo + hi - eff) // s + 1 != n:
      reason = reason or "a padded window sum that is not the transpose of a window sum"
    strides.append(s)
    padding.append((lo, hi))
  lay = reason or layout(in_shape, p["window_dimensions"], strides, padding,
                         p["window_dilation"])
  if isinstance(lay, str):
    ctx.note(where, eqn, False, f"(the transpose of a window sum) {lay}")
    return True
  impl = ctx.implementation
  full = lay.shape(in_shape)

  def run(ct):
    dx = api.avg_pool_grad(lay.to(ct), full, lay.window, lay.strides, lay.padding,
                           dilation=lay.dilation, divisor_override=1,
                           data_format=lay.data_format, implementation=impl)
    return [lay.back(dx)]
  site = Site("avg_pool_grad", full, str(ct.aval.dtype), lay)
  ctx.offer(where, eqn, site, rules, {i: Rule((ct,), run), j: DROP},
            "(the transpose of a window sum) "
            f"jaxpool.avg_pool_grad({lay.describe()}; divisor_override=1)")
  return True
