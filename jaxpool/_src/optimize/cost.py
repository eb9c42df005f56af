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
(``implementation="pallas"``) every recognised site is replaced, as before. For max pools it
reads the measured table of the site's device kind (:mod:`.cost_table`, shipped with the
package): a table is data that every process reads alike, and the device kind is in the site.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from jaxpool._src import dispatch
from jaxpool._src.optimize import cost_table
from jaxpool._src.optimize.site import Site

Cost = Callable[[Site], "str | None"]

SMALL_POOL = 1 << 15
"""Input elements below which the default model assumes a kernel launch does not pay.

An assumption, not a measurement: a launch costs a few microseconds whatever the size, and a
pool this small is a fraction of a microsecond of memory traffic, which XLA can fuse into its
neighbours instead."""

SLOWER = 0.95
"""A measured ratio (XLA's time over jaxpool's) below which the model leaves a max pool to
XLA (by its forward + gradient ratio): the bar below which ``benchmarks/windows_gpu.py``
reruns a cell before it counts."""

FORWARD_SLOWER = 0.85
"""A forward max pool whose gradient is measured faster than XLA's is still left to XLA when
its forward alone ran below this ratio. Between it and :data:`SLOWER` a forward keeps jaxpool:
a training step runs the gradient too, which is where XLA is slow (``select_and_scatter``), and
a forward within 15% of XLA's is a small part of it (the sweep's forward cells of at most 32
taps scatter around 1.0 from run to run)."""

_CONVS = frozenset({"conv_general_dilated"})
# The sites the table measures: a max pool (forward) and its gradient. A JVP site (forward
# mode) is not measured.
_MEASURED = {"max_pool": ("fwd", "fwd_grad"), "max_pool_grad": ("fwd_grad",)}


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
  * a pool of fewer than :data:`SMALL_POOL` input elements (an assumption: see there);
  * a max pool or max-pool gradient whose measured cell (:func:`measured`) ran below
    :data:`SLOWER` of XLA's speed by its forward + gradient ratio (a forward too: optimize
    cannot see whether the caller differentiates the function it returns, and
    ``jax.grad(optimize(f))`` takes jaxpool's gradient of a replaced forward), or a forward
    whose forward alone ran below :data:`FORWARD_SLOWER`. A device kind without a table keeps
    the rules above (:func:`note` says so for the report).
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
  if site.op in _MEASURED:
    return _measured_reason(site)
  return None


def measured(site: Site) -> tuple[cost_table.Table | None, cost_table.Cell | None]:
  """The table of the site's device kind (None where none ships) and the cell it reads for
  the site (:func:`.cost_table.nearest`; None where no cell is of its class, and for dilated
  windows, which the sweep does not measure)."""
  table = cost_table.load(site.device_kind)
  lay = site.layout
  if table is None or any(d != 1 for d in lay.dilation):
    return table, None
  return table, cost_table.nearest(table, site.dtype, lay.window, lay.strides)


def _measured_reason(site: Site) -> str | None:
  table, cell = measured(site)
  if table is None or cell is None:
    return None
  bars = {"fwd_grad": SLOWER, "fwd": FORWARD_SLOWER}
  slow = [p for p in _MEASURED[site.op] if getattr(cell, p) < bars[p]]
  if not slow:
    return None
  worst = min(slow, key=lambda p: getattr(cell, p))
  ratio = getattr(cell, worst)
  geom = cost_table.geometry_name(site.layout.window, site.layout.strides)
  how = "measured" if cell.name == geom else f"nearest measured cell {cell.name}"
  what = "max pool" if site.op == "max_pool" else "max pool gradient"
  why = (" (its gradient may be taken outside optimize)"
         if site.op == "max_pool" and worst == "fwd_grad" else "")
  return (f"{geom} {site.dtype} {what}: {how} {ratio:.2f}x XLA "
          f"{cost_table.PASS_NAMES[worst]} on {table.device_kind} ({table.source}){why}")


def note(site: Site) -> str:
  """What the report says about the measurements behind :func:`default_cost`'s decision on
  ``site`` where it found none: ``"no measurements for <kind>"`` (no table ships for the
  device kind), or which class the kind's table lacks; ``""`` where the table was read, or
  not consulted."""
  if site.implementation is not None or not site.kernels or site.op not in _MEASURED:
    return ""
  if math.prod(site.shape) < SMALL_POOL:
    return ""
  table, cell = measured(site)
  if table is None:
    return f"no measurements for {site.device_kind or 'this device'}"
  if cell is not None:
    return ""
  if any(d != 1 for d in site.layout.dilation):
    return f"no measurements of dilated max pools on {table.device_kind}"
  more = "more than" if cost_table.form(site.layout.window) == "separable" else "at most"
  return (f"no measurements of {len(site.layout.window)}-D {site.dtype} max pools of {more} "
          f"{cost_table.SEPARABLE_TAPS} taps on {table.device_kind}")


def always(site: Site) -> str | None:
  """Replaces every recognised site (``cost=always``: jaxpool's calls wherever they fit)."""
  del site
  return None
