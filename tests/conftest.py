"""Shared test setup: strict rank promotion (as Equinox's conftest), seeded generators.

Warnings are errors through ``filterwarnings`` in pyproject.toml.
"""

import zlib

import jax
import numpy as np
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng(request):
  """A NumPy generator seeded from the test's name: reproducible and distinct per test."""
  seed = zlib.crc32(request.node.nodeid.encode())
  return np.random.default_rng(seed)
