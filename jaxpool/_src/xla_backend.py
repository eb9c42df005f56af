"""The XLA backend: every op on ``lax`` (``xla.py``, ``xla_avg_lp.py``, ``adaptive_xla.py``,
``roi/xla.py``), on every platform, each jitted once per static configuration.

A ``mask`` (masked pooling) is served here only: the max pool is the shared rule of
``autodiff.py`` on the operand ``(x, mask)`` (``xla.MASKED_MAX_POOL_OPS``).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpool._src import adaptive_xla, autodiff, xla
from jaxpool._src.adaptive_plan import Plan
from jaxpool._src.backend import Backend, Op
from jaxpool._src.roi import xla as roi_xla
from jaxpool._src.roi.plan import AlignConfig, PoolConfig
from jaxpool._src.windows import Geometry

# Each op is jitted once per static config: calling it again with the same shapes and config
# does not retrace.
_max_pool = jax.jit(autodiff.max_pool, static_argnums=(1, 2, 3))
_max_pool_with_taps = jax.jit(autodiff.max_pool_with_taps, static_argnums=(1, 2, 3))
_grad_from_taps = jax.jit(autodiff.grad_from_taps, static_argnums=(2, 3))
_avg_pool = jax.jit(xla.avg_pool, static_argnums=(1, 2, 3))
_masked_avg_pool = jax.jit(xla.masked_avg_pool, static_argnums=(2, 3, 4))
_lp_pool = jax.jit(xla.lp_pool, static_argnums=(1, 2))
_roi_align = jax.jit(roi_xla.roi_align, static_argnums=(4,))
_roi_pool = jax.jit(roi_xla.roi_pool, static_argnums=(3,))


def _max_operand(x: jax.Array, mask: jax.Array | None):
  """The max pool's operand and functions: ``x``, or ``(x, mask)`` for a masked call."""
  if mask is None:
    return x, xla.MAX_POOL_OPS
  return (x, mask), xla.MASKED_MAX_POOL_OPS


class XlaBackend(Backend):
  """XLA: serves every op, on every platform; the only backend that takes a ``mask``."""

  name = "xla"
  label = "XLA"

  def supports(self, op: Op, x: jax.Array, geom: Geometry | None,
               mask: jax.Array | None = None, config: Any = None) -> str | None:
    if mask is not None and op is Op.LP_POOL:
      return "lp_pool takes no mask"  # (the public lp_pool has no mask argument)
    return None

  def not_default(self, platform: str) -> str | None:
    return None

  def max_pool(self, x: jax.Array, geom: Geometry, *, activation: str | None,
               mask: jax.Array | None) -> jax.Array:
    operand, ops = _max_operand(x, mask)
    return _max_pool(operand, geom, activation, ops)

  def min_pool(self, x: jax.Array, geom: Geometry, *, mask: jax.Array | None) -> jax.Array:
    operand, ops = _max_operand(x, mask)
    return _max_pool(operand, geom, None, autodiff.mirrored(ops))

  def max_pool_with_taps(self, x: jax.Array, geom: Geometry, *, activation: str | None,
                         mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    operand, ops = _max_operand(x, mask)
    return _max_pool_with_taps(operand, geom, activation, ops)

  def max_pool_grad_from_taps(self, dy: jax.Array, taps: jax.Array,
                              geom: Geometry) -> jax.Array:
    return _grad_from_taps(dy, taps, geom, xla.MAX_POOL_OPS)

  def avg_pool(self, x: jax.Array, geom: Geometry, *, count_include_pad: bool,
               divisor_override: int | None, mask: jax.Array | None) -> jax.Array:
    if mask is not None:
      return _masked_avg_pool(x, mask, geom, count_include_pad, divisor_override)
    return _avg_pool(x, geom, count_include_pad, divisor_override)

  def lp_pool(self, x: jax.Array, geom: Geometry, *, p: float) -> jax.Array:
    return _lp_pool(x, geom, p)

  def adaptive_max_pool(self, x: jax.Array, plan: Plan) -> jax.Array:
    return adaptive_xla.adaptive_max_jit(x, plan)

  def adaptive_max_pool_with_indices(self, x: jax.Array,
                                     plan: Plan) -> tuple[jax.Array, jax.Array]:
    return adaptive_xla.adaptive_max_indices_jit(x, plan)

  def adaptive_avg_pool(self, x: jax.Array, plan: Plan) -> jax.Array:
    return adaptive_xla.adaptive_avg_jit(x, plan)

  def global_max_pool(self, x: jax.Array, nspatial: int, channels_last: bool) -> jax.Array:
    return adaptive_xla.global_max_jit(x, nspatial, channels_last)

  def global_max_pool_with_indices(self, x: jax.Array, nspatial: int,
                                   channels_last: bool) -> tuple[jax.Array, jax.Array]:
    return adaptive_xla.global_max_indices_jit(x, nspatial, channels_last)

  def global_avg_pool(self, x: jax.Array, nspatial: int, channels_last: bool) -> jax.Array:
    return adaptive_xla.global_avg_jit(x, nspatial, channels_last)

  def roi_align(self, maps: tuple[jax.Array, ...], image: jax.Array, coords: jax.Array,
                level: jax.Array, config: AlignConfig) -> jax.Array:
    return _roi_align(maps, image, coords, level, config)

  def roi_pool(self, x: jax.Array, image: jax.Array, coords: jax.Array,
               config: PoolConfig) -> tuple[jax.Array, jax.Array]:
    return _roi_pool(x, image, coords, config)
