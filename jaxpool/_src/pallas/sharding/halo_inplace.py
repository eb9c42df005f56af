"""What each device runs (:func:`per_device`), and its part of a kernel call split along one
spatial dim computed in place: no copy of its block, only small slices with its neighbours'
rows.

With one spatial dim split, most of a device's work needs no copy of its block. A forward runs
the kernel on the block itself, its neighbours' rows standing as padding, and recomputes only
the few outputs whose windows reach those rows from small slices with the halos (written over
the block's result in place). A backward whose padding rows are neutral computes its gradient
block in place from the cotangent's rows with their (small) halos. Where a device's part does
not fit this (a window starting inside the block with no output before it, an edge window
wider than the block, ...), every device takes ``halo.py``'s general path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxpool._src.pallas.calls import KernelCall
from jaxpool._src.pallas.sharding.halo import (DimPlan, cdiv, exchange, general, halo_parts, join,
                                      local_dim, result_blocks)
from jaxpool._src.windows import Geometry


def per_device(kc: KernelCall, plans: tuple[DimPlan, ...], *operands):
  """What each device runs: its blocks in, its result blocks out (inside a manual context)."""
  if not plans:
    return kc.run(operands, kc.geom)
  if len(plans) == 1:
    parts = fast_plan(kc, plans[0])
    if parts is not None:
      return fast(kc, plans[0], parts, operands)
  return general(kc, plans, *operands)


@dataclasses.dataclass(frozen=True)
class _Edge:
  """Result rows ``[first, first + count)`` of a device's block, recomputed from a piece of
  its operands' rows and their halo's."""

  first: int  # the first result row, counted in the block's result rows
  count: int
  halo: tuple[int, int]  # rows taken from the halo: (start, stop) in the left or right halo
  own: tuple[int, int]  # rows taken from the block: (start, stop)
  dim: tuple  # the piece's local geometry (in, out, pad_lo, pad_hi, extra)
  skip: int = 0  # the piece's result rows before ``first`` (a backward's piece starts earlier)


@dataclasses.dataclass(frozen=True)
class _InPlace:
  """One device's in-place part along the split dim (all static)."""

  rows: int  # the block's real rows (fewer than a block only where the input ends)
  dim: tuple  # the block's local geometry (in, out, pad_lo, pad_hi, extra)
  keep: int  # its outputs that are this device's (a forward), or the cotangent rows it reads
  start: int  # a backward: where those cotangent rows start in the halo-extended block
  lo: _Edge | None
  hi: _Edge | None


