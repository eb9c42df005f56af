"""An independent NumPy reference for ROI pooling (docs/roi.md): plain loops over boxes, bins and
samples, written from torchvision's kernels' documented arithmetic, sharing no code with jaxpool.

Positions are computed in float32 by default (``pos_dtype``), as torchvision's float kernels
compute them, so that samples fall on the same side of every pixel boundary; values and sums are
float64. ``pos_dtype=np.float64`` gives a smooth version for finite differences.

Conventions (the contract):
  * roi_align: torchvision's ``roi_align`` (``aligned`` shifts by half a pixel; without it the
    region is at least 1x1); ``sampling_ratio <= 0``: ``ceil(roi / out)`` samples per axis,
    capped at ``max_samples``; a sample outside ``[-1, size]`` is 0, one in ``[-1, 0]`` reads
    pixel 0, one past ``size - 1`` reads the last pixel; the mean over ``max(gy * gx, 1)``
    samples. ``mode="max"``: the maximum over the samples (NaN wins, the first NaN, ties to the
    first in row-major sample order), 0 without samples.
  * box gradient: the derivative of the sample positions (right-sided at integer positions,
    zero in the clamp bands and where the region is raised to 1, the count's steps ignored).
  * roi_pool: torchvision's rounding (half away from zero), bins ``floor(i*b)..ceil((i+1)*b)``
    offset and clamped, the maximum under ``>`` from -FLT_MAX; an empty bin gives 0, index -1.
"""

from __future__ import annotations

import math

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)


def _pair(v):
  return (v, v) if isinstance(v, int) else tuple(v)


def _rows(boxes):
  """(K, 5) rows from a (K, 5) array or a list of (K_i, 4) arrays."""
  if isinstance(boxes, (list, tuple)):
    rows = [np.concatenate([np.full((len(b), 1), i), np.asarray(b, np.float64).reshape(-1, 4)],
                           axis=1) for i, b in enumerate(boxes)]
    return np.concatenate(rows) if rows else np.zeros((0, 5))
  return np.asarray(boxes, np.float64).reshape(-1, 5)


def _grid(start, roi, n_out, ratio, cap, f):
  """Sample positions of one axis: a list per bin of (position, d pos / d start, d pos / d roi),
  and the sample count."""
  bin_size = f(roi) / f(n_out)
  if ratio > 0:
    g = ratio
  else:
    g = int(math.ceil(bin_size)) if math.isfinite(bin_size) else 0
    g = max(0, min(g, cap))
  out = []
  for i in range(n_out):
    samples = []
    for s in range(g):
      pos = f(f(start) + f(i) * bin_size) + f(f(s + 0.5) * bin_size) / f(g)
      dpos_droi = (i + (s + 0.5) / g) / n_out
      samples.append((float(pos), 1.0, dpos_droi))
    out.append(samples)
  return out, g


def _bilinear(plane, y, x):
  """torchvision's bilinear_interpolate on one (H, W, C) plane: value (C,), d/dy, d/dx."""
  H, W, C = plane.shape
  zero = np.zeros(C)
  if y < -1.0 or y > H or x < -1.0 or x > W:
    return zero, zero, zero
  dy_on = dx_on = True
  if y <= 0:
    y, dy_on = 0.0, False
  if x <= 0:
    x, dx_on = 0.0, False
  yl = int(math.floor(y))
  xl = int(math.floor(x))
  if yl >= H - 1:
    yl = yh = H - 1
    y, dy_on = float(yl), False
  else:
    yh = yl + 1
  if xl >= W - 1:
    xl = xh = W - 1
    x, dx_on = float(xl), False
  else:
    xh = xl + 1
  ly, lx = y - yl, x - xl
  hy, hx = 1.0 - ly, 1.0 - lx
  a, b, c, d = plane[yl, xl], plane[yl, xh], plane[yh, xl], plane[yh, xh]
  value = hy * hx * a + hy * lx * b + ly * hx * c + ly * lx * d
  dvy = (hx * (c - a) + lx * (d - b)) if dy_on else zero
  dvx = (hy * (b - a) + ly * (d - c)) if dx_on else zero
  corners = [((yl, xl), hy * hx), ((yl, xh), hy * lx), ((yh, xl), ly * hx), ((yh, xh), ly * lx)]
  return value, dvy, dvx, corners


