"""Pallas kernels for GPUs (the Triton backend): 1-D, 2-D and 3-D pooling, both layouts.

This module is where the kernels are called: each op's ``pallas_call`` (grid, launch, cost
estimate) and the choice of launch configuration. The kernels live beside it:

- ``tile.py``: what every kernel shares (the tile, in-bounds loads and stores, the
  interior and edge code paths);
- ``max.py``: the max-pool forward (the maximum, and its tap);
- ``avg.py``: the average-pool forward;
- ``rows.py``: the forwards (the maximum and its tap, or the average) over a block of
  output rows a program, or looped over the output planes, where the tuner chooses one;
- ``backward.py``: the backward of both, as gathers.

Every kernel sees the spatial dims as ``(D, H, W)`` (1-D and 2-D pools get unit ``D`` and
``H``). A program covers one output row (``batch, depth, height``; a block of ``block_depth x
block_height`` of them in ``triton/rows.py``), a block of ``block_cols`` columns and a block of
``block_lanes`` *lanes* (the launch's fields, ``config.Launch``): the channels in
``channels_last`` (the operand viewed as ``(B, D, H, W, C)``, channels contiguous) or the
planes in ``channels_first`` (viewed as ``(P, D, H, W)`` with ``P = batch * C``, columns
contiguous). Each tap's load is a tile with the contiguous dim last: ``(block_cols,
block_lanes)`` in channels_last, ``(block_lanes, block_cols)`` in channels_first (Triton spreads
a warp's threads along the last dim, so that is what keeps the loads coalesced).

Why no ``BlockSpec``: the calls give the kernels whole operands (no ``in_specs`` or
``out_specs``; each ref is the array in global memory) and the kernels compute every load's
and store's indices themselves, because what a program reads and writes is not one block of a
grid of blocks. A forward tile's windows overlap their neighbours' (a window wider than its
stride, or dilated) and reach past the input at the edges: the input a tile reads is a halo
around it that starts at a negative index at the low edge, and each tap is a load strided by
the stride and dilation (``out_cols * stride + tap * dilation - pad``). Pallas Triton's blocks
sit at multiples of the block shape, or at element offsets without padding (jax 0.10:
"Unblocked indexing with padding is not supported in Triton lowering"); the kernels instead
clamp an edge tap to a copy of a real tap of its window (max) or mask it (average), and take
a path without clamps, chosen at run time, where a tile lies inside (the other path is not
built where no program needs it: ``tile.interior_of``). The backward gathers: a
program writes the input columns of each stride phase (``m * s_w + r_w``, a strided set, or
whole lines interleaved from the phases) and reads the cotangent tiles at static offsets
around its block (the windows that can hold its elements); the blocks of rows of
``triton/rows.py`` read the input rows their output rows share once, and with ``block_depth =
0`` a program loops over every output plane. The programs are numbered by the kernels
(``tile.program``: a 1-D grid, decoded so that neighbours in memory run together) and a tile's
lanes past the end are clamped copies of the last real one, its stores masked per column and
lane. (The TPU kernels, ``tpu/ops.py``, whose blocks sit in VMEM, do use ``BlockSpec``s: a
grid step's block is one image and one block of channels, padded in a VMEM scratch.)

The kernels never read out of bounds, and compiled never write out of bounds. At the edges
every index is clamped into the array: a max kernel's tap outside the input reads a copy of the
nearest real tap of its own window (which cannot change the maximum; the winner is mapped back
to the real tap), an average kernel masks such taps out of the sum, and stores are masked to the
real columns and lanes (the block's overhang past ``W`` or the lanes). In interpret mode, where
stores are not masked, the forwards' columns past the end rewrite the last column's value,
``triton/rows.py`` skips its block's rows past the end, and the backward's rows and columns
past the end are out of bounds, which the interpreter's scatter drops. In ``triton/max.py``
and ``triton/avg.py`` programs whose windows all lie inside the array (most of them) take a
second code path, chosen at run time, without clamps (and where every program's windows do,
only that path is built).

Forward kernels gather over the window's taps (max with the argmax, or a sum for average
pooling). Backward kernels are gathers too: each input element visits the taps of the windows
that can hold it, in a fixed order, and sums the cotangents of those that chose it (max) or
their share (average): no atomics, the same bits on every run.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxpool._src import platforms, settings
from jaxpool._src.api_args import Activation
from jaxpool._src.pallas.calls import out_struct
from jaxpool._src.pallas.triton import config, tile
from jaxpool._src.pallas.triton.avg import avg_kernel
from jaxpool._src.pallas.triton.backward import (PICK16_TAPS, backward_kernel, block_rows,
                                                 interleaves)
from jaxpool._src.pallas.triton.config import Launch
from jaxpool._src.pallas.triton.max import compare_dtype, max_kernel
from jaxpool._src.pallas.triton.rows import row_blocks, rows_kernel, shares_planes
from jaxpool._src.pallas.tuning import model as launch_model
from jaxpool._src.pallas.tuning import tuner as tuning
from jaxpool._src.pallas.tuning.cache import Key, geometry_class
from jaxpool._src.pallas.tuning.trials import trial_inputs
from jaxpool._src.pallas.types import KERNEL_OPS, ForwardMode, MaxForm, PoolKind
from jaxpool._src.windows import Geometry, taps_dtype


# ----------------------------------------------------------------------------- launch

# Triton's software pipelining depth (``num_stages``) for every kernel: 1, since most kernels
# have no loop; the loops over the output planes (``rd = 0``) are the exception, and ran within
# 2% with 2 or 3 stages (docs/tuning.md, docs/design/launches.md): ``tile.compiler_params``.
def _call_kwargs(interpret: bool, num_warps: int):
  return {} if interpret else tile.compiler_params(num_warps)


# ----------------------------------------------------------------------------- views

def _view_shape(shape, spatial, channels_last: bool) -> tuple[int, ...]:
  """``(B, D, H, W, C)`` (channels_last) or ``(P, D, H, W)`` (channels_first) for ``shape``."""
  rest = math.prod(shape) // (math.prod(spatial) * (shape[-1] if channels_last else 1))
  return (rest, *spatial, shape[-1]) if channels_last else (rest, *spatial)


def _view(x: jax.Array, spatial, channels_last: bool) -> jax.Array:
  return x.reshape(_view_shape(x.shape, spatial, channels_last))


def _lanes_and_batch(x_view: jax.Array, channels_last: bool) -> tuple[int, int]:
  return (x_view.shape[-1], x_view.shape[0]) if channels_last else (x_view.shape[0], 1)



# ----------------------------------------------------------------------------- forward

def _window_call(x: jax.Array, geom: Geometry, mode: ForwardMode, interpret: bool,
                 include_pad: bool = False, divisor: int | None = None,
                 launch: Launch | None = None, activation: Activation = None):
  """The forward kernel of ``mode`` ("max", "argmax": with the taps, "avg") over ``x``."""
  geom3 = geom.lift(3)
  out_shape = geom.output_shape(x.shape)
  x_view = _view(x, geom3.in_spatial, geom3.channels_last)
  lanes, n_batch = _lanes_and_batch(x_view, geom3.channels_last)
  (out_depth, out_height, out_width) = geom3.out_spatial
  launch = Launch.of(launch or launch_for(f"{mode}_fwd", x.shape, x.dtype, geom,
                                          interpret=interpret, include_pad=include_pad,
                                          divisor=divisor, activation=activation))
  block_cols, block_lanes, num_warps = launch.block_cols, launch.block_lanes, launch.num_warps
  block = list(launch.rows or ())  # (block_depth, block_height), or none: the one-row kernels
  rows = n_batch * out_depth * out_height
  grid = tile.grid(rows, pl.cdiv(out_width, block_cols), pl.cdiv(lanes, block_lanes))
  out_view_shape = _view_shape(out_shape, geom3.out_spatial, geom3.channels_last)
  outs = [out_struct(out_view_shape, x.dtype, x)]
  if mode == "argmax":
    outs.append(out_struct(out_view_shape, taps_dtype(geom3.num_taps), x))
  form = cast(MaxForm, config._max_form(compare_dtype(x.dtype), interpret))
  kernel: Callable[..., None]
  if block and tuple(block) != (1, 1):
    block_depth, block_height = block
    fits = (config.avg_blocks(geom3) if mode == "avg"
            else config._blocks_exact(geom3, x.dtype, interpret))
    if (not fits or block_height < 1 or block_depth < 0
        or (block_depth == 0 and not shares_planes(geom3))):
      raise ValueError(f"a block of output rows {tuple(block)} serves only the max forward "
                       f"with dilation 1, no empty window and (compiled) a maximum whose bits "
                       f"do not depend on the order, or the average forward with dilation 1 "
                       f"(a loop over the output planes, 0 planes, only where windows share "
                       f"input planes), not {mode} of {x.dtype} over {geom3}")
    grid = tile.grid(n_batch * row_blocks(geom3, (block_depth, block_height)),
                     pl.cdiv(out_width, block_cols), pl.cdiv(lanes, block_lanes))
    kernel = functools.partial(rows_kernel, geom=geom3, block_cols=block_cols,
                               block_lanes=block_lanes, lanes=lanes, n_batch=n_batch,
                               block=(block_depth, block_height), form=form, interpret=interpret,
                               with_taps=mode == "argmax", activation=activation,
                               mode="avg" if mode == "avg" else "max",
                               include_pad=include_pad, divisor=divisor, ptx=config._ptx(interpret))
  elif mode == "avg":
    kernel = functools.partial(avg_kernel, geom=geom3, block_cols=block_cols,
                               block_lanes=block_lanes, lanes=lanes, rows=rows,
                               interpret=interpret, include_pad=include_pad, divisor=divisor,
                               ptx=config._ptx(interpret))
  else:
    kernel = functools.partial(max_kernel, geom=geom3, block_cols=block_cols,
                               block_lanes=block_lanes, lanes=lanes, rows=rows,
                               interpret=interpret, with_taps=mode == "argmax", form=form,
                               activation=activation)
  bytes_in, bytes_out = x.size * x.dtype.itemsize, sum(
      math.prod(out.shape) * np.dtype(out.dtype).itemsize for out in outs)
  results = pl.pallas_call(
      kernel, out_shape=tuple(outs), grid=grid, interpret=interpret,
      name=f"jaxpool_{mode}_pool_fwd",
      cost_estimate=pl.CostEstimate(flops=math.prod(out_view_shape) * geom3.num_taps,
                                    transcendentals=0, bytes_accessed=bytes_in + bytes_out),
      **_call_kwargs(interpret, num_warps))(x_view)
  return tuple(result.reshape(out_shape) for result in results)

def max_forward(x: jax.Array, geom: Geometry, *, interpret: bool,
                activation: Activation = None) -> jax.Array:
  """Max pooling without the taps (then the activation): ``x`` in either layout, 1-3 spatial
  dims."""
  return _window_call(x, geom, "max", interpret, activation=activation)[0]


def max_forward_taps(x: jax.Array, geom: Geometry, *, interpret: bool,
                     activation: Activation = None):
  """Max pooling and each window's winning tap, row-major (``taps_dtype``; -1: none)."""
  return _window_call(x, geom, "argmax", interpret, activation=activation)


