"""ROI align on the GPU kernels (``triton.py``, ``triton_boxes.py``), as the registry's Pallas
Triton backend runs it.

The kernels compute the form's four derivatives (``form.py``) for the average: the forward
(``wrt="ct"``) and the feature gradient (``wrt="x"``) in ``triton.py``, the box gradient's parts,
the derivatives with respect to the corner weights ``wy`` and ``wx``, in ``triton_boxes.py``.
They are the implementation of a second primitive of the form, ``roi_kernel_p``
(``primitive.define``: the same JVP and transpose rules). So ``jax.grad`` through
:func:`roi_align` with respect to the features and the boxes runs kernels only (JAX's autodiff
of the plan, ``plan.py``, turns the corner weights' gradients into the boxes'); forward mode
and higher orders compose the same way. The max mode (``has_taps``): its taps and forward on the
kernels of ``triton_max.py``, its gradients on the same kernels with the taps (the feature
gradient of grids of more than ``triton_max.MAX_GRAD_SAMPLES`` samples a bin on the XLA
path's form).

The feature maps reach the kernels as they are: each level's map reshaped to a table
``(N * H * W, C)`` (free), one operand each (the form's ``"x"`` group), never concatenated;
the forward and the box gradient's programs read their box's level's array, and the feature
gradient's kernel writes one array per level, each the gradient of that level's map (a
gradient of only some levels, as ``grad`` of one level gives, runs only their programs;
``triton_levels.py``). Under ``vmap`` the mapped axis folds into the boxes and each level's
table (its copies one after the other, ``KernelOptions.copies``): the kernels run once on
the whole batch.
The per-image form (``batched=True`` binds: each image's boxes on its own table) runs the
kernels the same way, its images folded into copies of a one-image table; on several devices
they split along the batch, each device running them on its own images (``partition.py``,
``_lowering``).

:func:`unsupported` is the rule the registry asks (``pallas/backend.py``): the kernels serve
``roi_align`` and ``multi_scale_roi_align`` with ``mode="avg"`` in float32, bfloat16 and
float16 (a static sample grid: ``sampling_ratio > 0``, or the ``max_samples`` grid of the
adaptive count, whose padding samples are dead), maps not split over an Explicit mesh;
``mode="max"`` with boxes ``(K, 5)`` or a list (per-image boxes: the XLA path).
:func:`roi_pool` runs its argmax and its gradient on the kernels of
``triton_pool.py`` (the same dtypes and maps), the rest as the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.interpreters import batching, mlir

from jaxpool._src.pallas.calls import needs_devices, one_device
from jaxpool._src.roi import form, partition, primitive
from jaxpool._src.roi import xla as roi_xla
from jaxpool._src.linear import LinearPair
from jaxpool._src.roi.plan import AlignConfig, Level, PoolConfig

_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
MAX_ELEMENTS = 2**31 - 1  # the kernels index in int32


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """The kernels' static params: the levels (each one of the tables, for the gradient's
  tiles), how many copies of itself each level's table holds one after the other (``vmap``
  folds its axis into the tables), and interpret mode (on a CPU)."""

  levels: tuple[Level, ...]
  interpret: bool
  copies: int = 1


def _widen(extra, copies: int):
  kernel = extra["kernel"]
  return dict(extra, kernel=dataclasses.replace(kernel, copies=kernel.copies * copies))


def unsupported(x: jax.Array, config: Any) -> str | None:
  """Why the ROI kernels cannot serve a call (None: they can). ``x``: the (first) feature map,
  channels last; ``config``: the call's ``AlignConfig`` or ``PoolConfig`` (roi_pool)."""
  pool = isinstance(config, PoolConfig)
  what = "roi_pool" if pool else "ROI align"
  if not pool and config.mode != "avg" and config.per_image:
    return (f"the ROI align kernels take mode={config.mode!r} with boxes (K, 5) or a list; "
            f"per-image boxes (N, K, 4) run it on the XLA path")
  if np.dtype(x.dtype) not in _DTYPES:
    return f"the {what} kernels take float32, bfloat16 and float16, not {np.dtype(x.dtype)}"
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  if spec is not None and any(p is not None for p in spec):
    return f"the {what} kernels take maps that are not split over an Explicit mesh"
  levels = (config.level,) if pool else config.levels
  pixels = sum(lv.images * lv.height * lv.width for lv in levels)
  if pixels * int(x.shape[-1]) > MAX_ELEMENTS:
    return f"the feature maps have over {MAX_ELEMENTS} elements (the kernels index in int32)"
  return None


