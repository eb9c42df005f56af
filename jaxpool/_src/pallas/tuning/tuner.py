"""Launch configurations chosen per GPU: a small autotuner, a disk cache and shipped tables.

The GPU kernels (``triton/ops.py``) take a launch configuration ``(bw, bl, num_warps)``: the
tile's columns and lanes and the warps a program (the forwards also ``(bw, bl, num_warps, rd,
rh)``: a block of ``rd x rh`` output rows a program, or with ``rd = 0`` ``rh`` rows of every
output plane, looped over; ``triton/rows.py``). Every configuration computes the same bits
(each output element's arithmetic and order do not depend on the tile; blocks of rows are
offered only where their order cannot show), so the choice is only a matter of speed, and
the best one depends on the GPU. For a call that compiles for a CUDA GPU, :meth:`Tuner.choose`
looks the configuration up, in this order:

1. this process's memory;
2. the disk cache (``$JAXPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxpool``, else
   ``~/.cache/jaxpool``), an entry being used only when the versions, the device kind and the
   driver it was tuned with are this process's;
3. the table shipped with the package for this device kind (``launch_tables/*.json``);
4. by default (``JAXPOOL_TUNE=model``) the launch model's choice among the candidates
   (``tuning/model.py``; the caller passes it as ``default``): no call waits on tuning;
5. with ``JAXPOOL_TUNE=auto`` only, tuning: each candidate (:func:`candidates` around
   today's heuristic, at most ``JAXPOOL_TUNE_MAX_CANDIDATES``, and up to 10 blocks or loops
   of rows more for the forwards, 5 blocks of rows for the backwards) is compiled (in
   parallel threads) and timed on pseudo-random data of the call's shape
   (``trials.trial_inputs``), for at most ``JAXPOOL_TUNE_BUDGET_S`` seconds a key; the fastest is
   written to the disk cache.

Steps 1 to 3 and the keys are ``tuning/cache.py``'s (:class:`~cache.Store`, which a
:class:`Tuner` is); this module holds the modes, the timing and step 5 (the settings
themselves are ``jaxpool/_src/settings.py``'s).

``JAXPOOL_TUNE=off`` (or ``0``) uses the heuristic constants only (no cache, no table, no
tuning); ``JAXPOOL_TUNE=cached`` uses the cache and the tables but never tunes (a key that has
neither gets the heuristic). Interpret mode and non-CUDA platforms never tune. ``pretune``
(``jaxpool/tune.py``) traces a function under :func:`recording`, then tunes the keys noted.

A key (:class:`Key`) is the op, dtype, layout and a geometry class (window, strides, dilation,
the columns and lanes rounded up to powers of two, and a size class of the work; for the
average forward also how it counts its divisor), not the exact shape: shapes of one class
share one configuration.

Under ``auto``, tuning happens where the kernel is first traced, which is usually inside a
``jit`` trace: it runs the candidates eagerly there (``jax.ensure_compile_time_eval``), logs
its cost on the ``jaxpool.tune`` logger (one INFO line a process, the rest DEBUG) and keeps it
in :func:`report`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from jaxpool._src import settings

from jaxpool._src.pallas.triton.config import Launch
from jaxpool._src.pallas.tuning.cache import Key, Store

# Re-exported: the tests (tests/kernels/test_tuning.py) and benchmarks/pooling_gpu.py reach the
# tuner's whole surface, the cache's names included, through this one module; their home is
# tuning/cache.py.
from jaxpool._src.pallas.tuning.cache import (  # noqa: F401
    CACHE_ENV as CACHE_ENV, FORMAT as FORMAT, TABLES as TABLES, TuningWarning as TuningWarning,
    _valid_launch as _valid_launch, cache_dir as cache_dir, geometry_class as geometry_class,
    launch_name as launch_name, shipped_table as shipped_table, table_name as table_name)

TUNE_ENV = settings.SETTINGS["tune"].env
BUDGET_ENV = settings.SETTINGS["tune_budget_s"].env
CANDIDATES_ENV = settings.SETTINGS["tune_max_candidates"].env
THREADS_ENV = settings.SETTINGS["tune_threads"].env
MODES = settings.TUNE_MODES
DEFAULT_BUDGET_S = settings.SETTINGS["tune_budget_s"].default
DEFAULT_MAX_CANDIDATES = settings.SETTINGS["tune_max_candidates"].default
MARGIN = 0.02  # a candidate must beat the heuristic by more than this fraction to replace it
ROUNDS = 5  # samples a candidate, taken in rounds over all candidates (:func:`rounds`)
SAMPLE_MS = 5.0  # one sample's calls last about this long (as benchmarks/pooling_gpu.py's)
COMPILE_SHARE = 0.8  # of a key's budget, the most its candidates' compiles take

log = logging.getLogger("jaxpool.tune")


# ----------------------------------------------------------------------------- settings


def mode() -> str:
  """``JAXPOOL_TUNE`` (the ``tune`` setting): ``"model"`` (default), ``"auto"`` (also
  ``1``/``on``), ``"cached"``, ``"off"`` (``0``); see ``settings.py``. Where no tuning may run
  (:func:`cached_only`, inside a ``shard_map``), ``"auto"`` acts as ``"model"``."""
  name = settings.get("tune")
  if name == "auto" and (getattr(_LOCAL, "cached_only", False) or _inside_manual_axes()):
    return "model"
  return name


def _inside_manual_axes() -> bool:
  """Whether this trace is inside a ``shard_map`` (yours, or the one an Explicit mesh runs the
  kernels under). There a tuning run's random inputs, drawn with ``jax.random`` before they
  were a hash (``trials.trial_inputs``), raised an error from JAX on a GPU (not tried again
  with the hash); the kernel takes the table's, the cache's or the heuristic
  configuration instead (``python -m jaxpool.tune`` tunes ahead)."""
  return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


_LOCAL = threading.local()


@contextlib.contextmanager
def cached_only() -> Iterator[None]:
  """Inside the block (this thread), ``"auto"`` acts as ``"cached"``: configurations come
  from memory, the cache or the table, never from a new tuning run. The kernels' partitioning
  rule traces each device's kernels while XLA compiles a program: no kernel is compiled and
  timed from inside that."""
  previous = getattr(_LOCAL, "cached_only", False)
  _LOCAL.cached_only = True
  try:
    yield
  finally:
    _LOCAL.cached_only = previous


def budget_s() -> float:
  """``JAXPOOL_TUNE_BUDGET_S``: the most seconds one key's tuning takes (default 10)."""
  return float(settings.get("tune_budget_s"))


