"""The cost decision: whether jaxpool's call pays off at a pooling site, or XLA keeps it.

A cost source is a function ``cost(site) -> reason | None``: ``None`` replaces the site with
jaxpool, a string leaves it to XLA and says why (the report shows it). It must be a pure
function of the :class:`~.site.Site` (its op, shapes, dtype, window, neighbours, the
platform and whether jaxpool's kernels would run): every process of a multi-process job then
compiles the same program (two processes that decide differently can hang on their
collectives). A per-process timing is therefore not a default; a table of measurements that
every process reads is.

:func:`default_cost` is jaxpool's shipped cost model. It leaves a site to XLA only where
jaxpool would run its Pallas kernels (``implementation=None`` on an NVIDIA GPU); where jaxpool
runs XLA itself (CPUs, TPUs, ``implementation="xla"``) or the user asked for the kernels
(``implementation="pallas"``) every recognised site is replaced, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from jaxpool._src import dispatch
from jaxpool._src.optimize.site import Site

Cost = Callable[[Site], "str | None"]

SMALL_POOL = 1 << 15
"""Input elements below which the default model assumes a kernel launch does not pay.

An assumption, not a measurement: a launch costs a few microseconds whatever the size, and a
pool this small is a fraction of a microsecond of memory traffic, which XLA can fuse into its
neighbours instead."""

_CONVS = frozenset({"conv_general_dilated"})


def kernels_by_default(implementation) -> bool:
  """Whether jaxpool's call runs its Pallas kernels (where they serve it) for ``implementation``:
  ``"pallas"``, or ``None`` where the kernels are the default (NVIDIA GPUs)."""
  if implementation == "pallas":
    return True
  return implementation is None and dispatch.pallas_by_default()


def default_cost(site: Site) -> str | None:
  """jaxpool's cost model: ``None`` (replace) or why XLA keeps the site.

  Only with ``implementation=None`` where the kernels are the default:

  * an average pool or an average pool's gradient. XLA fuses a window sum with its neighbours
    (a convolution's epilogue, an elementwise consumer), and the kernels' gain there is
    smaller than for max pooling, whose gradient XLA computes with a slow
    ``select_and_scatter``. Measured on one H100 (bfloat16,
    ``benchmarks/optimize_cost_gpu.py``, one run), a training step's pooling site
    replaced against XLA: an average pool after no convolution 0.75x; DenseNet's transitions
    (a 1x1 convolution, then a 2x2/s2 average pool)
    1.13x at 56x56, 1.34x at 28x28, 0.92x at 14x14; a whole DenseNet121 step went from 29.3 to
    43.7 ms with its average pools (and its stem's max pool) replaced. The stem's ReLU and
    3x3/s2 max pool at 112x112: 2.8x, kept.
  * a pool of fewer than :data:`SMALL_POOL` input elements (an assumption: see there).
  """
  if site.implementation is not None or not site.kernels:
    return None
  if site.op in ("avg_pool", "avg_pool_grad"):
    conv = site.producer in _CONVS if site.op == "avg_pool" else bool(_CONVS & set(site.readers))
    what = "an average pool" + ("" if site.op == "avg_pool" else " gradient")
    if conv:
      side = "reads a convolution's output" if site.op == "avg_pool" else (
          "feeds a convolution's gradient")
      return (f"{what} that {side}: XLA fuses it with the convolution (cost model: DenseNet's "
              "transitions were slower replaced)")
    return (f"{what}: XLA fuses its window sum with its neighbours (cost model: measured "
            "slower replaced, 0.75x on an H100)")
  n = math.prod(site.shape)
  if n < SMALL_POOL:
    return (f"{n} input elements, below {SMALL_POOL}: too small for a kernel launch to pay "
            "(cost model)")
  return None


def always(site: Site) -> str | None:
  """Replaces every recognised site (``cost=always``: jaxpool's calls wherever they fit)."""
  del site
  return None