def _block_dim(geom: Geometry, j: int, first: int, rows: int, oa: int, ob: int):
  """The local geometry of windows ``[oa, ob)`` over the block's rows ``[first, first+rows)``,
  rows before and after it standing as padding (the input's own padding at its ends); None when
  that geometry cannot give exactly those windows."""
  L, s, ek = geom.in_spatial[j], geom.strides[j], geom.effective_window[j]
  lo, hi = geom.padding[j]
  pad_lo = first + lo - oa * s
  over = (ob - 1) * s - lo + ek - (first + rows)
  if first + rows == L:  # the input's end: its own padding, then the ceil-mode overhang
    pad_hi = min(hi, max(over, 0))
    extra = max(over, 0) - pad_hi
  else:
    pad_hi, extra = max(over, 0), 0
  span = rows + pad_lo + pad_hi + extra
  if pad_lo < 0 or span < ek:
    return None
  return (rows, (span - ek) // s + 1, pad_lo, pad_hi, extra)


def fast_plan(kc: KernelCall, p: DimPlan) -> tuple[_InPlace | None, ...] | None:
  if kc.backward and not kc.neutral_pads:
    return None
  geom, j = kc.geom, p.spatial
  L, O = geom.in_spatial[j], geom.out_spatial[j]  # noqa: E741
  s, lo, ek = geom.strides[j], geom.padding[j][0], geom.effective_window[j]
  in_tile = p.out_tile if kc.backward else p.tile
  out_tile = p.tile if kc.backward else p.out_tile
  plans: list[_InPlace | None] = []
  for i in range(p.n):
    first, rows = i * in_tile, min(in_tile, L - i * in_tile)
    if kc.backward:
      w = p.works[i]
      if w is None:
        plans.append(None)
        continue
      oa = w.start - p.left + i * out_tile
      ob = oa + w.rows
      if rows <= 0:
        return None
      dim = _block_dim(geom, j, first, rows, oa, ob)
      if dim is None or dim[1] != ob - oa:
        return None
      plans.append(_InPlace(rows, dim, ob - oa, w.start, None, None))
      continue
    oa, ob = min(i * out_tile, O), min((i + 1) * out_tile, O)
    if oa >= ob:
      plans.append(None)
      continue
    if rows <= 0:
      return None
    dim = _block_dim(geom, j, first, rows, oa, ob)
    if dim is None or dim[1] < ob - oa:
      return None
    # Outputs whose windows reach rows before the block (not the input's own padding) ...
    n_lo = 0 if first == 0 else max(0, min(ob, cdiv(first + lo, s)) - oa)
    # ... or after it.
    last_inside = (first + rows + lo - ek) // s  # the last window ending inside the block
    n_hi = 0 if first + rows == L else max(0, ob - max(oa, last_inside + 1))
    if n_lo + n_hi > ob - oa:
      n_hi = ob - oa - n_lo
    edges: list[_Edge | None] = []
    for e_first, count, left in ((0, n_lo, True), (ob - oa - n_hi, n_hi, False)):
      if count == 0:
        edges.append(None)
        continue
      a, b, edim = local_dim(geom, j, oa + e_first, oa + e_first + count)
      if left:
        if b > first + rows or first - a > p.left:
          return None
        halo, own = (p.left - (first - a), p.left), (0, b - first)
      else:
        if a < first or b - (first + rows) > p.right:
          return None
        halo, own = (0, b - (first + rows)), (a - first, rows)
      edges.append(_Edge(e_first, count, halo, own, edim))
    plans.append(_InPlace(rows, dim, ob - oa, 0, edges[0], edges[1]))
  return tuple(plans)


def _halos(x: jax.Array, p: DimPlan) -> tuple[jax.Array | None, jax.Array | None]:
  """The ``p.left`` rows before ``x``'s block and the ``p.right`` rows after it."""
  lefts, rights = halo_parts(x, p)
  return (join(lefts, p.axis) if lefts else None), (join(rights, p.axis) if rights else None)


def fast(kc: KernelCall, p: DimPlan, plans, operands):
  if kc.backward and kc.sums_as_is:
    grad = _grad_plan(kc, p)
    if grad is not None:
      return _grad_in_place(kc, p, grad, operands)
  block_shapes = result_blocks(kc, operands, (p,))
  if kc.backward:  # the cotangent rows with their halos (output-sized: small)
    ext = [exchange(o, p) for o in operands]
    args: tuple = (ext,)
  else:  # the block itself, and small halos beside it
    x = operands[0]
    left, right = _halos(x, p) if (p.left or p.right) else (None, None)
    args = (x, left, right)
  classes = sorted(set(plans), key=repr)
  if len(classes) > 1:
    same = _same_work(kc, p, plans)
    if same is not None:
      return _fast_same(kc, p, plans, same, block_shapes, args)
  branches = [functools.partial(_fast_branch, kc, p, w, block_shapes) for w in classes]
  if len(branches) == 1:
    return branches[0](*args)
  table = jnp.asarray([classes.index(w) for w in plans], jnp.int32)
  return lax.switch(table[lax.axis_index(p.names)], branches, *args)


# ----------------------------------------------------------------------------- one program
#
# Where the devices' in-place parts differ only at the edges (the first and last devices of an
# evenly split dim whose block size the stride divides: the common case), every device runs the
# same kernel call, and the edge outputs are recomputed on every device and kept by a select on
# the device's position. A ``lax.switch`` over device classes would compile to a conditional,
# whose branch index a GPU reads back to the host before it can go on (measured on 2 H200s: a
# depth-split gradient took longer than the whole problem on one GPU).


def _same_work(kc: KernelCall, p: DimPlan, plans) -> _InPlace | None:
  """The one main kernel call every device can run, or None where their calls differ.

  A forward: every device's block has the same rows and local geometry (the edges may differ).
  A backward: the same, after the last devices' window runs are extended to the longest one with
  windows past the input's end. Only kernels that read padding and the ceil-mode overhang alike
  (``pads_alike``: the max pool's) take those: such a window's cotangent comes from no device and
  is zero, and its winner, whatever it is, gains an exact zero (the backward's sums start at
  +0 and never hold -0, so adding +0 changes no bit)."""
  if any(w is None for w in plans):
    return None
  if not kc.backward:
    first = plans[0]
    if all((w.rows, w.dim, w.keep) == (first.rows, first.dim, first.keep) for w in plans):
      return first
    return None
  if not kc.pads_alike:
    return None
  geom, j = kc.geom, p.spatial
  keep = max(w.keep for w in plans)
  dims = []
  for i, w in enumerate(plans):
    if w.rows != p.out_tile or w.start != plans[0].start:
      return None
    oa = w.start - p.left + i * p.tile
    if w.keep < keep and (oa + w.keep < geom.out_spatial[j]  # (only windows past the end)
                          or w.start + keep > p.left + p.tile + p.right):
      return None
    dim = _block_dim(geom, j, i * p.out_tile, w.rows, oa, oa + keep)
    if dim is None or dim[1] != keep:
      return None
    n_in, n_out, lo, hi, ex = dim
    dims.append((n_in, n_out, lo, hi + ex, 0))
  if len(set(dims)) != 1:
    return None
  return dataclasses.replace(plans[0], dim=dims[0], keep=keep)


def _fast_same(kc: KernelCall, p: DimPlan, plans, same: _InPlace, block_shapes, args):
  geom, ax, j = kc.geom, p.axis, p.spatial
  where = lax.axis_index(p.names)
  if kc.backward:
    # The windows past the input's end get a zero cotangent (a padded block's rows may hold
    # anything).
    count = [min(same.keep, geom.out_spatial[j] - (same.start - p.left + i * p.tile))
             for i in range(p.n)]
    real = None
    if min(count) < same.keep:
      shape = [1] * args[0][-1].ndim
      shape[ax] = same.keep
      real = lax.broadcasted_iota(jnp.int32, shape, ax) < jnp.asarray(count, jnp.int32)[where]
    return _backward_in_place(kc, p, same, args[0], real)
  x, left, right = args
  outs = [_fit(o, ax, same.keep) for o in kc.run([x], _with_dim(geom, j, same.dim))]
  for side, halo in (("lo", left), ("hi", right)):
    for edge in sorted({getattr(w, side) for w in plans} - {None}, key=repr):
      use = jnp.asarray([getattr(w, side) == edge for w in plans])[where]
      outs = _write_edge(p, outs, _edge_outputs(kc, p, [x], [halo], edge, side == "lo"), edge,
                         use)
  return tuple(_fit(o, ax, p.out_tile) for o in outs)


def _with_dim(geom: Geometry, j: int, dim: tuple) -> Geometry:
  n_in, n_out, lo, hi, ex = dim
  in_sp, out_sp = list(geom.in_spatial), list(geom.out_spatial)
  padding, extra = list(geom.padding), list(geom.extra)
  in_sp[j], out_sp[j], padding[j], extra[j] = n_in, n_out, (lo, hi), ex
  return dataclasses.replace(geom, in_spatial=tuple(in_sp), out_spatial=tuple(out_sp),
                             padding=tuple(padding), extra=tuple(extra))


def _fit(a: jax.Array, axis: int, size: int) -> jax.Array:
  """``a`` cut or zero-padded to ``size`` rows along ``axis``."""
  if a.shape[axis] == size:
    return a
  cfg = [(0, 0, 0)] * a.ndim
  cfg[axis] = (0, size - a.shape[axis], 0)
  return lax.pad(a, jnp.zeros((), a.dtype), cfg)


def _fast_branch(kc: KernelCall, p: DimPlan, w: _InPlace | None, block_shapes, *args):
  if w is None:
    return tuple(jnp.zeros(shape, dtype) for shape, dtype in block_shapes)
  if kc.backward:
    return _backward_in_place(kc, p, w, *args)
  x, left, right = args
  ax = p.axis
  block = x if w.rows == p.tile else lax.slice_in_dim(x, 0, w.rows, axis=ax)
  outs = [_fit(o, ax, w.keep) for o in kc.run([block], _with_dim(kc.geom, p.spatial, w.dim))]
  for edge, halo, before in ((w.lo, left, True), (w.hi, right, False)):
    if edge is not None:
      outs = _write_edge(p, outs, _edge_outputs(kc, p, [x], [halo], edge, before), edge)
  return tuple(_fit(o, ax, p.out_tile) for o in outs)


def _edge_outputs(kc: KernelCall, p: DimPlan, blocks, halos, edge: _Edge, before: bool):
  """The result rows ``edge`` names, recomputed from each operand's block rows and its halo's
  (``before``: the halo comes before the block)."""
  pieces = []
  for x, halo in zip(blocks, halos, strict=True):
    own = lax.slice_in_dim(x, edge.own[0], edge.own[1], axis=p.axis)
    near = lax.slice_in_dim(halo, edge.halo[0], edge.halo[1], axis=p.axis)
    pieces.append(join([near, own] if before else [own, near], p.axis))
  return [lax.slice_in_dim(o, edge.skip, edge.skip + edge.count, axis=p.axis)
          for o in kc.run(pieces, _with_dim(kc.geom, p.spatial, edge.dim))]


def _write_edge(p: DimPlan, outs, fixed, edge: _Edge, use=None):
  """``outs`` with the rows ``edge`` names replaced by ``fixed`` (in place), where ``use``
  (a traced bool: this device has that edge) holds, or everywhere without it."""
  ax, new = p.axis, []
  for o, f in zip(outs, fixed, strict=True):
    if use is not None:
      f = jnp.where(use, f, lax.slice_in_dim(o, edge.first, edge.first + edge.count, axis=ax))
    new.append(lax.dynamic_update_slice_in_dim(o, f, edge.first, axis=ax))
  return new


def _backward_in_place(kc: KernelCall, p: DimPlan, w: _InPlace, ext, real=None):
  """A device's gradient block from its cotangent rows with their halos; ``real`` (a mask
  along the split dim: the windows that exist) zeroes the cotangent of the others."""
  pieces = [lax.slice_in_dim(o, w.start, w.start + w.keep, axis=p.axis) for o in ext]
  if real is not None:
    pieces[-1] = jnp.where(real, pieces[-1], jnp.zeros((), pieces[-1].dtype))
  outs = kc.run(pieces, _with_dim(kc.geom, p.spatial, w.dim))
  return tuple(_fit(o, p.axis, p.out_tile) for o in outs)


# ----------------------------------------------------------------------------- a backward's edges
#
# A backward on an even split whose block the stride divides (every device holds as many
# windows, all real, and as many gradient rows) runs one kernel call on every device's own
# cotangent rows, as they are: the windows of a neighbour's rows stand as padding, so the
# gradient rows that those windows also reach lack their share. Those few rows are recomputed
# from a small piece (the windows that reach them: some of the device's own and some of its
# neighbour's, from the halo) and written over the block's result in place, kept by a select
# on the device's position where it has that neighbour. A recomputed row sums every window that
# reaches it, in the kernel's fixed order, so it has one device's bits. Copying each cotangent
# with its halo into one array instead cost two copies of the cotangent rows per gradient (on 2
# H100s, 0.08 ms of a 0.35 ms depth-split max-pool gradient; docs/design/split-gradients.md).
# The max pool's backward only (``sums_as_is``): its sums add the cotangents as they are. The
# average pool's divides them, and a compiler that sees the small piece's divisors as constants
# may divide by multiplying by the reciprocal (XLA:CPU with LLVM's optimisations did, in
# interpret mode: one element of 40 random cases 1 ulp off one device's), so it keeps the copy.


@dataclasses.dataclass(frozen=True)
class _GradPlan:
  """The block's local geometry, its edges (None: no device has one on that side) and which
  devices keep each edge's rows."""

  dim: tuple
  lo: _Edge | None
  hi: _Edge | None
  use_lo: tuple[bool, ...]
  use_hi: tuple[bool, ...]


class _Unfit(Exception):
  """An edge that the halos cannot serve."""


def _grad_edge(geom: Geometry, j: int, p: DimPlan, block: int, r0: int, count: int,
               own: tuple[int, int], left: bool) -> _Edge:
  """The edge of gradient rows ``[r0, r0 + count)`` of the block starting at row ``block``,
  whose own windows are ``own`` (global window indices ``[oa, ob)``)."""
  s, lo, ek = geom.strides[j], geom.padding[j][0], geom.effective_window[j]
  wa = max(0, cdiv(r0 + lo - ek + 1, s))
  wb = min(geom.out_spatial[j], (r0 + count - 1 + lo) // s + 1)
  a, b, dim = local_dim(geom, j, wa, wb)
  oa, ob = own
  if not a <= r0 <= r0 + count <= b:
    raise _Unfit
  if left:
    if wb > ob or oa - wa > p.left:
      raise _Unfit
    halo, mine = (p.left - (oa - wa), p.left), (0, wb - oa)
  else:
    if wa < oa or wb - ob > p.right:
      raise _Unfit
    halo, mine = (0, wb - ob), (wa - oa, ob - oa)
  return _Edge(r0 - block, count, halo, mine, dim, skip=r0 - a)


def _grad_plan(kc: KernelCall, p: DimPlan) -> _GradPlan | None:
  """The one-call backward of every device, or None where the split does not allow it."""
  geom, j = kc.geom, p.spatial
  L, O = geom.in_spatial[j], geom.out_spatial[j]  # noqa: E741
  s, lo, ek = geom.strides[j], geom.padding[j][0], geom.effective_window[j]
  T, Lt = p.tile, p.out_tile  # the windows and the gradient rows a device holds
  if O != p.n * T or L != p.n * Lt:
    return None
  dims, los, his = set(), [], []
  try:
    for i in range(p.n):
      first, oa, ob = i * Lt, i * T, (i + 1) * T
      dim = _block_dim(geom, j, first, Lt, oa, ob)
      if dim is None or dim[1] != T:
        return None
      dims.add(dim)
      # Rows that the windows before the device's reach, and those that the windows after do.
      c = min(Lt, (oa - 1) * s - lo + ek - first) if oa > 0 else 0
      los.append(_grad_edge(geom, j, p, first, first, c, (oa, ob), True) if c > 0 else None)
      r = max(first, ob * s - lo) if ob < O else first + Lt
      his.append(_grad_edge(geom, j, p, first, r, first + Lt - r, (oa, ob), False)
                 if r < first + Lt else None)
  except _Unfit:
    return None
  edges = []
  for side in (los, his):
    kinds = {e for e in side if e is not None}
    if len(kinds) > 1:
      return None
    edges.append((kinds.pop() if kinds else None, tuple(e is not None for e in side)))
  if len(dims) != 1:
    return None
  (lo_edge, use_lo), (hi_edge, use_hi) = edges
  return _GradPlan(dims.pop(), lo_edge, hi_edge, use_lo, use_hi)


def _grad_in_place(kc: KernelCall, p: DimPlan, g: _GradPlan, operands):
  outs = list(kc.run(list(operands), _with_dim(kc.geom, p.spatial, g.dim)))
  halos = [_halos(o, p) for o in operands]
  for edge, use, left in ((g.lo, g.use_lo, True), (g.hi, g.use_hi, False)):
    if edge is not None:
      fixed = _edge_outputs(kc, p, operands, [h[0 if left else 1] for h in halos], edge, left)
      keep = None if all(use) else jnp.asarray(use)[lax.axis_index(p.names)]
      outs = _write_edge(p, outs, fixed, edge, keep)
  return tuple(outs)

