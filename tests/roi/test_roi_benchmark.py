"""The ROI benchmarks' ``--quick`` runs (on the CPU) write their JSON: ``benchmarks/roi_gpu.py``
(the baseline agrees with jaxpool, jaxpool's gradient gives the same bits over 10 runs),
``roi_max_gpu.py``, ``roi_pool_gpu.py`` and ``detection_gpu.py``. Slow tier."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def _quick(script, tmp_path):
  """The first case's rows of ``benchmarks/<script> --quick``."""
  out = tmp_path / "out.json"
  run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(out.read_text())["cases"][0]["rows"]


@pytest.mark.slow
def test_quick_benchmark_runs(tmp_path):
  rows = _quick("roi_gpu.py", tmp_path)
  assert rows["max_abs_diff_vs_plain"] < 1e-4
  assert rows["jaxpool"]["same_bits_10_runs"]
  assert rows["jaxpool"]["fwd+dx"]["ms"] > 0
  for name in ("jaxpool", "jaxpool_xla"):  # (with the box gradient)
    assert rows[name]["fwd+dx+dboxes"]["ms"] > 0
    assert rows[name]["fwd+dx+dboxes"]["same_bits_10_runs"]
  assert rows["max_abs_diff_dboxes_default_vs_xla"] < 1e-4


@pytest.mark.slow
def test_quick_max_mode_benchmark_runs(tmp_path):
  rows = _quick("roi_max_gpu.py", tmp_path)
  assert rows["jaxpool"]["fwd+dx+dboxes"]["same_bits_10_runs"]
  assert rows["max_abs_diff_default_vs_xla"]["y"] == 0  # (on a CPU both are the XLA path)


@pytest.mark.slow
def test_quick_roi_pool_benchmark_runs(tmp_path):
  rows = _quick("roi_pool_gpu.py", tmp_path)
  assert rows["same_values_and_indices_as_xla"] and rows["jaxpool"]["same_bits_10_runs"]
  assert rows["max_abs_diff_dx_vs_xla"] == 0  # (on a CPU both are the XLA path)
  assert rows["jaxpool"]["fwd+dx"]["ms"] > 0


@pytest.mark.slow
def test_quick_detection_benchmark_runs(tmp_path):
  rows = _quick("detection_gpu.py", tmp_path)
  assert all(rows[n]["step_ms"] > 0 for n in ("jaxpool", "jaxpool_xla", "plain_jnp"))
