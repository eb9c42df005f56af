"""benchmarks/models_gpu.py's driver: a row's child process, its log, its time limit, its outputs.

A stand-in child (a script that prints the progress lines a row prints, then hangs or writes a
row) checks what the parent does without measuring a model: the child's output goes to its log
file and its progress lines to the parent's output as they come; a child past its limit is
killed with everything it started, and its row names the phase it was in; the table and the
chart (an SVG written by hand when matplotlib is missing) are written beside the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("models_gpu_driver",
                                              ROOT / "benchmarks" / "models_gpu.py")
assert spec is not None and spec.loader is not None
models_gpu = importlib.util.module_from_spec(spec)
sys.modules["models_gpu_driver"] = models_gpu   # (its dataclasses look their module up)
spec.loader.exec_module(models_gpu)


def _args(tmp_path, **kw) -> argparse.Namespace:
  base = dict(out=str(tmp_path / "rows.json"), smoke=True, reps=2, batch=None, reference=True,
              cache_dir=None, timeout=60, autotune_level=0, tune="cached", wheels=None)
  return argparse.Namespace(**dict(base, **kw))


def _fake_child(tmp_path, monkeypatch, body: str) -> None:
  """Makes ``run_child`` start ``body`` (a script given the child's arguments) instead of a row."""
  script = tmp_path / "child.py"
  script.write_text(textwrap.dedent(body))
  monkeypatch.setattr(models_gpu, "__file__", str(script))


@pytest.mark.slow  # (8 s: a child that sleeps past its limit)
def test_child_past_its_limit_is_killed_and_names_its_phase(tmp_path, monkeypatch, capsys):
  pid_file = tmp_path / "grandchild.pid"
  _fake_child(tmp_path, monkeypatch, f"""
      import subprocess, sys, time
      print("[models_gpu 00:00:00] m float32: build the model done in 0.1 s", file=sys.stderr,
            flush=True)
      print("[models_gpu 00:00:00] m float32: compile without optimize ...", file=sys.stderr,
            flush=True)
      print("x" * 200000, flush=True)     # more than a pipe holds: a log file takes it
      p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
      open({str(pid_file)!r}, "w").write(str(p.pid))
      time.sleep(120)
      """)
  t0 = time.perf_counter()
  row = models_gpu.run_child("equinox_cnn", "float32", _args(tmp_path), timeout=6)
  assert time.perf_counter() - t0 < 30
  assert row["error"] == "timed out after 6 s", row
  assert row["last_phase"].endswith("compile without optimize ..."), row
  assert row["batch"] == models_gpu.CONFIGS["equinox_cnn"][1]["batch"]["float32"]
  log = Path(row["log"])
  assert log.parent == tmp_path / "models_gpu_logs" and "x" * 200000 in log.read_text()
  assert "compile without optimize ..." in capsys.readouterr().out  # echoed while it ran
  # the child's own child went with it (the process group was killed)
  pid = int(pid_file.read_text())
  for _ in range(50):
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      break
    time.sleep(0.1)
  else:
    pytest.fail(f"process {pid} outlived its row")


def test_child_row_is_read_from_its_result_file(tmp_path, monkeypatch):
  _fake_child(tmp_path, monkeypatch, """
      import json, os, sys
      result = sys.argv[sys.argv.index("--result") + 1]
      env = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "JAXPOOL_TUNE",
                                            "XLA_FLAGS", "KERAS_BACKEND")}
      row = dict(model="equinox_cnn", dtype="float32", device="fake", env=env)
      json.dump(row, open(result, "w"))
      print("{not the row}")
      """)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  row = models_gpu.run_child("equinox_cnn", "float32", _args(tmp_path, tune="off"))
  assert row["device"] == "fake" and row["wall_s"] > 0
  assert row["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert row["env"]["JAXPOOL_TUNE"] == "off" and row["env"]["KERAS_BACKEND"] == "jax"
  assert "--xla_gpu_autotune_level=0" in row["env"]["XLA_FLAGS"]
  # the row file is consumed; the log stays
  assert sorted(p.name for p in (tmp_path / "models_gpu_logs").iterdir()) == [
      "equinox_cnn-float32-smoke.log"]


def test_outputs_without_matplotlib_are_an_svg(tmp_path, monkeypatch):
  rows = [dict(model="keras_vgg16", dtype="bfloat16", device="NVIDIA H100", batch=64,
               smoke=False, speedup=1.27, ms_without=15.8, ms_with=12.5, replaced=10,
               left_alone=0, compile_s_without=20.0, compile_s_with=21.0),
          dict(model="keras_densenet121", dtype="bfloat16", device="NVIDIA H100", batch=64,
               smoke=False, error="timed out after 200 s",
               last_phase="[models_gpu 01:02:03] keras_densenet121 bfloat16 batch 64: "
                          "compile without optimize ... (at 15.0 s)")]
  path = tmp_path / "zoo.json"
  path.write_text(json.dumps(dict(rows=rows)))
  monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib fails
  written = models_gpu.write_outputs(str(path))
  assert written == [str(path), str(tmp_path / "zoo.md"), str(tmp_path / "zoo.svg")]
  md = (tmp_path / "zoo.md").read_text()
  assert "| keras_vgg16 | bfloat16 | 64 | 15.80 | 12.50 | 1.27x |" in md
  assert "timed out after 200 s (last: keras_densenet121 bfloat16 batch 64: compile " in md
  svg = ET.parse(tmp_path / "zoo.svg").getroot()
  ns = "{http://www.w3.org/2000/svg}"
  bars = svg.findall(f"{ns}rect")
  texts = [t.text for t in svg.iter(f"{ns}text")]
  assert "keras_vgg16 (bf16)" in texts and "1.27x" in texts and "NVIDIA H100" in texts
  assert len(bars) == 2                     # one bar (the failed row has none), one legend key
