"""Reliability: no size kills the process, no parameter file misleads, no zero makes a NaN.

Each section was a bug (issue 26): a huge ``output_size`` built its tables (GiBs) before any
check; ``load_params`` answered a bad file with whatever NumPy, zipfile or json raised (and
NumPy's advice to allow pickle); a float shape was truncated silently; a zero cotangent times an
infinite input made a NaN in the Lp gradient.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import stat
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool
from jaxpool import graph as jg

# ----------------------------------------------------------------------------- Lp: inf and NaN


def _lp_reference(x, dy, p, window, strides, padding, dilation):
  """``(y, dx)`` of Lp pooling on ``x: (N, *spatial, C)`` in float64, written from the rule in
  docs/semantics.md, one window at a time (no jaxpool code): a window with a NaN outputs NaN,
  else one with an infinity outputs inf; the window's largest elements (its NaNs, else its
  infinities) get ``sign(x)`` (1 for NaN) times the cotangent, the others the limit of
  ``sign(x) (|x|/y)^(p-1)``: 0 for p > 1, ``sign(x)`` for p == 1."""
  x = np.asarray(x, np.float64)
  spatial = x.shape[1:-1]
  out = [(L + lo + hi - d * (k - 1) - 1) // s + 1
         for L, (lo, hi), k, s, d in zip(spatial, padding, window, strides, dilation)]
  y = np.zeros((x.shape[0], *out, x.shape[-1]))
  dx = np.zeros_like(x)
  reached = np.zeros(x.shape, bool)
  for n, c in itertools.product(range(x.shape[0]), range(x.shape[-1])):
    for o in itertools.product(*map(range, out)):
      elems = []
      for t in itertools.product(*map(range, window)):
        pos = tuple(oi * s + ti * d - lo for oi, ti, s, d, (lo, _) in
                    zip(o, t, strides, dilation, padding))
        if all(0 <= q < L for q, L in zip(pos, spatial)):
          elems.append((n, *pos, c))
      v = np.array([x[e] for e in elems])
      g = dy[(n, *o, c)]
      if np.isnan(v).any():
        yo, top = np.nan, np.isnan(v)
      elif np.isinf(v).any():
        yo, top = np.inf, np.isinf(v)
      else:
        m = np.abs(v).max() if v.size else 0.0
        yo = 0.0 if m == 0 else m * np.sum((np.abs(v) / m) ** p) ** (1 / p)
        top = None
      y[(n, *o, c)] = yo
      for i, e in enumerate(elems):
        if top is not None:  # NaN or inf window
          sign = 1.0 if np.isnan(v[i]) else np.sign(v[i])
          w = sign if (top[i] or p == 1) else 0.0
        elif yo == 0:
          w = 0.0
        else:
          w = np.sign(v[i]) * (abs(v[i]) / yo) ** (p - 1)
        dx[e] += g * w
        reached[e] |= g != 0
  return y, dx, reached


LP_CONFIGS = [
    # window, strides, padding, dilation, input spatial
    ((2,), (2,), ((0, 0),), (1,), (10,)),
    ((3,), (1,), ((1, 1),), (1,), (9,)),
    ((2,), (1,), ((1, 0),), (2,), (8,)),
    ((2, 2), (1, 1), ((0, 1), (1, 0)), (1, 1), (4, 5)),
    ((2, 3), (2, 1), ((1, 1), (0, 2)), (1, 2), (5, 6)),
]


@pytest.mark.parametrize("p", [1, 1.5, 2, 3])
@pytest.mark.parametrize("cfg", LP_CONFIGS, ids=lambda c: f"w{c[0]}s{c[1]}d{c[3]}")
def test_lp_gradient_with_inf_and_nan_matches_reference(rng, p, cfg):
  window, strides, padding, dilation, spatial = cfg
  shape = (2, *spatial, 2)
  x = rng.uniform(-3, 3, shape).astype(np.float32)
  special = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), shape)
  x = np.where(rng.random(shape) < 0.2, special, x)
  kw = dict(strides=strides, padding=padding, dilation=dilation)
  y = jaxpool.lp_pool(x, p, window, **kw)
  dy = rng.uniform(0.5, 2, y.shape).astype(np.float32)
  dy = np.where(rng.random(y.shape) < 0.5, np.float32(0), dy)  # zero cotangents
  y_ref, dx_ref, reached = _lp_reference(x, dy, p, window, strides, padding, dilation)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-6)
  _, vjp = jax.vjp(lambda v: jaxpool.lp_pool(v, p, window, **kw), jnp.asarray(x))
  for dx in (vjp(jnp.asarray(dy))[0], jaxpool.lp_pool_grad(x, dy, p, window, **kw)):
    dx = np.asarray(dx)
    assert np.isfinite(dx).all(), dx
    assert (dx[~reached] == 0).all()  # exactly 0 where no nonzero cotangent reaches
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_forward_mode_with_inf_and_nan(p):
  """Forward mode is the same rule: a zero tangent gives exactly 0, and jacfwd == jacrev."""
  x = jnp.array([jnp.inf, 1., 3., 4., jnp.nan, 2., -jnp.inf, 5., 0., 0.]).reshape(1, 10, 1)
  f = lambda v: jaxpool.lp_pool(v, p, (2,), (2,))
  jf, jr = jax.jacfwd(f)(x), jax.jacrev(f)(x)
  assert np.isfinite(np.asarray(jf)).all()
  np.testing.assert_array_equal(np.asarray(jf), np.asarray(jr))


def test_lp_issue_example_is_zero_outside_the_window():
  v = jnp.array([jnp.inf, 1., 3., 4.]).reshape(1, 4, 1)
  g = jax.grad(lambda v: jaxpool.lp_pool(v, 2, (2,), (2,))[0, 1, 0])(v)
  g = np.asarray(g)[0, :, 0]
  np.testing.assert_array_equal(g[:2], [0., 0.])  # was [nan, 0]: 0 * inf
  np.testing.assert_allclose(g[2:], [0.6, 0.8], rtol=1e-6)


# ----------------------------------------------------------------------------- parameter files


def _params():
  return {"conv": {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
                   "b": jnp.array([1.5, -2.0], jnp.float32)},
          "odd/name": {"n": jnp.array([3], jnp.int32)},
          "empty": {}}


def _same(back, params):
  assert list(back) == list(params)
  for node in params:
    assert list(back[node]) == list(params[node])
    for k, v in params[node].items():
      assert back[node][k].dtype == v.dtype and back[node][k].shape == v.shape
      np.testing.assert_array_equal(np.asarray(back[node][k]).view(np.uint8),
                                    np.asarray(v).view(np.uint8))


def _load_or_error(path):
  """The load's result, or the ParamsFileError (anything else fails the test)."""
  start = time.perf_counter()
  try:
    return jg.load_params(path)
  except jg.ParamsFileError as e:
    assert repr(str(path)) in str(e) and "allow_pickle" not in str(e), str(e)
    return e
  finally:
    assert time.perf_counter() - start < 1.0


