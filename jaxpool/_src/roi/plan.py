"""ROI pooling's static configuration and the sampling plans computed from the boxes.

The plans are plain ``jnp`` functions of the box coordinates, so JAX differentiates them: the
box gradient is the derivative of the sample positions (through the corner weights) and follows
from the rules written here (``docs/roi.md``, "Gradients"):

- a sample on a pixel boundary takes the derivative on its right (``floor`` is constant there);
- zero inside torchvision's clamp bands: a position in ``[-1, 0]`` is moved to 0 and one in
  ``[size - 1, size]`` to ``size - 1``; the jumps to zero outside ``[-1, size]`` are ignored;
- zero where ``aligned=False`` raises a region's size to 1;
- the steps of ``ceil(roi / out)`` (the adaptive sample count) are ignored.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
I32 = jnp.int32
MODES = ("avg", "max")
# The lowest value roi_pool's maximum starts from (torchvision's -FLT_MAX): an element equal to
# it, -inf or NaN never wins.
POOL_FLOOR = float(-jnp.finfo(F32).max)


@dataclasses.dataclass(frozen=True)
class Level:
  """One feature map of the flat table: ``images`` x ``height`` x ``width`` pixels from row
  ``offset``, sampled at ``scale`` (box coordinates times ``scale`` are map coordinates)."""

  images: int
  height: int
  width: int
  scale: float
  offset: int


@dataclasses.dataclass(frozen=True)
class AlignConfig:
  """The static part of a ``roi_align`` call (hashable: the jit's static argument).

  ``samples``: the sample grid per bin ``(Sy, Sx)`` that the arrays hold: ``sampling_ratio``
  when it is positive, else the ``max_samples`` bound (the per-box count
  ``min(ceil(roi / out), bound)`` is masked inside it).

  ``per_image``: 0, or ``K`` when the boxes come ``K`` per image in order (``roi_align``'s
  ``(N, K, 4)`` form, one level): box ``r`` belongs to image ``r // K`` or is padding (image
  index -1). A backend may ignore it (the image indices say the same); the XLA path then keeps
  the batch as an axis of its own, which a batch-sharded mesh splits.
  """

  output_size: tuple[int, int]
  levels: tuple[Level, ...]
  sampling_ratio: int
  samples: tuple[int, int]
  aligned: bool
  mode: str
  per_image: int = 0


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """The static part of a ``roi_pool`` call."""

  output_size: tuple[int, int]
  level: Level


def _table(levels, attr, dtype, level):
  values = jnp.asarray([getattr(lv, attr) for lv in levels], dtype)
  return values[level]


def _box_frame(levels, image, coords, level):
  """Per box: the scale, map size, first row in the table and whether the box is usable."""
  scale = _table(levels, "scale", F32, level)
  height = _table(levels, "height", I32, level)
  width = _table(levels, "width", I32, level)
  images = _table(levels, "images", I32, level)
  offset = _table(levels, "offset", I32, level)
  finite = jnp.isfinite(coords).all(axis=-1)
  ok = (image >= 0) & (image < images) & finite
  img = jnp.clip(image, 0, images - 1)
  base = offset + img * height * width
  return scale, height, width, base, ok, finite


def exact_quotient(a: jax.Array, b) -> jax.Array:
  """``a / b`` as a division in every program: the divisor an array of the quotient's shape,
  mapped wherever ``a`` is under ``vmap`` (a select on ``a``), behind a barrier. XLA rewrites a
  division by a constant or a broadcast value into a product with its inverse in some programs
  only, so the last bit of a box gradient moved with the mesh. (A quotient that meets ``floor``
  or ``ceil`` takes :func:`divide_by_count`.)"""
  b = jnp.asarray(b, F32)
  return a / jax.lax.optimization_barrier(jnp.where(jnp.isnan(a), b, b))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def divide_by_count(a: jax.Array, n: int) -> jax.Array:
  """``a / n`` (float32 ``a``, a positive Python int ``n``) rounded once to nearest even, as
  torchvision's kernels divide, on every backend: a GPU's float32 division under XLA need not
  be correctly rounded, and XLA turns a division by a constant into a product with its
  inverse. It matters where a whole quotient meets ``floor`` or ``ceil`` (roi_pool's bin
  edges, ROI align's adaptive sample count: 11 / 7 * 7 is 11 in float32, 11 * (1 / 7) * 7 is
  not). Integer long division of ``a``'s 24-bit significand by ``n`` (below 2**24): exact."""
  n = int(n)
  if n & (n - 1) == 0:  # (a power of two: a product with its inverse is exact)
    return a * (1.0 / n)
  if n >= 2**24:  # (past the long division's int32 range; no grid is that large)
    return exact_quotient(a, n)
  extra = n.bit_length() + 1  # (quotient bits past the significand's: 25 or 26 in all)
  m, e = jnp.frexp(jnp.abs(a))
  sig = (m * 2.0**24).astype(I32)  # |a| = sig * 2**(e - 24), sig < 2**24
  q, r = sig // n, sig % n
  for _ in range(extra):  # long division, one bit a step: q = floor(sig * 2**extra / n)
    r = 2 * r
    bit = r >= n
    q, r = 2 * q + bit.astype(I32), jnp.where(bit, r - n, r)
  drop = (32 - jax.lax.clz(q)) - 24  # bits past float32's 24 (1 or 2; q >= 2**24 if sig > 0)
  drop = jnp.maximum(drop, 0)
  half = jnp.left_shift(jnp.int32(1), jnp.maximum(drop - 1, 0))
  low = q & (jnp.left_shift(jnp.int32(1), drop) - 1)
  top = jnp.right_shift(q, drop)
  up = (drop > 0) & ((low > half) | ((low == half) & ((r != 0) | (top & 1 == 1))))
  out = jnp.ldexp((top + up.astype(I32)).astype(F32), e - 24 - extra + drop)
  out = jnp.copysign(out, a)
  return jnp.where(jnp.isfinite(a), out, a / n)


