"""How many examples a hypothesis test draws in each tier of the tests."""

from __future__ import annotations

import os


def draws(full: int, quick: int) -> int:
  """``quick`` in ``make test`` (the tests marked slow left out: tests/conftest.py sets
  ``POOL_TESTS_QUICK``), ``full`` otherwise (``make test-all``, a plain ``pytest``)."""
  return quick if os.environ.get("POOL_TESTS_QUICK") == "1" else full
