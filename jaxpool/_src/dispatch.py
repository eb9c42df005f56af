"""The backend registry: which backend serves a call, in order of preference.

Every op asks :func:`choose` for a backend (an object of ``backend.Backend``: XLA, Pallas
Triton, Pallas TPU) and calls that backend's method for the op. Each backend says whether it
serves a call and, when it does not, why (``Backend.supports``); ``implementation="pallas"`` (or
``"xla"``) that cannot be served raises a ValueError with that reason, for every op alike, and
``implementation=None`` takes the first backend that serves the call and runs by default on
this platform (``Backend.not_default``).

``implementation="pallas"`` means the Pallas kernels of this platform (:func:`pallas`): the TPU
kernels on a TPU, the Triton kernels elsewhere (``JAXPOOL_PALLAS_BACKEND`` overrides it). The
Pallas kernels run by default only on NVIDIA GPUs, where they were compiled and tested. TPUs and
AMD (ROCm) GPUs get them with ``implementation="pallas"``.

``min_pool`` is each backend's max pool mirrored (``autodiff.mirrored``), so it is served
wherever the max pool is. A ``mask`` (masked pooling) is served by XLA's tap loops only; the
Pallas backends say so.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpool._src.backend import Backend, Op
from jaxpool._src.checks import check_choice
from jaxpool._src.pallas.backend import PALLAS_TPU, PALLAS_TRITON, PallasBackend
from jaxpool._src import settings
from jaxpool._src.platforms import pallas_kernels, platform
from jaxpool._src.windows import IMPLEMENTATIONS, Geometry
from jaxpool._src.xla_backend import XlaBackend

__all__ = ["PALLAS_TPU", "PALLAS_TRITON", "XLA", "REGISTRY", "Backend", "Op", "choose",
           "default_implementation", "pallas", "pallas_by_default", "platform"]

ENV = settings.SETTINGS["implementation"].env

XLA = XlaBackend()

# Every backend, in order of preference for implementation=None (of the two Pallas backends,
# only this platform's is asked: :func:`candidates`).
REGISTRY: tuple[Backend, ...] = (PALLAS_TRITON, PALLAS_TPU, XLA)


def default_implementation() -> str | None:
  """What ``implementation=None`` means: ``JAXPOOL_IMPLEMENTATION=xla`` makes it XLA everywhere
  (a switch for a whole program, its layers included); unset (or ``auto``), the first backend
  that serves the call."""
  return settings.get("implementation")


def pallas() -> PallasBackend:
  """The Pallas backend of this platform: what ``implementation="pallas"`` names."""
  return PALLAS_TPU if pallas_kernels() == "tpu" else PALLAS_TRITON


def candidates() -> tuple[Backend, ...]:
  """The backends ``implementation=None`` asks, in order: this platform's Pallas, then XLA."""
  return (pallas(), XLA)


def named(implementation: str) -> Backend:
  """The backend ``implementation=`` names (``"xla"`` or ``"pallas"``)."""
  return XLA if implementation == "xla" else pallas()


def pallas_by_default() -> bool:
  """Whether ``implementation=None`` runs the Pallas kernels here where they serve a call: not
  under ``JAXPOOL_IMPLEMENTATION=xla``, and on a platform where they run by default."""
  return default_implementation() is None and pallas().not_default(platform()) is None


def choose(op: Op | str, implementation: Any, x: jax.Array, geom: Geometry | None,
           mask: jax.Array | None = None, *, caller: str | None = None,
           config: Any = None) -> Backend:
  """The backend that serves ``op`` for this call.

  Args:
    op: the op (an :class:`Op`, or its value).
    implementation: the user's ``implementation=``: ``None``, ``"xla"`` or ``"pallas"``.
    x: the op's array operand (``dy`` for a gradient from taps).
    geom: the call's geometry (None for adaptive bins and global pooling).
    mask: None, or the mask of a masked call.
    caller: the public function that refusals name (default: the op).
    config: an op's static configuration where it has no geometry (ROI pooling's), which the
      backends' ``supports`` read.

  Raises:
    ValueError: ``implementation`` is not one of ``None``, ``"xla"``, ``"pallas"``, or names a
      backend that cannot serve this call (the message says why).
  """
  op = Op(op)
  check_choice("implementation", implementation, IMPLEMENTATIONS)
  if implementation is None:
    implementation = default_implementation()
  if implementation is not None:
    backend = named(implementation)
    reason = backend.supports(op, x, geom, mask, config)
    if reason is not None:
      raise ValueError(
          f"implementation={implementation!r} cannot serve {caller or op.value} for this call "
          f"(shape {tuple(x.shape)}, dtype {x.dtype}): {reason}. Use implementation=None or "
          f"'xla'.")
    return backend
  where = platform()
  for backend in candidates():
    if backend.not_default(where) is None and backend.supports(op, x, geom, mask, config) is None:
      return backend
  raise AssertionError("the XLA backend serves every call")
