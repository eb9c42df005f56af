"""What a backend is: the ops it may serve (:class:`Op`) and one typed method per op.

A backend (:class:`Backend`) is an object: the XLA backend (``xla_backend.py``), the Pallas
Triton and Pallas TPU backends (``pallas/backend.py``). Each says whether it serves a call and,
when it does not, why (:meth:`Backend.supports`), and whether ``implementation=None`` may pick it
on a platform (:meth:`Backend.not_default`); the registry (``dispatch.py``) asks them in order
of preference. A method a backend does not implement raises ``NotImplementedError`` with the
reason its ``supports`` gives.
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, Any

import jax

from jaxpool._src.windows import Geometry

if TYPE_CHECKING:
  from jaxpool._src.adaptive_plan import Plan
  from jaxpool._src.roi.plan import AlignConfig, PoolConfig


class Op(enum.Enum):
  """The ops of the registry; the value is how a refusal names it ("there is no Pallas kernel
  for lp_pool")."""

  MAX_POOL = "max_pool"
  MIN_POOL = "min_pool"
  MAX_POOL_WITH_TAPS = "max_pool_with_taps"
  MAX_POOL_GRAD_FROM_TAPS = "max_pool_grad_from_taps"
  AVG_POOL = "avg_pool"
  LP_POOL = "lp_pool"
  # Adaptive pooling whose bins are not one fixed window (reshape-and-reduce stages), and
  # global pooling (one reduction): no fixed-window op serves them.
  ADAPTIVE_POOL = "bins that are not one fixed window"
  GLOBAL_POOL = "global pooling"
  # ROI pooling (jaxpool/_src/roi/): regions of feature maps pooled into a fixed grid.
  ROI_ALIGN = "roi_align"
  ROI_POOL = "roi_pool"


class Backend(abc.ABC):
  """One implementation of the ops.

  Attributes:
    name: what ``implementation=`` calls it (``"xla"``, ``"pallas"``: both Pallas backends are
      ``"pallas"``, the kernels of the platform).
    label: how the docs call it (``"XLA"``, ``"Pallas Triton"``, ``"Pallas TPU"``).
  """

  name: str
  label: str

  def __repr__(self) -> str:
    return f"<jaxpool backend {self.label}>"

  @abc.abstractmethod
  def supports(self, op: Op, x: jax.Array, geom: Geometry | None,
               mask: jax.Array | None = None, config: Any = None) -> str | None:
    """None when the backend serves ``op`` for this call, else the reason it does not.

    Args:
      op: the op.
      x: the op's array operand (``dy`` for :attr:`Op.MAX_POOL_GRAD_FROM_TAPS`).
      geom: the call's geometry (None for :attr:`Op.ADAPTIVE_POOL` and :attr:`Op.GLOBAL_POOL`).
      mask: None, or the mask of a masked call.
      config: the static configuration of an op without a geometry (ROI pooling's
        ``AlignConfig`` or ``PoolConfig``), else None.
    """

  @abc.abstractmethod
  def not_default(self, platform: str) -> str | None:
    """None when ``implementation=None`` may pick this backend on ``platform`` (as
    ``platforms.platform()`` names it), else why not."""

  def _missing(self, op: Op) -> NotImplementedError:
    return NotImplementedError(f"the {self.label} backend has no {op.value}")

  # ------------------------------------------------------------------- fixed-window ops

  def max_pool(self, x: jax.Array, geom: Geometry, *, activation: str | None,
               mask: jax.Array | None) -> jax.Array:
    """Max pooling (then ``activation``), differentiable (``autodiff.max_pool``)."""
    raise self._missing(Op.MAX_POOL)

  def min_pool(self, x: jax.Array, geom: Geometry, *, mask: jax.Array | None) -> jax.Array:
    """Min pooling: the max pool mirrored (``autodiff.mirrored``)."""
    raise self._missing(Op.MIN_POOL)

  def max_pool_with_taps(self, x: jax.Array, geom: Geometry, *, activation: str | None,
                         mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(y, taps)``: each window's winning tap (``windows.taps_dtype``, -1: none)."""
    raise self._missing(Op.MAX_POOL_WITH_TAPS)

  def max_pool_grad_from_taps(self, dy: jax.Array, taps: jax.Array,
                              geom: Geometry) -> jax.Array:
    """``dx`` from the forward's taps: each window's ``dy`` added at its winner."""
    raise self._missing(Op.MAX_POOL_GRAD_FROM_TAPS)

  def avg_pool(self, x: jax.Array, geom: Geometry, *, count_include_pad: bool,
               divisor_override: int | None, mask: jax.Array | None) -> jax.Array:
    """Average pooling with PyTorch's divisors."""
    raise self._missing(Op.AVG_POOL)

  def lp_pool(self, x: jax.Array, geom: Geometry, *, p: float) -> jax.Array:
    """Lp-norm pooling."""
    raise self._missing(Op.LP_POOL)

  # ------------------------------------------------------------------- adaptive and global

  def adaptive_max_pool(self, x: jax.Array, plan: Plan) -> jax.Array:
    """Adaptive max pooling over the bins of ``plan`` (:attr:`Op.ADAPTIVE_POOL`)."""
    raise self._missing(Op.ADAPTIVE_POOL)

  def adaptive_max_pool_with_indices(self, x: jax.Array,
                                     plan: Plan) -> tuple[jax.Array, jax.Array]:
    """:meth:`adaptive_max_pool` and the flat input index of each maximum."""
    raise self._missing(Op.ADAPTIVE_POOL)

  def adaptive_avg_pool(self, x: jax.Array, plan: Plan) -> jax.Array:
    """Adaptive average pooling over the bins of ``plan``."""
    raise self._missing(Op.ADAPTIVE_POOL)

  def global_max_pool(self, x: jax.Array, nspatial: int, channels_last: bool) -> jax.Array:
    """The max over every spatial dim, which it drops (:attr:`Op.GLOBAL_POOL`)."""
    raise self._missing(Op.GLOBAL_POOL)

  def global_max_pool_with_indices(self, x: jax.Array, nspatial: int,
                                   channels_last: bool) -> tuple[jax.Array, jax.Array]:
    """:meth:`global_max_pool` and the flat spatial index of each maximum."""
    raise self._missing(Op.GLOBAL_POOL)

  def global_avg_pool(self, x: jax.Array, nspatial: int, channels_last: bool) -> jax.Array:
    """The mean over every spatial dim, which it drops."""
    raise self._missing(Op.GLOBAL_POOL)

  # ------------------------------------------------------------------- ROI pooling

  def roi_align(self, maps: tuple[jax.Array, ...], image: jax.Array, coords: jax.Array,
                level: jax.Array, config: AlignConfig) -> jax.Array:
    """ROI align (:attr:`Op.ROI_ALIGN`) of the boxes ``(image, coords)`` ``(K,)``, ``(K, 4)``,
    each from the map ``maps[level]`` (channels last): ``(K, ph, pw, C)``, differentiable in
    the maps and the coordinates."""
    raise self._missing(Op.ROI_ALIGN)

  def roi_pool(self, x: jax.Array, image: jax.Array, coords: jax.Array,
               config: PoolConfig) -> tuple[jax.Array, jax.Array]:
    """``(y, indices)``: torchvision's ROI max pooling (:attr:`Op.ROI_POOL`), channels last."""
    raise self._missing(Op.ROI_POOL)
