"""``benchmarks/first_call_gpu.py --quick``: the whole path (cases, a new process per case and
implementation with an empty cache, the parts of the first call, the saved JSON) on the CPU.
Slow tier: its four child processes take about a minute on a shared CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import first_call_gpu  # noqa: E402


def test_cases_are_random_untabled_and_fixed():
  cases = first_call_gpu.make_cases(20)
  assert cases == first_call_gpu.make_cases(20)  # (a fixed seed)
  assert {len(c["window"]) for c in cases} == {1, 2, 3}
  assert {c["data_format"] for c in cases} == {"channels_last", "channels_first"}
  assert {c["dtype"] for c in cases} == set(first_call_gpu.DTYPES)
  for c in cases:
    assert all(2 <= w <= 5 for w in c["window"]) and all(1 <= s <= 3 for s in c["strides"])
    assert (c["window"], c["strides"]) not in first_call_gpu.TABLE_GEOMETRIES
  assert sum(first_call_gpu.taps(c) <= 9 for c in cases) >= 10


@pytest.mark.slow
def test_quick_run(tmp_path):
  out = tmp_path / "first_call.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "first_call_gpu.py"),
                         "--quick", "--json", str(out)], capture_output=True, text=True,
                        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  data = json.loads(out.read_text())
  assert data["summary"]["cases"] == 2 and data["summary"]["failed"] == 0
  for row in data["rows"]:
    assert set(row["parts_s"]) == {"pallas_import", "kernel_compile", "other"}
    assert row["xla"]["first_call_s"] > 0 and row["default"]["first_call_s"] > 0