@divide_by_count.defjvp
def _divide_by_count_jvp(n, primals, tangents):
  (a,), (t,) = primals, tangents
  return divide_by_count(a, n), t / n


def _axis(start, roi, n_out, cap, size, ok, ratio):
  """One axis of the sample grid: corner indices (-1 for a dead sample: padding, outside
  ``[-1, size]`` or an unusable box; form.py reads such a sample as nothing) and weights
  ``(K, n_out, cap, 2)``, and the per-box sample count ``(K,)``."""
  bin_size = divide_by_count(roi, n_out)
  K = start.shape[0]
  if ratio > 0:
    count = jnp.full((K,), ratio, I32)
  else:
    need = jnp.ceil(jax.lax.stop_gradient(bin_size))
    need = jnp.where(jnp.isfinite(need), need, 0.0)
    count = jnp.clip(need, 0, cap).astype(I32)
  gsize = jnp.maximum(count, 1).astype(F32)[:, None, None]
  i = jnp.arange(n_out, dtype=F32)[None, :, None]
  s = jnp.arange(cap, dtype=F32)[None, None, :]
  b = bin_size[:, None, None]
  step = (s + 0.5) * b
  pos = (start[:, None, None] + i * b) + exact_quotient(step, gsize)
  sz = size.astype(F32)[:, None, None]
  live = ((jnp.arange(cap)[None, None, :] < count[:, None, None]) & ok[:, None, None]
          & ~((pos < -1.0) | (pos > sz)))
  p = jnp.where(pos <= 0, 0.0, pos)
  low = jnp.floor(jax.lax.stop_gradient(p))
  at_end = low >= sz - 1
  low = jnp.where(at_end, sz - 1, low)
  p = jnp.where(at_end, sz - 1, p)
  frac = p - low
  w = jnp.stack([1.0 - frac, frac], axis=-1)
  w = jnp.where(live[..., None], w, 0.0)
  top = (size - 1)[:, None, None]
  low_i = jnp.clip(jnp.where(jnp.isfinite(low), low, 0.0), 0, top.astype(F32)).astype(I32)
  high_i = jnp.minimum(low_i + 1, top)
  idx = jnp.where(live[..., None], jnp.stack([low_i, high_i], axis=-1), -1)  # -1: dead
  return idx, w, count


