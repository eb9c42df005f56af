"""The platform that JAX runs on by default, named as jaxpool's dispatch names it, and which
Pallas kernels (Triton or TPU) ``implementation="pallas"`` means here."""

from __future__ import annotations

import os
import warnings

import jax

PALLAS_ENV = "JAXPOOL_PALLAS_BACKEND"
PALLAS_KERNELS = ("triton", "tpu")


def platform() -> str:
  """``"cuda"``, ``"rocm"``, ``"tpu"``, ``"cpu"`` (or another JAX backend name)."""
  name = jax.default_backend()
  if name in ("cuda", "rocm"):
    return name
  if name == "gpu":
    from jax.extend import backend as jex_backend
    version = str(getattr(jex_backend.get_backend(), "platform_version", "")).lower()
    return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
  return name


def pallas_kernels() -> str:
  """Which Pallas kernels run: ``"tpu"`` (Mosaic TPU) on a TPU, else ``"triton"``.

  The environment variable ``JAXPOOL_PALLAS_BACKEND`` (``"tpu"`` or ``"triton"``) overrides it;
  on a CPU, ``"tpu"`` runs the TPU kernels in the TPU interpreter (how they are tested).
  """
  name = os.environ.get(PALLAS_ENV, "").strip().lower()
  if not name:
    return "tpu" if jax.default_backend() == "tpu" else "triton"
  if name not in PALLAS_KERNELS:
    raise ValueError(f"{PALLAS_ENV} must be one of {PALLAS_KERNELS} or unset, got {name!r}")
  return name


class PallasInterpreterWarning(UserWarning):
  """``implementation="pallas"`` ran on a platform without Pallas kernels (a CPU): the Pallas
  interpreter serves the call, correct but many times slower than ``implementation="xla"``.
  Issued once per process; silence it with ``warnings.filterwarnings("ignore",
  category=jaxpool.PallasInterpreterWarning)``."""


_interpreter_warned = False


def warn_interpreter() -> None:
  """Issues :class:`PallasInterpreterWarning`, the first time only (once per process)."""
  global _interpreter_warned
  if _interpreter_warned:
    return
  _interpreter_warned = True
  warnings.warn(
      f"implementation='pallas' runs the Pallas interpreter on {jax.default_backend()!r}: the "
      "Pallas kernels compile for GPUs and TPUs only, and interpreted they run many times "
      "slower than implementation='xla' or None (the same values). Warned once per process.",
      PallasInterpreterWarning, stacklevel=3)
