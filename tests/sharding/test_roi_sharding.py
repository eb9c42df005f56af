"""``roi_align``'s per-image form (boxes ``(N, K, 4)`` with a mask) splits with a batch-sharded
mesh: the checks of tests/sharding/roi_checks.py, in a subprocess with 8 CPU devices (about 30 s
on 2 cores: the slow tier). Before the XLA path kept the batch as an axis, the flat ``(K, 5)``
form's program gathered the features (``roi_checks.py --before-fix`` shows it, every check
failing); the last test keeps that demonstration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("roi_checks.py")
ROOT = Path(__file__).parents[2]


def _run(*flags: str) -> tuple[int, list[dict]]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0")
  run = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True,
                       timeout=900, env=env)
  lines = [json.loads(s) for s in run.stdout.splitlines() if s.startswith("{")]
  return run.returncode, lines


@pytest.mark.slow
def test_per_image_boxes_split_with_the_batch():
  rc, checks = _run()
  assert len(checks) == 15, checks
  bad = [c for c in checks if not c["ok"]]
  assert not bad and rc == 0, bad


@pytest.mark.slow
def test_the_check_fails_for_the_flat_form():
  rc, checks = _run("--before-fix")
  assert rc == 1 and checks and not any(c["ok"] for c in checks), checks
  assert all(c["detail"]["collectives"] for c in checks), checks
