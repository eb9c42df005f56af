"""examples/data_parallel.py in a short run on 8 CPU devices: on an Auto and an Explicit mesh,
its first sharded step equals the single-device step (the script checks that and exits 1 if
not)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optax")
pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).parents[2] / "examples" / "data_parallel.py"


def run_example(*args: str) -> str:
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)  # the script forces 8 devices
  proc = subprocess.run([sys.executable, str(EXAMPLE), "--cpu-devices", "8", "--steps", "2",
                         "--batch-per-device", "2", *args], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
  return proc.stdout


def first_steps(out: str) -> dict[str, tuple[str, str]]:
  """``{mesh kind: (loss on one device, loss sharded)}`` from the script's output."""
  kinds = re.findall(r"^(\w+) mesh, 8 device\(s\)", out, re.M)
  losses = re.findall(r"^first step: loss one device (\S+), sharded (\S+);", out, re.M)
  assert len(kinds) == len(losses), out
  return dict(zip(kinds, losses, strict=True))


def test_auto_mesh():
  steps = first_steps(run_example("--mesh", "auto"))
  assert list(steps) == ["Auto"]
  one, sharded = steps["Auto"]
  assert one == sharded


@pytest.mark.slow
def test_both_meshes_with_the_kernels():
  out = run_example("--implementation", "pallas")
  steps = first_steps(out)
  assert list(steps) == ["Explicit", "Auto"]
  assert "implementation pallas" in out
  for one, sharded in steps.values():
    assert one == sharded
