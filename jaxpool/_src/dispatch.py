"""Which implementation serves a call: a registry of backends, in order of preference.

Every op asks :func:`run`. Each backend says whether it serves a call and, when it does not, why
(:meth:`Backend.unsupported`); ``implementation="pallas"`` (or ``"xla"``) that cannot be served
raises a ValueError with that reason, for every op alike, and ``implementation=None`` takes the
first backend that serves the call and runs by default on this platform.

The Pallas kernels run by default only on NVIDIA GPUs, where they were compiled and tested.
TPUs and AMD (ROCm) GPUs get them with ``implementation="pallas"``: the TPU kernels pass in the
TPU interpreter and lower to Mosaic, but no TPU compiled them yet, and the Triton kernels were
never compiled for ROCm.

``min_pool`` is each backend's max pool mirrored (:func:`jaxpool._src.autodiff.mirrored`), so
it is served wherever the max pool is. A ``mask`` (masked pooling) is served by XLA's tap loops
only; the Pallas backend says so.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax

from jaxpool._src import autodiff, xla
from jaxpool._src.platforms import platform
from jaxpool._src.windows import IMPLEMENTATIONS, Geometry, check_choice

ENV = "JAXPOOL_IMPLEMENTATION"


def default_implementation() -> str | None:
  """What ``implementation=None`` means: ``JAXPOOL_IMPLEMENTATION=xla`` makes it XLA everywhere
  (a switch for a whole program, its layers included); unset (or ``auto``), the first backend
  that serves the call."""
  name = os.environ.get(ENV, "").strip().lower()
  if name in ("", "auto"):
    return None
  if name != "xla":
    raise ValueError(f"{ENV} must be 'xla', 'auto' or unset; got {name!r}.")
  return name


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of the ops.

  Attributes:
    name: what ``implementation=`` calls it.
    unsupported: ``(op, x, geom, mask) -> reason or None``; ``mask`` is None or the mask
      array of a masked call.
    not_default: ``() -> reason or None``: why ``implementation=None`` skips it on this
      platform.
    run: ``(op, x, geom, **config) -> output``.
  """

  name: str
  unsupported: Callable[[str, jax.Array, Geometry, jax.Array | None], str | None]
  not_default: Callable[[], str | None]
  run: Callable[..., Any]


# ----------------------------------------------------------------------------- XLA

_xla_max_pool = jax.jit(autodiff.max_pool, static_argnums=(1, 2, 3))
_xla_max_pool_with_taps = jax.jit(autodiff.max_pool_with_taps, static_argnums=(1, 2, 3))
_xla_grad_from_taps = jax.jit(autodiff.grad_from_taps, static_argnums=(2, 3))
_xla_avg_pool = jax.jit(xla.avg_pool, static_argnums=(1, 2, 3))
_xla_masked_avg_pool = jax.jit(xla.masked_avg_pool, static_argnums=(2, 3, 4))
_xla_lp_pool = jax.jit(xla.lp_pool, static_argnums=(1, 2))


def _xla_run(op: str, x: jax.Array, geom: Geometry, **config):
  mask = config.get("mask")
  if op in ("max_pool", "max_pool_with_taps", "min_pool"):
    # A masked max pool is the same rule on the operand (x, mask) (xla.MASKED_MAX_POOL_OPS).
    operand, ops = (x, xla.MAX_POOL_OPS) if mask is None else ((x, mask),
                                                               xla.MASKED_MAX_POOL_OPS)
    if op == "min_pool":
      return _xla_max_pool(operand, geom, None, autodiff.mirrored(ops))
    if op == "max_pool":
      return _xla_max_pool(operand, geom, config["activation"], ops)
    return _xla_max_pool_with_taps(operand, geom, config.get("activation"), ops)
  if op == "max_pool_grad_from_taps":  # x is dy
    return _xla_grad_from_taps(x, config["taps"], geom, xla.MAX_POOL_OPS)
  if op == "avg_pool":
    if mask is not None:
      return _xla_masked_avg_pool(x, mask, geom, config["count_include_pad"],
                                  config["divisor_override"])
    return _xla_avg_pool(x, geom, config["count_include_pad"], config["divisor_override"])
  if op == "lp_pool":
    return _xla_lp_pool(x, geom, config["p"])
  raise AssertionError(op)


