"""The window-sum patterns: average pools and the transpose of a window sum (its gradient)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import primitives as prims

from jaxpool._src import api
from jaxpool._src.optimize.dataflow import Dataflow, shape, uniform
from jaxpool._src.optimize.interpreter import DROP, Rule, Rules, alias
from jaxpool._src.optimize.layout import layout
from jaxpool._src.optimize.patterns import Context, common_checks, make_site, window_layout
from jaxpool._src.windows import effective_window


def window_sum(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``reduce_window_sum``: the transpose of a window sum, or an average pool. False: neither
  (the planner notes it once every other pattern of the jaxpr has had its turn)."""
  return sum_transpose(ctx, g, i, rules, where) or avg_pool(ctx, g, i, rules, where)


def avg_pool(ctx: Context, g: Dataflow, i: int, rules: Rules, where: str) -> bool:
  """``div(f(reduce_window_sum(x)), c)`` or ``div(f(rws(x)), h(rws(ones)))``.

  ``f`` is a chain of element-moving ops (:data:`~.dataflow.LAYOUT_OPS`, each read once) and
  float-to-float ``convert_element_type`` (a weak type dropped, a precision change: applied to
  jaxpool's result in the same order); ``h`` is a chain of broadcasts and conversions of the
  window counts (Flax's and Keras's counts have size-1 batch and channel dims).
  """
  eqn = g.eqns[i]
  p = eqn.params
  x = eqn.invars[0]
  cur = eqn.outvars[0]
  readers = g.readers.get(cur, [])
  div_idx = None
  moved: list = []  # the element-moving ops between the sum and the division
  converts: list = []  # the dtypes of the float conversions on the way
  int_to = None  # an integer sum converted to this float dtype (Equinox on integer input)
  while len(readers) == 1 and readers[0] >= 0:
    nxt = g.eqns[readers[0]]
    if nxt.primitive is prims.div_p and nxt.invars[0] is cur:
      div_idx = readers[0]
      break
    if int_to is None and not converts and _int_to_float(nxt):
      int_to = nxt.outvars[0].aval.dtype
    elif _float_convert(nxt):
      converts.append(nxt.outvars[0].aval.dtype)
    elif g.is_layout(nxt):
      moved.append((nxt.primitive, nxt.params))
    else:
      break
    cur = nxt.outvars[0]
    readers = g.readers.get(cur, [])
  if div_idx is None:
    return False
  div = g.eqns[div_idx]
  den = div.invars[1]
  lay = window_layout(ctx, g, p, x, allow_int=int_to is not None)
  count_include_pad, divisor = True, None
  drop: list[int] = []
  c = uniform(g.value(den))
  if c is not None:
    nwin = math.prod(lay.window) if not isinstance(lay, str) else None
    if c == nwin:
      how = f"divisor {c:g} = the window size"
    elif c >= 1 and c == int(c) and c < 2**31:
      divisor, how = int(c), f"divisor_override={int(c)}"
    else:
      lay, how = f"divided by {c!r}, not a positive int: not an average pool", ""
  elif (counts := count_chain(g, den, eqn, moved)) is not None:
    count_include_pad = False
    if all(g.only_reader(g.eqns[k].outvars[0], r) for k, r in zip(counts, [div_idx, *counts])):
      drop = counts
    how = "count_include_pad=False: divided by the window count of ones"
  else:
    return False
  if isinstance(lay, str):
    ctx.note(where, eqn, False, lay)
    return True
  impl = ctx.implementation

  def run(x):
    if int_to is not None:
      x = lax.convert_element_type(x, int_to)
    y = api.avg_pool(lay.to(x), lay.window, lay.strides, lay.padding, dilation=lay.dilation,
                     count_include_pad=count_include_pad, divisor_override=divisor,
                     data_format=lay.data_format, implementation=impl)
    y = lay.back(y)
    for dtype in converts:
      y = lax.convert_element_type(y, dtype)
    return [y]
  new = {i: Rule((x,), run), div_idx: alias(div.invars[0])}
  for k in drop:
    new[k] = DROP
  if int_to is not None:
    how += f"; the integer input converted to {np.dtype(int_to).name} first"
  if converts:
    how += f", then converted to {np.dtype(converts[-1]).name}"
  ctx.offer(where, eqn, make_site(ctx, g, i, "avg_pool", lay, x, out=div.outvars[0]), rules, new,
            f"jaxpool.avg_pool({lay.describe()}; {how})")
  return True


