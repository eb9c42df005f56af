"""benchmarks/windows_gpu.py and windows_cpu.py run on a CPU in their ``--quick`` form.

The timings mean nothing here; the test checks that every cell is measured and written as on a
GPU: both sides of each cell, the speed-up read from them, the backend that served jaxpool's
side, the SPP rows with their byte floors, and parts merged into one JSON file.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("windows_cpu", ROOT / "benchmarks" / "windows_cpu.py")
assert spec is not None and spec.loader is not None
windows_cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(windows_cpu)


def _check_cells(cells, part):
  assert [c["strides"][0] for c in cells] == [1, 7], cells
  for c in cells:
    assert c["part"] == part and c["window"] == [7, 7] and c["taps"] == 49
    assert c["served_by"] == "XLA"  # (a CPU runs no kernel by default)
    for mode in ("fwd", "fwd_grad"):
      assert c["ms"][f"jaxpool_{mode}"] > 0 and c["ms"][f"xla_{mode}"] > 0
      assert math.isclose(c["speedup"][mode], c["ms"][f"xla_{mode}"] / c["ms"][f"jaxpool_{mode}"])


@pytest.mark.slow  # (about 15 s: a quick sweep and the SPP rows on the CPU)
def test_quick_sweep_and_spp(tmp_path, monkeypatch):
  monkeypatch.delenv("JAXPOOL_TUNE", raising=False)
  out = tmp_path / "windows.json"
  assert windows_cpu.main(["--quick", "--parts", "2d_float32,spp", "--out", str(out)]) == 0
  assert "JAXPOOL_TUNE" not in os.environ  # (the run's own setting, put back)
  result = json.loads(out.read_text())
  _check_cells(result["cells"], "2d_float32")
  assert [r["case"] for r in result["spp"]] == ["pool 5x5", "pool 9x9", "SPP block"]
  for r in result["spp"]:
    assert r["bytes"]["fwd_grad"] > r["bytes"]["fwd"] > 0
    assert r["ms"]["jaxpool_fwd_grad"] > 0 and r["ms"]["xla_fwd_grad"] > 0
  assert result["meta"]["quick"] and result["meta"]["tune"] == "cached"


@pytest.mark.slow
def test_parts_merge_into_one_file(tmp_path):
  out = tmp_path / "windows.json"
  assert windows_cpu.main(["--quick", "--parts", "2d_float32", "--out", str(out)]) == 0
  assert windows_cpu.main(["--quick", "--parts", "3d_float32", "--out", str(out)]) == 0
  parts = [c["part"] for c in json.loads(out.read_text())["cells"]]
  assert parts == ["2d_float32"] * 2 + ["3d_float32"] * 2, parts


def test_unknown_part_is_refused():
  with pytest.raises(SystemExit):
    windows_cpu.main(["--quick", "--parts", "4d_float32"])