def avg_forward(x: jax.Array, geom: Geometry, *, interpret: bool, count_include_pad: bool,
                divisor_override: int | None) -> jax.Array:
  """Average pooling; sums in float32 for 16-bit inputs."""
  return _window_call(x, geom, "avg", interpret, count_include_pad, divisor_override)[0]



# ----------------------------------------------------------------------------- backward

def _backward_cols(geom: Geometry) -> int:
  """The backward's columns (``geom`` lifted to 3-D): phase columns ``m``, or, channels_first
  with a stride that does not interleave, input columns."""
  if geom.channels_last or interleaves(geom.strides[2]):
    return -(-geom.in_spatial[2] // geom.strides[2])
  return geom.in_spatial[2]


def _backward_call(operands, in_shape, geom: Geometry, mode: PoolKind, interpret: bool,
                   include_pad: bool = False, divisor: int | None = None,
                   launch: Launch | None = None) -> jax.Array:
  geom3 = geom.lift(3)
  dy = operands[-1]
  views = [_view(operand, geom3.out_spatial, geom3.channels_last) for operand in operands]
  lanes, n_batch = _lanes_and_batch(views[0], geom3.channels_last)
  # The column block counts phase columns ``m`` (or, channels_first with a stride that does not
  # interleave, input columns).
  n_cols = _backward_cols(geom3)
  launch = Launch.of(launch or launch_for(f"{mode}_bwd", in_shape, dy.dtype, geom,
                                          interpret=interpret, include_pad=include_pad,
                                          divisor=divisor))
  block_cols, block_lanes, num_warps = launch.block_cols, launch.block_lanes, launch.num_warps
  block = list(launch.rows or ())  # (block_depth, block_height), or none: one block a program
  block_depth, block_height = block or (1, 1)
  if block_depth < 1 or block_height < 1:
    raise ValueError(f"a backward's block of rows must be at least 1 x 1, got {tuple(block)}")
  rows = n_batch * math.prod(block_rows(geom3, (block_depth, block_height)))
  grid = tile.grid(rows, pl.cdiv(n_cols, block_cols), pl.cdiv(lanes, block_lanes))
  packed = _packed_select(mode, operands, geom3, block_cols * block_lanes, num_warps, interpret)
  kernel = functools.partial(backward_kernel, geom=geom3, block_cols=block_cols,
                             block_lanes=block_lanes, lanes=lanes, rows=rows, n_cols=n_cols,
                             mode=mode, include_pad=include_pad, divisor=divisor,
                             interpret=interpret, block=(block_depth, block_height),
                             packed=packed)
  in_view_shape = _view_shape(in_shape, geom3.in_spatial, geom3.channels_last)
  n_bytes = (sum(operand.size * operand.dtype.itemsize for operand in operands)
             + math.prod(in_view_shape) * dy.dtype.itemsize)
  dx = pl.pallas_call(
      kernel, out_shape=out_struct(in_view_shape, dy.dtype, dy), grid=grid, interpret=interpret,
      name=f"jaxpool_{mode}_pool_bwd",
      cost_estimate=pl.CostEstimate(flops=math.prod(in_view_shape) * geom3.num_taps,
                                    transcendentals=0, bytes_accessed=n_bytes),
      **_call_kwargs(interpret, num_warps))(*views)
  return dx.reshape(in_shape)


def _packed_select(mode: str, operands, g: Geometry, tile: int, warps: int,
                   interpret: bool) -> bool:
  """Whether the backward kernel runs :func:`backward.pick16`: the max backward of a
  16-bit float compiled for an NVIDIA GPU, taps of at most 16 bits (at most ``PICK16_TAPS``
  taps a window), and each thread holding an even number of the ``tile``'s elements (so that each
  32-bit register pairs two of them), unless the ``packed_select`` setting is off (one lane at a
  time, as for other dtypes: the same bits; read here, when the kernel is traced)."""
  if mode != "max" or not settings.get("packed_select") or not config._ptx(interpret):
    return False
  taps, dy = operands
  return (jnp.issubdtype(dy.dtype, jnp.floating) and dy.dtype.itemsize == 2
          and taps.dtype.itemsize <= 2 and g.num_taps <= PICK16_TAPS
          and tile % (64 * warps) == 0)


def max_backward(taps: jax.Array, dy: jax.Array, in_shape, geom: Geometry, *,
                 interpret: bool) -> jax.Array:
  """``dx``: each input element sums, in descending tap order, the ``dy`` of windows choosing it.

  Args:
    taps: winning tap offsets from :func:`max_forward_taps` (the forward output's shape);
      ``-1`` sends nothing.
    dy: cotangent, the forward output's shape.
    in_shape: the forward input's shape.
  """
  return _backward_call((taps, dy), in_shape, geom, "max", interpret)


def avg_backward(dy: jax.Array, in_shape, geom: Geometry, *, interpret: bool,
                 count_include_pad: bool, divisor_override: int | None) -> jax.Array:
  """``dx``: each input element sums ``dy / divisor`` of the windows that hold it."""
  return _backward_call((dy,), in_shape, geom, "avg", interpret, count_include_pad,
                        divisor_override)



# ----------------------------------------------------------------------------- tuning

OPS = KERNEL_OPS  # ("max_fwd", "argmax_fwd", "avg_fwd", "max_bwd", "avg_bwd")


def avg_counting(include_pad: bool, divisor: int | None) -> str:
  """How an average forward counts its divisor, part of its tuning key (its blocks of rows
  compute the count per window, the one-row kernel inside the input a constant): "divisor",
  "pad" (``count_include_pad``) or "real"."""
  return "divisor" if divisor is not None else ("pad" if include_pad else "real")


def launch_for(op: str, in_shape, dtype, geom: Geometry, *, interpret: bool,
               include_pad: bool = False, divisor: int | None = None,
               activation: Activation = None) -> Launch:
  """The launch configuration of kernel ``op`` (:data:`OPS`) on an input of ``in_shape``.

  Interpret mode, platforms other than CUDA and ``JAXPOOL_TUNE=off``: :func:`launch_config`
  (the heuristic constants). Otherwise the tuner's choice (``tuning/tuner.py``): from memory, the
  disk cache or the shipped table, else (``JAXPOOL_TUNE``, read here) the launch model's choice
  among :func:`config.candidates` (``model``, the default: ``tuning/model.py``), tuned now among
  them (``auto``) or the heuristic (``cached``). Every configuration computes the same bits.
  A CUDA GPU older than sm_80 raises a ``RuntimeError`` (``platforms.old_gpu``).
  """
  if op not in OPS:
    raise ValueError(f"op must be one of {OPS}, got {op!r}")
  g = geom.lift(3)
  dtype = np.dtype(dtype)
  in_shape = tuple(int(n) for n in in_shape)
  forward = op.endswith("_fwd")
  kind = op[:-4]
  out_shape = geom.output_shape(in_shape)
  spatial = g.out_spatial if forward else g.in_spatial
  view = _view_shape(out_shape if forward else in_shape, spatial, g.channels_last)
  lanes = view[-1] if g.channels_last else view[0]
  cols = g.out_spatial[2] if forward else _backward_cols(g)
  heuristic = config.launch_config(cols, lanes, dtype.itemsize, g.channels_last)
  mode = tuning.mode()
  if interpret or mode == "off" or config.platform() != "cuda":
    return heuristic
  if (too_old := platforms.old_gpu()) is not None:
    raise RuntimeError(too_old)
  geometry = geometry_class(g.window, g.strides, g.dilation, cols, lanes, math.prod(view))
  if op == "avg_fwd":
    geometry += "/" + avg_counting(include_pad, divisor)
  key = Key(op, dtype.name, "channels_last" if g.channels_last else "channels_first", geometry)
  extra = (config.row_block_candidates(heuristic, g, dtype, op) if forward
           else config.backward_block_candidates(heuristic, g, dtype.itemsize))
  cands = config.candidates(heuristic, cols, lanes, dtype.itemsize, g.channels_last,
                            tuning.max_candidates(), extra)

  def call(launch: Launch, *ops):
    if forward:
      return _window_call(ops[0], geom, cast(ForwardMode, kind), False, include_pad, divisor,
                          launch, activation)
    return _backward_call(ops, in_shape, geom, cast(PoolKind, kind), False, include_pad,
                          divisor, launch)

  n_taps = g.num_taps
  operand_types = ([jax.ShapeDtypeStruct(in_shape, dtype)] if forward else
                   ([jax.ShapeDtypeStruct(out_shape, taps_dtype(n_taps))] if kind == "max" else [])
                   + [jax.ShapeDtypeStruct(out_shape, dtype)])

  def compile_launch(launch: Launch):
    return jax.jit(functools.partial(call, launch)).lower(*operand_types).compile()

  def args():
    taps = (np.dtype(taps_dtype(n_taps)).name, n_taps) if kind == "max" and not forward else None
    return trial_inputs(operand_types[-1].shape, dtype.name, taps)

  tuner = tuning.default_tuner()
  trial = tuning.Trial(compile_launch, args)
  if mode == "model":  # (the launch model where the cache and the table hold nothing)
    device_kind = getattr(tuner, "env", {}).get("device_kind", "")
    guess = launch_model.choose(key.name(), device_kind, heuristic, cands)
    chosen = Launch.of(tuner.choose(key, heuristic, cands, trial, tune=False, default=guess))
  else:
    chosen = Launch.of(tuner.choose(key, heuristic, cands, trial, tune=mode == "auto"))
  loops = forward and shares_planes(g)  # (a loop over the output planes: rd = 0)
  if chosen.rows is not None and (not extra or (chosen.block_depth == 0 and not loops)):
    # A block of rows chosen for this key's class (from the cache or a table) where this call
    # cannot take one (one output row, padding that leaves a window empty, another nan_max
    # form, no output planes sharing input planes to loop over, a backward's loop): the
    # heuristic.
    return heuristic
  return chosen
