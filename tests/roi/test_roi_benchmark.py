"""``benchmarks/roi_gpu.py --quick`` runs (on the CPU) and writes its JSON: the baseline agrees
with jaxpool and jaxpool's gradient gives the same bits over 10 runs. Slow tier."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow
def test_quick_benchmark_runs(tmp_path):
  out = tmp_path / "roi.json"
  run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "roi_gpu.py"), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert run.returncode == 0, run.stderr[-3000:]
  rows = json.loads(out.read_text())["cases"][0]["rows"]
  assert rows["max_abs_diff_vs_plain"] < 1e-4
  assert rows["jaxpool"]["same_bits_10_runs"]
  assert rows["jaxpool"]["fwd+dx"]["ms"] > 0
  for name in ("jaxpool", "jaxpool_xla"):  # (with the box gradient)
    assert rows[name]["fwd+dx+dboxes"]["ms"] > 0
    assert rows[name]["fwd+dx+dboxes"]["same_bits_10_runs"]
  assert rows["max_abs_diff_dboxes_default_vs_xla"] < 1e-4


@pytest.mark.slow
def test_quick_roi_pool_benchmark_runs(tmp_path):
  out = tmp_path / "roi_pool.json"
  run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "roi_pool_gpu.py"), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert run.returncode == 0, run.stderr[-3000:]
  rows = json.loads(out.read_text())["cases"][0]["rows"]
  assert rows["same_values_and_indices_as_xla"] and rows["jaxpool"]["same_bits_10_runs"]
  assert rows["max_abs_diff_dx_vs_xla"] == 0  # (on a CPU both are the XLA path)
  assert rows["jaxpool"]["fwd+dx"]["ms"] > 0


@pytest.mark.slow
def test_quick_detection_benchmark_runs(tmp_path):
  out = tmp_path / "detection.json"
  run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "detection_gpu.py"), "--quick",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert run.returncode == 0, run.stderr[-3000:]
  rows = json.loads(out.read_text())["cases"][0]["rows"]
  assert all(rows[n]["step_ms"] > 0 for n in ("jaxpool", "jaxpool_xla", "plain_jnp"))
