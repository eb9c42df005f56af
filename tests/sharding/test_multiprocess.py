"""Beyond one host: the batch-split max-pool gradient with the Pallas kernels in a job of two
processes (``jax.distributed`` on localhost, CPU collectives through gloo, 2 CPU devices each)
equals one process bit for bit, under an Auto and an Explicit mesh, and stays split.

The two processes run tests/sharding/multiprocess_worker.py. Before the kernels carried a
partitioning rule (commit 9b7a128), the Auto mesh replicated the gradient on every device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
# The worker script beside this file, imported for its loss and input (pytest's importlib mode
# puts no test folder on the path).
_spec = importlib.util.spec_from_file_location("multiprocess_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
TIMEOUT_S = 300  # a hang (a process waiting for its peer forever) fails the test instead


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)  # 2 devices a process, no more
  port = str(free_port())
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), port, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=TIMEOUT_S)
      assert p.returncode == 0, f"a process failed (rc {p.returncode}):\n{out}\n{err[-3000:]}"
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()

  want = np.asarray(jax.jit(jax.grad(worker.loss))(worker.tie_rich()))
  for kind in ("Auto", "Explicit"):
    for i, out in enumerate(outs):
      [info] = [json.loads(line) for line in out.splitlines()
                if line.startswith("{") and json.loads(line)["kind"] == kind]
      assert info["kernels"], f"process {i}, {kind} mesh: the kernels did not run"
      assert info["sharded_like_input"], f"process {i}, {kind} mesh: {info}"
      assert "all-gather" not in info["collectives"], f"process {i}, {kind} mesh: {info}"
    got = np.full(want.shape, np.nan, np.float32)
    rows = []
    for i in range(2):
      held = np.load(tmp_path / f"process{i}.npz")
      mine = sorted(int(k.split("/")[1]) for k in held.files if k.startswith(kind + "/"))
      # each process holds its own two devices' blocks, not the whole gradient
      assert mine == [4 * i, 4 * i + 2], f"{kind} mesh, process {i} holds blocks {mine}"
      for start in mine:
        block = held[f"{kind}/{start}"]
        assert block.shape == (2, *want.shape[1:]), block.shape
        got[start:start + 2] = block
      rows += mine
    assert sorted(rows) == [0, 2, 4, 6]
    assert got.tobytes() == want.tobytes(), (
        f"{kind} mesh: two processes differ from one by up to {np.nanmax(np.abs(got - want))}")