def _xla_unsupported(op: str, x: jax.Array, geom: Geometry, mask: jax.Array | None) -> str | None:
  if mask is not None and op == "lp_pool":
    return "lp_pool takes no mask"  # (the public lp_pool has no mask argument)
  return None


XLA = Backend("xla", unsupported=_xla_unsupported, not_default=lambda: None,
              run=_xla_run)


# ----------------------------------------------------------------------------- Pallas


@functools.cache
def _pallas():
  """The Pallas backend module (imported on first use: the core needs no Pallas)."""
  from jaxpool._src.pallas import ops
  return ops


def _pallas_unsupported(op: str, x: jax.Array, geom: Geometry,
                        mask: jax.Array | None) -> str | None:
  if mask is not None:
    return "the Pallas kernels take no mask (masked pooling runs on XLA's tap loops)"
  try:
    ops = _pallas()
  except ImportError as e:  # pragma: no cover - a jaxlib without Pallas
    return f"Pallas cannot be imported ({e})"
  reason = ops.unsupported(op, x.shape, x.dtype, geom)
  if reason is None:
    from jaxpool._src.pallas import partition
    shape = geom.input_shape(x.shape) if op == "max_pool_grad_from_taps" else x.shape
    reason = partition.explicit_unsupported(geom, shape, x)
  return reason


def _pallas_not_default() -> str | None:
  where = platform()
  if where == "cuda":
    return None
  return (f"the kernels run by default on NVIDIA GPUs only (they were never compiled on "
          f"{where}); ask for them with implementation='pallas'")


def _pallas_run(op: str, x: jax.Array, geom: Geometry, **config):
  """Calls a Pallas op. Each kernel call inside it splits over the devices its operands live on
  (``jaxpool._src.pallas.partition``), under every kind of mesh and inside ``shard_map``."""
  return getattr(_pallas(), op)(x, geom=geom, interpret=jax.default_backend() == "cpu",
                                **config)


PALLAS = Backend("pallas", unsupported=_pallas_unsupported, not_default=_pallas_not_default,
                 run=_pallas_run)

# In order of preference for implementation=None.
REGISTRY: dict[str, Backend] = {"pallas": PALLAS, "xla": XLA}


def choose(op: str, implementation: Any, x: jax.Array, geom: Geometry,
           mask: jax.Array | None = None) -> Backend:
  """The backend that serves ``op`` for this call (``mask``: None, or a masked call's mask).

  Raises:
    ValueError: ``implementation`` is not one of ``None``, ``"xla"``, ``"pallas"``, or names a
      backend that cannot serve this call (the message says why).
  """
  check_choice("implementation", implementation, IMPLEMENTATIONS)
  if implementation is None:
    implementation = default_implementation()
  if implementation is not None:
    backend = REGISTRY[implementation]
    reason = backend.unsupported(op, x, geom, mask)
    if reason is not None:
      raise ValueError(
          f"implementation={implementation!r} cannot serve {op} for this call (shape "
          f"{tuple(x.shape)}, dtype {x.dtype}): {reason}. Use implementation=None or 'xla'.")
    return backend
  for backend in REGISTRY.values():
    if backend.not_default() is None and backend.unsupported(op, x, geom, mask) is None:
      return backend
  raise AssertionError("the XLA backend serves every call")


def run(op: str, implementation: Any, x: jax.Array, geom: Geometry, *,
        mask: jax.Array | None = None, **config):
  """Runs ``op`` on the backend :func:`choose` picks; ``mask`` (None: no mask) as the op's."""
  backend = choose(op, implementation, x, geom, mask)
  if mask is not None:
    config["mask"] = mask
  return backend.run(op, x, geom, **config)
