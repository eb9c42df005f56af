"""Shared test setup: strict rank promotion (as Equinox's conftest), seeded generators, the
order in which ``make test``'s workers take the files.

Warnings are errors through ``filterwarnings`` in pyproject.toml.
"""

import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng(request):
  """A NumPy generator seeded from the test's name: reproducible and distinct per test."""
  seed = zlib.crc32(request.node.nodeid.encode())
  return np.random.default_rng(seed)


# The files of a minute or more (on 2 CPU cores), longest first: a check script in a subprocess
# (the partition checks' two halves, sharding_checks.py), many compiled kernels. `make test`
# (`--dist loadfile --no-loadscope-reorder`) hands out the files in the collection order, so
# its two workers start these and the short files fill in around them; a long file taken last
# would leave one worker idle while the other finishes it. The order changes no test.
FIRST = ("sharding/test_partitioning_spatial.py", "sharding/test_partitioning.py",
         "kernels/test_pallas.py", "reliability/test_reliability.py", "optimize/test_optimize.py",
         "sharding/test_sharding.py", "kernels/test_backward_blocks.py")
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
  rank = {_HERE / f: i for i, f in enumerate(FIRST)}
  items.sort(key=lambda item: rank.get(item.path, len(FIRST)))  # stable: the rest as collected
