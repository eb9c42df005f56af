"""ROI align's GPU kernel for the box gradient (Pallas Triton): the average's corner weights.

JAX differentiates the corner weights ``wy``, ``wx`` of ``plan.py`` into the box gradient, so
the box gradient needs the form's derivatives with respect to them (its ``wrt="wy"`` and
``wrt="wx"``; ``form._wy_grad``, ``form._wx_grad`` on the XLA path):

    wy_grad[k, i, sy, a] = sum over j, sx, b of wx[k, j, sx, b] * d[k, i, j, sy, sx, a, b]
    wx_grad[k, j, sx, b] = sum over i, sy, a of wy[k, i, sy, a] * d[k, i, j, sy, sx, a, b]
    d = where(live, sum over c of ct[k, i, j, c] * x[base[k] + iy * stride[k] + ix, c], 0)

(``live``: both corner indices are live, at least 0; a dead corner gives an exact 0, so a NaN
or inf read at its clamped pixel, or a NaN cotangent, goes nowhere.) The two are the same sum
with the axes' roles exchanged, so one kernel, :func:`corner_grad`, computes either: the *own*
axis (y for ``wy``, x for ``wx``) is the one whose weights' gradient it writes, the *other*
axis the one whose weights it reads. One program per (box ``k``, own bin ``o``), the other
axis's ``n`` bins as a ``(bins, lanes)`` tile (as the forward kernel's bin row in
``triton.py``, read from the box's level's table likewise); the program writes its
``(S_own, 2)`` gradients once, and nothing else writes them: no atomics, no partial sums
outside the kernel, memory only for the outputs.

**Order** (float32 from +0, the same on every run). For each own sample ``s`` ascending and
each of its corners ``a`` (0, then 1), the sum runs over the other axis's samples ``t``
ascending; for each ``t`` it adds one term, the sum over the other axis's bins (a reduction of
the tile, in the compiler's fixed tree) of ``where(live, d_0, 0) * w_0 + where(live, d_1, 0) *
w_1`` (the other axis's corners 0 and 1, its weights ``w``), where each corner's ``d`` is the
sum over the channels (per block of channels ascending, each block a reduction in the
compiler's fixed tree) of ``ct * x``, both in float32. Dead samples, which add exact zeros,
are skipped in the long sample loops (``triton._over``), which keeps the bits. The XLA path
sums the same products in other trees (``form.tree_sum``): the two agree to float32 rounding.
Every load and store stays in bounds: bins and channels are clamped; clamped lanes and bins add
an exact 0 to the sums; the outputs' clamped entries compute their clamp's value again and
are stored masked (compiled) or again with the same bits (interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpool._src.pallas.calls import out_struct
from jaxpool._src.pallas.triton.tile import load
from jaxpool._src.roi import form
from jaxpool._src.roi.triton import FWD_LANES, FWD_TILE, _call_kwargs, _Lanes, _over, _pow2
from jaxpool._src.roi.triton_levels import on_level

F32 = jnp.float32
I32 = jnp.int32


def _kernel(base_ref, stride_ref, own_ref, other_ref, w_ref, ct_ref, *refs, has_taps, starts,
            own_y, ph, pw, s_own, s_other, lanes, block_bins, block_lanes, interpret):
  # (the max mode's taps, then the levels' tables, then the output)
  taps_ref, *x_refs, o_ref = refs if has_taps else (None, *refs)
  n_own, n_other = (ph, pw) if own_y else (pw, ph)
  pid = pl.program_id(0)
  k, o = pid // n_own, pid % n_own
  bins = jnp.arange(block_bins, dtype=I32)
  bin_mask = None if block_bins == n_other else bins < n_other
  m = jnp.minimum(bins, n_other - 1)  # the other axis's bins (clamped)
  stride = stride_ref[k]
  # The cotangent's rows of the tile: bin (o, m) (y own) or (m, o) (x own).
  ct_rows = (k * ph + o) * pw + m if own_y else (k * ph + m) * pw + o
  n_lb = pl.cdiv(lanes, block_lanes)
  if n_lb == 1:
    lane = _Lanes(block_lanes, lanes, 0, interpret)
    ct_whole = load(ct_ref, lane.tile(ct_rows)).astype(F32)
    taps_whole = load(taps_ref, lane.tile(ct_rows)) if has_taps else None

  def level_grad(level, base):  # (the box's level's table, its first row there)
    x_ref = x_refs[level]

    def block_dot(rows, lb, sample, ct=None, taps=None):
      """The tile's channel block ``lb``: ``sum_c ct * x[rows]`` per bin (clamped lanes add 0;
      with taps, the channels whose tap is ``sample``)."""
      lane = _Lanes(block_lanes, lanes, lb, interpret)
      if ct is None:
        ct = load(ct_ref, lane.tile(ct_rows)).astype(F32)
        taps = load(taps_ref, lane.tile(ct_rows)) if has_taps else None
      prod = ct * load(x_ref, lane.tile(rows)).astype(F32)
      if has_taps:
        prod = jnp.where(taps == sample, prod, 0.0)
      if lane.mask is not None:
        prod = jnp.where(lane.mask[None, :], prod, 0.0)
      return jnp.sum(prod, axis=1)

    def dot(rows, sample):
      if n_lb == 1:
        return block_dot(rows, 0, sample, ct_whole, taps_whole)
      return lax.fori_loop(0, n_lb, lambda lb, acc: acc + block_dot(rows, lb, sample),
                           jnp.zeros((block_bins,), F32))

    def own_sample(s, acc):
      at_own = [((k * n_own + o) * s_own + s) * 2 + a for a in (0, 1)]
      p = [own_ref[at] for at in at_own]

      def other_sample(t, sums):
        at = [((k * n_other + m) * s_other + t) * 2 + b for b in (0, 1)]
        q = [load(other_ref, (a,)) for a in at]
        w = [load(w_ref, (a,)) for a in at]
        out = []
        for a in (0, 1):
          v = None
          for b in (0, 1):
            y, x = (p[a], q[b]) if own_y else (q[b], p[a])
            rows = base + jnp.maximum(y, 0) * stride + jnp.maximum(x, 0)
            live = (p[a] >= 0) & (q[b] >= 0)
            sample = s * s_other + t if own_y else t * s_own + s  # (row-major: sy, sx)
            term = jnp.where(live, dot(rows, sample), 0.0) * w[b]
            v = term if v is None else v + term
          if bin_mask is not None:
            v = jnp.where(bin_mask, v, 0.0)
          out.append(sums[a] + jnp.sum(v))
        return tuple(out)

      def other_alive(t):
        return jnp.max(load(other_ref, (((k * n_other + m) * s_other + t) * 2,))) >= 0

      zero = jnp.zeros((), F32)
      sums = _over(s_other, other_sample, (zero, zero), other_alive)
      for a in (0, 1):  # (entries past 2 * s_own repeat the last one's updates: clamped)
        acc = jnp.where(slots == s * 2 + a, sums[a], acc)
      return acc

    def own_alive(s):
      return own_ref[((k * n_own + o) * s_own + s) * 2] >= 0

    return _over(s_own, own_sample, jnp.zeros(slots.shape, F32), own_alive)

  out = _Lanes(_pow2(2 * s_own), 2 * s_own, 0, interpret)
  slots = jnp.minimum(jnp.arange(_pow2(2 * s_own), dtype=I32), 2 * s_own - 1)
  acc = on_level(base_ref[k], starts, level_grad)
  out.store(o_ref, jnp.full((1,), k * n_own + o, I32), acc[None, :].astype(o_ref.dtype))


def corner_grad(wrt: str, base, stride, iy, ix, w, x, ct, *, dtype, interpret: bool,
                taps=None) -> jax.Array:
  """The form's ``wrt`` of the average for ``wrt`` ``"wy"`` (``w`` is ``wx``) or ``"wx"``
  (``w`` is ``wy``): the gradient of the corner weights along that axis, ``iy``'s shape
  ``(K, ph, Sy, 2)`` or ``ix``'s ``(K, pw, Sx, 2)``, in ``dtype``. ``x``: the levels' tables
  ``(P_l, C)`` (a tuple, or one table), ``base`` a row of their concatenation
  (``triton_levels``); ``ct``: ``(K, ph, pw, C)``; ``taps``: the max mode's selected samples
  (``(K, ph, pw, C)``; None: the average); the rest as ``plan.align_plan``'s."""
  assert wrt in ("wy", "wx"), wrt
  x = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  own_y = wrt == "wy"
  K, ph, sy_n, _ = iy.shape
  pw, sx_n = ix.shape[1:3]
  C = x[0].shape[1]
  own, other = (iy, ix) if own_y else (ix, iy)
  n_own, s_own = own.shape[1:3]
  n_other, s_other = other.shape[1:3]
  if K == 0 or n_own == 0 or s_own == 0:
    return jnp.zeros(own.shape, dtype)
  block_bins = _pow2(n_other)
  block_lanes = min(_pow2(C), FWD_LANES, max(16, FWD_TILE // block_bins))
  kernel = functools.partial(_kernel, has_taps=taps is not None,
                             starts=form.starts(tuple(a.shape[0] for a in x)),
                             own_y=own_y, ph=ph, pw=pw, s_own=s_own, s_other=s_other,
                             lanes=C, block_bins=block_bins, block_lanes=block_lanes,
                             interpret=interpret)
  n_terms = K * ph * pw * sy_n * sx_n * 4 * C
  out = pl.pallas_call(
      kernel, out_shape=out_struct((K * n_own, 2 * s_own), dtype, x[0]), grid=(K * n_own,),
      interpret=interpret, name=f"jaxpool_roi_align_{wrt}_grad",
      cost_estimate=pl.CostEstimate(flops=2 * n_terms, transcendentals=0,
                                    bytes_accessed=4 * 2 * n_terms),
      **_call_kwargs(interpret))(
          base.astype(I32), stride.astype(I32), own.reshape(-1).astype(I32),
          other.reshape(-1).astype(I32), w.reshape(-1).astype(F32),
          ct.reshape(K * ph * pw, C),
          *(() if taps is None else (taps.reshape(K * ph * pw, C).astype(I32),)), *x)
  return out.reshape(own.shape)
