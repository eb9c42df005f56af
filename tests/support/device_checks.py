"""Runs a check script in its own process with 8 CPU devices and collects its JSON lines.

The scripts (``sharding_checks.py``, ``partition_checks.py``, ``optimize_sharding_checks.py``)
print one ``{"name": ..., "ok": ..., "detail": ...}`` line a check and a ``summary`` line last;
running them apart keeps this pytest process on its single device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def quick(config) -> bool:
  """Whether this run leaves out the slow tests (the scripts then run their --quick form)."""
  return "not slow" in (config.getoption("markexpr") or "")


def run(script: Path, *args: str, timeout: int) -> dict[str, dict]:
  """``{check name: result}`` of ``script`` run with 8 CPU devices; fails the test if the script
  did not reach its summary."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                        text=True, timeout=timeout)
  out = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      r = json.loads(line)
      out[r["name"]] = r
  if "summary" not in out:
    pytest.fail(f"{script.name} did not finish (rc {proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return out
