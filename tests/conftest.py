"""Shared test setup: strict rank promotion (as Equinox's conftest), seeded generators, the
order in which ``make test``'s workers take the files.

Warnings are errors through ``filterwarnings`` in pyproject.toml.
"""

import collections
import os
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng(request):
  """A NumPy generator seeded from the test's name: reproducible and distinct per test."""
  seed = zlib.crc32(request.node.nodeid.encode())
  return np.random.default_rng(seed)


# The files of a minute or more (on 2 CPU cores), longest first: a check script in a subprocess
# (the partition checks' two halves, sharding_checks.py), many compiled kernels. `make test`
# (`--dist loadfile --no-loadscope-reorder`) hands out the files in the collection order, so
# its two workers start these and the short files fill in around them; a long file taken last
# would leave one worker idle while the other finishes it. The order changes no test.
FIRST = ("sharding/test_partitioning_spatial.py", "sharding/test_partitioning.py",
         "kernels/test_pallas.py", "reliability/test_reliability.py", "optimize/test_optimize.py",
         "sharding/test_sharding.py", "kernels/test_backward_blocks.py")
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
  rank = {_HERE / f: i for i, f in enumerate(FIRST)}
  items.sort(key=lambda item: rank.get(item.path, len(FIRST)))  # stable: the rest as collected


def pytest_addoption(parser):
  parser.addoption("--file-progress", action="store_true",
                   help="print a line when a test file starts and when it is done, with the time "
                        "since the start (make test: its first tests end only after minutes)")


def pytest_configure(config):
  # Hypothesis tests read this at import for how many examples to draw (support/tiers.py):
  # fewer in `make test` (-m "not gpu and not slow"), all of them in `make test-all`.
  os.environ["POOL_TESTS_QUICK"] = "1" if "not slow" in (config.getoption("markexpr") or "") \
      else "0"
  # The controller prints (an xdist worker's output is not shown); plain pytest prints too.
  if config.getoption("--file-progress") and not hasattr(config, "workerinput"):
    config.pluginmanager.register(FileProgress(config), "jaxpool-file-progress")


class FileProgress:
  """``--file-progress``: ``  2:41  done     tests/ops/test_max.py: 50 passed (7 of 80 files)``.

  A file starts when its first test does and is done when each of its collected tests has
  reported (``--dist loadfile`` runs a file on one worker).
  """

  def __init__(self, config):
    self.config = config
    self.start = time.monotonic()
    self.expected: dict[str, int] | None = None
    self.outcomes: dict[str, collections.Counter] = {}
    self.files_done = 0

  def _line(self, what, text):
    minutes, seconds = divmod(int(time.monotonic() - self.start), 60)
    reporter = self.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
      if getattr(reporter._tw, "width_of_current_line", 0):   # after -q's dots
        reporter._tw.line()
      reporter.write_line(f"{minutes:3d}:{seconds:02d}  {what:7s}  {text}")

  def _collected(self, ids):
    if self.expected is None:   # every worker collects the same tests
      self.expected = collections.Counter(i.split("::")[0] for i in ids)

  @pytest.hookimpl(optionalhook=True)
  def pytest_xdist_node_collection_finished(self, node, ids):
    self._collected(ids)

  def pytest_collection_finish(self, session):
    if session.items:           # plain pytest (under xdist the controller collects nothing)
      self._collected(item.nodeid for item in session.items)

  def pytest_runtest_logstart(self, nodeid, location):
    path = nodeid.split("::")[0]
    if path not in self.outcomes:
      self.outcomes[path] = collections.Counter()
      self._line("started", path)

  def pytest_runtest_logreport(self, report):
    path = report.nodeid.split("::")[0]
    counts = self.outcomes.setdefault(path, collections.Counter())
    if report.when == "call" or (report.when == "setup" and not report.passed):
      counts[report.outcome] += 1
    if report.when == "teardown":
      counts["reported"] += 1
      if not report.passed:
        counts["error"] += 1
      if self.expected is not None and counts["reported"] == self.expected.get(path):
        self.files_done += 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()) if k != "reported")
        self._line("done", f"{path}: {summary} ({self.files_done} of {len(self.expected)} "
                           "files)")
