"""``roi_align``'s per-image form: boxes ``(B, K, 4)`` with a mask ``(B, K)``, the output
``(B, K, ph, pw, C)``.

The rows go to the backend as the ``(K, 5)`` form's (image ``b``, or -1 for padding: a dead
box), with the hint ``AlignConfig.per_image = K``: the XLA path then computes the plan as for
the flat form and keeps the batch as an axis of its own in the sampled sums (``xla._per_image``),
so that XLA's partitioner splits them with the features over a mesh axis that splits the batch:
each device pools its own images' boxes, with no collective on the features
(tests/sharding/roi_checks.py). A padding row (mask False) gives zeros and no gradient,
whatever its coordinates; the other rows give the bits of the ``(K, 5)`` form.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src.api_args import as_array

_FORM = ("boxes (B, K, 4) of (x1, y1, x2, y2) per image (with mask (B, K), True for a box, "
         "False for padding)")


def per_image(boxes: Any, mask: Any) -> bool:
  """Whether ``boxes`` (with ``mask``) is the per-image form; a mask with another form raises."""
  if isinstance(boxes, (list, tuple)):
    per = False
  else:
    per = np.ndim(boxes) == 3
  if mask is not None and not per:
    raise ValueError(f"mask goes with {_FORM}; got boxes of shape {np.shape(boxes)} (the "
                     f"(K, 5) and list forms have no padding).")
  return per


def split(boxes: Any, mask: Any, images: int) -> tuple[jax.Array, jax.Array]:
  """``(coords, keep)``: ``(B, K, 4)`` float (float32 for integer boxes; padding rows set to 0)
  and ``(B, K)`` bool. Outside ``jit``, a box (mask True) with a coordinate that is not finite
  raises a ValueError naming it."""
  b = as_array("boxes", boxes)
  if not (jnp.issubdtype(b.dtype, jnp.floating) or jnp.issubdtype(b.dtype, jnp.integer)):
    raise TypeError(f"boxes must have a float or integer dtype; got {b.dtype}.")
  if b.shape[0] != images or b.shape[2] != 4:
    raise ValueError(f"{_FORM}: B must be x's batch ({images}) and the last dim 4; got boxes "
                     f"of shape {tuple(b.shape)}.")
  if mask is None:
    keep = jnp.ones(b.shape[:2], bool)
  else:
    keep = as_array("mask", mask)
    if keep.dtype != jnp.bool_ or keep.shape != b.shape[:2]:
      raise ValueError(f"mask must be a bool array of shape {tuple(b.shape[:2])} (boxes' "
                       f"(B, K)); got {keep.dtype} {tuple(keep.shape)}.")
  if not jnp.issubdtype(b.dtype, jnp.floating):
    b = b.astype(jnp.float32)
  if not isinstance(b, jax.core.Tracer) and not isinstance(keep, jax.core.Tracer):
    c, k = np.asarray(b, np.float64), np.asarray(keep)
    bad = np.argwhere(k & ~np.isfinite(c).all(axis=-1))
    if bad.size:
      i, j = (int(v) for v in bad[0])
      raise ValueError(f"boxes must have finite coordinates; box [{i}, {j}] has "
                       f"{c[i, j].tolist()} (under jit, such a box gives NaN outputs).")
  return jnp.where(keep[..., None], b, 0), keep


def flat(coords: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The ``(K, 5)`` form's ``(image, coords)`` of the rows: ``(B * K,)`` (-1 for padding: an
  image out of range, a dead box) and ``(B * K, 4)``."""
  B, K = keep.shape
  image = jnp.where(keep, jnp.arange(B, dtype=jnp.int32)[:, None], -1)
  return image.reshape(-1), coords.reshape(B * K, 4)


def unflat(y: jax.Array, keep: jax.Array) -> jax.Array:
  """``(B * K, ph, pw, C)`` as ``(B, K, ph, pw, C)``, zeros at the padding rows."""
  y = y.reshape(*keep.shape, *y.shape[1:])
  return jnp.where(keep[:, :, None, None, None], y, jnp.zeros((), y.dtype))