def _too_large(ops, table_rows: int, planes: int) -> bool:
  """Whether the kernels' int32 indexing cannot reach the feature tables (with the copies that
  ``vmap`` folds into them), the boxes' outputs, the gradient's box lists (at least one cell
  of ``K`` entries per image of each level, ``planes`` of them), or the samples' corner
  indices and weights (``K x bins x samples x 2`` along each axis, which the box gradient's
  results have too): :func:`unsupported` sees only one copy."""
  channels = int((ops["x"][0] if "x" in ops else ops["ct"]).shape[-1])
  boxes = int(ops["iy"].shape[0])
  outputs = boxes * int(ops["iy"].shape[1]) * int(ops["ix"].shape[1])
  samples = max(math.prod(ops["iy"].shape), math.prod(ops["ix"].shape))
  return (max(table_rows, outputs) * channels > MAX_ELEMENTS or planes * boxes > MAX_ELEMENTS
          or samples > MAX_ELEMENTS)


def _impl(*operands, wrt, has_taps, dtype, parts, want=(), kernel: KernelOptions,
          batched=False):
  if batched:
    return _impl_batched(*operands, wrt=wrt, has_taps=has_taps, dtype=dtype, parts=parts,
                         want=want, kernel=kernel)
  ops = form.grouped(form.operand_names(wrt, has_taps, len(parts)), operands)
  table_rows = kernel.copies * sum(lv.images * lv.height * lv.width for lv in kernel.levels)
  planes = kernel.copies * sum(lv.images for lv in kernel.levels)
  from jaxpool._src.roi import triton_max  # (Pallas, imported when traced)
  big_grid = ops["iy"].shape[2] * ops["ix"].shape[2] > triton_max.MAX_GRAD_SAMPLES
  if (has_taps and wrt == "x" and big_grid) or _too_large(ops, table_rows, planes):
    # (the max mode's feature gradient on grids of many samples a bin, and sizes the kernels'
    # int32 indexing cannot reach: XLA)
    return form.evaluate(*operands, wrt=wrt, has_taps=has_taps, dtype=dtype, parts=parts,
                         want=want)
  levels = tuple(kernel.copies * lv.images * lv.height * lv.width for lv in kernel.levels)
  if parts != levels:
    raise AssertionError(f"tables of {parts} rows for {kernel}")
  from jaxpool._src.roi import triton, triton_boxes  # (Pallas, imported when traced)
  taps = ops.get("taps")
  if wrt in ("wy", "wx"):
    return [triton_boxes.corner_grad(wrt, ops["base"], ops["stride"], ops["iy"], ops["ix"],
                                     ops["wx" if wrt == "wy" else "wy"], ops["x"], ops["ct"],
                                     dtype=jnp.dtype(dtype), interpret=kernel.interpret,
                                     taps=taps)]
  if wrt == "ct" and has_taps:
    return [triton_max.at_taps(ops["base"], ops["stride"], ops["iy"], ops["ix"], ops["wy"],
                               ops["wx"], ops["taps"], ops["x"], dtype=jnp.dtype(dtype),
                               interpret=kernel.interpret)]
  if wrt == "ct":
    return [triton.forward(ops["base"], ops["stride"], ops["iy"], ops["ix"], ops["wy"],
                           ops["wx"], ops["x"], dtype=jnp.dtype(dtype),
                           interpret=kernel.interpret)]
  return triton.feature_grad(ops["base"], ops["iy"], ops["ix"], ops["wy"], ops["wx"],
                             ops["ct"], levels=kernel.levels, copies=kernel.copies, want=want,
                             dtype=jnp.dtype(dtype), interpret=kernel.interpret, taps=taps,
                             taps_kernel=triton_max.grad_kernel)