def max_candidates() -> int:
  """``JAXPOOL_TUNE_MAX_CANDIDATES``: the most one-row configurations tried a key (default 6;
  the forwards also try up to 10 blocks or loops of output rows, the backwards up to 5 blocks
  of rows)."""
  return int(settings.get("tune_max_candidates"))



# ----------------------------------------------------------------------------- candidates


# ----------------------------------------------------------------------------- timing


def time_ms(fn: Callable[..., Any], args: tuple, *, samples: int = 1,
            sample_ms: float = SAMPLE_MS) -> float:
  """The median over ``samples`` samples of ``fn(*args)``'s time (ms), after two warm-up calls;
  each sample at least one call and about ``sample_ms`` of them back to back, then blocks until
  done. (The tuner takes one sample a candidate a round, :data:`ROUNDS` rounds.)"""
  import statistics  # (here: only tuning needs it, not a first call's import)
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  each = time.perf_counter() - t0
  calls = max(1, math.ceil(sample_ms / 1e3 / max(each, 1e-6)))
  times = []
  for _ in range(samples):
    out = None
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times) * 1e3


def rounds(order: Sequence[Launch]) -> Iterator[Launch]:
  """The order in which the tuner samples ``order``'s candidates: :data:`ROUNDS` rounds, each
  sampling every candidate once, round ``r`` starting at candidate ``r`` (mod their count).
  So each candidate is sampled early and late alike: a clock that is still rising, or a
  GPU that warms up, favours none of them (timed one after the other, the first, the
  heuristic, was measured slowest: ``docs/tuning.md``)."""
  n = len(order)
  for r in range(ROUNDS):
    for i in range(n):
      yield order[(r + i) % n]


@dataclasses.dataclass
class Trial:
  """How to try a configuration: ``compile(launch)`` gives a callable, ``args()`` its inputs."""

  compile: Callable[[Launch], Callable[..., Any]]
  args: Callable[[], tuple]


