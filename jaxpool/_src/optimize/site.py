"""A pooling site as the cost decision sees it."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpool._src.optimize.layout import Layout


@dataclasses.dataclass(frozen=True)
class Site:
  """One pooling site that jaxpool can take over, as the cost decision sees it.

  Attributes:
    op: the jaxpool call: ``"max_pool"``, ``"avg_pool"``, ``"max_pool_grad"``,
      ``"max_pool_jvp"`` or ``"avg_pool_grad"``.
    shape: the input's shape in ``layout`` (what jaxpool is called on).
    dtype: the input's dtype name.
    layout: the window, strides, padding, dilation and data format.
    fused_relu: whether a ReLU is folded into it.
    implementation: the ``implementation=`` that optimize passes to jaxpool.
    kernels: whether that runs jaxpool's Pallas kernels (where they serve the call).
    producer: the primitive that makes the input (through element-moving ops and
      conversions), e.g. ``"conv_general_dilated"``; ``""`` for an input of the function.
    readers: the primitives that read the output (through the same ops).
    device_kind: the kind of JAX's first device (``jax.devices()[0].device_kind``, e.g.
      ``"NVIDIA H200"``; the same in every process of a job), whose measured cost table
      (:mod:`.cost_table`) the default cost model reads.
  """

  op: str
  shape: tuple[int, ...]
  dtype: str
  layout: Layout
  fused_relu: bool = False
  implementation: Any = None
  kernels: bool = False
  producer: str = ""
  readers: tuple[str, ...] = ()
  device_kind: str = ""
