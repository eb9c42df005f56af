"""Probe: the 2-D channels_last max-pool backward in Pallas' Mosaic GPU backend, each program's
cotangents and taps copied once into shared memory (the bulk copy engine, TMA).

A program (one warpgroup) covers ``th x tw`` windows: it copies the ``(th + 1) x (tw + 1)``
windows' cotangents and taps it reads (its own and the next row and column: the windows that
share input rows and columns with them; past the end, the copy fills zeros, which add exact
zeros) into shared memory, reads each tap's windows from there as shifted views, sums every
input phase's taps in the library's order (descending taps), writes the ``2 th x 2 tw`` input
block to shared memory and copies it out. The library's Triton kernel reads each window's tiles
from the L2 once for every phase offset that needs them (3-4 times a row); here the L2 is read
once (and a halo). Even input sizes (every input row and column lies in a window), stride 2.

``--runs "bf16:th,tw[,per[,read_only]];..."``; the rest of the command line is
``bwd_probe.py``'s (``--interpret --runs "small:8,8;small:4,8,2" --lib ""`` checks bits in
Mosaic GPU's interpreter on a CPU). Writes ``benchmarks/results/bwd_mosaic_gpu.json``
(``--out``). Needs a Hopper GPU.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_probe  # noqa: E402


def mosaic_backward(taps, dy, in_shape, geom, *, th, tw, per=1, read_only=0,
                    interpret=False):
  """``per``: the blocks of ``th x tw`` windows a program covers one after the other, the next
  block's copies in flight while it sums the current one (two buffers), and its input block's
  copy out left in flight while it sums the next. ``read_only``: a program ends once its last
  copy out has read the shared memory (the writes finish before the kernel does), not once it
  has written."""
  g = geom.lift(3)
  N, Ho, Wo, C = dy.shape
  H, W = in_shape[1:3]
  sh, sw = g.strides[1:]
  assert g.channels_last and (H, W) == (sh * Ho, sw * Wo) and Ho % th == 0 and Wo % tw == 0
  phases = bwd_probe.plan(g)
  qhs, qws = bwd_probe.offsets(phases)
  qh_max, qw_max = qhs[-1], qws[-1]
  rows, cols = th + qh_max, tw + qw_max
  n_cols = Wo // tw
  blocks = N * (Ho // th) * n_cols
  assert blocks % per == 0
  slots = 2 if per > 1 else 1

  def padded_rows(itemsize):
    """Rows a buffer slot holds: at least ``rows``, so that each slot starts 1024-byte aligned
    (the bulk copy engine's destinations must be aligned)."""
    r = rows
    while (r * cols * C * itemsize) % 1024:
      r += 1
    return r

  layout = plgpu.Layout.WG_STRIDED((th, tw, C), vec_size=8)

  def body(idx_g, dy_g, dx_g, dy_s, idx_s, dx_s, bars):
    first = jax.lax.axis_index("p") * per

    def where(blk):
      r, c = blk // n_cols, blk % n_cols
      b, i = r // (Ho // th), r % (Ho // th)
      return r, c, (b, pl.ds(i * th, rows), pl.ds(c * tw, cols), slice(None))

    def start(blk, slot):
      _, _, window = where(blk)
      plgpu.copy_gmem_to_smem(dy_g.at[window], dy_s.at[slot, pl.ds(0, rows)],
                              bars.at[2 * slot])
      plgpu.copy_gmem_to_smem(idx_g.at[window], idx_s.at[slot, pl.ds(0, rows)],
                              bars.at[2 * slot + 1])

    def step(k, carry):
      blk, slot = first + k, k % slots
      if per > 1:
        @pl.when(k + 1 < per)
        def _():
          start(blk + 1, 1 - slot)
      plgpu.barrier_wait(bars.at[2 * slot])
      plgpu.barrier_wait(bars.at[2 * slot + 1])
      d_s, i_s, o_s = dy_s.at[slot], idx_s.at[slot], dx_s.at[slot]
      zero = jnp.zeros((th, tw, C), dy.dtype)
      loaded = {}

      def tiles(qh, qw):
        if (qh, qw) not in loaded:
          at = (pl.ds(qh, th), pl.ds(qw, tw), slice(None))
          if interpret:  # (the interpreter has no plgpu.load; layouts do not matter there)
            loaded[qh, qw] = (d_s[at], i_s[at])
          else:  # (one layout for both, so that the taps' compare selects the cotangents)
            loaded[qh, qw] = (plgpu.load(d_s.at[at], (), layout=layout, optimized=False),
                              plgpu.load(i_s.at[at], (), layout=layout, optimized=False))
        return loaded[qh, qw]

      if per > 1:  # (this slot's previous copy out has read its buffer)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      for (rh, rw), (ts, every) in phases.items():
        terms = []
        for t, qh, qw in ts:
          d, it = tiles(qh, qw)
          terms.append(jnp.where(it == t, d, zero))
        acc = bwd_probe.phase_sum(terms, every, zero)
        o_s[:, rh, :, rw, :] = acc
      plgpu.commit_smem()
      r, c, _ = where(blk)
      plgpu.copy_smem_to_gmem(o_s, dx_g.at[pl.ds(r * th, th), :, pl.ds(c * tw, tw), :, :])
      return carry

    start(first, 0)
    jax.lax.fori_loop(0, per, step, 0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=bool(read_only))

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((N * Ho, sh, Wo, sw, C), dy.dtype),
      scratch_types=[plgpu.SMEM((slots, padded_rows(dy.dtype.itemsize), cols, C), dy.dtype),
                     plgpu.SMEM((slots, padded_rows(taps.dtype.itemsize), cols, C),
                                taps.dtype),
                     plgpu.SMEM((slots, th, sh, tw, sw, C), dy.dtype),
                     plgpu.Barrier(num_barriers=2 * slots)],
      grid=(blocks // per,), grid_names=("p",),
      interpret=_interpreter() if interpret else None)
  if interpret:  # (the interpreter has no out-of-bounds fill: zeros past the end, as TMA's)
    pads = ((0, 0), (0, qh_max), (0, qw_max), (0, 0))
    taps, dy = jnp.pad(taps, pads), jnp.pad(dy, pads)
  return kernel(taps, dy).reshape(in_shape)


def _interpreter():
  """Mosaic GPU's interpreter (shared memory, barriers and bulk copies simulated on a CPU)."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def make(params, *, shape, geom, interpret):
  th, tw, per, read_only = (*params, *(1, 0)[len(params) - 2:])
  return jax.jit(functools.partial(mosaic_backward, in_shape=shape, geom=geom, th=th, tw=tw,
                                   per=per, read_only=read_only, interpret=interpret))


if __name__ == "__main__":
  bwd_probe.main("mosaic", make, "bf16:8,8;bf16:4,8,1,1;bf16:8,4,1,1;f32:8,8",
                 "bf16:4,64,1,1,2;bf16:8,64,2", __doc__)
