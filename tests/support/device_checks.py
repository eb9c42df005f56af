"""Runs a check script in its own process with 8 CPU devices and collects its JSON lines.

The scripts (``sharding_checks.py``, ``partition_checks.py``, ``optimize_sharding_checks.py``)
print one ``{"name": ..., "ok": ..., "detail": ...}`` line a check and a ``summary`` line last;
running them apart keeps this pytest process on its single device.

``sharding_checks.py`` and ``partition_checks.py`` also run on the devices a process has (2 or
more GPUs, say) with ``--devices-as-is``, or with ``JAXPOOL_CHECK_DEVICES=as-is`` in the
environment, which also lets the pytest wrappers run them that way::

  python tests/sharding/partition_checks.py --devices-as-is --quick
  JAXPOOL_CHECK_DEVICES=as-is python -m pytest -q tests/sharding/test_sharding.py \
    tests/sharding/test_partitioning.py tests/sharding/test_partitioning_spatial.py

Their meshes then span the largest power of two up to 8 of the devices (``mesh_shape``); a
check that needs more devices than that (or another platform) prints
``{"name": ..., "ok": true, "skipped": why}``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

AS_IS_FLAG = "--devices-as-is"
AS_IS_ENV = "JAXPOOL_CHECK_DEVICES"  # "as-is": the same as the flag
FAKE_DEVICES = 8  # CPU devices of the default run
_FORCE = "--xla_force_host_platform_device_count"


def check(name: str, *, results: list | None = None, skip: str | None = None,
          only: str = ""):
  """Decorator for the check scripts: runs the function at once and prints one JSON line
  ``{"name", "ok", "detail", "seconds"}``; the function's return value is the detail, an
  exception (with its traceback's tail) makes the check fail. ``results`` collects the lines
  (for a script's summary); ``skip`` (why) prints a skipped line instead of running; a name
  that does not start with ``only`` is left out."""
  def deco(fn):
    if not name.startswith(only):
      return fn
    if skip:
      out = dict(name=name, ok=True, skipped=skip, detail="")
    else:
      start = time.perf_counter()
      try:
        detail = fn()
        out = dict(name=name, ok=True, detail=detail or "")
      except Exception as e:  # noqa: BLE001  (reported; the test fails on it)
        out = dict(name=name, ok=False,
                   detail=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}")
      out["seconds"] = round(time.perf_counter() - start, 2)
    if results is not None:
      results.append(out)
    print(json.dumps(out), flush=True)
    return fn
  return deco


def quick(config) -> bool:
  """Whether this run leaves out the slow tests (the scripts then run their --quick form)."""
  return "not slow" in (config.getoption("markexpr") or "")


def devices_as_is(argv: list[str]) -> bool:
  """Whether a script runs on the process's own devices (``--devices-as-is`` or
  ``JAXPOOL_CHECK_DEVICES=as-is``) instead of 8 CPU devices."""
  value = os.environ.get(AS_IS_ENV, "").strip().lower()
  if value not in ("", "as-is"):
    raise ValueError(f"{AS_IS_ENV} must be 'as-is' or unset, got {value!r}")
  return AS_IS_FLAG in argv or value == "as-is"


def prepare(argv: list[str]) -> None:
  """Called by a check script before it imports JAX: unless the devices are taken as they are,
  8 CPU devices (``JAX_PLATFORMS=cpu`` unless set, and XLA's host device count)."""
  if devices_as_is(argv) or "jax" in sys.modules:
    return
  if _FORCE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" {_FORCE}={FAKE_DEVICES}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def mesh_shape(count: int) -> tuple[int, int]:
  """The two-axis mesh the checks split over, from the number of devices the process has.

  The meshes take the largest power of two up to 8 of the devices: ``(4, 2)`` for 8 (and
  more), ``(2, 2)`` for 4 to 7, ``(2, 1)`` for 2 and 3 (the second axis has one device: a split
  along it changes nothing).

  Raises:
    ValueError: for fewer than 2 devices.
  """
  if count < 2:
    raise ValueError(f"the checks need at least 2 devices, got {count}")
  used = 1 << (min(count, FAKE_DEVICES).bit_length() - 1)
  return (used // 2, 2) if used >= 4 else (used, 1)


# The custom calls of compiled Pallas GPU kernels (Triton, Mosaic GPU) in an XLA program's text;
# in interpret mode (on a CPU) the kernels lower to plain XLA ops instead.
GPU_KERNEL_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu")


COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def collectives(hlo: str, names=COLLECTIVES) -> list[tuple[str, int]]:
  """``(op, elements)`` of every collective instruction named in ``names`` in an HLO module's
  text (the first array of its result: an asynchronous ``-start`` returns a tuple, as XLA's GPU
  backend compiles most collectives)."""
  out = []
  # XLA's GPU backend may compile a collective-permute as a send (and a recv) between devices:
  # counted as the collective-permute it is.
  alias = {"send": "collective-permute"} if "collective-permute" in names else {}
  # (A result may be a nested tuple, as of combined permutes, and XLA writes ``/*index=5*/``
  # into long tuples: comments are dropped, any opening parentheses skipped.)
  pattern = (r"= \(*(\w+)\[([\d,]*)\][^=\n]*? (" + "|".join((*names, *alias))
             + r")(-start)?\(")
  for m in re.finditer(pattern, re.sub(r"/\*.*?\*/", "", hlo)):
    op = alias.get(m.group(3), m.group(3))
    out.append((op, math.prod(int(d) for d in m.group(2).split(",") if d)))
  return out


def communication_ops(hlo: str) -> list[str]:
  """The names of an HLO module's instructions that can move data between devices (for a
  failure's message)."""
  found = re.findall(r" ([a-z-]*(?:permute|send|recv|all-|collective|async)[a-z-]*)\(", hlo)
  return sorted(set(found))


def has_compiled_kernel(hlo: str) -> bool:
  """Whether a compiled program's text calls a compiled Pallas GPU kernel."""
  return any(call in hlo for call in GPU_KERNEL_CALLS)


def run(script: Path, *args: str, timeout: int, any_devices: bool = False) -> dict[str, dict]:
  """``{check name: result}`` of ``script`` run with 8 CPU devices; fails the test if the script
  did not reach its summary.

  With ``any_devices`` (a script that runs on the devices it finds: ``sharding_checks.py``,
  ``partition_checks.py``) and ``JAXPOOL_CHECK_DEVICES=as-is``, on the devices the process
  finds instead.
  """
  env = dict(os.environ)
  if any_devices and devices_as_is([]):
    # This pytest process may hold GPU memory of its own: the script allocates as it goes.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  else:
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" {_FORCE}={FAKE_DEVICES}"
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


def assert_group(results: dict[str, dict], prefix: str, minimum: int) -> None:
  """Asserts that at least ``minimum`` checks named ``prefix*`` ran or were skipped, and that
  none failed; skips the test when the script skipped every one of them (too few devices).

  On 8 CPU devices (the default run) no check may be skipped.
  """
  group = {k: v for k, v in results.items() if k.startswith(prefix)}
  assert len(group) >= minimum, f"only {len(group)} checks named {prefix}*: {sorted(group)}"
  failed = {k: v["detail"] for k, v in group.items() if not v["ok"]}
  assert not failed, "\n\n".join(f"{k}:\n{d}" for k, d in failed.items())
  skipped = {k: v["skipped"] for k, v in group.items() if v.get("skipped")}
  summary = results["summary"]
  if summary.get("platform") == "cpu" and summary.get("devices_used") == FAKE_DEVICES:
    assert not skipped, f"skipped on {FAKE_DEVICES} CPU devices: {skipped}"
  if skipped and len(skipped) == len(group):
    pytest.skip(f"{prefix}*: {sorted(set(skipped.values()))} ({summary.get('detail', '')})")


def part_tests(script: Path, part: str, groups: list[tuple[str, int, bool]]):
  """The tests of one ``--part`` of a checks script, for a test module to bind at its top
  level: a module fixture ``results`` (the script run once, ``--quick`` unless the slow tier
  runs), ``test_split_equals_one_device`` (one test a group: ``(name prefix, how many checks at
  least, only in the full run)``) and ``test_every_check_is_in_a_group``."""

  @pytest.fixture(scope="module")
  def results(request):
    return run(script, "--part", part, *(["--quick"] if quick(request.config) else []),
               timeout=1200, any_devices=True)

  @pytest.mark.parametrize("prefix,minimum", [
      pytest.param(p, n, id=p.strip("/"), marks=pytest.mark.slow if slow else ())
      for p, n, slow in groups])
  def test_split_equals_one_device(results, prefix, minimum):
    assert_group(results, prefix, minimum)

  def test_every_check_is_in_a_group(results):
    loose = [k for k in results
             if k != "summary" and not any(k.startswith(p) for p, _, _ in groups)]
    assert not loose, loose

  return results, test_split_equals_one_device, test_every_check_is_in_a_group
