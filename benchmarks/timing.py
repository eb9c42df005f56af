"""Wall-clock timing shared by the benchmark scripts (new scripts use this, not a copy)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def median_ms(call: Callable[[], object], sync: Callable[[], object], reps: int) -> float:
  """The median of ``reps`` timings of one ``call`` (ms), each ended by ``sync``, after two
  warm-up calls."""
  for _ in range(2):
    call()
  sync()
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    call()
    sync()
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples) * 1e3


def median_ms_per_call(call: Callable[[], object], sync: Callable[[], object], reps: int,
                       sample_ms: float = 20.0) -> float:
  """The median over ``reps`` samples of the time a call takes (ms) when calls run back to back,
  as in a training loop: each sample runs enough calls (measured once) to last ``sample_ms`` and
  ends with one ``sync``. A single blocking call also counts the host's dispatch and the wait
  for the device, a fixed cost of about a tenth of a millisecond or more that one call cannot
  resolve from the work."""
  call()
  sync()
  t0 = time.perf_counter()
  call()
  sync()
  one = (time.perf_counter() - t0) * 1e3
  n = max(1, math.ceil(sample_ms / max(one, 1e-3)))

  def many():
    for _ in range(n):
      call()

  return median_ms(many, sync, reps) / n
