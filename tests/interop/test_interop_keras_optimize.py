"""Keras's own pooling tests under ``jaxpool.optimize``: every pool that Keras builds is
recognised.

Keras 3's JAX backend pools in ``keras.src.backend.jax.nn.max_pool`` / ``average_pool`` (the
functions that ``jaxpool.interop.keras`` replaces). Here they are replaced instead by
``jaxpool.optimize`` of Keras's own functions (``framework_pools.Recorder``): Keras's pooling
tests (``keras.src.ops.nn_test``'s pooling cases, ``max_pooling_test``, ``average_pooling_test``:
NumPy references, both data formats, 1-D to 3-D, ``"valid"`` and ``"same"``) then check the
values of optimize's program, and each call's report must leave no pool of more than one
element unrecognised. Every recognised site is replaced (the cost decision aside), so the
tests run jaxpool's pooling wherever optimize recognises one.

The tests run in a subprocess, from the installed Keras package (3.15.1's wheel ships its tests;
earlier ones do not, and this test is then skipped): ``python
tests/interop/test_interop_keras_optimize.py KERAS_TEST_MODULE ...`` prints one JSON line.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

if importlib.util.find_spec("keras") is None:
  pytest.skip("Keras is not installed (pip install 'jaxpool[keras]')", allow_module_level=True)
if "keras" not in sys.modules:
  os.environ["KERAS_BACKEND"] = "jax"  # Keras reads it when first imported (find_spec imports it)

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
SUPPORT = ROOT / "tests" / "support"

# Keras's pooling test modules (as tests/test_interop_keras.py): the first three reach
# max_pool / average_pool; the others (global and adaptive pooling) run in the slow variant.
KERAS_TESTS = ["keras.src.ops.nn_test", "keras.src.layers.pooling.max_pooling_test",
               "keras.src.layers.pooling.average_pooling_test"]
KERAS_OTHER_TESTS = ["keras.src.layers.pooling.global_max_pooling_test",
                     "keras.src.layers.pooling.global_average_pooling_test",
                     "keras.src.layers.pooling.adaptive_pooling1d_test",
                     "keras.src.layers.pooling.adaptive_pooling2d_test",
                     "keras.src.layers.pooling.adaptive_pooling3d_test"]
HOOK_MODULE = "keras.src.backend.jax.nn"


def _run(modules: list[str]) -> dict:
  """This file as a script in a subprocess (Keras on JAX, no project conftest); its JSON."""
  env = dict(os.environ, KERAS_BACKEND="jax",
             PYTHONPATH=os.pathsep.join([str(ROOT), str(SUPPORT),
                                         os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, str(HERE), *modules], capture_output=True, text=True,
                        env=env, timeout=900, cwd=str(HERE.parent))
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  assert proc.returncode == 0 and lines, (
      f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
  return json.loads(lines[-1])


def _skip_unless_shipped(modules: list[str]) -> None:
  if not all(importlib.util.find_spec(m) is not None for m in modules):
    import keras
    pytest.skip(f"Keras {keras.__version__}'s wheel ships no tests (3.15.1's does)")


def _check(out: dict, at_least: int) -> None:
  assert out["exit"] == 0, out
  assert out["outcomes"].get("failed", 0) == 0 and out["outcomes"].get("error", 0) == 0, out
  # Keras 3.15.1: 66 tests of max_pool / average_pool; 142 with the other pooling modules.
  assert out["outcomes"].get("passed", 0) >= at_least, out
  pools = out["pools"]
  # optimize computed them: Keras's functions were called through it, and it replaced pools
  assert pools["calls"].get("max_pool", 0) >= 20 and pools["calls"].get("average_pool", 0) >= 20
  assert pools["replaced"].get("reduce_window_max", 0) >= 20, pools
  assert pools["replaced"].get("reduce_window_sum", 0) >= 20, pools
  assert pools["unrecognised"] == {}, pools["unrecognised"]
  assert pools["other"] == {}, pools["other"]


def test_keras_own_pooling_tests_under_optimize():
  _skip_unless_shipped(KERAS_TESTS)
  _check(_run(KERAS_TESTS), 60)


@pytest.mark.slow
def test_keras_own_pooling_tests_under_optimize_all_modules():
  _skip_unless_shipped(KERAS_TESTS + KERAS_OTHER_TESTS)
  _check(_run(KERAS_TESTS + KERAS_OTHER_TESTS), 130)


def run_keras_tests(modules: list[str]) -> dict:
  """Keras's test modules under pytest, Keras's JAX backend pooling run through optimize."""
  import framework_pools
  import keras
  assert keras.backend.backend() == "jax", keras.backend.backend()
  recorder = framework_pools.Recorder()
  recorder.patch([importlib.import_module(HOOK_MODULE)], ["max_pool", "average_pool"])
  outcomes: collections.Counter[str] = collections.Counter()

  class Outcomes:
    def pytest_runtest_logreport(self, report):
      if report.when == "call" or report.outcome != "passed":
        outcomes["error" if report.when != "call" and report.failed else report.outcome] += 1

  select = "pool and not adaptive" if modules == KERAS_TESTS else "pool"
  with tempfile.TemporaryDirectory() as tmp:
    ini = Path(tmp) / "pytest.ini"           # Keras's tests are not this project's
    ini.write_text("[pytest]\n")
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", tmp,
                        "-k", select, "--pyargs", *modules], plugins=[Outcomes()])
  return dict(exit=int(code), outcomes=dict(outcomes), pools=recorder.summary(),
              keras=keras.__version__)


if __name__ == "__main__":
  print(json.dumps(run_keras_tests(sys.argv[1:])), flush=True)