def align_plan(image: jax.Array, coords: jax.Array, level: jax.Array, cfg: AlignConfig):
  """The operands of the sampled-sum form for every box, its sample count and usability.

  Args:
    image: ``(K,)`` int32 image index of each box.
    coords: ``(K, 4)`` float32 ``(x1, y1, x2, y2)`` in input-image coordinates.
    level: ``(K,)`` int32 index into ``cfg.levels``.

  Returns:
    ``dict(base, stride, iy, ix, wy, wx)`` (``primitive.bind``'s operands), the per-box sample count
    ``(K,)`` float32 (at least 1), and ``finite`` ``(K,)`` (False: a NaN or infinite coordinate).
  """
  scale, height, width, base, ok, finite = _box_frame(cfg.levels, image, coords, level)
  shift = 0.5 if cfg.aligned else 0.0
  x1 = coords[:, 0] * scale - shift
  y1 = coords[:, 1] * scale - shift
  x2 = coords[:, 2] * scale - shift
  y2 = coords[:, 3] * scale - shift
  roi_w, roi_h = x2 - x1, y2 - y1
  if not cfg.aligned:  # torchvision's max(roi, 1): zero gradient where it binds
    roi_w = jnp.where(roi_w < 1.0, 1.0, roi_w)
    roi_h = jnp.where(roi_h < 1.0, 1.0, roi_h)
  (ph, pw), (sy, sx) = cfg.output_size, cfg.samples
  iy, wy, gy = _axis(y1, roi_h, ph, sy, height, ok, cfg.sampling_ratio)
  ix, wx, gx = _axis(x1, roi_w, pw, sx, width, ok, cfg.sampling_ratio)
  count = jnp.maximum(gy * gx, 1).astype(F32)
  ops = dict(base=base, stride=width, iy=iy, ix=ix, wy=wy, wx=wx)
  return ops, count, (gy, gx), finite


def _round_half_away(v):
  """C's ``round``: halves away from zero (``jnp.round`` rounds them to even)."""
  return jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5)


def pool_bins(image: jax.Array, coords: jax.Array, cfg: PoolConfig):
  """torchvision's ``roi_pool`` bins: ``(hstart, hend)`` ``(K, ph)``, ``(wstart, wend)``
  ``(K, pw)`` (clamped to the map), the first row of each box's image, usability, finiteness."""
  lv = cfg.level
  level = jnp.zeros(image.shape, I32)
  scale, height, width, base, ok, finite = _box_frame((lv,), image, coords, level)
  limit = float(2**30)
  c = jnp.clip(jnp.where(finite[:, None], coords, 0.0) * scale[:, None], -limit, limit)
  c = _round_half_away(c).astype(I32)
  sw, sh, ew, eh = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
  roi_w = jnp.maximum(ew - sw + 1, 1)
  roi_h = jnp.maximum(eh - sh + 1, 1)

  def edges(start, roi, n_out, size):
    b = divide_by_count(roi.astype(F32), n_out)[:, None]
    i = jnp.arange(n_out, dtype=F32)[None, :]
    lo = jnp.floor(i * b).astype(I32) + start[:, None]
    hi = jnp.ceil((i + 1) * b).astype(I32) + start[:, None]
    return (jnp.clip(lo, 0, size[:, None]), jnp.clip(hi, 0, size[:, None]))

  (ph, pw) = cfg.output_size
  hs, he = edges(sh, roi_h, ph, height)
  ws, we = edges(sw, roi_w, pw, width)
  return (hs, he), (ws, we), base, width, ok, finite
