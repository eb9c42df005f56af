"""The 4-linear form of ``form.py`` as jaxpool primitives: their JVP, transpose and batching rules.

A primitive of :func:`define` computes ``dF/d(wrt)`` (``form.py``) from the other three slots;
its results are a list: one array, or for ``wrt="x"`` one per table of the ``"x"`` group that
``want`` names. The ``"x"`` slot is a group of tables ``(rows_l, C)`` (static ``parts``: their
rows), whose concatenation, in order, is the table that the boxes' ``base`` addresses: the
feature maps' levels, each a free reshape of its map, so that the GPU kernels read each level's
array and write each level's gradient with no copy in between. (The XLA path passes one table.)

Each derivative is linear in each of its three slots (the group jointly), so its JVP is a bind
per slot with that slot's tangents, and its transpose with respect to a slot is the bind for
that slot with the cotangents in the slot of the old ``wrt``: reverse, forward and higher order
compose without ``custom_vjp``. With respect to the group, the transpose gives the gradient of
exactly the tables that are undefined primals (a level closed over gets none); the transpose
of a feature gradient reads zeros for the tables it does not give.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxpool._src.roi import form
from jaxpool._src.roi.form import SLOTS, grouped, operand_names, starts, ungrouped


def define(name: str, impl, widen=None) -> jex_core.Primitive:
  """A primitive of the form: ``impl(*operands, wrt, has_taps, dtype, parts, want, **extra)``
  (a list of results) evaluates and lowers it; its JVP, transpose and batching rules are this
  module's, binding the same primitive with ``extra`` passed on. Under ``vmap``
  (``_batch``): with ``widen`` (``widen(extra, copies)``), the mapped axis always folds into
  the boxes, one copy of the tables per element; without it (the XLA path), a mapped feature
  table stays an axis (``batched=True``). ``roi_form_p`` is the XLA path's; the GPU kernels
  define another (``kernels.py``) with the same rules."""
  prim = jex_core.Primitive(name)
  prim.multiple_results = True

  @functools.cache
  def jitted(params):
    return jax.jit(functools.partial(impl, **dict(params)))

  prim.def_impl(lambda *operands, **params: jitted(tuple(sorted(params.items())))(*operands))
  prim.def_abstract_eval(_abstract_eval)
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
  ad.primitive_jvps[prim] = functools.partial(_jvp, prim)
  ad.primitive_transposes[prim] = functools.partial(_transpose, prim)
  batching.primitive_batchers[prim] = functools.partial(
      _batch_folded if widen is not None else _batch, prim, widen)
  return prim


def _shapes(ops, wrt, parts, want):
  if wrt == "ct":
    K, ph = ops["iy"].shape[:2]
    return [(K, ph, ops["ix"].shape[1], ops["x"][0].shape[1])]
  if wrt == "x":
    return [(parts[p], ops["ct"].shape[-1]) for p in want]
  return [ops["iy" if wrt == "wy" else "ix"].shape]


def _abstract_eval(*avals, wrt, has_taps, dtype, parts, want=(), batched=False, **extra):
  ops = grouped(operand_names(wrt, has_taps, len(parts)), avals)
  like = next(ops[s][0] if s == "x" else ops[s] for s in SLOTS if s in ops)
  if batched:
    one = {n: (tuple(a.update(shape=a.shape[1:]) for a in v) if n == "x"
               else v.update(shape=v.shape[1:])) for n, v in ops.items()}
    shapes = [(like.shape[0], *s) for s in _shapes(one, wrt, parts, want)]
  else:
    shapes = _shapes(ops, wrt, parts, want)
  return [like.update(shape=s, dtype=jnp.dtype(dtype), weak_type=False) for s in shapes]


def bind(wrt: str, *, base, stride, iy, ix, taps=None, dtype, batched=False, **slots):
  """``dF/d(wrt)`` from the other three slots (keyword arguments ``wy``, ``wx``, ``x``, ``ct``;
  ``x`` one table ``(P, C)``) on the XLA path. ``batched``: every operand has a leading batch
  axis, each element computed on its own (its boxes on its own table ``x`` ``(B, P, C)``)."""
  return bind_to(roi_form_p, wrt, base=base, stride=stride, iy=iy, ix=ix, taps=taps,
                 dtype=dtype, extra={"batched": bool(batched)}, **slots)


def bind_to(prim, wrt: str, *, base, stride, iy, ix, taps=None, dtype, extra=None, **slots):
  """:func:`bind` for a primitive of :func:`define` (``extra``: its own static params; ``x``
  one table or a tuple of them, the group): the result (``wrt`` is not ``"x"``)."""
  assert wrt != "x", "the feature gradient is bound by the rules"
  x = slots["x"] if isinstance(slots["x"], (tuple, list)) else (slots["x"],)
  given = dict(base=base, stride=stride, iy=iy, ix=ix, taps=taps, **dict(slots, x=tuple(x)))
  names = operand_names(wrt, taps is not None, len(x))
  parts = tuple(int(a.shape[-2]) for a in x)
  return prim.bind(*ungrouped(names, given), wrt=wrt, has_taps=taps is not None,
                   dtype=jnp.dtype(dtype).name, parts=parts, want=(), **(extra or {}))[0]


def _jvp(prim, primals, tangents, *, wrt, has_taps, parts, **params):
  names = operand_names(wrt, has_taps, len(parts))
  params = dict(wrt=wrt, has_taps=has_taps, parts=parts, **params)
  out = prim.bind(*primals, **params)
  total = None
  for slot in SLOTS:  # the group's tangents together (a zero one as zeros): one bind a slot
    at = [n for n, name in enumerate(names) if name == slot]
    if all(type(tangents[n]) is ad.Zero for n in at):
      continue
    args = list(primals)
    for n in at:
      args[n] = ad.instantiate_zeros(tangents[n])
    term = prim.bind(*args, **params)
    total = term if total is None else [a + b for a, b in zip(total, term, strict=True)]
  if total is None:
    return out, [ad.Zero.from_primal_value(o) for o in out]
  return out, total


def _transpose(prim, cts, *operands, wrt, has_taps, dtype, parts, want=(), **extra):
  names = operand_names(wrt, has_taps, len(parts))
  undefined = [n for n, a in enumerate(operands) if ad.is_undefined_primal(a)]
  slots = {names[n] for n in undefined}
  assert len(slots) == 1 and slots <= set(SLOTS), slots
  u = slots.pop()
  if all(type(c) is ad.Zero for c in cts):
    return [ad.Zero(a.aval) if n in undefined else None for n, a in enumerate(operands)]
  ops = grouped(names, operands)
  batched = bool(extra.get("batched"))
  if wrt == "x":  # the cotangents of the tables it gave, zeros for the others
    given = dict(zip(want, cts, strict=True))
    like = next(c for c in cts if type(c) is not ad.Zero)
    lead = like.shape[:1] if batched else ()
    ops["x"] = tuple(jnp.zeros((*lead, rows, like.shape[-1]), like.dtype)
                     if p not in given or type(given[p]) is ad.Zero else given[p]
                     for p, rows in enumerate(parts))
  else:
    ops[wrt] = cts[0]
  if u == "x":
    tables = [n for n, name in enumerate(names) if name == "x"]
    new_want = tuple(p for p, n in enumerate(tables) if n in undefined)
    new_dtype = operands[undefined[0]].aval.dtype.name
  else:
    new_want, new_dtype = (), operands[undefined[0]].aval.dtype.name
  new_names = operand_names(u, has_taps, len(parts))
  results = prim.bind(*ungrouped(new_names, ops), wrt=u, has_taps=has_taps, dtype=new_dtype,
                      parts=parts, want=new_want, **extra)
  out: list = [None] * len(operands)
  for n, r in zip(undefined, results, strict=True):
    out[n] = r
  return out


def _moved(a, d, size):
  return jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)


def _batch(prim, widen, args, dims, *, wrt, has_taps, dtype, parts, want=(), batched=False):
  """The XLA path's rule. A mapped axis with the features (each batch element its own table:
  ``x`` mapped, or the feature gradient) stays an axis: the bind ``batched=True`` runs each
  element on its own (a ``vmap`` of the implementation, whose gathers and sorts keep the axis,
  so XLA's partitioner splits them over a mesh axis that splits the batch, with no
  collective). With one table for all, the mapped axis folds into the boxes
  (:func:`_batch_folded`). Either way each pixel's contributions come in the same order: the
  same bits."""
  names = operand_names(wrt, has_taps, len(parts))
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  x_mapped = any(n == "x" and d is not None for n, d in zip(names, dims))
  params = dict(wrt=wrt, has_taps=has_taps, dtype=dtype, parts=parts, want=want)
  if not (batched or x_mapped or wrt == "x"):
    return _batch_folded(prim, widen, args, dims, batched=False, **params)
  ops = [_moved(a, d, size) for a, d in zip(args, dims, strict=True)]
  if batched:  # the new axis joins the existing one
    ops = [a.reshape(size * a.shape[1], *a.shape[2:]) for a in ops]
  outs = prim.bind(*ops, batched=True, **params)
  if batched:
    outs = [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]
  return outs, [0] * len(outs)


def _batch_folded(prim, widen, args, dims, *, wrt, has_taps, dtype, parts, want=(), **extra):
  """A mapped axis folds into the boxes (and the tables' rows): the boxes of different batch
  elements never meet, and ``base`` moves each element's boxes to its own copy of its level's
  table (each table of the group becomes its ``size`` copies, one after the other: a box of
  level ``l`` at row ``g`` of element ``b`` goes to ``g + (size - 1) * start_l + b * rows_l``).
  ``widen(extra, copies)`` gives the primitive's own params for tables of ``copies`` copies of
  the ones it had (1: the tables are not batched)."""
  names = operand_names(wrt, has_taps, len(parts))
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  x_batched = wrt == "x" or any(n == "x" and d is not None for n, d in zip(names, dims))
  ops = []
  for name, a, d in zip(names, args, dims, strict=True):
    if name != "x" or x_batched:
      a = _moved(a, d, size)
      a = a.reshape(size * a.shape[1], *a.shape[2:])
    ops.append(a)
  if x_batched:
    base = ops[0]
    K = base.shape[0] // size
    if len(parts) == 1:
      shift = jnp.repeat(jnp.arange(size, dtype=base.dtype) * parts[0], K)
    else:
      first = starts(parts)
      level = sum((base >= v).astype(base.dtype) for v in first[1:])
      rows = jnp.asarray(parts, base.dtype)[level]
      shift = ((size - 1) * jnp.asarray(first, base.dtype)[level]
               + jnp.repeat(jnp.arange(size, dtype=base.dtype), K) * rows)
    ops[0] = base + shift
    parts = tuple(size * p for p in parts)
  if widen is not None:
    extra = widen(extra, size if x_batched else 1)
  outs = prim.bind(*ops, wrt=wrt, has_taps=has_taps, dtype=dtype, parts=parts, want=want,
                   **extra)
  return [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs], [0] * len(outs)


roi_form_p = define("jaxpool_roi_form", form.evaluate)

# What another primitive of the form (``kernels.py``) reuses: the batching rule that folds a
# mapped axis.
batch_folded = _batch_folded
