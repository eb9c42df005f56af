"""Hypothesis strategies and small helpers shared by the functional-core tests."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import ml_dtypes
import numpy as np

# Per-dtype tolerances for sums (avg, Lp) against the float64 reference, scaled by sqrt(taps).
# bfloat16/float16 accumulate in float32, so their results are the float64 reference rounded
# once to the dtype: one unit in the last place (eps) covers them.
TOL = {
    np.dtype(np.float64): dict(rtol=1e-13, atol=1e-13),
    np.dtype(np.float32): dict(rtol=2e-6, atol=2e-6),
    np.dtype(ml_dtypes.bfloat16): dict(rtol=2**-7, atol=2**-7),
    np.dtype(np.float16): dict(rtol=2**-10, atol=2**-10),
}


def tol(dtype, taps=1):
  t = TOL[np.dtype(dtype)]
  low = np.dtype(dtype).itemsize < 4  # float32 accumulation: rounding does not grow with taps
  scale = 1.0 if low else max(1.0, float(np.sqrt(taps)))
  return dict(rtol=t["rtol"] * scale, atol=t["atol"] * scale)


def assert_bitwise(actual, expected, msg=""):
  """Same shape, dtype and bits (NaN where NaN: NaN payloads are compared as NaN)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape, (actual.shape, expected.shape, msg)
  assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype, msg)
  if np.issubdtype(actual.dtype, np.integer) or actual.dtype == np.bool_:
    np.testing.assert_array_equal(actual, expected, err_msg=msg)
    return
  a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
  np.testing.assert_array_equal(np.isnan(a64), np.isnan(e64), err_msg=f"NaN mask {msg}")
  ok = ~np.isnan(a64)
  # bitwise: compare the raw bits (distinguishes -0.0 from 0.0) of the non-NaN elements
  view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[actual.dtype.itemsize]
  np.testing.assert_array_equal(actual.view(view)[ok], expected.view(view)[ok], err_msg=msg)


def assert_same_bits(a, b, msg=""):
  """Two library results, bit for bit (including -0.0 and NaN payloads)."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype, msg)
  assert a.tobytes() == b.tobytes(), msg


def assert_trees_close(a, b, rtol=1e-5):
  """Equal to float32 rounding: two pytrees of the same structure, each leaf within ``rtol`` of
  its largest entry (in float64)."""
  import jax
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scale = max(float(np.max(np.abs(y))), 1e-30)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * scale)


def zeros_equal(actual, expected):
  """Value equality treating -0.0 == 0.0, NaN == NaN; exact otherwise."""
  np.testing.assert_array_equal(np.asarray(actual).astype(np.float64),
                                np.asarray(expected).astype(np.float64))


@st.composite
def pool_configs(draw, max_nspatial=3, allow_dilation=True, allow_ceil=True):
  """A random valid pooling configuration and input shape.

  Returns a dict with ``shape``, ``window_shape``, ``strides``, ``padding``, ``dilation``,
  ``ceil_mode``, ``data_format``.
  """
  n = draw(st.integers(1, max_nspatial))
  small = n == 3
  window = tuple(draw(st.integers(1, 2 if small else 3)) for _ in range(n))
  strides = tuple(draw(st.integers(1, 3)) for _ in range(n))
  dilation = tuple(draw(st.integers(1, 2)) if allow_dilation else 1 for _ in range(n))
  eff = [d * (k - 1) + 1 for k, d in zip(window, dilation, strict=True)]
  kind = draw(st.sampled_from(["VALID", "SAME", "SAME_LOWER", "int", "pairs"]))
  if kind == "int":
    padding = draw(st.integers(0, min(eff) - 1))
    pads = [(padding, padding)] * n
  elif kind == "pairs":
    pads = [(draw(st.integers(0, e - 1)), draw(st.integers(0, e - 1))) for e in eff]
    padding = tuple(pads)
  else:
    padding = kind
    pads = [(0, 0)] * n  # SAME never makes the padded input smaller than the window
  spatial = []
  for e, (lo, hi) in zip(eff, pads, strict=True):
    least = max(1, e - lo - hi) if kind not in ("SAME", "SAME_LOWER") else 1
    spatial.append(draw(st.integers(least, least + (3 if small else 5))))
  nbatch = draw(st.integers(0, 2))
  batch = tuple(draw(st.integers(1, 2)) for _ in range(nbatch))
  channels = draw(st.integers(1, 2))
  data_format = draw(st.sampled_from(["channels_last", "channels_first"]))
  if data_format == "channels_last":
    shape = (*batch, *spatial, channels)
  else:
    shape = (*batch, channels, *spatial)
  ceil_mode = draw(st.booleans()) if allow_ceil else False
  return dict(shape=shape, window_shape=window, strides=strides, padding=padding,
              dilation=dilation, ceil_mode=ceil_mode, data_format=data_format)


def split(cfg):
  """``(shape, kwargs)`` from a :func:`pool_configs` dict."""
  kw = dict(cfg)
  shape = kw.pop("shape")
  return shape, kw


def tie_rich(rng, shape, dtype=np.float32, specials=False):
  """Small integers (many ties), optionally sprinkled with NaN, -inf and +inf."""
  x = rng.integers(0, 4, size=shape).astype(np.float64)
  if specials:
    u = rng.random(shape)
    x[u < 0.08] = np.nan
    x[(u >= 0.08) & (u < 0.16)] = -np.inf
    x[(u >= 0.16) & (u < 0.2)] = np.inf
  return x.astype(dtype)


def unique_values(rng, shape, dtype=np.float32, spread=1.0):
  """Distinct values, well separated (for finite differences and check_grads)."""
  size = int(np.prod(shape, dtype=np.int64))
  vals = (rng.permutation(size).astype(np.float64) + 1.0) * spread / max(size, 1)
  signs = rng.choice([-1.0, 1.0], size=size)
  return (vals * signs).reshape(shape).astype(dtype)


class _XlaApi:
  """jaxpool's public functions with ``implementation="xla"`` bound: these tests own the XLA path
  (the Pallas kernels have their own suite that compares them with it)."""

  def __getattr__(self, name):
    import jaxpool

    fn = getattr(jaxpool, name)
    if name == "max_unpool":
      return fn
    return functools.partial(fn, implementation="xla")


jp = _XlaApi()
