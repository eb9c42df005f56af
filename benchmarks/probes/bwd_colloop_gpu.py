"""Probe: the 2-D channels_last max-pool backward with a loop over columns, each cotangent
(and taps) tile loaded once a program.

The library's backward (``triton_backward.py``) loads, for a block of ``s_h x s_w`` input rows
and columns, the cotangent tiles of every window offset the block reads: for 3x3/s2 four
tiles (offsets ``(0|1, 0|1)``) for one block, each read again by the neighbouring blocks. Here a
program covers ``bh`` blocks in height and a strip of ``L`` steps in width: at step ``c`` its
columns are ``m = k * L + c`` for ``k < K`` (a ``(K, bl)`` tile, ``K`` columns ``L`` apart), and
the tiles that the next step reads at offset ``q - 1`` are passed on to it, so each cotangent
tile is loaded once and a program reads ``(bh + 1) x (L + 1)`` tiles for ``bh x L`` blocks.
The same taps summed in the same order as the library's kernel: the same bits (checked).

``--runs "bf16:K,L,bh,bl,warps;..."``; the rest of the command line is ``bwd_probe.py``'s
(``--interpret --runs "small:2,5,2,16,1;odd:4,3,1,16,1" --lib ""`` checks bits on a CPU).
Writes ``benchmarks/results/bwd_colloop_gpu.json`` (``--out``). Needs a GPU.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_probe  # noqa: E402
from jaxpool._src.pallas.triton import ops as pk  # noqa: E402
from jaxpool._src.pallas.triton.tile import Tile, both_paths, load, split  # noqa: E402


def programs(g, K, L, bh):
  """A batch's blocks of ``bh`` phase rows, and the strips of ``K * L`` phase columns."""
  H, W = g.in_spatial[1:]
  return pl.cdiv(pl.cdiv(H, g.strides[1]), bh), pl.cdiv(pl.cdiv(W, g.strides[2]), K * L)


def colloop_kernel(idx_ref, dy_ref, dx_ref, *, g, K, L, bh, bl, lanes, interpret):
  (_, H, W), (_, Ho, Wo) = g.in_spatial, g.out_spatial
  sh, sw = g.strides[1], g.strides[2]
  n_rows, n_strips = programs(g, K, L, bh)
  pid = pl.program_id(0)
  row, strip, lb = split(pid, (n_strips, pl.cdiv(lanes, bl)))
  b, mb = split(row, (n_rows,))
  mh0 = mb * bh
  tile = Tile(K, lanes, bl, interpret, True, lb)
  dtype = dy_ref.dtype
  zero = jnp.zeros(tile.shape, dtype)
  ks = jnp.arange(K, dtype=jnp.int32)
  base = strip * (K * L)
  phases = bwd_probe.plan(g)
  qhs, qws = bwd_probe.offsets(phases)
  row_offsets = range(bh + qhs[-1])  # window rows mh0 + r the program reads

  def body(edge):
    def tile_at(r, x):
      oh = mh0 + r
      ow = base + ks * L + x
      # Columns past the end: masked unless every strip's columns are known to be real.
      mask = None if n_strips == 1 and (K - 1) * L + x < Wo else ow < Wo
      if edge:
        mask = (mask & (oh < Ho)) if mask is not None else jnp.broadcast_to(oh < Ho, (K,))
      owc = jnp.minimum(ow, Wo - 1)
      ohc = jnp.minimum(oh, Ho - 1)
      where = tile.index(b, 0, ohc, owc)
      m2 = None if mask is None else tile.cols_of(mask)
      dyt = load(dy_ref, where, m2, None if m2 is None else np.array(0, dtype))
      it = load(idx_ref, where, m2, None if m2 is None else np.array(-1, idx_ref.dtype))
      return dyt, it

    have = {}
    for c in range(L):
      for r in row_offsets:
        for qw in qws:
          if (r, c + qw) not in have:
            have[r, c + qw] = tile_at(r, c + qw)
      m = base + ks * L + c
      for kh in range(bh):
        for (rh, rw), (taps, every) in phases.items():
          terms = []
          for t, qh, qw in taps:
            dyt, it = have[kh + qh, c + qw]
            terms.append(jnp.where(it == t, dyt, np.array(0, dtype)))
          acc = bwd_probe.phase_sum(terms, every, zero)
          h = (mh0 + kh) * sh + rh
          w = m * sw + rw
          mask = None if n_strips == 1 and ((K - 1) * L + c) * sw + rw < W else w < W
          if edge:
            real = jnp.broadcast_to(h < H, (K,))
            mask = real if mask is None else mask & real
          # (interpret mode: the stores past the end are dropped)
          tile.store(dx_ref, tile.index(b, 0, h, w), acc.astype(dtype), mask)
      for r in row_offsets:  # (what the next step does not read)
        have.pop((r, c), None)

  interior = (mh0 + bh - 1 + qhs[-1] < Ho) & ((mh0 + bh) * sh <= H)
  both_paths(interior, body)


def colloop_backward(taps, dy, in_shape, geom, *, K, L, bh, bl, warps, interpret=False):
  g = geom.lift(3)
  assert g.channels_last and g.in_spatial[0] == 1
  ops = [pk._view(o, g.out_spatial, True) for o in (taps, dy)]
  lanes, nb = ops[0].shape[-1], ops[0].shape[0]
  n_rows, n_strips = programs(g, K, L, bh)
  grid = (nb * n_rows * n_strips * pl.cdiv(lanes, bl),)
  shape5 = pk._view_shape(in_shape, g.in_spatial, True)
  kernel = functools.partial(colloop_kernel, g=g, K=K, L=L, bh=bh, bl=bl, lanes=lanes,
                             interpret=interpret)
  dx = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape5, dy.dtype), grid=grid,
                      interpret=interpret, name="jaxpool_max_pool_bwd_colloop",
                      **pk._call_kwargs(interpret, warps))(*ops)
  return dx.reshape(in_shape)


def make(params, *, shape, geom, interpret):
  K, L, bh, bl, warps = params
  return jax.jit(functools.partial(colloop_backward, in_shape=shape, geom=geom, K=K, L=L, bh=bh,
                                   bl=bl, warps=warps, interpret=interpret))


if __name__ == "__main__":
  bwd_probe.main("colloop", make, "bf16:8,7,2,64,2;bf16:8,7,1,64,2",
                 "bf16:4,64,1,1,2;bf16:8,64,2,1,2", __doc__)
