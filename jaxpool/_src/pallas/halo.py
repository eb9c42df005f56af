"""How a kernel call's work splits along spatial dims: the halo plan, the exchange of halo
rows between neighbouring devices, and what each device runs (``partition.py`` calls it).

A device's part of a split spatial dim is static (the block sizes, the mesh and the geometry are
known when the program is partitioned). Where every device's kernel calls are the same (an even
split whose block the stride divides) all run one program, the edge outputs kept by a select on
the device's position; otherwise devices doing the same work share one branch of a
``lax.switch`` on their position along the mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpool._src.pallas.calls import KernelCall
from jaxpool._src.windows import Geometry


# ----------------------------------------------------------------------------- the plan


def _names(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def spec_dims(spec, ndim: int) -> list[tuple[str, ...]]:
  dims = [_names(e) for e in tuple(spec)[:ndim]]
  return dims + [()] * (ndim - len(dims))


@dataclasses.dataclass(frozen=True)
class _Work:
  """One device's part of the problem along one spatial dim (all static)."""

  start: int  # where its operand rows start in the halo-extended block
  rows: int  # operand rows it reads (input rows for a forward, windows for a backward)
  dim: tuple  # (in, out, pad_lo, pad_hi, extra): the local geometry along this dim
  place: tuple[int, int]  # backward: pad (may be negative: crop) of the local gradient


@dataclasses.dataclass(frozen=True)
class _DimPlan:
  """How one sharded spatial dim splits: the halo exchange and each device's work."""

  axis: int  # the array dim
  spatial: int  # its index among the spatial dims
  names: tuple[str, ...]  # the mesh axes it is sharded over
  n: int  # devices along it
  tile: int  # rows of the operand block each device holds
  left: int  # halo rows received from the left neighbours
  right: int  # ... and from the right
  out_tile: int  # rows of the result block each device holds
  works: tuple[_Work | None, ...]  # per device (None: no window touches its block)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _local_dim(geom: Geometry, j: int, oa: int, ob: int) -> tuple[int, int, tuple]:
  """The input rows ``[a, b)`` that windows ``[oa, ob)`` of spatial dim ``j`` read, and the
  local geometry ``(in, out, pad_lo, pad_hi, extra)`` of that piece."""
  L, s = geom.in_spatial[j], geom.strides[j]
  ek = geom.effective_window[j]
  lo, hi = geom.padding[j]
  first, end = oa * s - lo, (ob - 1) * s - lo + ek
  a, b = max(0, first), min(L, end)
  over = end - b  # rows past the input's end: the user's padding first, then the overhang
  pad_hi = min(hi, over)
  return a, b, (b - a, ob - oa, a - first, pad_hi, over - pad_hi)


