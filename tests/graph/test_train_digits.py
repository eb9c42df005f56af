"""The digits example's training loop in a short run (a few steps), so CI stays fast."""

import importlib.util
import math
import os

import numpy as np
import pytest

from jaxpool import graph as jg

pytest.importorskip("optax")
pytest.importorskip("sklearn")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                       "train_digits.py")


def load_example():
  spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_short_training_run(tmp_path, capsys):
  example = load_example()
  result = example.main(["--steps", "60", "--epochs", "2", "--batch-size", "32",
                         "--out", str(tmp_path), "--no-progress"])
  out = capsys.readouterr().out
  # The graph summaries and the training graph's self-check are printed.
  assert "TrainingGraph:" in out and "pool1.state" in out and "MaxPoolGradient" in out
  # ... with batch norm and dropout, their gradient states and gradient nodes
  for part in ("bn1.state", "BatchNormGradient", "drop.state", "DropoutGradient"):
    assert part in out, part
  assert "max |grad difference|" in out
  assert result["grad_check_max_diff"] <= 1e-5
  assert result["steps"] == 60
  history = result["history"]
  assert len(history["loss"]) == 2                        # 44 steps per epoch: 2 epochs
  assert all(math.isfinite(v) for v in history["loss"])
  assert history["loss"][-1] < history["loss"][0]          # it learns
  # 60 steps of adam already beat chance (10%) by far; the full run reaches >= 97%.
  assert result["test_accuracy"] > 0.5
  assert f"Final test accuracy: {100 * result['test_accuracy']:.2f}%" in out
  assert f"Final train accuracy: {100 * result['train_accuracy']:.2f}%" in out
  assert result["train_accuracy"] > 0.5
  # the parameters and the running statistics were saved, read back and tested
  assert result["saved"] == [str(tmp_path / "digits_params.npz"),
                             str(tmp_path / "digits_state.npz")]
  state = jg.load_params(result["saved"][1])
  assert set(state) == {"bn1", "bn2"} and state["bn1"]["var"].shape == (32,)
  assert not np.allclose(state["bn1"]["mean"], 0)     # the running statistics moved
  assert os.path.getsize(result["plot"]) > 10_000
  assert result["plot"] == str(tmp_path / "train_digits.png")
