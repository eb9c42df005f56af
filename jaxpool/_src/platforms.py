"""The platform that JAX runs on by default, named as jaxpool's dispatch names it, and which
Pallas kernels (Triton or TPU) ``implementation="pallas"`` means here."""

from __future__ import annotations

import warnings

import jax

from jaxpool._src import settings

PALLAS_ENV = settings.SETTINGS["pallas_backend"].env
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


def device_kind() -> str:
  """The kind of JAX's first device, e.g. ``"NVIDIA H200"`` or ``"cpu"``: device 0 of the
  job, so every process of a multi-process job reads the same kind."""
  return str(getattr(jax.devices()[0], "device_kind", ""))


def pallas_kernels() -> str:
  """Which Pallas kernels run: ``"tpu"`` (Mosaic TPU) on a TPU, else ``"triton"``.

  The environment variable ``JAXPOOL_PALLAS_BACKEND`` (``"tpu"`` or ``"triton"``) overrides it;
  on a CPU, ``"tpu"`` runs the TPU kernels in the TPU interpreter (how they are tested).
  """
  name = settings.get("pallas_backend")
  if name is None:
    return "tpu" if jax.default_backend() == "tpu" else "triton"
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


MIN_COMPUTE_CAPABILITY = (8, 0)  # the Triton kernels' inline PTX (max.NaN, packed selects)


def _capability(device) -> tuple[int, int] | None:
  raw = getattr(device, "compute_capability", None)
  try:
    major, minor = str(raw).split(".")[:2]
    return int(major), int(minor)
  except (TypeError, ValueError):
    return None


def _oldest_gpu() -> tuple[tuple[int, int], str] | None:
  """The lowest compute capability among the default platform's devices, with that device's
  kind; None where no device has one (CPUs, TPUs)."""
  try:
    devices = jax.devices()
  except RuntimeError:  # pragma: no cover - no backend at all
    return None
  found = [(cc, str(getattr(d, "device_kind", "this GPU")))
           for d in devices if (cc := _capability(d)) is not None]
  return min(found) if found else None


def compute_capability() -> tuple[int, int] | None:
  """The lowest CUDA compute capability among the default platform's devices, e.g. ``(9, 0)``
  (a program runs on every one of them: a host with an sm_75 GPU beside an sm_90 one gets
  ``(7, 5)``); None where they have none."""
  oldest = _oldest_gpu()
  return None if oldest is None else oldest[0]


def old_gpu() -> str | None:
  """Why the Triton kernels cannot run on this host's CUDA GPUs (one of compute capability
  below 8.0, named), or None. ``implementation=None`` takes XLA there;
  ``implementation="pallas"`` raises this."""
  cc = compute_capability()
  if cc is None or cc >= MIN_COMPUTE_CAPABILITY:
    return None
  oldest = _oldest_gpu()
  kind = oldest[1] if oldest is not None and oldest[0] == cc else "this GPU"
  return (f"jaxpool's Triton kernels need an NVIDIA GPU of compute capability 8.0 (sm_80) or "
          f"newer; {kind} is {cc[0]}.{cc[1]}: use implementation='xla' (or "
          f"JAXPOOL_IMPLEMENTATION=xla)")
