"""An independent NumPy reference for jaxpool's functional API (the contract in docs/semantics.md).

Plain loops over output positions and window taps, in float64 (int64 for integer max), vectorised
only over the rows ``(*batch, C)`` that are never pooled. It shares no code with the library: the
output-size formula, the padding resolution and the divisor rules are written here from the
contract (and PyTorch's / ONNX's / DirectML's documented rules), not imported.

Conventions, as docs/semantics.md states them:
  * max: padding never wins; ties -> lowest row-major tap; NaN beats every number, the first NaN
    wins; +0.0 beats -0.0 (as ``lax.max``); a window whose real elements are all -inf picks its
    first real element; a window with no real element outputs -inf (``iinfo.min`` for ints),
    index -1 and takes no gradient.
  * avg: PyTorch divisors (count_include_pad counts taps inside the user-padded input, never the
    ceil-mode overhang; otherwise real taps; divisor_override replaces both); empty window -> 0.
  * Lp: ``(sum |x|^p)^(1/p)`` over real taps; gradient ``dy sign(x) |x|^(p-1) / y^(p-1)``, 0 where
    ``y == 0``.
  * min: max's rules mirrored, written out on their own (not as a negated max): ties -> lowest
    tap; NaN is smaller than every number, the first NaN wins; -0.0 beats +0.0 (as ``lax.min``);
    a window with no real element outputs +inf (``iinfo.max``, True for bool), index -1.
  * mask (bool, broadcast to x's shape; True = real): a masked element is treated as absent from
    every window: it never wins, takes no gradient, is not summed and not counted in a divisor
    (with count_include_pad the divisor is the unmasked real taps plus the padding taps).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

# ------------------------------------------------------------------------------ configuration


def _per_dim(value, n, default):
  if value is None:
    return (default,) * n
  return tuple(int(v) for v in value)


def resolve_padding(padding, in_spatial, window, strides, dilation):
  """``(lo, hi)`` per spatial dim, from any of the accepted padding forms."""
  n = len(in_spatial)
  if isinstance(padding, str):
    if padding == "VALID":
      return [(0, 0)] * n
    pads = []
    for size, k, s, d in zip(in_spatial, window, strides, dilation, strict=True):
      span = d * (k - 1) + 1
      out = (size + s - 1) // s  # ONNX SAME_*: out = ceil(L / s)
      total = max(0, (out - 1) * s + span - size)
      if padding == "SAME":  # SAME_UPPER: the odd element goes at the end
        pads.append((total // 2, total - total // 2))
      elif padding == "SAME_LOWER":
        pads.append((total - total // 2, total // 2))
      else:
        raise ValueError(padding)
    return pads
  if isinstance(padding, int):
    return [(padding, padding)] * n
  return [(int(lo), int(hi)) for lo, hi in padding]


def output_size(size, k, s, d, lo, hi, ceil_mode):
  """PyTorch's ``pooling_output_shape``, with asymmetric padding."""
  numer = size + lo + hi - d * (k - 1) - 1
  if ceil_mode:
    out = -(-numer // s) + 1
    if (out - 1) * s >= size + lo:  # the last window must start inside the input or lo padding
      out -= 1
  else:
    out = numer // s + 1
  return out


class Config:
  """One pooling configuration against one input shape (the reference's own arithmetic)."""

  def __init__(self, x_shape, window_shape, strides=None, padding="VALID", dilation=None,
               ceil_mode=False, data_format="channels_last"):
    n = len(window_shape)
    self.n = n
    self.x_shape = tuple(x_shape)
    self.channels_last = data_format == "channels_last"
    if self.channels_last:
      self.in_spatial = self.x_shape[len(x_shape) - 1 - n:-1]
    else:
      self.in_spatial = self.x_shape[len(x_shape) - n:]
    self.window = tuple(int(k) for k in window_shape)
    self.strides = _per_dim(strides, n, 1)
    self.dilation = _per_dim(dilation, n, 1)
    self.pads = resolve_padding(padding, self.in_spatial, self.window, self.strides,
                                self.dilation)
    self.out_spatial = tuple(
        output_size(size, k, s, d, lo, hi, ceil_mode)
        for size, k, s, d, (lo, hi) in zip(self.in_spatial, self.window, self.strides,
                                           self.dilation, self.pads, strict=True))

  @property
  def out_shape(self):
    shape = list(self.x_shape)
    n = self.n
    axes = range(len(shape) - 1 - n, len(shape) - 1) if self.channels_last else range(
        len(shape) - n, len(shape))
    for a, o in zip(axes, self.out_spatial, strict=True):
      shape[a] = o
    return tuple(shape)

  # rows: every (*batch, C) combination, channels first, spatial flattened
  def to_rows(self, a, spatial):
    n = self.n
    a = np.asarray(a)
    if self.channels_last:
      a = np.moveaxis(a, -1, a.ndim - 1 - n)
    lead = a.shape[:a.ndim - n]
    rows = int(np.prod(lead, dtype=np.int64))
    return a.reshape(rows, int(np.prod(spatial, dtype=np.int64))), lead

  def from_rows(self, rows, lead, spatial):
    a = rows.reshape(*lead, *spatial)
    if self.channels_last:
      a = np.moveaxis(a, a.ndim - 1 - self.n, -1)
    return a

  def windows(self):
    """For each output position (row-major): its taps, in row-major tap order.

    Each tap is ``(kind, flat)``: kind ``"real"`` (``flat`` = row-major index in the input's
    spatial plane), ``"pad"`` (inside the user's padding) or ``"overhang"`` (ceil-mode overhang).
    """
    out = []
    for o in itertools.product(*[range(v) for v in self.out_spatial]):
      taps = []
      for t in itertools.product(*[range(k) for k in self.window]):
        pos = [oi * s + ti * d - lo for oi, ti, s, d, (lo, _) in
               zip(o, t, self.strides, self.dilation, self.pads, strict=True)]
        if all(0 <= p < size for p, size in zip(pos, self.in_spatial, strict=True)):
          flat = 0
          for p, size in zip(pos, self.in_spatial, strict=True):
            flat = flat * size + p
          taps.append(("real", flat))
        elif all(-lo <= p < size + hi for p, size, (lo, hi) in zip(pos, self.in_spatial,
                                                                    self.pads, strict=True)):
          taps.append(("pad", None))
        else:
          taps.append(("overhang", None))
      out.append(taps)
    return out


# ------------------------------------------------------------------------------ max


def _lowest(dtype):
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return 0
  if np.issubdtype(dtype, np.integer):
    return np.iinfo(dtype).min
  return -np.inf


def _highest(dtype):
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return 1
  if np.issubdtype(dtype, np.integer):
    return np.iinfo(dtype).max
  return np.inf


def _wide(x):
  x = np.asarray(x)
  if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
    return x.astype(np.int64)
  return x.astype(np.float64)


def _mask_rows(cfg, mask):
  """The mask broadcast to x's shape, as rows (all True for None)."""
  full = np.ones(cfg.x_shape, bool) if mask is None else np.broadcast_to(
      np.asarray(mask, bool), cfg.x_shape)
  return cfg.to_rows(full, cfg.in_spatial)[0]


def max_pool_with_indices(x, window_shape, strides=None, padding="VALID", *, dilation=None,
                          ceil_mode=False, data_format="channels_last", mask=None):
  """Returns ``(y, indices)``: ``y`` in ``x.dtype``, ``indices`` int32 (PyTorch convention)."""
  y, idx, _ = _max_winners(x, window_shape, strides, padding, dilation, ceil_mode, data_format,
                           mask)
  return y, idx


def max_pool_with_taps(x, window_shape, strides=None, padding="VALID", *, dilation=None,
                       ceil_mode=False, data_format="channels_last", mask=None, activation=None):
  """Returns ``(y, taps)``: ``taps`` int64, the winner's position in the window's row-major
  tap list (padding taps counted), -1 for no winner; with ``activation="relu"``, ``y`` is
  ``max(y, 0)`` (NaN stays NaN) and a window whose maximum is not positive gets -1."""
  y, _, taps = _max_winners(x, window_shape, strides, padding, dilation, ceil_mode, data_format,
                            mask)
  if activation == "relu":
    wide = y.astype(np.float64)
    taps = np.where(wide > 0, taps, -1)
    y = np.where((wide > 0) | np.isnan(wide), y, np.zeros((), y.dtype))
  return y, taps


def _max_winners(x, window_shape, strides, padding, dilation, ceil_mode, data_format, mask):
  """``(y, flat indices, taps)`` of the max pool."""
  x = np.asarray(x)
  cfg = Config(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  rows, lead = cfg.to_rows(_wide(x), cfg.in_spatial)
  live = _mask_rows(cfg, mask)
  is_float = np.issubdtype(rows.dtype, np.floating)
  nout = math.prod(cfg.out_spatial)
  y = np.full((rows.shape[0], nout), _lowest(x.dtype), rows.dtype)
  idx = np.full((rows.shape[0], nout), -1, np.int64)
  tap = np.full((rows.shape[0], nout), -1, np.int64)
  for j, taps in enumerate(cfg.windows()):
    best = np.full(rows.shape[0], _lowest(x.dtype), rows.dtype)
    arg = np.full(rows.shape[0], -1, np.int64)
    where = np.full(rows.shape[0], -1, np.int64)
    for t, (kind, flat) in enumerate(taps):
      if kind != "real":
        continue
      v = rows[:, flat]
      take = arg < 0
      if is_float:
        best_nan = np.isnan(best)
        # +0.0 beats -0.0 (as lax.max does): the value at the argmax is the forward's value.
        zero_up = (v == best) & np.signbit(best) & ~np.signbit(v)
        take |= ~best_nan & (np.isnan(v) | (v > best) | zero_up)
      else:
        take |= v > best
      take &= live[:, flat]
      best = np.where(take, v, best)
      arg = np.where(take, flat, arg)
      where = np.where(take, t, where)
    y[:, j] = best
    idx[:, j] = arg
    tap[:, j] = where
  y = cfg.from_rows(y, lead, cfg.out_spatial).astype(x.dtype)
  idx = cfg.from_rows(idx, lead, cfg.out_spatial).astype(np.int32)
  tap = cfg.from_rows(tap, lead, cfg.out_spatial)
  return y, idx, tap


def min_pool_with_indices(x, window_shape, strides=None, padding="VALID", *, dilation=None,
                          ceil_mode=False, data_format="channels_last", mask=None):
  """Min pooling: ``(y, indices)``, the rules written for the minimum (not a negated max)."""
  x = np.asarray(x)
  cfg = Config(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  rows, lead = cfg.to_rows(_wide(x), cfg.in_spatial)
  live = _mask_rows(cfg, mask)
  is_float = np.issubdtype(rows.dtype, np.floating)
  nout = math.prod(cfg.out_spatial)
  y = np.full((rows.shape[0], nout), _highest(x.dtype), rows.dtype)
  idx = np.full((rows.shape[0], nout), -1, np.int64)
  for j, taps in enumerate(cfg.windows()):
    best = np.full(rows.shape[0], _highest(x.dtype), rows.dtype)
    arg = np.full(rows.shape[0], -1, np.int64)
    for kind, flat in taps:
      if kind != "real":
        continue
      v = rows[:, flat]
      take = (arg < 0) & live[:, flat]
      if is_float:
        # A NaN is smaller than every number and the first one stays; -0.0 beats +0.0.
        zero_down = (v == best) & np.signbit(v) & ~np.signbit(best)
        smaller = ~np.isnan(best) & (np.isnan(v) | (v < best) | zero_down)
      else:
        smaller = v < best
      take |= (arg >= 0) & live[:, flat] & smaller
      best = np.where(take, v, best)
      arg = np.where(take, flat, arg)
    y[:, j] = best
    idx[:, j] = arg
  y = cfg.from_rows(y, lead, cfg.out_spatial).astype(x.dtype)
  idx = cfg.from_rows(idx, lead, cfg.out_spatial).astype(np.int32)
  return y, idx


def min_pool(x, window_shape, strides=None, padding="VALID", **kw):
  return min_pool_with_indices(x, window_shape, strides, padding, **kw)[0]


def max_pool(x, window_shape, strides=None, padding="VALID", **kw):
  return max_pool_with_indices(x, window_shape, strides, padding, **kw)[0]


def max_pool_grad(x, dy, window_shape, strides=None, padding="VALID", *, dilation=None,
                  ceil_mode=False, data_format="channels_last", mask=None, minimum=False):
  """DirectML's MaxPoolGrad: scatter-add each window's ``dy`` to its argmax (float64 sums);
  with ``minimum``, to the min pool's winner."""
  x = np.asarray(x)
  cfg = Config(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  pool = min_pool_with_indices if minimum else max_pool_with_indices
  _, idx = pool(x, window_shape, strides, padding, dilation=dilation, ceil_mode=ceil_mode,
                data_format=data_format, mask=mask)
  irows, lead = cfg.to_rows(idx, cfg.out_spatial)
  dyrows, _ = cfg.to_rows(np.asarray(dy).astype(np.float64), cfg.out_spatial)
  dx = np.zeros((irows.shape[0], math.prod(cfg.in_spatial)), np.float64)
  for r in range(irows.shape[0]):
    for j in range(irows.shape[1]):
      if irows[r, j] >= 0:
        dx[r, irows[r, j]] += dyrows[r, j]
  return cfg.from_rows(dx, lead, cfg.in_spatial)


def max_unpool(y, indices, output_size, *, data_format="channels_last"):
  """PyTorch's max_unpool: ``out[..., indices] = y``, zeros elsewhere; -1 indices dropped."""
  y = np.asarray(y)
  n = len(output_size)
  cl = data_format == "channels_last"
  yy = np.moveaxis(y, -1, y.ndim - 1 - n) if cl else y
  ii = np.moveaxis(np.asarray(indices), -1, y.ndim - 1 - n) if cl else np.asarray(indices)
  lead = yy.shape[:yy.ndim - n]
  yr = yy.reshape(-1, math.prod(yy.shape[yy.ndim - n:]))
  ir = ii.reshape(yr.shape)
  out = np.zeros((yr.shape[0], math.prod(output_size)), y.dtype)
  for r in range(yr.shape[0]):
    for j in range(yr.shape[1]):
      if ir[r, j] >= 0:
        out[r, ir[r, j]] = yr[r, j]
  out = out.reshape(*lead, *output_size)
  return np.moveaxis(out, out.ndim - 1 - n, -1) if cl else out


# ------------------------------------------------------------------------------ average


def _divisors(cfg, count_include_pad, divisor_override, live):
  """One divisor per (row, window); ``live``: the mask rows (True = real element)."""
  nrows = live.shape[0]
  divs = []
  for taps in cfg.windows():
    if divisor_override is not None:
      divs.append(np.full(nrows, float(divisor_override)))
      continue
    count = np.zeros(nrows)
    for kind, flat in taps:
      if kind == "real":
        count += live[:, flat]
      elif kind == "pad" and count_include_pad:
        count += 1
    divs.append(count)
  return divs


def avg_pool(x, window_shape, strides=None, padding="VALID", *, dilation=None, ceil_mode=False,
             count_include_pad=True, divisor_override=None, data_format="channels_last",
             mask=None):
  """Average pooling in float64 (complex128 for complex x; the caller casts)."""
  x = np.asarray(x)
  cfg = Config(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  wide = np.complex128 if np.iscomplexobj(x) else np.float64
  rows, lead = cfg.to_rows(x.astype(wide), cfg.in_spatial)
  live = _mask_rows(cfg, mask)
  divs = _divisors(cfg, count_include_pad, divisor_override, live)
  y = np.zeros((rows.shape[0], len(divs)), wide)
  for j, taps in enumerate(cfg.windows()):
    total = np.zeros(rows.shape[0], wide)
    for kind, flat in taps:
      if kind == "real":
        total += np.where(live[:, flat], rows[:, flat], 0)
    ok = divs[j] > 0  # no real (unmasked) element, no padding counted: 0
    y[:, j] = np.where(ok, total / np.where(ok, divs[j], 1), 0)
  return cfg.from_rows(y, lead, cfg.out_spatial)


def avg_pool_grad(dy, input_shape, window_shape, strides=None, padding="VALID", *, dilation=None,
                  ceil_mode=False, count_include_pad=True, divisor_override=None,
                  data_format="channels_last", mask=None):
  cfg = Config(input_shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  dyrows, lead = cfg.to_rows(np.asarray(dy).astype(np.float64), cfg.out_spatial)
  live = _mask_rows(cfg, mask)
  divs = _divisors(cfg, count_include_pad, divisor_override, live)
  dx = np.zeros((dyrows.shape[0], math.prod(cfg.in_spatial)))
  for j, taps in enumerate(cfg.windows()):
    for kind, flat in taps:
      if kind == "real":
        dx[:, flat] += np.where(live[:, flat], dyrows[:, j] / np.where(divs[j] > 0, divs[j], 1),
                                0)
  return cfg.from_rows(dx, lead, cfg.in_spatial)


# ------------------------------------------------------------------------------ Lp


def lp_pool(x, p, window_shape, strides=None, padding="VALID", *, dilation=None, ceil_mode=False,
            data_format="channels_last"):
  """``(sum |x|^p)^(1/p)`` over real elements, float64."""
  x = np.asarray(x)
  cfg = Config(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  rows, lead = cfg.to_rows(np.abs(x.astype(np.float64)), cfg.in_spatial)
  windows = cfg.windows()
  y = np.zeros((rows.shape[0], len(windows)))
  for j, taps in enumerate(windows):
    real = [flat for kind, flat in taps if kind == "real"]
    y[:, j] = (rows[:, real] ** p).sum(axis=1) ** (1.0 / p)
  return cfg.from_rows(y, lead, cfg.out_spatial)


def lp_pool_grad(x, dy, p, window_shape, strides=None, padding="VALID", *, dilation=None,
                 ceil_mode=False, data_format="channels_last"):
  """``dx = sum_windows dy sign(x) |x|^(p-1) / y^(p-1)``; windows with ``y == 0`` give 0."""
  x = np.asarray(x)
  cfg = Config(x.shape, window_shape, strides, padding, dilation, ceil_mode, data_format)
  xr, lead = cfg.to_rows(x.astype(np.float64), cfg.in_spatial)
  dyr, _ = cfg.to_rows(np.asarray(dy).astype(np.float64), cfg.out_spatial)
  dx = np.zeros_like(xr)
  for j, taps in enumerate(cfg.windows()):
    real = [flat for kind, flat in taps if kind == "real"]
    if not real:
      continue
    y = (np.abs(xr[:, real]) ** p).sum(axis=1) ** (1.0 / p)
    safe = np.where(y > 0, y, 1.0)
    for flat in real:
      v = xr[:, flat]
      g = np.sign(v) * np.abs(v) ** (p - 1) / safe ** (p - 1)
      dx[:, flat] += np.where(y > 0, dyr[:, j] * g, 0.0)
  return cfg.from_rows(dx, lead, cfg.in_spatial)