def _plan_dim(geom: Geometry, axis: int, j: int, names: tuple[str, ...], n: int,
              backward: bool) -> _DimPlan:
  L, O = geom.in_spatial[j], geom.out_spatial[j]  # noqa: E741
  s, lo, ek = geom.strides[j], geom.padding[j][0], geom.effective_window[j]
  in_tile, out_tile = _cdiv(L, n), _cdiv(O, n)
  works: list[_Work | None] = []
  spans = []  # (first operand row needed, end) per device, for the halo sizes
  for i in range(n):
    if backward:  # the gradient rows [ra, rb) this device holds; the windows that touch them
      ra, rb = min(i * in_tile, L), min((i + 1) * in_tile, L)
      oa = max(0, _cdiv(ra + lo - ek + 1, s))
      ob = min(O, (rb - 1 + lo) // s + 1) if rb > ra else oa
      if oa >= ob:
        works.append(None)
        continue
      a, b, dim = _local_dim(geom, j, oa, ob)
      spans.append((oa, ob, i * out_tile, out_tile))
      works.append(_Work(start=oa - i * out_tile, rows=ob - oa, dim=dim,
                         place=(a - i * in_tile, (i + 1) * in_tile - b)))
    else:  # the output rows this device holds; the input rows they read
      oa, ob = min(i * out_tile, O), min((i + 1) * out_tile, O)
      if oa >= ob:
        works.append(None)
        continue
      a, b, dim = _local_dim(geom, j, oa, ob)
      spans.append((a, b, i * in_tile, in_tile))
      works.append(_Work(start=a - i * in_tile, rows=b - a, dim=dim, place=(0, 0)))
  left = max([0] + [own - need for need, _, own, _ in spans])
  right = max([0] + [end - (own + t) for _, end, own, t in spans])
  works = [None if w is None else dataclasses.replace(w, start=w.start + left) for w in works]
  return _DimPlan(axis=axis, spatial=j, names=names, n=n,
                  tile=out_tile if backward else in_tile, left=left, right=right,
                  out_tile=in_tile if backward else out_tile, works=tuple(works))


def plan(kc: KernelCall, dims: list[tuple[str, ...]], mesh_shape: dict[str, int],
          ndim: int) -> tuple[_DimPlan, ...]:
  spatial = kc.geom.spatial_axes(ndim)
  plans = []
  for j, ax in enumerate(spatial):
    if dims[ax]:
      n = int(np.prod([mesh_shape[a] for a in dims[ax]]))
      if n > 1:
        plans.append(_plan_dim(kc.geom, ax, j, dims[ax], n, kc.backward))
  return tuple(plans)


# ----------------------------------------------------------------------------- per device


def _exchange(x: jax.Array, p: _DimPlan) -> jax.Array:
  """``x``'s block with ``p.left`` rows of its left neighbours' blocks before it and
  ``p.right`` of its right neighbours' after it (zeros past the ends), along ``p.axis``."""
  parts = [x]
  need, hop = p.left, 1
  while need > 0:  # hop h brings the last rows of the block h devices to the left
    c = min(p.tile, need)
    piece = lax.slice_in_dim(x, p.tile - c, p.tile, axis=p.axis)
    parts.insert(0, lax.ppermute(piece, p.names, [(k, k + hop) for k in range(p.n - hop)]))
    need, hop = need - c, hop + 1
  need, hop = p.right, 1
  while need > 0:
    c = min(p.tile, need)
    piece = lax.slice_in_dim(x, 0, c, axis=p.axis)
    parts.append(lax.ppermute(piece, p.names, [(k, k - hop) for k in range(hop, p.n)]))
    need, hop = need - c, hop + 1
  return parts[0] if len(parts) == 1 else lax.concatenate(parts, p.axis)


def _local_geometry(geom: Geometry, plans, works) -> Geometry:
  in_sp, out_sp = list(geom.in_spatial), list(geom.out_spatial)
  padding, extra = list(geom.padding), list(geom.extra)
  for p, w in zip(plans, works):
    n_in, n_out, lo, hi, ex = w.dim
    j = p.spatial
    in_sp[j], out_sp[j], padding[j], extra[j] = n_in, n_out, (lo, hi), ex
  return dataclasses.replace(geom, in_spatial=tuple(in_sp), out_spatial=tuple(out_sp),
                             padding=tuple(padding), extra=tuple(extra))


def _tile_shape(shape, plans) -> list[int]:
  out = list(shape)
  for p in plans:
    out[p.axis] = p.out_tile
  return out


def _branch(kc: KernelCall, plans, works, result_shapes, operands):
  """One class of devices' work: the kernel on its piece, placed in its result block."""
  if any(w is None for w in works):  # no window touches this block
    return tuple(jnp.zeros(s, d) for s, d in result_shapes)
  pieces = list(operands)
  for p, w in zip(plans, works):
    pieces = [lax.slice_in_dim(o, w.start, w.start + w.rows, axis=p.axis) for o in pieces]
  outs = kc.run(pieces, _local_geometry(kc.geom, plans, works))
  placed = []
  for o, (shape, _) in zip(outs, result_shapes):
    cfg = [(0, 0, 0)] * o.ndim
    for p, w in zip(plans, works):
      lo, hi = w.place if kc.backward else (0, p.out_tile - w.dim[1])
      cfg[p.axis] = (lo, hi, 0)
    placed.append(lax.pad(o, jnp.zeros((), o.dtype), cfg))
    assert placed[-1].shape == tuple(shape), (placed[-1].shape, shape)
  return tuple(placed)


def per_device(kc: KernelCall, plans: tuple[_DimPlan, ...], *operands):
  """What each device runs: its blocks in, its result blocks out (inside a manual context)."""
  if not plans:
    return kc.run(operands, kc.geom)
  if len(plans) == 1:
    fast = _fast_plan(kc, plans[0])
    if fast is not None:
      return _fast(kc, plans[0], fast, operands)
  ext = list(operands)
  for p in plans:
    ext = [_exchange(o, p) for o in ext]
  # Devices doing the same work share a branch: per dim, a class per distinct work.
  classes = [sorted(set(p.works), key=repr) for p in plans]
  block_shapes = _result_blocks(kc, operands, plans)
  branches = [functools.partial(_branch, kc, plans, combo, block_shapes)
              for combo in itertools.product(*classes)]
  if len(branches) == 1:
    return branches[0](ext)
  index = jnp.zeros((), jnp.int32)
  for p, cls in zip(plans, classes):
    table = jnp.asarray([cls.index(w) for w in p.works], jnp.int32)
    index = index * len(cls) + table[lax.axis_index(p.names)]
  return lax.switch(index, branches, ext)


def _result_blocks(kc: KernelCall, operands, plans) -> list[tuple[tuple[int, ...], Any]]:
  """Each result's block shape and dtype on one device: the whole problem's result shapes,
  with each split spatial dim at its block size."""
  whole = []
  for o in operands:
    shape = list(o.shape)
    for p in plans:  # a forward's operands are input-shaped, a backward's output-shaped
      j = p.spatial
      shape[p.axis] = kc.geom.out_spatial[j] if kc.backward else kc.geom.in_spatial[j]
    whole.append(jax.ShapeDtypeStruct(tuple(shape), o.dtype))
  avals = jax.eval_shape(lambda *o: kc.run(o, kc.geom), *whole)
  return [(tuple(_tile_shape(a.shape, plans)), a.dtype) for a in avals]


# ----------------------------------------------------------------------------- in place
#
# With one spatial dim split, most of a device's work needs no copy of its block. A forward runs
# the kernel on the block itself, its neighbours' rows standing as padding, and recomputes only
# the few outputs whose windows reach those rows from small slices with the halos (written over
# the block's result in place). A backward whose padding rows are neutral computes its gradient
# block in place from the cotangent's rows with their (small) halos. Where a device's part does
# not fit this (a window starting inside the block with no output before it, an edge window
# wider than the block, ...), every device takes the general path above.


@dataclasses.dataclass(frozen=True)
class _Edge:
  """Outputs ``[first, first + count)`` of a device's block, recomputed with the halos."""

  first: int  # the first output, counted in the block's outputs
  count: int
  halo: tuple[int, int]  # rows taken from the halo: (start, stop) in the left or right halo
  own: tuple[int, int]  # rows taken from the block: (start, stop)
  dim: tuple  # their local geometry (in, out, pad_lo, pad_hi, extra)


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


def _fast_plan(kc: KernelCall, p: _DimPlan) -> tuple[_InPlace | None, ...] | None:
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
    n_lo = 0 if first == 0 else max(0, min(ob, _cdiv(first + lo, s)) - oa)
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
      a, b, edim = _local_dim(geom, j, oa + e_first, oa + e_first + count)
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


def _halos(x: jax.Array, p: _DimPlan) -> tuple[jax.Array | None, jax.Array | None]:
  """The ``p.left`` rows before ``x``'s block and the ``p.right`` rows after it."""
  ext = _exchange(x, p)
  left = lax.slice_in_dim(ext, 0, p.left, axis=p.axis) if p.left else None
  right = (lax.slice_in_dim(ext, p.left + p.tile, p.left + p.tile + p.right, axis=p.axis)
           if p.right else None)
  return left, right


def _fast(kc: KernelCall, p: _DimPlan, plans, operands):
  block_shapes = _result_blocks(kc, operands, (p,))
  if kc.backward:  # the cotangent rows with their halos (output-sized: small)
    ext = [_exchange(o, p) for o in operands]
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


def _same_work(kc: KernelCall, p: _DimPlan, plans) -> _InPlace | None:
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


def _fast_same(kc: KernelCall, p: _DimPlan, plans, same: _InPlace, block_shapes, args):
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
      fixed = _edge_outputs(kc, p, x, halo, edge, before=side == "lo")
      use = jnp.asarray([getattr(w, side) == edge for w in plans])[where]
      outs = [lax.dynamic_update_slice_in_dim(
          o, jnp.where(use, f, lax.slice_in_dim(o, edge.first, edge.first + edge.count, axis=ax)),
          edge.first, axis=ax) for o, f in zip(outs, fixed)]
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


def _fast_branch(kc: KernelCall, p: _DimPlan, w: _InPlace | None, block_shapes, *args):
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
      outs = [lax.dynamic_update_slice_in_dim(o, f, edge.first, axis=ax)
              for o, f in zip(outs, _edge_outputs(kc, p, x, halo, edge, before))]
  return tuple(_fit(o, ax, p.out_tile) for o in outs)


def _edge_outputs(kc: KernelCall, p: _DimPlan, x, halo, edge: _Edge, before: bool):
  """The outputs ``edge`` names, recomputed from the block's rows and the halo's (``before``:
  the halo comes before the block)."""
  own = lax.slice_in_dim(x, edge.own[0], edge.own[1], axis=p.axis)
  near = lax.slice_in_dim(halo, edge.halo[0], edge.halo[1], axis=p.axis)
  piece = lax.concatenate([near, own] if before else [own, near], p.axis)
  return kc.run([piece], _with_dim(kc.geom, p.spatial, edge.dim))


def _backward_in_place(kc: KernelCall, p: _DimPlan, w: _InPlace, ext, real=None):
  """A device's gradient block from its cotangent rows with their halos; ``real`` (a mask
  along the split dim: the windows that exist) zeroes the cotangent of the others."""
  pieces = [lax.slice_in_dim(o, w.start, w.start + w.keep, axis=p.axis) for o in ext]
  if real is not None:
    pieces[-1] = jnp.where(real, pieces[-1], jnp.zeros((), pieces[-1].dtype))
  outs = kc.run(pieces, _with_dim(kc.geom, p.spatial, w.dim))
  return tuple(_fit(o, p.axis, p.out_tile) for o in outs)
