"""Nodes that only rearrange their input: :class:`Flatten`; reshape, padding, concatenation and
upsampling belong here too."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpool._src.graph.base import Node, Ref, batch_shape, input_field


@dataclass(frozen=True)
class Flatten(Node):
  """Flattens the per-example dims: ``(*batch, *shape) -> (*batch, prod(shape))``."""

  source: Ref = input_field()

  def forward(self, params, xs, in_specs):
    (x,), (spec,) = xs, in_specs
    return x.reshape((*batch_shape(x, spec), math.prod(spec.shape)))