def test_params_file_truncated_at_every_offset_and_every_byte_flipped(tmp_path):
  params = _params()
  good = tmp_path / "params.npz"
  jg.save_params(good, params)
  data = good.read_bytes()
  bad = tmp_path / "bad.npz"
  loaded = errors = 0
  cases = [data[:n] for n in range(len(data))]
  for i in range(len(data)):
    flipped = bytearray(data)
    flipped[i] ^= 0xFF
    cases.append(bytes(flipped))
  for case in cases:
    bad.write_bytes(case)
    out = _load_or_error(bad)
    if isinstance(out, jg.ParamsFileError):
      errors += 1
    else:
      _same(out, params)
      loaded += 1
  assert errors > len(data)  # every truncation, and most flips, are errors
  _same(jg.load_params(good), params)


def _npz(path, **arrays):
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def _meta(**over):
  meta = {"format": "jaxpool.graph arrays 1", "nodes": ["fc"], "dtypes": {}}
  meta.update(over)
  return np.asarray(json.dumps(meta))


@pytest.mark.parametrize("kind", [
    "empty", "text", "pickle", "npy", "npz_without_metadata", "object_array", "bad_json",
    "meta_not_a_dict", "unknown_format", "array_of_unlisted_node", "dtype_without_array",
    "unknown_dtype", "dtype_width_mismatch", "key_without_slash", "compressed"])