def roi_align(x, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False,
              mode="avg", max_samples=None, dy=None, pos_dtype=np.float32):
  """``y`` (K, ph, pw, C) float64 for ``x`` (N, H, W, C); with ``dy``, also ``(dx, dboxes)``
  (``dboxes`` (K, 4), the coordinates' gradient)."""
  x = np.asarray(x, np.float64)
  rows = _rows(boxes)
  N, H, W, C = x.shape
  ph, pw = _pair(output_size)
  if max_samples is None:
    cap = (-(-(H + 1) // ph), -(-(W + 1) // pw))
  else:
    cap = _pair(max_samples)
  f = pos_dtype
  y = np.zeros((len(rows), ph, pw, C))
  dx = np.zeros_like(x)
  dboxes = np.zeros((len(rows), 4))
  for k, (n, x1, y1, x2, y2) in enumerate(rows):
    n = int(n)
    off = f(0.5) if aligned else f(0.0)
    sx, sy = f(f(x1) * f(spatial_scale)) - off, f(f(y1) * f(spatial_scale)) - off
    ex, ey = f(f(x2) * f(spatial_scale)) - off, f(f(y2) * f(spatial_scale)) - off
    rw, rh = f(ex - sx), f(ey - sy)
    w_clamped = h_clamped = False
    if not aligned:
      if rw < 1:
        rw, w_clamped = f(1.0), True
      if rh < 1:
        rh, h_clamped = f(1.0), True
    ys, gy = _grid(sy, rh, ph, sampling_ratio, cap[0], f)
    xs, gx = _grid(sx, rw, pw, sampling_ratio, cap[1], f)
    count = max(gy * gx, 1)
    for i in range(ph):
      for j in range(pw):
        values, parts = [], []
        for (py, dsy, dry) in ys[i]:
          for (px, dsx, drx) in xs[j]:
            out = _bilinear(x[n], py, px)
            values.append(out[0])
            parts.append((out, dsy, dry, dsx, drx))
        if mode == "avg":
          y[k, i, j] = sum(values, np.zeros(C)) / count
          picks = [(p, np.full(C, 1.0 / count)) for p in parts]
        else:
          best = np.zeros(C)
          which = np.full(C, -1)
          for s, v in enumerate(values):
            for c in range(C):
              b = best[c]
              if which[c] < 0 or v[c] > b or (np.isnan(v[c]) and not np.isnan(b)):
                best[c], which[c] = v[c], s
          y[k, i, j] = best
          picks = [(p, (which == s).astype(np.float64)) for s, p in enumerate(parts)]
        if dy is None:
          continue
        g = np.asarray(dy[k, i, j], np.float64)
        for (out, dsy, dry, dsx, drx), wgt in picks:
          if len(out) == 3:
            continue  # outside the map: zero value, no gradient
          _, dvy, dvx, corners = out
          for (r, c), cw in corners:
            dx[n, r, c] += g * wgt * cw
          ty = float(np.sum(g * wgt * dvy)) * spatial_scale
          tx = float(np.sum(g * wgt * dvx)) * spatial_scale
          # y = start + roi * t, start = y1 * s - off, roi = (y2 - y1) * s (unless clamped)
          dy1 = dsy - (0.0 if h_clamped else dry)
          dy2 = 0.0 if h_clamped else dry
          dx1 = dsx - (0.0 if w_clamped else drx)
          dx2 = 0.0 if w_clamped else drx
          dboxes[k] += [tx * dx1, ty * dy1, tx * dx2, ty * dy2]
  if dy is None:
    return y
  return y, dx, dboxes


def _round(v):
  return math.floor(v + 0.5) if v >= 0 else -math.floor(-v + 0.5)


def roi_pool(x, boxes, output_size, spatial_scale=1.0, dy=None):
  """``(y, indices)`` (K, ph, pw, C); with ``dy`` also ``dx``."""
  x = np.asarray(x, np.float64)
  rows = _rows(boxes)
  N, H, W, C = x.shape
  ph, pw = _pair(output_size)
  f = np.float32
  y = np.zeros((len(rows), ph, pw, C))
  idx = np.full((len(rows), ph, pw, C), -1)
  dx = np.zeros_like(x)
  for k, (n, x1, y1, x2, y2) in enumerate(rows):
    n = int(n)
    s = f(spatial_scale)
    sw, sh = _round(f(f(x1) * s)), _round(f(f(y1) * s))
    ew, eh = _round(f(f(x2) * s)), _round(f(f(y2) * s))
    rw, rh = max(ew - sw + 1, 1), max(eh - sh + 1, 1)
    bh, bw = f(rh) / f(ph), f(rw) / f(pw)
    for i in range(ph):
      for j in range(pw):
        hs = min(max(int(math.floor(f(i) * bh)) + sh, 0), H)
        he = min(max(int(math.ceil(f(i + 1) * bh)) + sh, 0), H)
        ws = min(max(int(math.floor(f(j) * bw)) + sw, 0), W)
        we = min(max(int(math.ceil(f(j + 1) * bw)) + sw, 0), W)
        empty = he <= hs or we <= ws
        for c in range(C):
          best, arg = (0.0, -1) if empty else (-FLT_MAX, -1)
          for h in range(hs, he):
            for w in range(ws, we):
              if x[n, h, w, c] > best:
                best, arg = x[n, h, w, c], h * W + w
          y[k, i, j, c] = best
          idx[k, i, j, c] = arg
          if dy is not None and arg >= 0:
            dx[n, arg // W, arg % W, c] += dy[k, i, j, c]
  if dy is None:
    return y, idx
  return y, idx, dx


def fpn_levels(boxes_xyxy, scales, canonical_scale=224.0, canonical_level=4, eps=1e-6):
  """torchvision's LevelMapper, in float32: the level index of each box."""
  k_min = int(round(-math.log2(scales[0])))
  k_max = int(round(-math.log2(scales[-1])))
  out = []
  for x1, y1, x2, y2 in np.asarray(boxes_xyxy, np.float32):
    area = np.float32((x2 - x1) * (y2 - y1))
    lvl = np.floor(np.float32(canonical_level) + np.log2(np.sqrt(area) / np.float32(
        canonical_scale)) + np.float32(eps))
    lvl = k_min if np.isnan(lvl) else min(max(lvl, k_min), k_max)
    out.append(int(lvl) - k_min)
  return out