@dataclasses.dataclass
class Record:
  """One key's tuning: what was tried, what won, and what it cost."""

  key: str
  launch: Launch
  source: str  # "memory", "cache", "table", "tuned", "heuristic"
  seconds: float = 0.0
  times_ms: dict[str, float] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- the tuner


class Tuner(Store):
  """Chooses, caches and reports launch configurations (see the module docstring).

  Args:
    cache: the cache folder (default :func:`cache_dir`, read when first needed).
    env: what entries must match (default :func:`environment` of the default device).
    table: the shipped table (default :func:`shipped_table` of ``env``'s device kind).
    measure: ``measure(fn, args) -> ms``, one sample of ``fn``'s time; the tuner calls it
      once a candidate a round (:func:`rounds`) and keeps each candidate's fastest sample
      (default :func:`time_ms`).
    fresh: tune every key once, whatever the cache and the table hold (``--retune``).
  """

  MAX_RECORDS = 10000

  def __init__(self, cache: str | None = None, env: Mapping[str, str] | None = None,
               table: Mapping[str, Launch] | None = None,
               measure: Callable[[Callable[..., Any], tuple], float] | None = None,
               fresh: bool = False):
    super().__init__(cache, env, table, fresh)
    self.measure = measure or time_ms
    self.records: list[Record] = []
    self._lock = threading.RLock()

  def choose(self, key: Key, heuristic: Launch, cands: Sequence[Launch], trial: Trial, *,
             tune: bool = True, budget: float | None = None,
             default: Launch | None = None) -> Launch:
    """The configuration for ``key``: looked up, else tuned (``tune``), else ``default`` (the
    launch model's choice; source "model") or ``heuristic``."""
    with self._lock:
      if _RECORDING is not None:  # (pretune's trace: note the key, tune nothing)
        _RECORDING.append((key, heuristic, tuple(cands), trial))
        tune = False
      found = self.lookup(key)
      if found is not None:
        launch, source = found
        self.memory[key.name()] = launch
        self._add(Record(key.name(), launch, source))
        return launch
      if not tune:
        launch = Launch.of(default) if default is not None else heuristic
        self._add(Record(key.name(), launch, "heuristic" if default is None else "model"))
        return launch
      record = self.tune(key, heuristic, cands, trial, budget=budget)
      self.memory[key.name()] = record.launch
      self._add(record)
      return record.launch

  def _add(self, record: Record) -> None:
    self.records.append(record)
    if len(self.records) > self.MAX_RECORDS:  # (a long process: the newest half is kept)
      del self.records[:self.MAX_RECORDS // 2]

  def tune(self, key: Key, heuristic: Launch, cands: Sequence[Launch], trial: Trial, *,
           budget: float | None = None) -> Record:
    """Compiles ``cands`` (``heuristic`` always among them), times them within ``budget``
    seconds and writes the fastest to the cache."""
    budget = budget_s() if budget is None else budget
    start = time.perf_counter()
    order = [heuristic] + [c for c in dict.fromkeys(cands) if c != heuristic]
    with jax.ensure_compile_time_eval():  # eager, even inside a jit trace
      # Compiling takes at most COMPILE_SHARE of the budget; timing (ROUNDS samples of about
      # SAMPLE_MS a candidate) the rest. Where the budget runs out within the rounds, the
      # candidates timed have fewer samples (in the first round: one each, one after the other).
      compiled = self._compile_all(order, trial, start + COMPILE_SHARE * budget)
      args = trial.args()
      samples: dict[Launch, list[float]] = {}
      failed: set[Launch] = set()
      for launch in rounds([c for c in order if c in compiled]):
        if launch in failed:
          continue
        if launch != heuristic and time.perf_counter() - start > budget:
          break
        try:
          samples.setdefault(launch, []).append(float(self.measure(compiled[launch], args)))
        except Exception as e:  # (a candidate that fails to run is skipped)
          if launch == heuristic:
            raise
          log.info("jaxpool: %s %s failed to run: %s", key.name(), launch, e)
          failed.add(launch)
          samples.pop(launch, None)
      # The fastest sample of each: interference (another process, the host falling behind)
      # only ever adds time, and on a shared or busy machine it can hit most of a
      # candidate's samples, where a median would take it in.
      times = {c: min(v) for c, v in samples.items()}
      del args
    # The fastest (on equal times the earlier candidate), unless the heuristic is within
    # MARGIN of it: timing noise alone never moves a key off today's configuration.
    best = min(times, key=lambda c: (times[c], order.index(c))) if times else heuristic
    if heuristic in times and times[heuristic] <= times[best] * (1 + MARGIN):
      best = heuristic
    seconds = time.perf_counter() - start
    record = Record(key.name(), best, "tuned", seconds,
                    {launch_name(c): t for c, t in times.items()})
    self.write(key, best, {"times_ms": record.times_ms, "seconds": seconds,
                           "samples_ms": {launch_name(c): v for c, v in samples.items()},
                           "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    log.debug("jaxpool: tuned %s on %s in %.1f s (%d of %d candidates timed): %s, %.4f ms "
              "(heuristic %s, %.4f ms)", key.name(), self.env.get("device_kind"), seconds,
              len(times), len(order), best, times.get(best, math.nan), heuristic,
              times.get(heuristic, math.nan))
    _announce(key, seconds)
    return record

  def _compile_all(self, order: Sequence[Launch], trial: Trial,
                   deadline: float) -> dict[Launch, Callable[..., Any]]:
    """Compiles the candidates in threads; those not compiled by ``deadline`` are dropped
    (the heuristic, first, is always waited for)."""
    threads = int(settings.get("tune_threads") or min(8, os.cpu_count() or 1))
    out: dict[Launch, Callable[..., Any]] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
    try:
      futures = {pool.submit(trial.compile, c): c for c in order}
      for fut, launch in futures.items():
        remaining = deadline - time.perf_counter()
        if launch == order[0]:
          out[launch] = fut.result()
          continue
        try:
          out[launch] = fut.result(timeout=max(remaining, 0.0))
        except concurrent.futures.TimeoutError:
          continue
        except Exception as e:  # (Triton may reject a tile: out of registers, shared memory)
          log.info("jaxpool: %s failed to compile: %s", launch, e)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
    return out


# ----------------------------------------------------------------------------- the default

_ANNOUNCED = False


def _announce(key: Key, seconds: float) -> None:
  """The one INFO line a process logs when tuning first runs (``JAXPOOL_TUNE=auto``): which
  kernel, how long, and how to tune ahead. (The other keys' lines are DEBUG.)"""
  global _ANNOUNCED
  if _ANNOUNCED:
    return
  _ANNOUNCED = True
  log.info("jaxpool: tuned the GPU kernel %s in %.1f s on its first use (JAXPOOL_TUNE=auto; "
           "each new kernel shape is tuned once and cached). To tune ahead instead, run "
           "`python -m jaxpool.tune` or `jaxpool.tune.pretune(fn, *args)`; unset JAXPOOL_TUNE "
           "to use the launch model without tuning.", key.name(), seconds)


_RECORDING: list[tuple[Key, Launch, tuple[Launch, ...], Trial]] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Key, Launch, tuple[Launch, ...], Trial]]]:
  """Inside the block, :meth:`Tuner.choose` tunes nothing and notes each key it is asked for,
  with its heuristic, candidates and trial, in the list it yields (``jaxpool.tune.pretune``
  traces a function so, then tunes those keys)."""
  global _RECORDING
  with _DEFAULT_LOCK:
    previous, _RECORDING = _RECORDING, []
    found = _RECORDING
  try:
    yield found
  finally:
    with _DEFAULT_LOCK:
      _RECORDING = previous



_DEFAULT: Tuner | None = None
_DEFAULT_LOCK = threading.Lock()


def default_tuner() -> Tuner:
  """This process's tuner (created on first use)."""
  global _DEFAULT
  with _DEFAULT_LOCK:
    if _DEFAULT is None:
      _DEFAULT = Tuner()
    return _DEFAULT


@contextlib.contextmanager
def using(tuner: Tuner) -> Iterator[Tuner]:
  """Makes ``tuner`` this process's tuner inside the block (tests, the ``tune`` command)."""
  global _DEFAULT
  with _DEFAULT_LOCK:
    previous, _DEFAULT = _DEFAULT, tuner
  try:
    yield tuner
  finally:
    with _DEFAULT_LOCK:
      _DEFAULT = previous


def report(tuner: Tuner | None = None) -> list[Record]:
  """The configurations chosen so far (each lookup or tuning, in order) and their cost."""
  return list((tuner or default_tuner()).records)
