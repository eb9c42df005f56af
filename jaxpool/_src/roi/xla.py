"""ROI pooling on XLA: ``roi_align`` (average or max over the samples, one or several feature
maps) and ``roi_pool``, channels last, from the plans of ``plan.py`` and the primitives of
``form.py`` (and, for ``roi_pool``, a gather whose transpose is the same deterministic sorted
sum).

Every function here takes checked arguments; the public functions (``api.py``) check them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxpool._src.linear import LinearPair
from jaxpool._src.roi import form, primitive
from jaxpool._src.roi.plan import POOL_FLOOR, AlignConfig, PoolConfig, align_plan, pool_bins

F32 = jnp.float32


def tables(maps: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """Each feature map ``(N, H, W, C)`` as a table of pixels ``(N * H * W, C)`` (a reshape, no
  copy)."""
  return tuple(m.reshape(-1, m.shape[-1]) for m in maps)


def flat_table(maps: tuple[jax.Array, ...]) -> jax.Array:
  """The feature maps ``(N, H, W, C)`` as one table of pixels ``(rows, C)``: the levels'
  tables one after the other (``plan.Level.offset``)."""
  flat = tables(maps)
  return flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=0)


def bind_table(wrt: str, *, x, **kw) -> jax.Array:
  """The XLA path's bind (``primitive.bind``) of the levels' tables ``x``, concatenated."""
  return primitive.bind(wrt, x=x[0] if len(x) == 1 else jnp.concatenate(x, axis=0), **kw)


def _align_taps(ops, counts, x):
  """Max mode: the first sample of each bin holding the maximum (a NaN beats every number, the
  first NaN wins), per channel; -1 where the bin has no sample. Not differentiated."""
  ops = {k: lax.stop_gradient(v) for k, v in ops.items()}
  x = lax.stop_gradient(x)
  gy, gx = counts
  K, ph, Sy, _ = ops["iy"].shape
  pw, Sx = ops["ix"].shape[1:3]
  C = x.shape[1]

  def body(s, carry):
    best, arg = carry
    v = form.sample_value(s, ops["base"], ops["stride"], ops["iy"], ops["ix"], ops["wy"],
                          ops["wx"], x)
    real = ((s // Sx < gy) & (s % Sx < gx))[:, None, None, None]
    better = real & ((arg < 0) | (v > best) | (jnp.isnan(v) & ~jnp.isnan(best)))
    return jnp.where(better, v, best), jnp.where(better, s, arg)

  init = form.varying((jnp.zeros((K, ph, pw, C), F32), jnp.full((K, ph, pw, C), -1, jnp.int32)),
                      x, *ops.values(), *counts)
  return lax.fori_loop(0, Sy * Sx, body, init)[1]


def _mean_weights(ops: dict, count: jax.Array) -> dict:
  """The average's plan with ``1 / count`` folded into the y-weights: the form's sum is then
  the mean, in the maps' dtype straight from its float32 sum (no float32 outputs or
  cotangents the size of the outputs in between: the memory of a bfloat16 call), and the
  gradients follow through the product. A count that is a power of two (1, 4, 16, ...) scales
  exactly: the bits of the sum, then the product."""
  # (K,) or (N, K): the leading dims of the weights. Behind a barrier: XLA's simplifier turned
  # the mean's ``y * (1 / count)`` into ``y / count`` in a sharded program only (the last bit
  # of the feature gradient moved), as it does with a division by a broadcast value (plan.py).
  inv = lax.optimization_barrier(1.0 / count)
  return dict(ops, wy=ops["wy"] * inv.reshape(*inv.shape, 1, 1, 1))


def roi_align(maps: tuple[jax.Array, ...], image: jax.Array, coords: jax.Array,
              level: jax.Array, cfg: AlignConfig, bind=bind_table, taps=None) -> jax.Array:
  """``(K, ph, pw, C)`` in the maps' dtype.

  Args:
    maps: the feature maps, ``(N, H_l, W_l, C)`` each (``cfg.levels`` describes them).
    image: ``(K,)`` int32; coords: ``(K, 4)`` float32; level: ``(K,)`` int32.
    bind: how the average's sampled sum is bound, given the levels' tables (``x``, a tuple):
      :func:`bind_table` (the XLA path's primitive on one table), or the GPU kernels'
      primitive (``kernels.py``), which takes them as they are.
    taps: the max mode's selected samples, ``taps(ops, counts, maps)`` (default
      :func:`_align_taps` on the levels' table; the kernels' ``triton_max.taps``).
  """
  if cfg.per_image:
    return _per_image(maps[0], image, coords, level, cfg, bind)
  ops, count, counts, finite = align_plan(image, coords, level, cfg)
  if cfg.mode == "max":
    if taps is None:
      selected = _align_taps(ops, counts, flat_table(maps))
    else:
      selected = taps(ops, counts, maps)
    y = bind("ct", **ops, taps=selected, x=tables(maps), dtype=F32)
  else:
    y = bind("ct", **_mean_weights(ops, count), x=tables(maps), dtype=maps[0].dtype)
  y = jnp.where(finite[:, None, None, None], y, jnp.nan)
  return y.astype(maps[0].dtype)


def _per_image(x, image, coords, level, cfg, bind=bind_table):
  """``cfg.per_image = K``: the plan of every box as in the flat form (the same bits), then the
  batch kept as an axis (``form``'s ``batched`` binds: each image's boxes on its own table), so
  that XLA's partitioner splits the program with a batch-sharded ``x``, with no collective.
  (The GPU kernels' ``bind`` runs them on one device and this form on several: kernels.py.)"""
  N, H, W, C = x.shape
  K = cfg.per_image
  one = dataclasses.replace(cfg, levels=(dataclasses.replace(cfg.levels[0], images=1),))
  own = jnp.where(image >= 0, 0, -1)  # each box's image is its row of the batch
  ops, count, counts, finite = align_plan(own, coords, level, one)
  ops = {k: v.reshape(N, K, *v.shape[1:]) for k, v in ops.items()}
  table = x.reshape(N, H * W, C)
  if cfg.mode == "max":
    taps = jax.vmap(_align_taps)(ops, tuple(c.reshape(N, K) for c in counts), table)
    y = primitive.bind("ct", **ops, taps=taps, x=table, dtype=F32, batched=True)
  else:
    ops = _mean_weights(ops, count.reshape(N, K))
    y = bind("ct", **ops, x=(table,), dtype=x.dtype, batched=True)
  y = y.reshape(N * K, *y.shape[2:])
  y = jnp.where(finite[:, None, None, None], y, jnp.nan)
  return y.astype(x.dtype)


# ------------------------------------------------------------------------------- roi_pool


def _pick(elems: jax.Array, x: jax.Array, *, rows: int) -> jax.Array:
  if x.ndim > 2:  # a mapped axis in front (linear.LinearPair's batching)
    return jax.vmap(functools.partial(_pick, rows=rows))(elems, x)
  return jnp.take(x.reshape(-1), elems, mode="clip")


def _pick_transpose(elems: jax.Array, ct: jax.Array, *, rows: int) -> jax.Array:
  if ct.ndim > 4:
    return jax.vmap(functools.partial(_pick_transpose, rows=rows))(elems, ct)
  C = ct.shape[-1]
  ok = elems >= 0
  vals = jnp.where(ok, ct.astype(F32), 0.0).reshape(-1, 1)
  keys = jnp.where(ok, elems, 0).reshape(-1).astype(jnp.int32)
  out = form.segment_sum_sorted(vals, keys, rows * C)
  return out.reshape(rows, C).astype(ct.dtype)


# ``x.reshape(-1)[elems]`` (-1: none) and its transpose, the deterministic sorted sum.
PICK = LinearPair(
    "roi_pick", _pick, _pick_transpose,
    forward_shape=lambda e, x, *, rows: tuple(e),
    transpose_shape=lambda e, ct, *, rows: (*e[:-4], rows, ct[-1]))


def _pool_argmax(x, bins, base, width):
  """Per element ``(K, ph, pw, C)``: the table row of the bin's first maximum under ``>`` from
  torchvision's start (-FLT_MAX), or -1. Loops over the largest bin's pixels; not
  differentiated."""
  (hs, he), (ws, we) = bins
  x = lax.stop_gradient(x)
  K, ph = hs.shape
  pw = ws.shape[1]
  C = x.shape[1]
  ey = jnp.max(he - hs, initial=0)
  ex = jnp.maximum(jnp.max(we - ws, initial=0), 1)
  rows_h, rows_w = hs[:, :, None], ws[:, None, :]

  def body(t, carry):
    best, arg = carry
    h = rows_h + t // ex
    w = rows_w + t % ex
    inside = (h < he[:, :, None]) & (w < we[:, None, :])
    r = base[:, None, None] + jnp.clip(h, 0, None) * width[:, None, None] + jnp.clip(w, 0, None)
    r = jnp.where(inside, r, 0)
    v = jnp.take(x, r, axis=0, mode="clip").astype(F32)
    better = inside[..., None] & (v > best)
    return jnp.where(better, v, best), jnp.where(better, r[..., None], arg)

  init = form.varying((jnp.full((K, ph, pw, C), POOL_FLOOR, F32),
                       jnp.full((K, ph, pw, C), -1, jnp.int32)), x, hs, he, ws, we, base, width)
  return lax.fori_loop(0, ey * ex, body, init)[1]


def pick(rows, table):
  """``table.reshape(-1)[rows * C + c]`` (-1: none, read as row 0) on XLA: linear in
  ``table``, its transpose the deterministic sorted sum."""
  C = table.shape[1]
  elems = jnp.where(rows >= 0, rows * C + jnp.arange(C, dtype=rows.dtype)[None, None, None], -1)
  return PICK.forward(elems, table, rows=table.shape[0])


def roi_pool(x: jax.Array, image: jax.Array, coords: jax.Array, cfg: PoolConfig, *,
             select=None) -> tuple[jax.Array, jax.Array]:
  """``(y, indices)`` ``(K, ph, pw, C)``: torchvision's max over each integer bin, and the
  flat index ``h * W + w`` of each maximum in its image's plane (-1: none).

  ``select(table, bins, base, ok)`` may give each bin's maxima: ``(rows, values)``, the table
  rows of the maxima (``_pool_argmax``'s) and their values, differentiable in ``table`` as
  :func:`pick` of the rows (the GPU kernels', ``kernels.py``); by default, XLA's."""
  table = flat_table((x,))
  (hs, he), (ws, we), base, width, ok, finite = pool_bins(image, coords, cfg)
  bins = ((hs, he), (ws, we))
  empty = (he <= hs)[:, :, None] | (we <= ws)[:, None, :]
  usable = (ok[:, None, None] & ~empty)[..., None]
  if select is None:
    rows = jnp.where(usable, _pool_argmax(table, bins, base, width), -1)
    picked = pick(rows, table)
  else:
    rows, picked = select(table, bins, base, ok)
    rows = jnp.where(usable, rows, -1)
  fill = jnp.where(usable, POOL_FLOOR, 0.0).astype(x.dtype)
  y = jnp.where(rows >= 0, picked, fill)
  y = jnp.where(finite[:, None, None, None], y, jnp.nan).astype(x.dtype)
  indices = jnp.where(rows >= 0, rows - base[:, None, None, None], -1)
  return y, indices
