"""Every op under sharding (jit with NamedSharding inputs, shard_map) equals one device.

The checks run in one subprocess with 8 CPU devices (tests/sharding/sharding_checks.py), so that
this pytest process keeps its single device; each test below asserts on one group of its checks.
On GPUs (2 or more), ``JAXPOOL_CHECK_DEVICES=as-is python -m pytest -q
tests/sharding/test_sharding.py`` runs the same checks on them (tests/support/device_checks.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import device_checks

SCRIPT = Path(__file__).with_name("sharding_checks.py")

# Groups of checks: (name prefix, how many checks at least). A group that ran fewer checks
# than expected fails too, so a check cannot vanish silently.
# The groups marked slow run only in the script's full form (`make test-all`, the GPU session):
# `make test` runs it with --quick, which leaves them out.
GROUPS = [
    ("jit/channels_last/explicit/batch+channels/", 12, False),
    ("jit/channels_last/auto/batch+channels/", 7, True),  # (sharding_checks.SUBSET)
    ("shard_map/channels_last/", 12, False),
    ("jit/channels_first/explicit/batch+channels/", 7, True),
    ("shard_map/channels_first/", 7, True),
    ("jit/channels_last/spatial/", 3, False),
    ("jit/1d/", 1, True),
    ("jit/3d/", 1, True),
    ("jit/data_parallel/", 1, False),
    ("jit/pallas/explicit/", 1, False),
    ("shard_map/vmap_grad", 1, False),
]


@pytest.fixture(scope="module")
def results(request):
  return device_checks.run(SCRIPT, *(["--quick"] if device_checks.quick(request.config)
                                             else []), timeout=600, any_devices=True)


@pytest.mark.parametrize("prefix,minimum", [
    pytest.param(p, n, id=p.strip("/"), marks=pytest.mark.slow if slow else ())
    for p, n, slow in GROUPS])
def test_sharded_equals_one_device(results, prefix, minimum):
  device_checks.assert_group(results, prefix, minimum)


def test_every_check_is_in_a_group(results):
  names = [k for k in results if k != "summary"]
  loose = [k for k in names
           if not k.startswith("graph/") and not any(k.startswith(p) for p, _, _ in GROUPS)]
  assert not loose, loose
  assert results["summary"]["ok"] == all(results[k]["ok"] for k in names)


def test_graph_under_sharding(results):
  try:
    import jaxpool.graph  # noqa: F401
  except ImportError:
    pytest.skip("jaxpool.graph is not there yet")
  device_checks.assert_group(results, "graph/", 2)
