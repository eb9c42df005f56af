"""The Pallas kernels split with the mesh: every kernel op on several devices equals one device.

The checks run in a subprocess with 8 CPU devices, the kernels in interpret mode
(tests/sharding/partition_checks.py); each test below asserts on one group of them. This file
runs the script's ``--part rest``; the Auto-mesh splits along height, width or a length run in
tests/sharding/test_partitioning_spatial.py (``--part spatial``), so that the two halves run on
``make test``'s two workers at once. Before the
kernels carried a partitioning rule, the Auto-mesh groups failed (the outputs came back replicated,
with all-reduces and all-gathers in the program) and the ``shard_map`` groups raised
(``check_vma=True`` refused the kernels' outputs).

On GPUs (2 or more), ``JAXPOOL_CHECK_DEVICES=as-is python -m pytest -q
tests/sharding/test_partitioning.py tests/sharding/test_partitioning_spatial.py`` runs the same
checks on them, the kernels compiled
(tests/support/device_checks.py); the groups that need more devices than there are are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import device_checks

SCRIPT = Path(__file__).with_name("partition_checks.py")

# (name prefix, how many checks at least (in the --quick run), only in the full run); the
# groups of the script's --part spatial are in test_partitioning_spatial.py.
GROUPS = [
    ("auto/batch/", 6, False),
    ("auto/batch+channels/", 4, False),
    ("auto/3d_depth/", 2, False),
    ("auto/channels_first/batch+channels/", 4, True),
    ("auto/vmap_grad", 1, False),
    ("auto/3d_depth+height/", 9, True),
    ("explicit/batch+channels/", 4, False),
    ("explicit/height/", 4, False),
    ("explicit/depth_one_program/", 2, False),
    ("shard_map/check_vma/", 6, False),
    ("shard_map/no_check_vma/", 4, False),
    ("shard_map/partly_manual/", 5, False),
    ("shard_map/partly_manual_one_device_axis/", 4, False),
    ("shard_map/partly_manual_mesh_context/", 1, False),
    ("tpu/batch/", 4, False),
    ("tpu/height/", 4, False),
    ("export/sharded", 1, False),
]


results, test_split_equals_one_device, test_every_check_is_in_a_group = (
    device_checks.part_tests(SCRIPT, "rest", GROUPS))


def test_the_private_jax_name_the_kernels_use_is_there():
  # jaxpool/_src/pallas/sharding/partition.py marks its primitives in this JAX-private set
  # (lowering a nested jit then keeps the devices, which custom_partitioning needs). A JAX release
  # that moves it fails here first.
  from jax._src import dispatch
  assert isinstance(dispatch.prim_requires_devices_during_lowering, set)
  from jaxpool._src.pallas.sharding import partition
  assert partition.kernel_p in dispatch.prim_requires_devices_during_lowering


_CACHE_PROGRAM = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, jaxpool
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    x = jnp.arange(2 * 8 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 8, 3)
    step = jax.jit(jax.grad(lambda v: jnp.sum(jaxpool.max_pool(
        v, (3, 3), (2, 2), 1, implementation="pallas") ** 2)))
    print(float(step(x).sum()))
""")


def test_persistent_compilation_cache_hits_in_a_second_process(tmp_path):
  # One device: the kernels lower as plain kernels (no partitioning callback), so a second
  # process finds the step in JAX's persistent compilation cache and compiles nothing new.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda: subprocess.run(  # noqa: E731
      [sys.executable, "-c", _CACHE_PROGRAM, str(tmp_path)], env=env, capture_output=True,
      text=True, timeout=300, check=True).stdout
  first = run()
  entries = sorted(p.name for p in tmp_path.iterdir())
  assert entries, "nothing was cached"
  assert run() == first
  assert sorted(p.name for p in tmp_path.iterdir()) == entries, "the second process missed"
