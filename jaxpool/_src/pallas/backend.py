"""The Pallas backends of the registry: Pallas Triton (GPU kernels, ``triton/ops.py``) and Pallas
TPU (Mosaic kernels, ``tpu/ops.py``), one object each.

Both are ``implementation="pallas"``: the registry (``dispatch.pallas()``) takes the one whose
kernels run on this platform (``platforms.pallas_kernels``). Each serves what its kernels serve
(``ops.unsupported``), no mask, and an Explicit-sharded call only where its spatial dims split
evenly (``partition.explicit_unsupported``). They run by default on NVIDIA GPUs only, where the
kernels were compiled and tested: the TPU kernels pass in the TPU interpreter and lower to
Mosaic, but no TPU compiled them yet, and the Triton kernels were never compiled for ROCm.

Nothing here imports Pallas until a backend is asked about a call: the core needs no Pallas.
Each kernel call splits over the devices its operands live on (``sharding/partition.py``),
under every kind of mesh and inside ``shard_map``.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpool._src import platforms
from jaxpool._src.backend import Backend, Op
from jaxpool._src.platforms import warn_interpreter
from jaxpool._src.windows import Geometry


def _ops():
  """The Pallas ops module (imported on first use)."""
  from jaxpool._src.pallas import ops
  return ops


def _roi():
  """ROI align's kernels (``roi/kernels.py``, which imports Pallas only when a kernel is
  traced)."""
  from jaxpool._src.roi import kernels
  return kernels


def _interpret() -> bool:
  """On a CPU the kernels run in interpret mode (how they are tested), with a
  :class:`~jaxpool._src.platforms.PallasInterpreterWarning` the first time."""
  if jax.default_backend() == "cpu":
    warn_interpreter()
    return True
  return False


class PallasBackend(Backend):
  """The Pallas kernels ``kernels`` (``"triton"`` or ``"tpu"``) as a backend."""

  name = "pallas"

  def __init__(self, kernels: str, label: str):
    self.kernels = kernels
    self.label = label

  def supports(self, op: Op, x: jax.Array, geom: Geometry | None,
               mask: jax.Array | None = None, config: Any = None) -> str | None:
    if mask is not None:
      return "the Pallas kernels take no mask (masked pooling runs on XLA's tap loops)"
    if op in (Op.ROI_ALIGN, Op.ROI_POOL):
      if self.kernels != "triton":
        return f"there is no {self.label} kernel for {op.value}"
      return _roi().unsupported(x, config)
    if geom is None:  # adaptive bins and global pooling: no fixed window
      return f"there is no Pallas kernel for {op.value}"
    try:
      ops = _ops()
    except ImportError as e:  # pragma: no cover - a jaxlib without Pallas
      return f"Pallas cannot be imported ({e})"
    reason = ops.unsupported(op, x.shape, x.dtype, geom, kernels=self.kernels)
    if reason is None:
      from jaxpool._src.pallas.sharding import partition
      shape = geom.input_shape(x.shape) if op is Op.MAX_POOL_GRAD_FROM_TAPS else x.shape
      reason = partition.explicit_unsupported(geom, shape, x)
    return reason

  def not_default(self, platform: str) -> str | None:
    if platform == "cuda":
      return platforms.old_gpu()
    return (f"the kernels run by default on NVIDIA GPUs only (they were never compiled on "
            f"{platform}); ask for them with implementation='pallas'")

  def max_pool(self, x: jax.Array, geom: Geometry, *, activation: str | None,
               mask: jax.Array | None) -> jax.Array:
    assert mask is None  # (supports refuses a mask)
    return _ops().max_pool(x, geom, interpret=_interpret(), activation=activation,
                           kernels=self.kernels)

  def min_pool(self, x: jax.Array, geom: Geometry, *, mask: jax.Array | None) -> jax.Array:
    assert mask is None
    return _ops().min_pool(x, geom, interpret=_interpret(), kernels=self.kernels)

  def max_pool_with_taps(self, x: jax.Array, geom: Geometry, *, activation: str | None,
                         mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    assert mask is None
    return _ops().max_pool_with_taps(x, geom, interpret=_interpret(), activation=activation,
                                     kernels=self.kernels)

  def max_pool_grad_from_taps(self, dy: jax.Array, taps: jax.Array,
                              geom: Geometry) -> jax.Array:
    return _ops().max_pool_grad_from_taps(dy, geom, taps=taps, interpret=_interpret(),
                                          kernels=self.kernels)

  def avg_pool(self, x: jax.Array, geom: Geometry, *, count_include_pad: bool,
               divisor_override: int | None, mask: jax.Array | None) -> jax.Array:
    assert mask is None
    return _ops().avg_pool(x, geom, interpret=_interpret(), count_include_pad=count_include_pad,
                           divisor_override=divisor_override, kernels=self.kernels)

  def roi_align(self, maps: tuple[jax.Array, ...], image: jax.Array, coords: jax.Array,
                level: jax.Array, config: Any) -> jax.Array:
    assert self.kernels == "triton"  # (supports refuses the TPU kernels)
    return _roi().roi_align(maps, image, coords, level, config, interpret=_interpret())

  def roi_pool(self, x: jax.Array, image: jax.Array, coords: jax.Array,
               config: Any) -> tuple[jax.Array, jax.Array]:
    assert self.kernels == "triton"
    return _roi().roi_pool(x, image, coords, config, interpret=_interpret())


PALLAS_TRITON = PallasBackend("triton", "Pallas Triton")
PALLAS_TPU = PallasBackend("tpu", "Pallas TPU")
