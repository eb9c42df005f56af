"""benchmarks/models_gpu.py runs on a CPU in its smoke form, and its rows say what they should.

The smoke form measures tiny models in this process (``--inline``): the timings mean nothing on
a CPU, but every column is computed as on a GPU (both steps compiled, optimize's report, the
float32 equality and the bfloat16 distances), and the table and the plot read the JSON back.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("equinox")
pytest.importorskip("optax")

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("models_gpu", ROOT / "benchmarks" / "models_gpu.py")
assert spec is not None and spec.loader is not None
models_gpu = importlib.util.module_from_spec(spec)
sys.modules["models_gpu"] = models_gpu
spec.loader.exec_module(models_gpu)


def _run(tmp_path, models, dtypes="float32,bfloat16", inline=True):
  out = tmp_path / "rows.json"
  code = models_gpu.main(["--smoke", "--models", models, "--dtypes", dtypes, "--reps", "2",
                          "--out", str(out)] + (["--inline"] if inline else []))
  assert code == 0
  return out, json.loads(out.read_text())["rows"]


def _check_row(row):
  assert "error" not in row, row
  assert row["ms_without"] > 0 and row["ms_with"] > 0
  assert math.isclose(row["speedup"], row["ms_without"] / row["ms_with"])
  assert row["replaced"] >= 1 and "reduce_window_max" in row["replaced_ops"], row
  assert {"build the model", "compile without optimize", "optimize: trace and plan"} <= set(
      row["phases_s"]), row
  assert row["tuning"]["seconds"] == 0.0, row      # (a CPU never tunes the GPU kernels)
  if row["dtype"] == "float32":
    f32 = row["f32_with_vs_without"]
    assert f32["loss_abs_diff"] <= 1e-6 * max(1.0, abs(row["loss_without"])), f32
    assert f32["grad_rel_l2"] <= 1e-5, f32
  else:
    for key in ("bf16_without_vs_f32", "bf16_with_vs_f32"):
      assert math.isfinite(row[key]["grad_rel_l2"]) and row[key]["grad_rel_l2"] > 0, row


def test_smoke_equinox(tmp_path, capsys):
  out, rows = _run(tmp_path, "equinox_cnn")
  assert sorted(r["dtype"] for r in rows) == ["bfloat16", "float32"]
  for row in rows:
    _check_row(row)
    # three max pools, one average pool, three ReLUs folded
    assert row["replaced_ops"] == {"custom_jvp_call(relu)": 3, "reduce_window_max": 3,
                                   "reduce_window_sum": 1}, row
  # rows accumulate: a second part (here in a child process, as on a GPU) replaces its own
  # rows and keeps the others
  _, again = _run(tmp_path, "equinox_cnn", "float32", inline=False)
  assert len(again) == 2
  _check_row(next(r for r in again if r["dtype"] == "float32"))
  merged = tmp_path / "merged.json"        # parts measured in other runs, merged
  assert models_gpu.main(["--merge", str(out), "--out", str(merged)]) == 0
  capsys.readouterr()
  assert models_gpu.main(["--table", "--out", str(merged)]) == 0
  assert capsys.readouterr().out.count("| equinox_cnn |") == 2


@pytest.mark.slow
def test_smoke_flax_and_keras(tmp_path):
  pytest.importorskip("flax")
  pytest.importorskip("matplotlib")
  if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras is not installed")
  # children: Keras relies on rank promotion, which this suite's conftest makes an error
  out, rows = _run(tmp_path, "flax_unet2d,keras_vgg16", inline=False)
  assert len(rows) == 4
  for row in rows:
    _check_row(row)
  png = tmp_path / "speedup.png"
  rows_gpu = [dict(r, smoke=False) for r in rows]  # the plot leaves smoke rows out
  models_gpu.plot(rows_gpu, str(png))
  assert png.stat().st_size > 1000


def test_unknown_model_is_refused(tmp_path, capsys):
  with pytest.raises(SystemExit):
    models_gpu.main(["--smoke", "--models", "keras_vgg19", "--out", str(tmp_path / "x.json")])
  assert "unknown model 'keras_vgg19'" in capsys.readouterr().err
