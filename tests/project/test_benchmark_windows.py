"""benchmarks/windows_gpu.py and windows_cpu.py run on a CPU in their ``--quick`` form, and
docs/make_figures.py draws the sweep's heat map from their JSON.

The timings mean nothing here; the test checks that every cell is measured and written as on a
GPU: both sides of each cell, the speed-up read from them, the backend that served jaxpool's
side, the SPP and 3-D target rows with their byte floors, the SPPF step with the same loss on
both sides, and parts merged into one JSON file. The heat map's panels hold the cells' speed-ups
by window and stride class, for the parts the file holds only.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _module(name: str, path: Path):
  spec = importlib.util.spec_from_file_location(name, path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


windows_cpu = _module("windows_cpu", ROOT / "benchmarks" / "windows_cpu.py")


def _check_cells(cells, part):
  assert [c["strides"][0] for c in cells] == [1, 7], cells
  for c in cells:
    assert c["part"] == part and c["window"] == [7, 7] and c["taps"] == 49
    assert c["served_by"] == "XLA"  # (a CPU runs no kernel by default)
    for mode in ("fwd", "fwd_grad"):
      assert c["ms"][f"jaxpool_{mode}"] > 0 and c["ms"][f"xla_{mode}"] > 0
      assert math.isclose(c["speedup"][mode], c["ms"][f"xla_{mode}"] / c["ms"][f"jaxpool_{mode}"])


def _check_timed(row):
  for mode in ("fwd", "fwd_grad"):
    assert row["ms"][f"jaxpool_{mode}"] > 0 and row["ms"][f"xla_{mode}"] > 0
    assert math.isclose(row["speedup"][mode],
                        row["ms"][f"xla_{mode}"] / row["ms"][f"jaxpool_{mode}"])


@pytest.mark.slow  # (about 25 s: a quick sweep, the SPP rows, the 3-D target and SPPF on the CPU)
def test_quick_sweep_and_rows(tmp_path, monkeypatch):
  monkeypatch.delenv("JAXPOOL_TUNE", raising=False)
  out = tmp_path / "windows.json"
  parts = "2d_float32,spp,3d_target,sppf"
  assert windows_cpu.main(["--quick", "--parts", parts, "--out", str(out)]) == 0
  assert "JAXPOOL_TUNE" not in os.environ  # (the run sets none)
  result = json.loads(out.read_text())
  _check_cells(result["cells"], "2d_float32")
  assert [r["case"] for r in result["spp"]] == ["pool 5x5", "pool 9x9", "SPP block"]
  assert [r["case"] for r in result["3d_target"]] == ["pool 7x7x7"]
  for r in result["spp"] + result["3d_target"]:
    assert r["bytes"]["fwd_grad"] > r["bytes"]["fwd"] > 0
    _check_timed(r)
  target = result["3d_target"][0]
  assert target["window"] == [7, 7, 7] and target["strides"] == [1, 1, 1]
  assert target["shape"] == [1, 8, 8, 8, 2] and target["served_by"] == "XLA"
  assert target["target"] == {"fwd_grad_speedup_at_least": 5.0,
                              "met": target["speedup"]["fwd_grad"] >= 5.0}
  # x (2 KiB of float32) read and y written; + the taps (int16 for 343 taps), dy, dx
  assert target["bytes"] == {"fwd": 2 * 4096, "fwd_grad": 2 * 4096 + 2 * 2048 + 2 * 4096}
  (step,) = result["sppf"]
  assert step["case"] == "SPPF step" and step["dtype"] == "float32" and step["window"] == [5, 5]
  _check_timed(step)
  assert step["target"]["met"] == (step["speedup"]["fwd_grad"] >= 1.0)
  # the same model on both sides: max pools of equal values, so equal losses
  assert math.isclose(step["loss"]["jaxpool"], step["loss"]["xla"], rel_tol=1e-6)
  assert set(result["meta"]["part_seconds"]) == set(parts.split(","))
  # (the library's default launches, what a user's call gets, unless JAXPOOL_TUNE says else;
  # each part records its mode)
  assert result["meta"]["quick"] and result["meta"]["tune"] == "model"
  assert {p["tune"] for p in result["meta"]["part_seconds"].values()} == {"model"}


@pytest.mark.slow
def test_parts_merge_into_one_file(tmp_path):
  out = tmp_path / "windows.json"
  assert windows_cpu.main(["--quick", "--parts", "2d_float32", "--out", str(out)]) == 0
  assert windows_cpu.main(["--quick", "--parts", "3d_float32", "--out", str(out)]) == 0
  parts = [c["part"] for c in json.loads(out.read_text())["cells"]]
  assert parts == ["2d_float32"] * 2 + ["3d_float32"] * 2, parts


@pytest.mark.slow
def test_a_rerun_of_some_strides_keeps_the_other_cells(tmp_path):
  """``--strides k`` (the cells whose stride is the window) measures those cells again, in
  their place; the others stay as they were."""
  out = tmp_path / "windows.json"
  assert windows_cpu.main(["--quick", "--parts", "2d_float32", "--out", str(out)]) == 0
  before = json.loads(out.read_text())["cells"]
  assert windows_cpu.main(["--quick", "--parts", "2d_float32", "--strides", "k", "--out",
                           str(out)]) == 0
  after = json.loads(out.read_text())["cells"]
  _check_cells(after, "2d_float32")
  assert after[0] == before[0] and after[1] != before[1]
  with pytest.raises(SystemExit):
    windows_cpu.main(["--quick", "--strides", "half"])


def test_in_jit_times_calls_inside_one_jit(tmp_path, monkeypatch):
  """``--in-jit K``: each sample runs K calls inside one jit (on K copies of the inputs), so a
  cell of tens of microseconds is timed without the per-call dispatch; the file says so."""
  import pooling_gpu
  monkeypatch.setattr(pooling_gpu, "IN_JIT", 0)
  timed_args = []
  real_time_calls = pooling_gpu._time_calls

  def recording(fn, *args):
    timed_args.append(args)
    return real_time_calls(fn, *args)

  monkeypatch.setattr(pooling_gpu, "_time_calls", recording)
  out = tmp_path / "windows.json"
  assert windows_cpu.main(["--quick", "--parts", "2d_float32", "--strides", "k", "--in-jit",
                           "2", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert "each call 2 calls in one jit" in result["meta"]["timer"]
  # every timed function ran on 2 copies of its inputs, inside one jit
  assert timed_args and all(len(a) == 1 and len(a[0]) == 2 for a in timed_args), timed_args
  (cell,) = result["cells"]
  assert all(v > 0 for v in cell["ms"].values())
  with pytest.raises(SystemExit):
    windows_cpu.main(["--quick", "--in-jit", "-1"])


@pytest.mark.slow  # (about 5 s: the quick 3-D target)
def test_a_run_cut_short_keeps_its_finished_parts(tmp_path, monkeypatch):
  out = tmp_path / "windows.json"

  def cut(*args):
    raise KeyboardInterrupt  # (as a timeout's signal would stop the run)

  monkeypatch.setattr(windows_cpu.windows_gpu, "sppf", cut)
  with pytest.raises(KeyboardInterrupt):
    windows_cpu.main(["--quick", "--parts", "3d_target,sppf", "--out", str(out)])
  result = json.loads(out.read_text())
  assert [r["case"] for r in result["3d_target"]] == ["pool 7x7x7"] and result["sppf"] == []
  assert list(result["meta"]["part_seconds"]) == ["3d_target"]


def test_unknown_part_is_refused():
  with pytest.raises(SystemExit):
    windows_cpu.main(["--quick", "--parts", "4d_float32"])


@pytest.mark.slow  # (about 5 s: three training steps compiled)
def test_sppf_sides_compute_the_same_step():
  """The SPPF rows compare one model: jaxpool's and XLA's pools give the same loss and
  gradients (float32, distinct values: no ties), and the pools matter (a step without them
  differs)."""
  import jax
  import numpy as np

  windows_gpu = windows_cpu.windows_gpu
  params = windows_gpu.sppf_params(jax.random.key(0), 8)
  x = jax.random.normal(jax.random.key(1), (1, 6, 6, 8))
  steps = {name: jax.jit(jax.value_and_grad(windows_gpu.sppf_loss(pool, 3), argnums=(0, 1)))
           for name, pool in [("jaxpool", windows_gpu.jaxpool_max), ("xla", windows_gpu.xla_max),
                              ("none", lambda a, w, s: a)]}
  (loss, grads), (xla_loss, xla_grads), (none_loss, _) = (steps[n](params, x)
                                                          for n in ("jaxpool", "xla", "none"))
  np.testing.assert_allclose(loss, xla_loss, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(xla_grads), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not np.isclose(loss, none_loss, rtol=1e-3)


@functools.cache
def _figures():
  return _module("make_figures", ROOT / "docs" / "make_figures.py")


def _cell(part, k, s, fwd, fwd_grad, n=2):
  return {"part": part, "window": [k] * n, "strides": [s] * n, "shape": [1] + [9] * n + [1],
          "speedup": {"fwd": fwd, "fwd_grad": fwd_grad}}


def test_heat_map_panels_follow_the_cells():
  figures = _figures()
  result = {"cells": [_cell("3d_bfloat16", 5, 1, 4.0, 8.0, n=3),
                      _cell("3d_bfloat16", 5, 2, 0.5, 3.0, n=3),
                      _cell("2d_float32", 1, 1, 1.1, 2.2), _cell("2d_float32", 7, 7, 0.9, 0.3),
                      _cell("2d_float32", 1, 2, 1.3, 1.4)],
            "spp": [{"case": "SPP block"}]}
  panels = figures.sweep_panels(result)
  assert [p["part"] for p in panels] == ["2d_float32", "3d_bfloat16"]  # (sweep order; no SPP)
  two, three = panels
  assert two["windows"] == [1, 7] and three["windows"] == [5]
  nan = float("nan")
  # columns: stride 1, 2, k // 2, k; a stride in two classes fills both
  np.testing.assert_equal(two["speedup"]["fwd_grad"], [[2.2, 1.4, 2.2, 2.2], [nan, nan, nan, 0.3]])
  np.testing.assert_equal(three["speedup"]["fwd"], [[4.0, 0.5, 0.5, nan]])
  np.testing.assert_equal(three["strides"], [[1, 2, 2, 0]])
  assert figures.sweep_panels({"cells": [], "spp": []}) == []


def test_heat_map_renders_the_committed_results(tmp_path):
  """The committed file's sweep parts are drawn (its SPP rows are not sweep cells)."""
  figures = _figures()
  results = ROOT / "benchmarks" / "results" / "windows_gpu_h200.json"
  parts = {c["part"] for c in json.loads(results.read_text())["cells"]}
  path = tmp_path / "sweep.png"
  assert figures.windows_sweep_figure(path, results) == [
      p for p in figures.SWEEP_PARTS if p in parts]
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
