"""``halo.join``: a split dim's halo rows joined to a device's block through the blocks' 2-D
views (the dims before the split dim, the rest flattened) puts every element where NumPy's
concatenation along that dim does, for any rank, dim, dtype and piece sizes."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import ml_dtypes
import numpy as np
from core_strategies import assert_same_bits
from hypothesis import given, settings

from jaxpool._src.pallas.sharding import halo
from tiers import draws

DTYPES = (np.float32, ml_dtypes.bfloat16, np.int8)


@st.composite
def pieces(draw):
  ndim = draw(st.integers(1, 5))
  shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
  axis = draw(st.integers(0, ndim - 1))
  rows = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
  if sum(rows) == 0:
    rows[0] = 1
  dtype = draw(st.sampled_from(DTYPES))
  seed = draw(st.integers(0, 2**31 - 1))
  return shape, axis, rows, dtype, seed


@settings(max_examples=draws(60, 30), deadline=None)
@given(pieces())
def test_join_equals_concatenation(case):
  shape, axis, rows, dtype, seed = case
  rng = np.random.default_rng(seed)
  parts = []
  for r in rows:
    s = list(shape)
    s[axis] = r
    # Random values (a misplaced element shows).
    if np.issubdtype(dtype, np.integer):
      parts.append(rng.integers(-128, 128, s).astype(dtype))
    else:
      parts.append(rng.standard_normal(s).astype(dtype))
  expected = np.concatenate(parts, axis)
  got = jax.jit(lambda *p: halo.join(list(p), axis))(*parts)
  assert_same_bits(np.asarray(got), expected, f"{shape} axis {axis} rows {rows}")


def test_join_on_a_tpu_is_the_concatenation(monkeypatch):
  # (a TPU's tiled layouts would make the 2-D views copies of their own)
  monkeypatch.setattr(halo.jax, "default_backend", lambda: "tpu")
  parts = [np.zeros((2, 1, 3), np.float32), np.ones((2, 2, 3), np.float32)]
  text = jax.jit(lambda a, b: halo.join([a, b], 1)).lower(*parts).as_text()
  assert "reshape" not in text, text
  assert_same_bits(np.asarray(jax.jit(lambda a, b: halo.join([a, b], 1))(*parts)),
                   np.concatenate(parts, 1))


def test_join_of_one_piece_is_that_piece():
  x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  assert halo.join([x], 1) is x
