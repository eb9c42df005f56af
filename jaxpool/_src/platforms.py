"""The platform that JAX runs on by default, named as jaxpool's dispatch names it."""

from __future__ import annotations

import jax


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