def test_bad_parameter_files_raise_params_file_error(tmp_path, kind):
  path = tmp_path / f"{kind}.npz"
  w = np.ones((2, 2), np.float32)
  if kind == "empty":
    path.write_bytes(b"")
  elif kind == "text":
    path.write_text("hello, not parameters\n")
  elif kind == "pickle":
    path.write_bytes(pickle.dumps({"fc": {"w": w}}))
  elif kind == "npy":
    np.save(tmp_path / "x.npy", w)
    path.write_bytes((tmp_path / "x.npy").read_bytes())
  elif kind == "npz_without_metadata":
    _npz(path, **{"fc/w": w})
  elif kind == "object_array":
    _npz(path, **{"fc/w": np.array([None, 1], object), "__jaxpool__": _meta()})
  elif kind == "bad_json":
    _npz(path, **{"fc/w": w, "__jaxpool__": np.asarray("{not json")})
  elif kind == "meta_not_a_dict":
    _npz(path, **{"fc/w": w, "__jaxpool__": np.asarray("[1, 2]")})
  elif kind == "unknown_format":
    _npz(path, **{"fc/w": w, "__jaxpool__": _meta(format="other 9")})
  elif kind == "array_of_unlisted_node":
    _npz(path, **{"conv/w": w, "__jaxpool__": _meta()})
  elif kind == "dtype_without_array":
    _npz(path, **{"fc/w": w, "__jaxpool__": _meta(dtypes={"fc/v": "bfloat16"})})
  elif kind == "unknown_dtype":
    _npz(path, **{"fc/w": w.view(np.uint32), "__jaxpool__": _meta(dtypes={"fc/w": "nope"})})
  elif kind == "dtype_width_mismatch":
    _npz(path, **{"fc/w": w.view(np.uint32), "__jaxpool__": _meta(dtypes={"fc/w": "bfloat16"})})
  elif kind == "key_without_slash":
    _npz(path, **{"w": w, "__jaxpool__": _meta()})
  elif kind == "compressed":
    np.savez_compressed(path, **{"fc/w": w, "__jaxpool__": _meta()})
  with pytest.raises(jg.ParamsFileError) as e:
    jg.load_params(path)
  assert isinstance(e.value, ValueError)
  assert repr(str(path)) in str(e.value) and "allow_pickle" not in str(e.value), str(e.value)


def test_missing_file_is_an_os_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    jg.load_params(tmp_path / "missing.npz")


@pytest.mark.parametrize("leaf, what", [
    (None, "NoneType"), (np.array([None, 1], object), "ndarray"), ("text", "str"),
    (object(), "object"), (jax.random.key(0), "dtype key<fry>")])
def test_save_params_rejects_unsavable_leaves_by_path(tmp_path, leaf, what):
  path = tmp_path / "p.npz"
  with pytest.raises(TypeError, match=re.escape("params['fc']['b']")) as e:
    jg.save_params(path, {"fc": {"w": jnp.ones(2), "b": leaf}})
  assert "allow_pickle" not in str(e.value)
  assert not list(tmp_path.iterdir())  # nothing written


def test_save_params_is_atomic_and_durable(tmp_path, monkeypatch):
  path = tmp_path / "p.npz"
  jg.save_params(path, {"old": {"w": jnp.ones(2)}})
  events = []
  real_fsync, real_replace = os.fsync, os.replace

  def fsync(fd):
    events.append(("fsync", stat.S_ISDIR(os.fstat(fd).st_mode)))
    return real_fsync(fd)

  def replace(src, dst):
    events.append(("replace", os.path.dirname(src) == str(tmp_path)))
    return real_replace(src, dst)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "replace", replace)
  jg.save_params(path, _params())
  # the file synced, then renamed (from the same folder), then the folder synced
  assert events == [("fsync", False), ("replace", True), ("fsync", True)]
  _same(jg.load_params(path), _params())

  def failing_fsync(fd):
    raise OSError("disk full")

  monkeypatch.setattr(os, "fsync", failing_fsync)
  with pytest.raises(OSError, match="disk full"):
    jg.save_params(path, {"new": {"w": jnp.zeros(3)}})
  _same(jg.load_params(path), _params())  # the old file, whole
  assert [p.name for p in tmp_path.iterdir()] == ["p.npz"]  # no temp file left
