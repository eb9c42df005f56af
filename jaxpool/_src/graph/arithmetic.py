"""Elementwise nodes of several inputs: :class:`Add` (MPS's ``MPSNNAdditionNode``, one of its
arithmetic nodes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxpool._src.graph.base import Node, Ref, input_field


@dataclass(frozen=True)
class Add(Node):
  """Elementwise sum of two nodes of the same shape (MPS's ``MPSNNAdditionNode``)."""

  left: Ref = input_field()
  right: Ref = input_field()
  _input_fields: ClassVar[tuple[str, ...]] = ("left", "right")

  def check_inputs(self, in_specs):
    a, b = in_specs
    if a.shape != b.shape:
      raise self._fail(f"inputs {self.inputs[0]!r} {a.shape} and {self.inputs[1]!r} {b.shape} "
                       "must have the same shape.")

  def forward(self, params, xs, in_specs):
    return xs[0] + xs[1]
