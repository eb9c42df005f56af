"""benchmarks/multi_gpu.py in a short run on 2 CPU devices (``--cpu-devices``: toy sizes, a test
of the script, not a measurement): the VGG step with its parameters and optimizer state split
over the devices (``fsdp``, and ``fsdp_bf16`` with bfloat16 all-gathers and reduce-scatters)
gives one device's loss, and the compiled program's collectives are counted, the combined
(tuple-valued) ones too; the ``no_pool`` variant runs the model without its pools. In the slow
tier (``make test-all``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optax")
pytest.importorskip("flax")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "multi_gpu.py"


@pytest.mark.slow  # (about 30 s: three compiled VGG steps in each of three variants)
def test_vgg_fsdp_mode(tmp_path):
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)  # the script forces the count
  out = tmp_path / "mg.json"
  proc = subprocess.run(
    [sys.executable, str(SCRIPT), "--cpu-devices", "2", "--parts", "vgg", "--modes",
     "one GPU,fsdp,fsdp_bf16", "--variants", "plain,optimize,no_pool", "--steps", "0",
     "--reps", "1", "--out", str(out)],
    env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
  rows = {(r["variant"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {(v, m) for v in ("plain", "optimize", "no_pool")
                       for m in ("one GPU", "fsdp", "fsdp_bf16")}
  for variant in ("plain", "optimize"):
    row = rows[variant, "fsdp"]
    assert "error" not in row, row
    assert row["devices"] == 2 and row["loss_vs_one_gpu"] < 1e-5, row
    # The step's update: each updated parameter's norm as one device's, to the bfloat16
    # model's rounding (a bias starts at zero, so after one step its norm is the norm of its
    # bfloat16 gradient: 1.5e-2 apart on the Auto mesh too). An update left out moves a
    # bias's norm by 1 (relative).
    assert row["params_vs_one_gpu"] < 5e-2, row
    assert row["update_vs_one_gpu"] < 0.3, row
    counts = row["collectives"]
    # The parameters that are split are gathered whole for the model.
    assert counts.get("all-gather", 0) >= 1, counts
    # The gradients are summed over the devices in one combined all-reduce (XLA:CPU sums the
    # split kernel's whole, then each device keeps its part), whose result is a tuple of more
    # than five arrays (the HLO text then holds "/*index=5*/" inside the result's type); its
    # largest array is the split dense kernel's gradient, 1024 x 128.
    assert counts.get("all-reduce max elems", 0) == 1024 * 128, counts

  for variant in ("plain", "optimize", "no_pool"):
    row = rows[variant, "fsdp_bf16"]
    assert "error" not in row, row
    # The forward is one device's (the model casts its parameters to bfloat16 itself). The
    # gradients are summed in bfloat16: each array's update (new minus initial values) is one
    # device's to the bfloat16 model's rounding (up to 5e-2 relative on some small array, on
    # the Auto mesh too); a gradient summed but not averaged over the 2 devices, or counted
    # twice, moves an array's update by 1 or more (relative).
    assert row["loss_vs_one_gpu"] < 1e-5 and row["update_vs_one_gpu"] < 0.3, row
    counts = row["collectives"]
    # The split parameters are gathered and their gradients reduce-scattered (the gather's
    # transpose): the split dense kernel's part (512 x 128) is the largest piece a device keeps.
    assert counts.get("all-gather", 0) >= 1, counts
    assert counts.get("reduce-scatter max elems", 0) == 512 * 128, counts
  # Without its pools the model computes something else (a strided slice for each pool).
  assert rows["no_pool", "one GPU"]["loss"] != rows["plain", "one GPU"]["loss"]