def _impl_batched(*operands, wrt, has_taps, dtype, parts, want, kernel: KernelOptions):
  """The per-image form (``batched=True``: every operand has a leading axis of ``N`` images,
  each image's boxes on its own table ``x`` ``(N, P, C)``, one level) on the kernels: the
  images fold into the boxes and into ``N`` copies of the one-image table, the kernels run
  once, and the axis comes back. The flat form of the same boxes gives the same bits: the same
  table, the same boxes in the same order."""
  assert len(parts) == 1, parts
  names = form.operand_names(wrt, has_taps, 1)
  n, k = operands[0].shape[:2]
  flat = [a.reshape(n * a.shape[1], *a.shape[2:]) for a in operands]
  shift = (jnp.arange(n, dtype=flat[0].dtype) * parts[0])[:, None]
  flat[names.index("base")] = (operands[0] + shift).reshape(n * k)
  outs = _impl(*flat, wrt=wrt, has_taps=has_taps, dtype=dtype, parts=(n * parts[0],),
               want=want, kernel=dataclasses.replace(kernel, copies=kernel.copies * n))
  return [o.reshape(n, o.shape[0] // n, *o.shape[1:]) for o in outs]


roi_kernel_p = primitive.define("jaxpool_roi_form_kernels", _impl, _widen)


def _single_device(ctx) -> bool:
  """Whether the program runs on one device, outside any ``shard_map``."""
  axis_context = ctx.module_context.axis_context
  return (getattr(axis_context, "num_devices", None) == 1
          and not getattr(axis_context, "manual_axes", ()))


def _lowering(ctx, *operands, **params):
  """The kernels. The per-image form on several devices: under ``jit``, the kernels split along
  the batch (``partition.py``: each device runs them on its images); inside a ``shard_map``
  over the axes that split the batch, on the block given (interpreted, on a CPU: the XLA
  path's form); when ``jax.export`` serialises the
  program, the XLA path's form (which XLA's partitioner splits along the batch with no
  collective), as a kernel's partitioning rule is a Python callback."""
  fn = functools.partial(_impl, **params)
  if params.get("batched") and not _single_device(ctx):
    xla_form = functools.partial(form.evaluate,
                                 **{k: v for k, v in params.items() if k != "kernel"})
    if getattr(ctx.module_context.lowering_parameters, "for_export", False):
      fn = xla_form
    elif not one_device(ctx):
      fn = functools.partial(partition.split, _impl, params)
    elif params["kernel"].interpret:
      # (interpreted inside a ``shard_map``, the kernels fail JAX's check of the manual axes
      # their values vary over: the XLA form there, on a CPU only)
      fn = xla_form
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


mlir.register_lowering(roi_kernel_p, _lowering)
needs_devices(roi_kernel_p)  # (the lowering reads the program's devices)


def _batch(args, dims, **params):
  """``vmap``: the per-image form's mapped axis joins its batch axis (each element's images on
  their own tables, as the XLA path keeps them); the flat form's folds into the boxes
  (``form``'s rule)."""
  if not params.get("batched"):
    return _batch_folded(args, dims, **params)
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  ops = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
         for a, d in zip(args, dims, strict=True)]
  ops = [a.reshape(size * a.shape[1], *a.shape[2:]) for a in ops]
  outs = roi_kernel_p.bind(*ops, **params)
  return [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs], [0] * len(outs)


_batch_folded = functools.partial(primitive.batch_folded, roi_kernel_p, _widen)
batching.primitive_batchers[roi_kernel_p] = _batch


def _roi_align(maps, image, coords, level, cfg: AlignConfig, interpret: bool) -> jax.Array:
  levels = cfg.levels
  if cfg.per_image:  # (each image's boxes on its own one-image table: xla._per_image)
    levels = (dataclasses.replace(levels[0], images=1),)
  options = KernelOptions(levels, interpret)

  def bind(wrt, *, batched=False, **kw):
    return primitive.bind_to(roi_kernel_p, wrt, extra=dict(kernel=options, batched=batched), **kw)

  def find_taps(ops, counts, maps):  # (the max mode's selected samples: not differentiated)
    from jaxpool._src.roi import triton_max
    ops = {k: lax.stop_gradient(v) for k, v in ops.items()}
    return triton_max.taps(ops["base"], ops["stride"], ops["iy"], ops["ix"], ops["wy"],
                           ops["wx"], lax.stop_gradient(roi_xla.tables(maps)), *counts,
                           interpret=interpret)

  return roi_xla.roi_align(maps, image, coords, level, cfg, bind=bind, taps=find_taps)


_roi_align_jit = jax.jit(_roi_align, static_argnums=(4, 5))


def roi_align(maps: tuple[jax.Array, ...], image: jax.Array, coords: jax.Array,
              level: jax.Array, cfg: AlignConfig, *, interpret: bool) -> jax.Array:
  """The XLA path's ``roi_align`` (``xla.py``) with the average's sampled sum and its
  derivatives (the feature gradient, the corner weights' gradients) on the kernels, the maps
  their operands as they are (no copy): ``(K, ph, pw, C)``; the max mode's taps and values on
  the kernels (``triton_max.py``), its gradients on the kernels with the taps."""
  assert math.prod(cfg.output_size) > 0
  return _roi_align_jit(maps, image, coords, level, cfg, interpret)


# ----------------------------------------------------------------------------- roi_pool


def _pick(rows, hs, he, ws, we, base, ok, table, *, level, interpret):
  if rows.ndim > 4:  # (a mapped axis in front: LinearPair's batching)
    fn = functools.partial(_pick, level=level, interpret=interpret)
    return jax.vmap(fn)(rows, hs, he, ws, we, base, ok, table)
  return roi_xla.pick(rows, table)


def _pick_transpose(rows, hs, he, ws, we, base, ok, ct, *, level, interpret):
  if rows.ndim > 4:
    fn = functools.partial(_pick_transpose, level=level, interpret=interpret)
    return jax.vmap(fn)(rows, hs, he, ws, we, base, ok, ct)
  from jaxpool._src.roi import triton_pool  # (Pallas, imported when traced)
  return triton_pool.pick_transpose(rows, ((hs, he), (ws, we)), base, ok, ct, level=level,
                                    interpret=interpret)


# The gather of the maxima, ``table.reshape(-1)[rows * C + c]``, whose transpose (the feature
# gradient) is the kernel; the bins and boxes ride along as residuals for it.
_PICK = LinearPair(
    "roi_pool_pick_kernels", _pick, _pick_transpose,
    forward_shape=lambda rows, *res, **kw: tuple(rows),
    transpose_shape=lambda rows, *res, level, interpret: (
        *rows[:-4], level.images * level.height * level.width, rows[-1]))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _maxima(level, interpret, values, rows, hs, he, ws, we, base, ok, table):
  """The maxima ``values`` (the argmax kernel's), as a function of ``table``: ``table``'s
  elements at ``rows`` (the tangent :data:`_PICK` of the table's, and so its transpose the
  gradient kernel). The forward keeps the kernel's values and gathers nothing."""
  del level, interpret, rows, hs, he, ws, we, base, ok, table
  return values


@_maxima.defjvp
def _maxima_jvp(level, interpret, primals, tangents):
  values, rows, hs, he, ws, we, base, ok, table = primals
  t = _PICK.forward(rows, hs, he, ws, we, base, ok, tangents[-1], level=level,
                    interpret=interpret)
  # (the primal through the rule again, so that a derivative of this one, a second order,
  # takes the same rule: the kernel's values alone would carry no tangent)
  return _maxima(level, interpret, *primals), t


def _roi_pool(x, image, coords, cfg: PoolConfig, interpret: bool):
  K, C = image.shape[0], x.shape[-1]
  if K * math.prod(cfg.output_size) * C > MAX_ELEMENTS or x.shape[0] * K > MAX_ELEMENTS:
    # (outputs or box lists past the kernels' int32 indexing: the XLA path)
    return roi_xla.roi_pool(x, image, coords, cfg)
  from jaxpool._src.roi import triton_pool  # (Pallas, imported when traced)

  def select(table, bins, base, ok):
    (hs, he), (ws, we) = bins
    rows, values = triton_pool.argmax(lax.stop_gradient(table), bins, base, ok,
                                      width=cfg.level.width, interpret=interpret)
    return rows, _maxima(cfg.level, interpret, values, rows, hs, he, ws, we, base, ok, table)

  return roi_xla.roi_pool(x, image, coords, cfg, select=select)


_roi_pool_jit = jax.jit(_roi_pool, static_argnums=(3, 4))


def roi_pool(x: jax.Array, image: jax.Array, coords: jax.Array, cfg: PoolConfig, *,
             interpret: bool) -> tuple[jax.Array, jax.Array]:
  """The XLA path's ``roi_pool`` (``xla.py``) with each bin's argmax and maximum and the
  feature gradient on the kernels (``triton_pool.py``): ``(y, indices)``, the XLA path's bits;
  the gradient equal to it to float32 rounding."""
  return _roi_pool_jit(x, image, coords, cfg, interpret)
