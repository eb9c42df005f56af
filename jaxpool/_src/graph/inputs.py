"""Image nodes: :class:`Input` (MPS's ``MPSNNImageNode``), the values the caller passes in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from jaxpool._src import checks
from jaxpool._src.graph.base import Node, Spec
from jaxpool._src.graph.common import check_dtype


@dataclass(frozen=True)
class Input(Node):
  """A named input image (MPS's ``MPSNNImageNode``): the caller passes it to ``apply``.

  Attributes:
    shape: the per-example shape, e.g. ``(H, W, C)``; arrays passed in may add leading batch dims.
    dtype: the dtype arrays are cast to (their kind, float or integer, must match).
  """

  shape: tuple[int, ...] = ()
  dtype: Any = jnp.float32
  _input_fields: ClassVar[tuple[str, ...]] = ()
  is_filter: ClassVar[bool] = False  # an image node: it has no gradient node

  def _normalize(self):
    self._set("shape", self._check(checks.int_tuple, "shape", self.shape, None, minimum=0))
    self._set("dtype", check_dtype(self, "dtype", self.dtype))

  def infer(self, in_specs):
    return Spec(self.shape, self.dtype)

  def describe(self):
    return f"Input {np.dtype(self.dtype).name}"


Image = Input
"""Another name for :class:`Input` (MPS calls its inputs image nodes)."""