def _float_convert(eqn) -> bool:
  """A ``convert_element_type`` from a float dtype to a float dtype."""
  if eqn.primitive is not prims.convert_element_type_p or len(eqn.invars) != 1:
    return False
  a, b = eqn.invars[0].aval, eqn.outvars[0].aval
  return (jnp.issubdtype(a.dtype, jnp.floating) and jnp.issubdtype(b.dtype, jnp.floating)
          and a.shape == b.shape)


def _int_to_float(eqn) -> bool:
  """A ``convert_element_type`` from an integer dtype to a float dtype."""
  if eqn.primitive is not prims.convert_element_type_p or len(eqn.invars) != 1:
    return False
  a, b = eqn.invars[0].aval, eqn.outvars[0].aval
  return jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.floating)


def count_chain(g: Dataflow, den, num_eqn, moved: list) -> list[int] | None:
  """The equations (last first, the window sum of ones at the end) that make ``den`` the window
  counts of ``num_eqn``: the same window sum over ones, then broadcasts, conversions and the
  same element-moving ops as the sum went through (``moved``: Flax squeezes both when the
  input has no batch dim)."""
  chain: list[int] = []
  layout_ops: list = []
  cur = den
  while True:
    j = g.producer.get(cur)
    if j is None:
      return None
    e = g.eqns[j]
    chain.append(j)
    if e.primitive is prims.reduce_window_sum_p:
      break
    if g.is_layout(e):
      layout_ops.append((e.primitive, e.params))
    elif e.primitive not in (prims.broadcast_in_dim_p, prims.convert_element_type_p):
      return None
    cur = e.invars[0]
  if layout_ops[::-1] != moved:
    return None
  e = g.eqns[chain[-1]]
  if not counts_ones(g, e) or e.params != num_eqn.params:
    return None
  num_shape, den_shape = shape(num_eqn.outvars[0]), shape(e.outvars[0])
  ok = len(num_shape) == len(den_shape) and all(
      d == n or d == 1 for d, n in zip(den_shape, num_shape))
  return chain if ok else None


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
    eff = effective_window(k, dil)
    lo, hi = eff - 1 - lo_p, max(eff - 1 - hi_p, 0)
    n, size = shape(ct)[d], in_shape[d]
    if lo < 0 or size + lo + hi < eff or (size + lo + hi - eff) // s + 1 != n:
      reason = reason or "a window sum of a padded array that is not an average pool's gradient"
    strides.append(s)
    padding.append((lo, hi))
  lay = reason or layout(in_shape, p["window_dimensions"], strides, padding,
                         p["window_dilation"])
  if isinstance(lay, str):
    ctx.note(where, eqn, False, f"an average pool's gradient, left alone: {lay}")
    return True
  impl = ctx.implementation
  full = lay.shape(in_shape)

  def run(ct):
    dx = api.avg_pool_grad(lay.to(ct), full, lay.window, lay.strides, lay.padding,
                           dilation=lay.dilation, divisor_override=1,
                           data_format=lay.data_format, implementation=impl)
    return [lay.back(dx)]
  site = make_site(ctx, g, i, "avg_pool_grad", lay, ct, full=full)
  ctx.offer(where, eqn, site, rules, {i: Rule((ct,), run), j: DROP},
            "an average pool's gradient: "
            f"jaxpool.avg_pool_grad({lay.describe()}; divisor_override=1)")
  return True
