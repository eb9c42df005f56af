"""The spellings users bring from other tools, and the near misses that get a way out.

``padding`` strings in any case, as ``lax.reduce_window`` takes them (checked against
``lax.padtype_to_pads`` and ``lax.reduce_window``'s values); and for each near miss of issue 49
(``padding=(1, 1)``, a traced window size under ``jit``, PyTorch's full ``output_size`` for
``max_unpool``, an adaptive ``output_size`` that cannot fit), an error that names the form
probably meant. ``implementation="pallas"`` on a CPU warns once that the interpreter runs it.
"""

import math
import re
import resource
import time
import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpool
from jaxpool._src import adaptive_plan, platforms
from tiers import draws

SETTINGS = hypothesis.settings(max_examples=draws(60, 30), deadline=None, derandomize=True)
STRINGS = ("VALID", "SAME", "SAME_LOWER")


def _cases(name: str, draw_case: int) -> str:
  """``name`` in one of four cases: upper, lower, capitalised, alternating."""
  return (name, name.lower(), name.capitalize(),
          "".join(c.lower() if i % 2 else c for i, c in enumerate(name)))[draw_case]


def _same_pads(L: int, e: int, s: int, lower: bool) -> tuple[int, int]:
  """SAME as TensorFlow defines it, written out: ceil(L/s) outputs, the odd element at the end
  (at the start for SAME_LOWER). Shares nothing with jaxpool's code."""
  out = math.ceil(L / s)
  total = max((out - 1) * s + e - L, 0)
  return (total - total // 2, total // 2) if lower else (total // 2, total - total // 2)


@SETTINGS
@hypothesis.given(n=st.integers(1, 3), data=st.data(), name=st.sampled_from(STRINGS),
                  case=st.integers(0, 3), ceil_mode=st.booleans(),
                  channels_last=st.booleans())
def test_string_padding_resolves_as_lax_in_any_case(n, data, name, case, ceil_mode,
                                                     channels_last):
  """The resolved pairs equal lax.padtype_to_pads (on the dilated window) and a NumPy formula;
  the output size is ceil(L/s) for SAME, and ceil_mode changes nothing with SAME."""
  L = data.draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
  k = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
  s = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
  d = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
  eff = [di * (ki - 1) + 1 for ki, di in zip(k, d, strict=True)]
  hypothesis.assume(name != "VALID" or all(Li >= e for Li, e in zip(L, eff, strict=True)))
  shape = (2, *L, 3) if channels_last else (2, 3, *L)
  fmt = "channels_last" if channels_last else "channels_first"
  geom = jaxpool.make_geometry(shape, tuple(k), tuple(s), _cases(name, case), tuple(d),
                               ceil_mode, fmt)
  want = lax.padtype_to_pads(tuple(L), tuple(eff), tuple(s), name)
  assert geom.padding == tuple(tuple(p) for p in want)
  if name == "VALID":
    assert geom.padding == ((0, 0),) * n
    plain = jaxpool.make_geometry(shape, tuple(k), tuple(s), 0, tuple(d), ceil_mode, fmt)
    assert geom.out_spatial == plain.out_spatial
  else:
    lower = name == "SAME_LOWER"
    assert geom.padding == tuple(_same_pads(Li, e, si, lower)
                                 for Li, e, si in zip(L, eff, s, strict=True))
    assert geom.out_spatial == tuple(math.ceil(Li / si) for Li, si in zip(L, s, strict=True))
    assert geom.extra == (0,) * n  # ceil_mode adds no overhang to SAME


# (n spatial dims, layout, padding as written): each string twice, each (n, layout) once.
VALUE_CASES = [(1, "channels_last", "same"), (1, "channels_first", "Valid"),
               (2, "channels_last", "same_lower"), (2, "channels_first", "Same"),
               (3, "channels_last", "valid"), (3, "channels_first", "Same_Lower")]


def _reduce_window_max(x, window, strides, padding, dilation, fmt):
  n = len(window)
  if fmt == "channels_last":
    full = lambda v, fill: (fill,) + tuple(v) + (fill,)  # noqa: E731
  else:
    full = lambda v, fill: (fill, fill) + tuple(v)  # noqa: E731
  assert len(full(window, 1)) == x.ndim == n + 2
  return lax.reduce_window(x, -jnp.inf, lax.max, full(window, 1), full(strides, 1), padding,
                           window_dilation=full(dilation, 1))


@pytest.mark.parametrize("n, fmt, padding", VALUE_CASES)
def test_string_padding_values_equal_lax_reduce_window_under_jit(rng, n, fmt, padding):
  L, k, s, d = (7, 6, 5)[:n], (3, 2, 3)[:n], (2, 3, 2)[:n], (1, 2, 1)[:n]
  shape = (2, *L, 3) if fmt == "channels_last" else (2, 3, *L)
  x = jnp.asarray(rng.integers(-3, 4, size=shape).astype(np.float32))  # ties
  pool = jax.jit(lambda x: jaxpool.max_pool(x, k, s, padding, dilation=d, data_format=fmt))
  want = _reduce_window_max(x, k, s, padding.upper(), d, fmt)
  np.testing.assert_array_equal(pool(x), want)
  # lax takes the string in any case too: the same pairs.
  np.testing.assert_array_equal(_reduce_window_max(x, k, s, padding, d, fmt), want)


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["same", "SAME", "valid", "Same_Lower", "same_lower"])
@pytest.mark.parametrize("fmt", ["channels_last", "channels_first"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_string_padding_values_every_case(rng, n, fmt, padding):
  """The whole grid of the test above (make test-all)."""
  test_string_padding_values_equal_lax_reduce_window_under_jit(rng, n, fmt, padding)


def test_every_op_that_takes_padding_takes_any_case(rng):
  """The pools, with_indices/with_taps, the gradients, the Flax function and the graph's node:
  "same" gives what "SAME" gives."""
  x = jnp.asarray(rng.standard_normal((1, 5, 5, 2)).astype(np.float32))
  dy = jnp.ones((1, 3, 3, 2), jnp.float32)
  from jaxpool.interop import flax_linen
  calls = {
      "max_pool": lambda p: jaxpool.max_pool(x, (3, 3), (2, 2), p),
      "min_pool": lambda p: jaxpool.min_pool(x, (3, 3), (2, 2), p),
      "avg_pool": lambda p: jaxpool.avg_pool(x, (3, 3), (2, 2), p),
      "lp_pool": lambda p: jaxpool.lp_pool(x, 2.0, (3, 3), (2, 2), p),
      "with_indices": lambda p: jaxpool.max_pool_with_indices(x, (3, 3), (2, 2), p)[1],
      "with_taps": lambda p: jaxpool.max_pool_with_taps(x, (3, 3), (2, 2), p)[1],
      "max_pool_grad": lambda p: jaxpool.max_pool_grad(x, dy, (3, 3), (2, 2), p),
      "avg_pool_grad": lambda p: jaxpool.avg_pool_grad(dy, x.shape, (3, 3), (2, 2), p),
      "flax_linen": lambda p: flax_linen.max_pool(x, (3, 3), (2, 2), p),
  }
  for name, call in calls.items():
    np.testing.assert_array_equal(call("same"), call("SAME"), err_msg=name)
  from jaxpool import graph
  node = graph.MaxPool("p", graph.Input("x", (5, 5, 2)), window=(3, 3), strides=(2, 2),
                       padding="same_lower")
  assert node.padding == "SAME_LOWER"


def test_an_unknown_padding_string_names_the_forms():
  x = jnp.zeros((1, 4, 4, 1))
  with pytest.raises(ValueError, match=re.escape("'VALID', 'SAME', 'SAME_LOWER' (in any case)")
                     + ".*'full'"):
    jaxpool.max_pool(x, (2, 2), padding="full")


# ----------------------------------------------------------------------------- near misses


def test_padding_of_two_ints_names_the_int_form():
  """Issue 49: ``padding=(1, 1)`` said only "must be a sequence of (lo, hi) pairs"."""
  x = jnp.zeros((2, 8, 8, 3))
  with pytest.raises(TypeError, match=re.escape("did you mean padding=1 (1 on both sides of "
                                                "every spatial dim), or padding=((1, 1), (1, 1))")):
    jaxpool.max_pool(x, (3, 3), padding=(1, 1))
  with pytest.raises(TypeError, match=re.escape("padding=((1, 1), (2, 2)) (a (lo, hi) pair")):
    jaxpool.avg_pool(x, (3, 3), padding=(1, 2))


def test_a_traced_window_size_names_static_argnums():
  """Issue 49: ``jax.jit(lambda x, k: max_pool(x, k))(x, 3)`` said "must be a tuple of ints;
  got (JitTracer...)"."""
  x = jnp.zeros((2, 8, 8, 3))
  with pytest.raises(TypeError, match="window_shape must be static.*static_argnums.*"
                     "static_argnames"):
    jax.jit(lambda x, k: jaxpool.max_pool(x, k))(x, 3)
  with pytest.raises(TypeError, match="strides must be static.*static_argnums"):
    jax.jit(lambda x, s: jaxpool.max_pool(x, (2, 2), (s, s)))(x, 2)
  with pytest.raises(TypeError, match="output_size must be static.*static_argnums"):
    jax.jit(lambda x, o: jaxpool.adaptive_avg_pool(x, o))(x, (4, 4))
  # The way out that the message names works:
  f = jax.jit(lambda x, k: jaxpool.max_pool(x, k), static_argnums=1)
  assert f(x, (3, 3)).shape == (2, 6, 6, 3)


def test_max_unpool_with_a_full_output_size_names_the_spatial_size():
  """Issue 49: PyTorch's full output size said "y must have at least 5 dims"."""
  x = jnp.arange(2 * 8 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 8, 3)
  y, idx = jaxpool.max_pool_with_indices(x, (2, 2), (2, 2))
  with pytest.raises(ValueError, match=re.escape("output_size is the unpooled spatial shape")
                     + ".*" + re.escape("output_size=(8, 8)")):
    jaxpool.max_unpool(y, idx, (2, 8, 8, 3))
  yc, ic = jnp.moveaxis(y, -1, 1), jnp.moveaxis(idx, -1, 1)
  with pytest.raises(ValueError, match=re.escape("output_size=(8, 8)")):
    jaxpool.max_unpool(yc, ic, (2, 3, 8, 8), data_format="channels_first")
  np.testing.assert_array_equal(jaxpool.max_unpool(y, idx, (8, 8)).max(), x.max())


def _vm_bytes() -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmSize:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmSize")


@pytest.mark.parametrize("pool", [jaxpool.adaptive_avg_pool, jaxpool.adaptive_max_pool])
def test_an_adaptive_output_size_that_cannot_fit_fails_before_any_table(monkeypatch, pool):
  """Issue 49: ``output_size=(2**31 - 1, 1)`` built 16 GiB of host tables before failing.

  The machine's memory is fixed at 16 GiB (so the rule, not this machine, decides), and the
  call runs under an address-space limit of 1 GiB above what the process holds: a table of
  that size would fail with MemoryError at once, never allocate. It must fail in well under a
  second, on its size."""
  monkeypatch.setattr(adaptive_plan, "host_memory", lambda: 16 * 2**30, raising=False)
  monkeypatch.setattr(adaptive_plan, "device_memory", lambda: 16 * 2**30, raising=False)
  x = jnp.zeros((1, 4, 4, 1))
  soft, hard = resource.getrlimit(resource.RLIMIT_AS)
  limit = _vm_bytes() + 2**30
  start = time.perf_counter()
  resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY
                                          else min(limit, hard), hard))
  try:
    with pytest.raises(ValueError, match=re.escape("output_size=(2147483647, 1) cannot fit")
                       + ".*pooled spatial size"):
      pool(x, (2**31 - 1, 1))
  finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
  assert time.perf_counter() - start < 1.0
  # An output that fits runs (O > L: the scatter tables).
  assert pool(x, (9, 1)).shape == (1, 9, 1, 1)


# ----------------------------------------------------------------------------- Pallas on a CPU


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter runs on a CPU")
def test_pallas_on_a_cpu_warns_once_that_it_interprets(monkeypatch):
  monkeypatch.setattr(platforms, "_interpreter_warned", False, raising=False)
  x = jnp.arange(8.0).reshape(1, 8, 1)
  with pytest.warns(jaxpool.PallasInterpreterWarning, match="Pallas interpreter"):
    jaxpool.max_pool(x, (2,), (2,), implementation="pallas")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once per process: no second warning
    y = jaxpool.max_pool(x, (2,), (2,), implementation="pallas")
  np.testing.assert_array_equal(y[0, :, 0], [1.0, 3.0, 5.0, 7.0])
  assert issubclass(jaxpool.PallasInterpreterWarning, UserWarning)
