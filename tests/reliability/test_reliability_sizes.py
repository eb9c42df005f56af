"""Reliability: no size kills the process, no parameter file misleads, no zero makes a NaN.

Each section was a bug (issue 26): a huge ``output_size`` built its tables (GiBs) before any
check; ``load_params`` answered a bad file with whatever NumPy, zipfile or json raised (and
NumPy's advice to allow pickle); a float shape was truncated silently; a zero cotangent times an
infinite input made a NaN in the Lp gradient.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pickle
import re
import stat
import subprocess
import sys
import time

import hypothesis
import hypothesis.strategies as st
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
         for L, (lo, hi), k, s, d in zip(spatial, padding, window, strides, dilation, strict=True)]
  y = np.zeros((x.shape[0], *out, x.shape[-1]))
  dx = np.zeros_like(x)
  reached = np.zeros(x.shape, bool)
  for n, c in itertools.product(range(x.shape[0]), range(x.shape[-1])):
    for o in itertools.product(*map(range, out)):
      elems = []
      for t in itertools.product(*map(range, window)):
        pos = tuple(oi * s + ti * d - lo for oi, ti, s, d, (lo, _) in
                    zip(o, t, strides, dilation, padding, strict=True))
        if all(0 <= q < L for q, L in zip(pos, spatial, strict=True)):
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


# ----------------------------------------------------------------------------- sizes

LIMIT = 2**31 - 1  # docs/semantics.md, "Bad input": every size, and every plane a call makes
SMALL_PLANE = 2**22  # accepted calls at most this big are run (or traced) in the child

# A size: mostly one that breaks the limit (cheap to refuse), else a small one, else one below the
# limit that only a product (a plane) can break.
SIZES = st.one_of(st.integers(2**31, 2**40), st.integers(LIMIT - 2, LIMIT + 2),
                  st.integers(2**16, LIMIT), st.integers(2, 6))


def _refused(fn, *names):
  """``fn()`` raises a ValueError naming one of ``names`` and the limit, or a TypeError naming
  one of them; nothing else."""
  try:
    fn()
  except (ValueError, TypeError) as e:
    msg = str(e)
    assert any(n in msg for n in names), msg
    assert isinstance(e, TypeError) or "2**31 - 1" in msg, msg
    return
  raise AssertionError(f"no error naming {names}")


def _ok_or_refused(sizes, fn, shape_fn, *names):
  """Refused (named) where a size or the product of ``sizes`` passes the limit; else ``fn()``
  gives an array of shape ``shape_fn()`` (run only where it is small)."""
  if max(sizes) > LIMIT or math.prod(sizes) > LIMIT:
    _refused(fn, *names)
  else:
    hypothesis.assume(math.prod(sizes) <= SMALL_PLANE)
    assert fn().shape == shape_fn()


# The issue's examples (the first killed a 24 GiB machine: 16 GiB of bin tables), run by the child
# under its memory limit: in this process a regression could take pytest down with it.
ISSUE_SIZES = [
    (lambda x: jaxpool.adaptive_avg_pool(x, (2**31, 2)), "output_size"),
    (lambda x: jaxpool.adaptive_max_pool(x, (2**16, 2**15)), "output_size"),
    (lambda x: jaxpool.adaptive_max_pool_with_indices(x, (2**40, 2)), "output_size"),
    (lambda x: jaxpool.max_unpool(*jaxpool.max_pool_with_indices(x, (2, 2), (2, 2)),
                                  (2**16, 2**16)), "output_size"),
    (lambda x: jax.eval_shape(lambda dy: jaxpool.avg_pool_grad(dy, (1, 2**16, 2**16, 1), (2, 2),
                                                               (2, 2)),
                              jax.ShapeDtypeStruct((1, 2**15, 2**15, 1), jnp.float32)),
     "input_shape"),
]


def _size_properties(max_examples: int) -> None:
  """The properties, each a hypothesis test; run by the child process under a memory limit."""
  run = hypothesis.settings(max_examples=max_examples, deadline=None, database=None,
                            derandomize=True, suppress_health_check=list(hypothesis.HealthCheck))
  x = jnp.arange(16.0).reshape(1, 4, 4, 1)
  for call, name in ISSUE_SIZES:
    with pytest.raises(ValueError, match=f"{name}.*2\\*\\*31 - 1|2\\*\\*31 - 1.*{name}"):
      call(x)
  y, idx = jaxpool.max_pool_with_indices(x, (2, 2), (2, 2))

  @run
  @hypothesis.given(st.lists(SIZES, min_size=1, max_size=2),
                    st.sampled_from(["adaptive_avg_pool", "adaptive_max_pool",
                                     "adaptive_max_pool_with_indices"]))
  def adaptive(size, op):
    x3 = x if len(size) == 2 else x[..., 0, :]
    f = lambda: np.asarray(jax.tree.leaves(getattr(jaxpool, op)(x3, tuple(size)))[0])
    _ok_or_refused(size, f, lambda: (1, *size, 1), "output_size")

  @run
  @hypothesis.given(SIZES, SIZES)
  def unpool(a, b):
    f = lambda: jaxpool.max_unpool(y, idx, (a, b))
    if a * b < 16 and max(a, b) <= LIMIT:  # the indices of a 4x4 plane do not fit
      with pytest.raises(ValueError, match="indices must lie in"):
        f()
    elif max(a, b) <= LIMIT and a * b <= LIMIT:  # traced only: nothing is allocated
      assert jax.eval_shape(lambda y, i: jaxpool.max_unpool(y, i, (a, b)), y, idx).shape == (
          1, a, b, 1)
    else:
      _refused(f, "output_size")

  @run
  @hypothesis.given(SIZES, SIZES, SIZES, st.sampled_from(["avg", "taps"]))
  def gradients(n, a, b, op):
    shape = (n, a, b, 1)
    out = (n, (a - 2) // 2 + 1, (b - 2) // 2 + 1, 1)
    dy = jax.ShapeDtypeStruct(out, jnp.float32)
    taps = jax.ShapeDtypeStruct(out, jnp.int8)
    if op == "avg":
      f = lambda: jax.eval_shape(lambda d: jaxpool.avg_pool_grad(d, shape, (2, 2), (2, 2)), dy)
    else:
      f = lambda: jax.eval_shape(lambda d, t: jaxpool.max_pool_grad_from_taps(
          d, t, shape, (2, 2), (2, 2)), dy, taps)
    _ok_or_refused((a, b), f, lambda: shape, "input_shape")

  @run
  @hypothesis.given(st.lists(SIZES, min_size=4, max_size=4),
                    st.sampled_from(["window_shape", "strides", "dilation", "padding"]))
  def pool_arguments(sizes, name):
    v = x[..., :1]
    kw = dict(window_shape=(2, 2), strides=None, dilation=None, padding="VALID")
    kw[name] = ((sizes[0], sizes[1]), (sizes[2], sizes[3])) if name == "padding" else tuple(
        sizes[:2])
    if max(sizes if name == "padding" else sizes[:2]) > LIMIT:
      _refused(lambda: jaxpool.max_pool(v, **kw), name)
    else:  # a result (no larger than the input), or a size too large for this input
      try:
        assert jaxpool.max_pool(v, **kw).size <= v.size
      except ValueError:
        pass

  @run
  @hypothesis.given(SIZES, SIZES, st.sampled_from(["Upsample", "Pad", "Input"]))
  def graph(a, b, node):
    image = jg.Input("image", shape=(4, 4, 1))
    if node == "Upsample":
      out, build = (4 * a, 4 * b), lambda: jg.Graph(jg.Upsample("n", image, scale=(a, b)))
    elif node == "Pad":
      out, build = (4 + 2 * a, 4 + b), lambda: jg.Graph(
          jg.Pad("n", image, padding=((a, a), (0, b))))
    else:
      out, build = (a, b), lambda: jg.Graph(jg.MaxPool("n", jg.Input("image", shape=(a, b, 1))))
    if node == "Input":  # any shape within the limit: the graph is built, nothing allocated
      if max(a, b) > LIMIT:
        _refused(build, "shape")
      else:
        assert build().specs["n"].shape == (a // 2, b // 2, 1)
      return
    name = "scale" if node == "Upsample" else "padding"
    _ok_or_refused(out, lambda: build().apply({}, image=jnp.ones((1, 4, 4, 1))),
                   lambda: (1, *out, 1), name)

  for prop in (adaptive, unpool, gradients, pool_arguments, graph):
    prop()


def _child(max_examples: int, headroom: int) -> None:  # pragma: no cover - in a subprocess
  """Runs :func:`_size_properties` with the address space limited to what the process holds
  now plus ``headroom`` bytes: a call that builds anything of a refused size fails."""
  import resource  # (POSIX only)
  vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
  resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
  _size_properties(max_examples)
  print("size properties passed")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS, /proc: Linux")
def test_sizes_up_to_2_40_give_a_result_or_a_named_error_within_a_memory_bound():
  # 4 GiB beyond what the child holds after importing JAX: the smallest refused size needs 8 GiB
  # (a 2**31-element plane), the accepted ones run here at most 2**22 elements.
  code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_reliability_sizes as t; "
          "t._child(int(sys.argv[2]), 4 << 30)")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), "30"],
                        capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0 and "size properties passed" in proc.stdout, (
      f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def test_float_and_bool_sizes_are_refused():
  for shape in [(1, 8.5, 8, 1), (1, 8, np.float32(8), 1), (1, True, 8, 1), "1881", 8]:
    with pytest.raises(TypeError, match="x_shape"):
      jaxpool.make_geometry(shape, (3, 3))
  assert jaxpool.make_geometry((1, np.int64(8), np.int32(8), 1), (3, 3)).out_spatial == (6, 6)
  dy = jnp.ones((1, 3, 3, 1))
  for shape in [(1, 8.0, 8, 1), (1, True, 8, 1), (np.bool_(True), 8, 8, 1)]:
    with pytest.raises(TypeError, match="input_shape"):
      jaxpool.avg_pool_grad(dy, shape, (2, 2), (2, 2))
  x = jnp.ones((1, 4, 4, 1))
  y, i = jaxpool.max_pool_with_indices(x, (2, 2), (2, 2))
  for size in [(4.0, 4), (True, 4)]:
    with pytest.raises(TypeError, match="output_size"):
      jaxpool.max_unpool(y, i, size)
    with pytest.raises(TypeError, match="output_size"):
      jaxpool.adaptive_avg_pool(x, size)


def test_indices_of_a_plane_beyond_int32_are_refused():
  big = jax.ShapeDtypeStruct((1, 2**16, 2**15 + 1, 1), jnp.float32)  # traced: nothing allocated
  for op in (lambda v: jaxpool.max_pool_with_indices(v, (2, 2), (2, 2)),
             lambda v: jaxpool.adaptive_max_pool_with_indices(v, (3, 3))):
    with pytest.raises(ValueError, match=r"x of shape \(1, 65536, 32769, 1\).*2147549184"):
      jax.eval_shape(op, big)
  assert jax.eval_shape(lambda v: jaxpool.max_pool(v, (2, 2), (2, 2)), big).shape == (
      1, 2**15, 2**14, 1)  # no indices, no limit on the plane


def test_lp_second_order_is_zero_outside_the_window():
  x = jnp.array([jnp.inf, 1., 3., 4., jnp.nan, 2.]).reshape(1, 6, 1)
  h = np.asarray(jax.hessian(lambda v: jaxpool.lp_pool(v, 3, (2,), (2,))[0, 1, 0])(x))
  h = h[0, :, 0, 0, :, 0]
  assert np.isfinite(h).all()
  outside = np.ones((6, 6), bool)
  outside[2:4, 2:4] = False
  assert (h[outside] == 0).all() and (h[2:4, 2:4] != 0).all()


def test_graph_refuses_a_parameter_too_large_to_index():
  # Before this check, Graph(...).init(key) aborted the process inside XLA (a static extent
  # overflow of the Dense kernel's (2**62, 2) shape); now the graph refuses to be built.
  import jaxpool.graph as jg
  with pytest.raises(ValueError, match=r"node 'd' \(Dense\): parameter 'w'.*2\*\*31 - 1"):
    jg.Graph(jg.Dense("d", jg.Input("image", shape=(2**31 - 1, 2**31 - 1, 1)), features=2))
