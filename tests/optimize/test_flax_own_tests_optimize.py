"""Flax's own pooling tests under ``jaxpool.optimize``: every pool that Flax builds is recognised.

Flax's wheel ships no tests; its source distribution on PyPI does: ``tests/linen/linen_test.py``
(``PoolTest``: ``avg_pool`` with and without padded elements, weakly typed inputs, no batch
dims, ``max_pool`` and its gradient, ``"SAME"`` padding, a custom reduction) and
``tests/core/design/core_resnet_test.py`` (``ResNetTest``: a ResNet built with ``flax.core``,
whose stem max-pools). This test downloads the source distribution of the installed Flax
version (``pip download``) into a cache folder (``$JAXPOOL_TEST_CACHE``, else
``~/.cache/jaxpool-tests``), takes those two files, and runs them in a subprocess with Flax's
pooling functions (``flax.linen.pooling.pool``, ``max_pool``, ``avg_pool``, ``min_pool`` and
their re-exports in ``flax.linen`` and ``flax.core.nn``) replaced by ``jaxpool.optimize`` of
themselves (``framework_pools.Recorder``): Flax's tests then check optimize's values and
gradients, and no pool of more than one element may be left unrecognised. Offline, the test
is skipped and says so. Equinox's source distribution holds no tests (only the package), so
Equinox's pooling is checked by ``test_optimize_frameworks.py``'s cases written after its tests.

Run as a script (``python tests/optimize/test_flax_own_tests_optimize.py FOLDER``) it runs
the files in FOLDER that way and prints one JSON line.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
SUPPORT = ROOT / "tests" / "support"
# Flax's test files (in its source distribution) and the test classes that pool.
FLAX_TESTS = {"tests/linen/linen_test.py": "PoolTest",
              "tests/core/design/core_resnet_test.py": "ResNetTest"}
# Where Flax's pooling functions live, and the modules that re-export them.
FLAX_POOLING = ("flax.linen.pooling", "flax.linen", "flax.core.nn")
FLAX_FUNCTIONS = ("pool", "max_pool", "avg_pool", "min_pool")


def cache_dir() -> Path:
  return Path(os.environ.get("JAXPOOL_TEST_CACHE")
              or Path.home() / ".cache" / "jaxpool-tests")


def fetch_flax_tests(version: str) -> Path:
  """A folder holding FLAX_TESTS of Flax ``version``, from its source distribution (cached).

  Skips the calling test when the download fails (no network, no such distribution).
  """
  folder = cache_dir() / f"flax-{version}"
  if all((folder / name).is_file() for name in FLAX_TESTS):
    return folder
  download = cache_dir() / "sdists"
  download.mkdir(parents=True, exist_ok=True)
  sdist = download / f"flax-{version}.tar.gz"
  if not sdist.is_file():
    if importlib.util.find_spec("pip") is None:
      pytest.skip("pip is not installed: cannot download Flax's source distribution")
    try:
      proc = subprocess.run(
          [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           "--disable-pip-version-check", f"flax=={version}", "-d", str(download)],
          capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
      pytest.skip(f"pip download of Flax {version}'s source distribution took over 600 s "
                  "(offline?)")
    if proc.returncode != 0 or not sdist.is_file():
      tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
      pytest.skip(f"cannot download Flax {version}'s source distribution from PyPI "
                  f"(offline?): {' | '.join(tail)}")
  prefix = f"flax-{version}/"
  with tarfile.open(sdist) as tar:
    for name in FLAX_TESTS:
      member = tar.getmember(prefix + name)  # KeyError: this Flax moved its tests
      source = tar.extractfile(member)
      assert source is not None, member
      target = folder / name
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(source.read())
  return folder


def _run(folder: Path) -> dict:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(SUPPORT),
                                                     os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, str(HERE), str(folder)], capture_output=True,
                        text=True, env=env, timeout=900, cwd=str(HERE.parent))
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  assert proc.returncode == 0 and lines, (
      f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
  return json.loads(lines[-1])


@pytest.mark.slow
def test_flax_own_pooling_tests_under_optimize():
  flax = pytest.importorskip("flax")
  pytest.importorskip("optax")      # linen_test.py imports it
  out = _run(fetch_flax_tests(flax.__version__))
  assert out["exit"] == 0, out
  assert out["outcomes"].get("failed", 0) == 0 and out["outcomes"].get("error", 0) == 0, out
  # Flax 0.12.8: PoolTest's 10 tests and ResNetTest's one
  assert out["outcomes"].get("passed", 0) >= 11, out
  pools = out["pools"]
  assert pools["unrecognised"] == {}, pools
  assert pools["replaced"].get("reduce_window_max", 0) >= 4, pools    # max pools, the stem's
  assert pools["replaced"].get("reduce_window_sum", 0) >= 6, pools    # avg pools
  # the one pool that is none of jaxpool's: PoolTest's product over a window
  assert list(pools["other"]) == ["pool: reduce_window: its computation is not max(a, b)"], pools


def run_flax_tests(folder: str) -> dict:
  """FLAX_TESTS in ``folder`` under pytest, Flax's pooling functions run through optimize."""
  import framework_pools
  recorder = framework_pools.Recorder()
  recorder.patch([importlib.import_module(m) for m in FLAX_POOLING], FLAX_FUNCTIONS)
  outcomes: collections.Counter[str] = collections.Counter()

  class Outcomes:
    def pytest_runtest_logreport(self, report):
      if report.when == "call" or report.outcome != "passed":
        outcomes["error" if report.when != "call" and report.failed else report.outcome] += 1

  files = [str(Path(folder) / name) for name in FLAX_TESTS]
  with tempfile.TemporaryDirectory() as tmp:
    ini = Path(tmp) / "pytest.ini"           # Flax's tests are not this project's
    ini.write_text("[pytest]\n")
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", tmp,
                        "-k", " or ".join(FLAX_TESTS.values()), *files],
                       plugins=[Outcomes()])
  return dict(exit=int(code), outcomes=dict(outcomes), pools=recorder.summary())


if __name__ == "__main__":
  print(json.dumps(run_flax_tests(sys.argv[1])), flush=True)
