"""Wall-clock timing shared by the benchmark scripts (new scripts use this, not a copy)."""

from __future__ import annotations

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
