"""ROI align's sampled sum as one 4-linear form, and its four derivatives on XLA.

For fixed integer corner positions, ROI align (average or max over the samples) is

    F(wy, wx, x, ct) = sum ct[k,i,j,c] sel[k,i,j,c,s] wy[k,i,sy,a] wx[k,j,sx,b]
                                       x[base[k] + iy[k,i,sy,a] * stride[k] + ix[k,j,sx,b], c]

summed over the box ``k``, the bin ``(i, j)``, the channel ``c``, the sample ``s = (sy, sx)`` and
its corners ``(a, b)``: linear in each of the corner weights ``wy``, ``wx`` (functions of the
boxes, written with ``jnp`` in ``plan.py``, so JAX differentiates them), the flat feature table
``x`` ``(P, C)`` and the output cotangent ``ct`` ``(K, ph, pw, C)``. ``sel`` is 1 (average) or,
with the residual ``taps`` (max), 1 at the sample ``taps[k,i,j,c]`` only. The table ``x`` may
come as a group of tables (the levels' maps, each reshaped), whose concatenation it is.

:func:`evaluate` computes ``dF/d(wrt)`` for ``wrt`` one of ``"ct"`` (the forward ``y``), ``"x"``
(the feature gradient), ``"wy"``, ``"wx"`` (the box gradient's parts), from the other three:
the implementation of the primitives of ``primitive.py`` (their JVP, transpose and batching
rules) on XLA.

A dead sample (padding past a box's sample count, outside ``[-1, size]``, or in an unusable
box) has the corner indices -1 in ``iy``/``ix``: it reads pixel 0 but counts as nothing
(``jnp.where``, not a product with 0, so a NaN or inf it reads, or a NaN cotangent, goes
nowhere), and joins no pixel's sum in the feature gradient.

The feature gradient is deterministic: one sample of every bin at a time, in row-major sample
order, the contributions are sorted by pixel (a stable sort), summed per pixel by a segmented
scan in a fixed order, read at unique positions and added to the running sum; no scatter. Dead
samples add nothing, so the bits do not depend on the static sample grid (eager == jit).
Memory: the forward holds the outputs; the feature gradient, per step, a group of channels of
the contributions of one sample of every bin (``channel_group``: a sixteenth of 4 corners x the
outputs); the box gradient the outputs (without channels) times the samples per bin times 4,
its sums fixed trees (``tree_sum``), so that a box's bits do not depend on the other boxes.

``batched=True`` (the per-image form, and ``vmap`` with the features mapped): every operand
has a leading batch axis, each element computed on its own by a ``vmap`` of the implementation,
whose gathers and sorts keep the axis (XLA's partitioner splits them with the batch).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
SLOTS = ("wy", "wx", "x", "ct")  # the four linear slots, in operand order
_RES = ("base", "stride", "iy", "ix", "taps")


def operand_names(wrt: str, has_taps: bool, n_x: int = 1) -> tuple[str, ...]:
  """The names of a bind's operands, in order: the residuals, then the slots but ``wrt``, the
  ``"x"`` slot a group of ``n_x`` operands (the levels' tables, one name each)."""
  res = _RES if has_taps else _RES[:-1]
  out = list(res)
  for s in SLOTS:
    if s != wrt:
      out += [s] * (n_x if s == "x" else 1)
  return tuple(out)


def grouped(names, operands) -> dict:
  """The operands by name, the ``"x"`` group as a tuple."""
  ops: dict = {}
  for n, a in zip(names, operands, strict=True):
    if n == "x":
      ops["x"] = (*ops.get("x", ()), a)
    else:
      ops[n] = a
  return ops


def ungrouped(names, ops) -> list:
  """:func:`grouped`'s inverse: the operands in ``names``' order."""
  out, used = [], 0
  for n in names:
    out.append(ops["x"][used] if n == "x" else ops[n])
    used += n == "x"
  return out


def starts(parts) -> tuple[int, ...]:
  """The first table row of each of the group's tables (``parts``: their rows)."""
  return tuple(int(v) for v in (0, *itertools.accumulate(parts)))[:len(parts)]


# ----------------------------------------------------------------------------- implementations


def _varying_axes(a) -> set:
  t = jax.typeof(a)
  mat = getattr(t, "mat", None)  # JAX 0.10: ManualAxisType; before it, the set ``vma``
  return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def varying(init, *like):
  """``init`` (a loop's first carry) marked as varying over the manual mesh axes that ``like``
  vary over, as the loop's body makes it (inside ``shard_map`` with ``check_vma``)."""
  axes: set = set()
  for a in like:
    axes |= _varying_axes(a)

  def mark(v):
    more = tuple(sorted(axes - _varying_axes(v)))
    return lax.pcast(v, more, to="varying") if more else v

  return jax.tree.map(mark, init)


def _sample_corners(s, base, stride, iy, ix, wy=None, wx=None):
  """Sample ``s = sy * Sx + sx`` of every bin: its corners' flat rows of x, liveness and
  (given ``wy``, ``wx``) weights ``wy * wx`` (float32), each ``(K, ph, pw, 2, 2)``."""
  Sx = ix.shape[2]
  sy, sx = s // Sx, s % Sx
  r = lax.dynamic_index_in_dim(iy, sy, 2, keepdims=False)  # (K, ph, 2)
  c = lax.dynamic_index_in_dim(ix, sx, 2, keepdims=False)  # (K, pw, 2)
  rows = (base[:, None, None, None, None] + jnp.maximum(r, 0)[:, :, None, :, None] * stride[
      :, None, None, None, None] + jnp.maximum(c, 0)[:, None, :, None, :])
  live = (r >= 0)[:, :, None, :, None] & (c >= 0)[:, None, :, None, :]
  if wy is None or wx is None:
    return rows, live, None
  u = lax.dynamic_index_in_dim(wy, sy, 2, keepdims=False).astype(F32)
  t = lax.dynamic_index_in_dim(wx, sx, 2, keepdims=False).astype(F32)
  w = u[:, :, None, :, None] * t[:, None, :, None, :]
  return rows, live, w


def _selected(taps, sy, sx):
  """Per element ``(K, ph, pw, C)``: the selected sample's row and column index, and a mask."""
  ok = taps >= 0
  t = jnp.where(ok, taps, 0)
  return t // sx, t % sx, ok


def _max_parts(base, stride, iy, ix, taps, wy, wx):
  """Max mode: per element and corner ``(K, ph, pw, C, 2, 2)``: flat element rows, weights and
  liveness (the selected sample is live there)."""
  K, ph, Sy, _ = iy.shape
  pw, Sx = ix.shape[1:3]
  C = taps.shape[-1]
  sy, sx, ok = _selected(taps, Sy, Sx)
  k = jnp.arange(K)[:, None, None, None]
  i = jnp.arange(ph)[None, :, None, None]
  j = jnp.arange(pw)[None, None, :, None]
  ry, cy = iy[k, i, sy], wy[k, i, sy].astype(F32)  # (K, ph, pw, C, 2)
  rx, cx = ix[k, j, sx], wx[k, j, sx].astype(F32)
  rows = (base[:, None, None, None, None, None] + jnp.maximum(ry, 0)[..., :, None] * stride[
      :, None, None, None, None, None] + jnp.maximum(rx, 0)[..., None, :])
  elems = rows * C + jnp.arange(C)[None, None, None, :, None, None]
  live = ok[..., None, None] & (ry >= 0)[..., :, None] & (rx >= 0)[..., None, :]
  return elems, cy[..., :, None] * cx[..., None, :], live


def sample_value(s, base, stride, iy, ix, wy, wx, x):
  """The bilinear value of sample ``s = sy * Sx + sx`` of every bin: ``(K, ph, pw, C)``
  float32, its four corners added in the order of torchvision's kernel."""
  rows, live, w = _sample_corners(s, base, stride, iy, ix, wy, wx)
  v = None
  for a in (0, 1):
    for b in (0, 1):
      g = jnp.take(x, rows[..., a, b], axis=0, mode="clip").astype(F32)
      term = jnp.where(live[..., a, b, None], w[..., a, b, None] * g, 0.0)
      v = term if v is None else v + term
  return v


def _forward(base, stride, iy, ix, taps, wy, wx, x, *, dtype):
  """``y = dF/dct``: (K, ph, pw, C)."""
  K, ph, Sy, _ = iy.shape
  pw, Sx = ix.shape[1:3]
  C = x.shape[1]
  if taps is not None:
    elems, w, live = _max_parts(base, stride, iy, ix, taps, wy, wx)
    g = jnp.take(x.reshape(-1), elems, mode="clip").astype(F32)
    t = jnp.where(live, w * g, 0.0)
    v = t[..., 0, 0] + t[..., 0, 1] + t[..., 1, 0] + t[..., 1, 1]
    return v.astype(dtype)

  def body(s, acc):
    return acc + sample_value(s, base, stride, iy, ix, wy, wx, x)

  acc = lax.fori_loop(0, Sy * Sx, body,
                      varying(jnp.zeros((K, ph, pw, C), F32), base, stride, iy, ix, wy, wx, x))
  return acc.astype(dtype)


# One step of the feature gradient's sorted sum holds the contributions of a group of channels
# (twice: the scan's two buffers): a sixteenth of them all (4 corners x the outputs / 16), or
# GROUP_FLOOR bytes if that is more.
GROUPS = 16
GROUP_FLOOR = 1 << 20


def channel_group(entries: int, channels: int) -> int:
  """The channels summed per step: the largest divisor of ``channels`` whose ``entries`` x
  group float32 values fit in ``max(GROUP_FLOOR, all / GROUPS)`` bytes, at least 1. Each
  channel's sum is its own additions in its own order whatever the group, so the bits do not
  depend on it."""
  budget = max(GROUP_FLOOR, 4 * entries * channels // GROUPS)
  fit = max(1, budget // max(4 * entries, 1))
  return max(d for d in range(1, channels + 1) if channels % d == 0 and d <= fit)


def sorted_sum(take, rows: jax.Array, num_rows: int, into: jax.Array,
               group: int | None = None) -> jax.Array:
  """``out[p, c] = into[p, c] + sum of v[m, c] where rows[m] == p`` (``(num_rows, C)``),
  deterministic, with ``v`` never whole: ``take(order, c0, n)`` gives ``v[order, c0:c0 + n]``
  (float32 ``(M, n)``, ``order`` a permutation of the ``M`` entries).

  A stable sort of the rows, then for each group of ``n`` channels (``channel_group``): a
  segmented inclusive scan of the sorted values (Hillis-Steele: ``ceil(log2)`` of the longest
  run steps, each adding the partial sum ``2**t`` entries back within the segment, a fixed
  tree of additions), each row's sum read at the last entry of its segment (a gather at
  unique positions) and added to the group's columns of ``into`` (in place): no scatter, no
  atomics. ``rows``: ``(M,)`` int32 in ``[0, num_rows]``: an entry at ``num_rows`` (dead)
  sorts after every pixel and joins no sum. Memory: ``into`` and a few ``(M, n)`` arrays.
  """
  M = rows.shape[0]
  C = into.shape[1]
  if M == 0 or num_rows == 0:
    return into
  n = channel_group(M, C) if group is None else group
  order = jnp.argsort(rows, stable=True).astype(jnp.int32)
  keys = rows[order]
  idx = jnp.arange(M, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
  first = lax.cummax(jnp.where(starts, idx, 0))  # where each entry's segment starts
  # As many steps as the longest run needs (ceil(log2(run))), not log2(M): a data-dependent
  # count, fine here (this implementation is never differentiated by JAX).
  longest = jnp.max(jnp.where(keys < num_rows, idx - first, 0)) + 1
  steps = 32 - lax.clz((longest - 1).astype(jnp.int32))
  targets = jnp.arange(num_rows, dtype=keys.dtype)
  last = jnp.searchsorted(keys, targets, side="right") - 1  # each row's segment's last entry
  safe = jnp.clip(last, 0, M - 1)
  hit = (last >= 0) & (keys[safe] == targets)

  def group_sum(g, out):
    vals = take(order, g * n, n)
    zeros = jnp.zeros_like(vals)

    def step(t, v):  # Hillis-Steele: add the partial sum 2**t entries back, in the segment
      d = jnp.left_shift(jnp.int32(1), t)
      shifted = lax.dynamic_slice_in_dim(jnp.concatenate([zeros, v]), M - d, M)
      return v + jnp.where((idx - d >= first)[:, None], shifted, 0.0)

    sums = lax.fori_loop(0, steps, step, vals)
    col = lax.dynamic_slice_in_dim(out, g * n, n, axis=1)
    col = jnp.where(hit[:, None], col + sums[safe], col)
    return lax.dynamic_update_slice_in_dim(out, col, g * n, axis=1)

  return lax.fori_loop(0, C // n, group_sum, varying(into, rows))


def segment_sum_sorted(values: jax.Array, rows: jax.Array, num_rows: int,
                       into: jax.Array | None = None) -> jax.Array:
  """``sorted_sum`` of the entries ``values`` ``(M, C)`` float32."""
  if into is None:
    into = varying(jnp.zeros((num_rows, values.shape[1]), values.dtype), values, rows)

  def take(order, c0, n):
    return lax.dynamic_slice_in_dim(values, c0, n, axis=1)[order]

  return sorted_sum(take, rows, num_rows, into)


def _feature_grad(base, stride, iy, ix, taps, wy, wx, ct, *, dtype, rows_out):
  """``dx = dF/dx``: (P, C)."""
  C = ct.shape[-1]
  ctf = ct.astype(F32)
  if taps is not None:
    elems, w, live = _max_parts(base, stride, iy, ix, taps, wy, wx)
    vals = (ctf[..., None, None] * w).reshape(-1, 1)
    keys = jnp.where(live, elems, rows_out * C).reshape(-1).astype(jnp.int32)
    out = segment_sum_sorted(vals, keys, rows_out * C)
    return out.reshape(rows_out, C).astype(dtype)
  Sy, Sx = iy.shape[2], ix.shape[2]
  flat_ct = ct.reshape(-1, C)  # one row per bin

  def body(s, out):  # one sample of every bin, in row-major sample order
    rows, live, w = _sample_corners(s, base, stride, iy, ix, wy, wx)
    keys = jnp.where(live, rows, rows_out).reshape(-1).astype(jnp.int32)
    w = w.reshape(-1)  # (bins x 4 corners,)

    def take(order, c0, n):  # the contributions ct[bin, c] * w[bin, corner], sorted
      part = lax.dynamic_slice_in_dim(flat_ct, c0, n, axis=1)
      return part[order // 4].astype(F32) * w[order][:, None]

    return sorted_sum(take, keys, rows_out, out)

  out = lax.fori_loop(0, Sy * Sx, body,
                      varying(jnp.zeros((rows_out, C), F32), base, stride, iy, ix, wy, wx, ct))
  return out.astype(dtype)


def tree_sum(a: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """``a.sum(axes)`` as a fixed tree of elementwise additions (halves added, an odd last entry
  carried): the same bits whatever the other dims' sizes, which XLA's reductions do not
  promise (a batch axis more, or fewer boxes on a device, moved the box gradient's last bit)."""
  keep = [d for d in range(a.ndim) if d not in axes]
  a = jnp.transpose(a, (*keep, *axes))
  a = a.reshape(*a.shape[:len(keep)], -1)
  while a.shape[-1] > 1:
    n = a.shape[-1]
    h = n // 2
    pair = a[..., :h] + a[..., h:2 * h]
    a = jnp.concatenate([pair, a[..., 2 * h:]], axis=-1) if n % 2 else pair
  return a[..., 0] if a.shape[-1] else jnp.zeros(a.shape[:-1], a.dtype)


def _corner_dots(base, stride, iy, ix, taps, x, ct):
  """``d[k,i,j,sy,sx,a,b] = sum_c ct sel x[corner]`` (float32), one sample at a time."""
  K, ph, Sy, _ = iy.shape
  pw, Sx = ix.shape[1:3]
  ctf = ct.astype(F32)

  def one(s):
    rows, live, _ = _sample_corners(s, base, stride, iy, ix)
    g = jnp.take(x, rows, axis=0, mode="clip").astype(F32)  # (K, ph, pw, 2, 2, C)
    prod = ctf[:, :, :, None, None, :] * g
    if taps is not None:
      prod = jnp.where((taps == s)[:, :, :, None, None, :], prod, 0.0)
    return jnp.where(live, tree_sum(prod, (prod.ndim - 1,)), 0.0)

  d = lax.map(one, jnp.arange(Sy * Sx))  # (S, K, ph, pw, 2, 2)
  d = d.reshape(Sy, Sx, K, ph, pw, 2, 2)
  return jnp.transpose(d, (2, 3, 4, 0, 1, 5, 6))  # (K, ph, pw, Sy, Sx, 2, 2)


def _wy_grad(base, stride, iy, ix, taps, wx, x, ct, *, dtype):
  d = _corner_dots(base, stride, iy, ix, taps, x, ct)
  out = tree_sum(d * wx.astype(F32)[:, None, :, None, :, None, :], (2, 4, 6))
  return out.astype(dtype)  # (K, ph, Sy, 2)


def _wx_grad(base, stride, iy, ix, taps, wy, x, ct, *, dtype):
  d = _corner_dots(base, stride, iy, ix, taps, x, ct)
  out = tree_sum(d * wy.astype(F32)[:, :, None, :, None, :, None], (1, 3, 5))
  return out.astype(dtype)  # (K, pw, Sx, 2)


def evaluate(*operands, wrt, has_taps, dtype, parts, want=(), batched=False):
  """The form's derivative ``wrt`` (a list: for ``"x"``, the gradient of each table of the group
  named by ``want``; else the one result) on XLA, the group's tables concatenated (each
  table's gradient a slice of the whole one's: a pixel's sum has the same terms and order)."""
  if batched:  # a leading batch axis on every operand: each element on its own (see _batch)
    return jax.vmap(lambda *o: evaluate(*o, wrt=wrt, has_taps=has_taps, dtype=dtype,
                                        parts=parts, want=want))(*operands)
  ops = grouped(operand_names(wrt, has_taps, len(parts)), operands)
  res = (ops["base"], ops["stride"], ops["iy"], ops["ix"], ops.get("taps"))
  if wrt == "x":
    table = _feature_grad(*res, ops["wy"], ops["wx"], ops["ct"], dtype=dtype,
                          rows_out=sum(parts))
    if len(parts) == 1:
      return [table]
    first = starts(parts)
    return [table[first[p]:first[p] + parts[p]] for p in want]
  x = ops["x"][0] if len(ops["x"]) == 1 else jnp.concatenate(ops["x"], axis=0)
  if wrt == "ct":
    return [_forward(*res, ops["wy"], ops["wx"], x, dtype=dtype)]
  if wrt == "wy":
    return [_wy_grad(*res, ops["wx"], x, ops["ct"], dtype=dtype)]
  return [_wx_grad(*res, ops["wy"], x, ops["ct"], dtype=dtype)]
