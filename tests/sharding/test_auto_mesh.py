"""Data-parallel steps with the Pallas kernels on an Auto mesh equal one device and gather no
activations: ``jaxpool.optimize`` of a CNN's loss and the graph module's training step.

The checks run in one subprocess with 8 CPU devices, the kernels in interpret mode
(tests/sharding/auto_mesh_checks.py). Before the kernels carried a partitioning rule (commit
9b7a128), both failed: the compiled programs all-reduced activations (the kernels ran replicated).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import device_checks

SCRIPT = Path(__file__).with_name("auto_mesh_checks.py")


@pytest.fixture(scope="module")
def results(request):
  return device_checks.run(SCRIPT, *(["--quick"] if device_checks.quick(request.config)
                                             else []), timeout=900)


@pytest.mark.parametrize("name", [
    "optimize/auto/batch",
    pytest.param("graph/auto/batch", marks=pytest.mark.slow),
    pytest.param("layers/auto/batch", marks=pytest.mark.slow),
])
def test_auto_mesh_step_equals_one_device(results, name):
  assert name in results, sorted(results)
  assert results[name]["ok"], results[name]["detail"]
