"""jaxpool.interop.keras: one call makes Keras 3's JAX backend pool with jaxpool.

Three kinds of checks:

* **Keras's own pooling tests** (``keras/src/ops/nn_test.py``'s pooling cases and
  ``keras/src/layers/pooling/max_pooling_test.py`` / ``average_pooling_test.py``: NumPy
  references, both data formats, 1-D to 3-D, ``"valid"`` and ``"same"``), run from the installed
  Keras package with jaxpool enabled, in a subprocess. Keras 3.15.1's wheel ships its tests
  (3.10 to 3.14's do not); without them that test is skipped and the grid below is the check.
* **The grid**: ``keras.ops.max_pool`` / ``average_pool`` with jaxpool enabled against Keras's
  own functions (values and gradients) and against this suite's NumPy reference, in both data
  formats, 1-D, 2-D and 3-D, every padding Keras has, int and tuple sizes, default strides.
* **``model.fit``**: two training steps of a small CNN with jaxpool enabled against plain Keras
  (float32 losses and weights), on one device and under ``keras.distribution.DataParallel`` on 8
  CPU devices, in one subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8``); the
  subprocess also counts jaxpool's calls, so a fit that never reached jaxpool fails.

The subprocess runs this file as a script: ``python tests/interop/test_interop_keras.py [--fit]
[KERAS_TEST_MODULE ...]`` (with 8 CPU devices for ``--fit``) prints one JSON line.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if importlib.util.find_spec("keras") is None:
  pytest.skip("Keras is not installed (pip install 'jaxpool[keras]')", allow_module_level=True)
if "keras" not in sys.modules:
  os.environ["KERAS_BACKEND"] = "jax"  # Keras reads it when first imported
import keras  # noqa: E402

if keras.backend.backend() != "jax":
  pytest.skip(f"Keras was imported with the {keras.backend.backend()!r} backend",
              allow_module_level=True)

import reference as ref  # noqa: E402

import jaxpool  # noqa: E402
import jaxpool.interop.keras as jk  # noqa: E402

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
SUPPORT = ROOT / "tests" / "support"  # the NumPy reference

# Keras's pooling test modules. The first three exercise max_pool / average_pool (the functions
# enable() replaces); the others (global and adaptive pooling) do not reach them and run in the
# slow variant only, as a check that nothing else changed.
KERAS_TESTS = ["keras.src.ops.nn_test", "keras.src.layers.pooling.max_pooling_test",
               "keras.src.layers.pooling.average_pooling_test"]
KERAS_OTHER_TESTS = ["keras.src.layers.pooling.global_max_pooling_test",
                     "keras.src.layers.pooling.global_average_pooling_test",
                     "keras.src.layers.pooling.adaptive_pooling1d_test",
                     "keras.src.layers.pooling.adaptive_pooling2d_test",
                     "keras.src.layers.pooling.adaptive_pooling3d_test"]


@pytest.fixture(autouse=True)
def _restore():
  """Every test starts and ends with Keras's own pooling."""
  jk.disable()
  yield
  jk.disable()


def _subprocess(*args: str, env: dict[str, str] | None = None,
                timeout: int = 600) -> dict:
  """Runs this file as a script and returns the JSON that its last output line holds."""
  full_env = dict(os.environ, KERAS_BACKEND="jax",
                  PYTHONPATH=os.pathsep.join([str(ROOT), str(SUPPORT),
                                              os.environ.get("PYTHONPATH", "")]))
  full_env.update(env or {})
  proc = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True,
                        env=full_env, timeout=timeout, cwd=str(HERE.parent))
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  assert proc.returncode == 0 and lines, (
      f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
  return json.loads(lines[-1])


# ----------------------------------------------------------------------------- Keras's tests


def _ships_tests(modules: list[str]) -> bool:
  return all(importlib.util.find_spec(m) is not None for m in modules)


EIGHT_DEVICES = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
                 + " --xla_force_host_platform_device_count=8"}


@pytest.fixture(scope="module")
def subprocess_results():
  """One subprocess (8 CPU devices) runs the model.fit checks, then Keras's pooling tests."""
  shipped = _ships_tests(KERAS_TESTS)
  return _subprocess("--fit", *(KERAS_TESTS if shipped else []), env=EIGHT_DEVICES)


def _check_keras_tests(out, modules):
  assert out["exit"] == 0, out
  assert out["outcomes"].get("failed", 0) == 0 and out["outcomes"].get("error", 0) == 0, out
  # Keras 3.15.1: 66 tests of max_pool / average_pool; 142 with the other pooling modules.
  assert out["outcomes"].get("passed", 0) >= (60 if modules == KERAS_TESTS else 130), out
  # jaxpool computed them: the tests called the replacements, which called jaxpool.
  assert out["jaxpool_calls"].get("max_pool", 0) >= 20, out
  assert out["jaxpool_calls"].get("avg_pool", 0) >= 20, out


def _skip_unless_shipped(modules):
  if not _ships_tests(modules):
    pytest.skip(f"Keras {keras.__version__}'s wheel ships no tests (3.15.1's does); "
                f"test_backend_functions_equal_keras_and_numpy checks the same configurations "
                f"against Keras's own functions and NumPy")


def test_keras_own_pooling_tests_pass(subprocess_results):
  _skip_unless_shipped(KERAS_TESTS)
  _check_keras_tests(subprocess_results["keras_tests"], KERAS_TESTS)


@pytest.mark.slow
def test_keras_own_pooling_tests_pass_all_modules():
  modules = KERAS_TESTS + KERAS_OTHER_TESTS
  _skip_unless_shipped(modules)
  _check_keras_tests(_subprocess(*modules)["keras_tests"], modules)


def run_keras_tests(modules: list[str]) -> dict:
  """Keras's test modules under pytest with jaxpool enabled, jaxpool's calls counted."""
  calls = _count_jaxpool_calls()
  jk.enable()
  outcomes: collections.Counter[str] = collections.Counter()

  class Outcomes:
    def pytest_runtest_logreport(self, report):
      if report.when == "call" or report.outcome != "passed":
        outcomes["error" if report.when != "call" and report.failed else report.outcome] += 1

  # nn_test.py holds every op's tests: its pooling ones, without the adaptive pools (which
  # do not reach max_pool / average_pool) unless the other pooling modules run too.
  select = "pool and not adaptive" if modules == KERAS_TESTS else "pool"
  with tempfile.TemporaryDirectory() as tmp:
    # An empty ini file: Keras's tests are not this project's (no filterwarnings=error here).
    ini = Path(tmp) / "pytest.ini"
    ini.write_text("[pytest]\n")
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", tmp,
                        "-k", select, "--pyargs", *modules], plugins=[Outcomes()])
  return dict(exit=int(code), outcomes=dict(outcomes), jaxpool_calls=dict(calls),
              enabled=jk.is_enabled(), keras=keras.__version__)


def _count_jaxpool_calls(patch=setattr) -> collections.Counter[str]:
  """Counts calls of jaxpool's max_pool / avg_pool from here on (the replacements look them up
  in ``jaxpool._src.api`` at each call).

  ``patch`` sets the counting wrappers: ``monkeypatch.setattr`` in this process, so that the
  test restores jaxpool's own functions; ``setattr`` in a subprocess.
  """
  from jaxpool._src import api  # what the replacements call (the module, looked up each call)
  calls: collections.Counter[str] = collections.Counter()
  for name in ("max_pool", "avg_pool"):
    inner = getattr(api, name)

    def counted(*args, _inner=inner, _name=name, **kwargs):
      calls[_name] += 1
      return _inner(*args, **kwargs)
    patch(api, name, counted)
  return calls


# ----------------------------------------------------------------------------- the grid

# (spatial shape, pool_size, strides) per number of spatial dims; sizes as Keras's layers and
# ops take them (an int for every dim, or one per dim; strides None means pool_size).
GRID = {
    1: [((9,), 3, 2), ((8,), 2, None)],
    2: [((7, 8), (3, 2), (2, 1)), ((6, 6), 2, None)],
    3: [((5, 6, 4), (2, 3, 2), (2, 2, 1))],
}
# 1-D and 3-D channels last (Keras's default layout, which its own tests cover most) are slow.
CASES = [pytest.param(shape, pool, strides, padding, fmt, marks=(
             pytest.mark.slow if n != 2 and fmt == "channels_last" else ()))
         for n in GRID for shape, pool, strides in GRID[n]
         for padding in ("valid", "same") for fmt in ("channels_last", "channels_first")]


def _input(rng, spatial, fmt, ties=False):
  shape = (2, *spatial, 3) if fmt == "channels_last" else (2, 3, *spatial)
  if ties:
    return np.asarray(rng.integers(-2, 3, size=shape), np.float32)
  return np.asarray(rng.permutation(int(np.prod(shape))).reshape(shape), np.float32) / 7


def _ref_config(spatial, pool, strides, padding):
  n = len(spatial)
  window = (pool,) * n if isinstance(pool, int) else tuple(pool)
  steps = window if strides is None else ((strides,) * n if isinstance(strides, int)
                                          else tuple(strides))
  return window, steps, padding.upper()


@pytest.mark.parametrize("spatial,pool,strides,padding,fmt", CASES)
def test_backend_functions_equal_keras_and_numpy(rng, spatial, pool, strides, padding, fmt):
  """The replacements against Keras's own backend functions (values, gradients) and NumPy.

  Both run in one jitted program (the replacements are called directly here; the tests below
  check that keras.ops and the layers reach them once enabled).
  """
  window, steps, pad = _ref_config(spatial, pool, strides, padding)
  x = _input(rng, spatial, fmt)
  xt = _input(rng, spatial, fmt, ties=True)
  nn = importlib.import_module(jk.HOOK_MODULE)
  fns = {"max": (nn.max_pool, jk.max_pool), "avg": (nn.average_pool, jk.average_pool)}
  refs = {"max": lambda v: ref.max_pool(v, window, steps, pad, data_format=fmt),
          "avg": lambda v: ref.avg_pool(v, window, steps, pad, count_include_pad=False,
                                        data_format=fmt)}
  # Keras's own functions fail on strides=None (they convert pool_size to a full-rank window
  # and then convert that again as the strides): give them the pool size.
  keras_strides = pool if strides is None else strides
  out_shape = fns["max"][0](x, pool, keras_strides, padding, fmt).shape
  w = jnp.asarray(rng.standard_normal(out_shape), jnp.float32)

  @jax.jit
  def both(x, xt, w):
    out = {}
    for op, pair in fns.items():
      for who, f in zip(("keras", "jaxpool"), pair, strict=True):
        st = keras_strides if who == "keras" else strides
        run = lambda v, f=f, st=st: f(v, pool, st, padding, fmt)
        out[op, who] = (run(x), run(xt), jax.grad(lambda u, run=run: jnp.sum(w * run(u)))(x))
    return out

  out = both(x, xt, w)
  for op in fns:
    keras_out, ours = out[op, "keras"], out[op, "jaxpool"]
    for a, b, v in zip(ours[:2], keras_out[:2], (x, xt), strict=True):
      assert a.shape == b.shape and a.dtype == b.dtype
      if op == "max":
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      else:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(np.asarray(a), refs[op](v), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours[2]), np.asarray(keras_out[2]), rtol=1e-6,
                               atol=1e-6)


def test_strides_none(rng):
  """Keras's own backend fails on strides=None (the layers always pass strides); jaxpool's
  replacement takes it as Keras documents: strides = pool_size."""
  x = _input(rng, (6, 6), "channels_last")
  with pytest.raises(TypeError, match="inconsistent window_strides"):
    keras.ops.max_pool(x, 2)
  with jk.enabled():
    got = keras.ops.max_pool(x, (2, 2))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(keras.ops.max_pool(x, 2, 2)))


def test_layers_use_jaxpool_and_equal_keras(rng, monkeypatch):
  x = _input(rng, (8, 8), "channels_last")
  layers = [keras.layers.MaxPooling2D(3, strides=2, padding="same"),
            keras.layers.AveragePooling2D(3, strides=2, padding="same"),
            keras.layers.MaxPooling1D(2), keras.layers.AveragePooling3D(2, padding="same")]
  inputs = [x, x, x[:, 0], x[:, :4, :4, None, :].repeat(2, axis=3)]
  plain = [layer(v) for layer, v in zip(layers, inputs, strict=True)]
  calls = _count_jaxpool_calls(monkeypatch.setattr)
  with jk.enabled():
    ours = [layer(v) for layer, v in zip(layers, inputs, strict=True)]
  assert calls == {"max_pool": 2, "avg_pool": 2}
  for a, b in zip(ours, plain, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_bfloat16_is_closer_to_float32(rng):
  """jaxpool sums half precision in float32: the average is at least as close to float32's."""
  x = rng.standard_normal((2, 16, 16, 8)).astype(np.float32)
  xb = jnp.asarray(x, jnp.bfloat16)
  exact = np.asarray(keras.ops.average_pool(x, 5, 1, "same"))
  plain = np.asarray(keras.ops.average_pool(xb, 5, 1, "same"), np.float32)
  with jk.enabled():
    ours = keras.ops.average_pool(xb, 5, 1, "same")
  assert ours.dtype == jnp.bfloat16
  assert np.abs(np.asarray(ours, np.float32) - exact).max() <= np.abs(plain - exact).max()


def test_what_jaxpool_does_not_take_is_keras_own(rng):
  x = _input(rng, (4, 4), "channels_last")
  nn = importlib.import_module(jk.HOOK_MODULE)
  jk.enable()
  # a window larger than a "valid" input: Keras's (lax's) empty result
  assert nn.max_pool(x, 5, 1, "valid", "channels_last").shape == (2, 0, 0, 3)
  # Keras's backend takes "valid" / "same" only, lower case: Keras's own error
  with pytest.raises(ValueError, match="Invalid padding 'SAME'"):
    nn.average_pool(x, 2, 2, "SAME", "channels_last")


# ----------------------------------------------------------------------------- switching


def test_enable_disable_and_context(rng):
  nn = importlib.import_module(jk.HOOK_MODULE)
  own = (nn.max_pool, nn.average_pool)
  assert not jk.is_enabled()
  jk.enable()
  jk.enable()                                   # twice: still enabled, Keras's functions kept
  assert jk.is_enabled() and (nn.max_pool, nn.average_pool) == (jk.max_pool, jk.average_pool)
  jk.disable()
  jk.disable()
  assert not jk.is_enabled() and (nn.max_pool, nn.average_pool) == own
  with jk.enabled():
    assert jk.is_enabled()
    with jk.enabled(implementation="xla"):
      assert jk.is_enabled()
    assert jk.is_enabled()                      # the outer block's state comes back
  assert not jk.is_enabled() and (nn.max_pool, nn.average_pool) == own
  jk.enable()
  with pytest.raises(ZeroDivisionError), jk.enabled():
    raise ZeroDivisionError
  assert jk.is_enabled()                        # enabled before the block: still enabled


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_implementation_reaches_jaxpool(rng, implementation):
  x = _input(rng, (6, 6), "channels_first")
  want = jaxpool.max_pool(x, (2, 2), (2, 2), data_format="channels_first",
                          implementation=implementation)
  with jk.enabled(implementation=implementation):
    got = keras.ops.max_pool(x, 2, None, "valid", "channels_first")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_implementation():
  with pytest.raises(ValueError, match="implementation must be one of .*got 'cuda'"):
    jk.enable(implementation="cuda")
  assert not jk.is_enabled()


# ----------------------------------------------------------------------------- Keras moved


def _assert_unsupported(match):
  with pytest.raises(RuntimeError, match=match) as e:
    jk.enable()
  assert f"Keras {keras.__version__}" in str(e.value) and "keras>=3.10,<4" in str(e.value)
  assert not jk.is_enabled()


def test_missing_hook_names_keras_version(monkeypatch):
  nn = importlib.import_module(jk.HOOK_MODULE)
  monkeypatch.delattr(nn, "average_pool")
  _assert_unsupported("has no function average_pool")


def test_changed_signature_names_keras_version(monkeypatch):
  nn = importlib.import_module(jk.HOOK_MODULE)
  monkeypatch.setattr(nn, "max_pool", lambda inputs, pool_size, strides, padding, data_format,
                      dilation: None)
  _assert_unsupported(r"max_pool takes \(inputs, pool_size, strides, padding, data_format, "
                      r"dilation\)")


def test_moved_module_names_keras_version(monkeypatch):
  monkeypatch.setattr(importlib.import_module("keras.src.backend"), "nn", object())
  _assert_unsupported("keras.ops would not reach")
  monkeypatch.setattr(jk, "HOOK_MODULE", "keras.src.backend.jax.no_such_module")
  _assert_unsupported("cannot be imported")


def test_other_backend_is_refused(monkeypatch):
  monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
  with pytest.raises(RuntimeError, match="runs on 'torch'.*KERAS_BACKEND=jax"):
    jk.enable()


def test_importing_the_module_leaves_keras_alone():
  """Importing the module imports no Keras; enable() without KERAS_BACKEND says what to set."""
  env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
  code = ("import sys, jaxpool.interop.keras as jk\n"
          "assert 'keras' not in sys.modules\n"
          "try:\n  jk.enable()\nexcept ImportError as e:\n  print('ImportError:', e)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env=dict(env, PYTHONPATH=os.pathsep.join(
                            [str(ROOT), *filter(None, [env.get("PYTHONPATH")])])), timeout=120)
  assert proc.returncode == 0, proc.stderr
  # Keras's default backend is TensorFlow: without it (or a keras.json choosing JAX) the import
  # fails, and the message says what to set.
  if "ImportError" in proc.stdout:
    assert "set the environment variable KERAS_BACKEND=jax" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------- model.fit


def test_fit_before_enable_needs_compile(subprocess_results):
  """As docs/interop.md says: a compiled step stays; model.compile makes Keras trace anew."""
  refit = subprocess_results["fit"]["refit"]
  assert refit["kept"] == {}, refit
  assert refit["recompiled"].get("max_pool", 0) >= 2, refit


@pytest.mark.parametrize("where", ["one_device", "data_parallel"])
def test_fit_equals_plain_keras(subprocess_results, where):
  res = subprocess_results["fit"][where]
  assert res["devices"] == (8 if where == "data_parallel" else 1), res
  assert len(res["plain"]["losses"]) == 2 and len(res["jaxpool"]["losses"]) == 2
  # float32 on a CPU (jaxpool's XLA path): the same losses and the same weights after two
  # steps, bit for bit
  assert res["jaxpool"]["losses"] == res["plain"]["losses"], res
  assert res["max_weight_diff"] == 0.0, res
  assert res["jaxpool"]["calls"]["max_pool"] >= 2 and res["jaxpool"]["calls"]["avg_pool"] >= 1
  assert res["plain"]["calls"] == {}
  assert res["plain"]["losses"][0] != res["plain"]["losses"][1]  # it trained


def run_fit_checks() -> dict:
  """Two steps of ``model.fit``, plain and with jaxpool, on one device and DataParallel."""
  assert len(jax.devices()) == 8, jax.devices()
  calls = _count_jaxpool_calls()
  rng = np.random.default_rng(0)
  images = rng.standard_normal((32, 12, 12, 3)).astype(np.float32)
  labels = rng.integers(0, 4, 32).astype(np.int32)

  def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2)(x)                                      # 6x6
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.AveragePooling2D(3, strides=2, padding="same")(x)       # 3x3, real count
    x = keras.layers.MaxPooling2D(2, strides=1, padding="same")(x)
    x = keras.layers.Flatten()(x)
    model = keras.Model(inputs, keras.layers.Dense(4)(x))
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

  def fit(batch):
    losses: list[float] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda _, logs: losses.append(float(logs["loss"])))
    calls.clear()
    model = build()
    model.fit(images[:2 * batch], labels[:2 * batch], batch_size=batch, epochs=1,
              shuffle=False, verbose=0, callbacks=[cb])
    return dict(losses=losses, calls=dict(calls)), model.get_weights()

  # A model whose fit ran before enable() keeps its compiled step; model.compile makes a new one.
  model = build()
  model.fit(images[:8], labels[:8], batch_size=8, epochs=1, verbose=0)
  with jk.enabled():
    calls.clear()
    model.fit(images[:8], labels[:8], batch_size=8, epochs=1, verbose=0)
    kept = dict(calls)
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(images[:8], labels[:8], batch_size=8, epochs=1, verbose=0)
    recompiled = dict(calls)
  out: dict = {"refit": dict(kept=kept, recompiled=recompiled)}
  for where, batch in (("one_device", 8), ("data_parallel", 16)):
    if where == "data_parallel":
      keras.distribution.set_distribution(keras.distribution.DataParallel(
          devices=jax.devices()))
    plain, w_plain = fit(batch)
    with jk.enabled():
      ours, w_ours = fit(batch)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(w_plain, w_ours, strict=True))
    out[where] = dict(plain=plain, jaxpool=ours, max_weight_diff=diff,
                      devices=1 if keras.distribution.distribution() is None else
                      len(keras.distribution.distribution().device_mesh.devices.flat))
  keras.distribution.set_distribution(None)
  return out


if __name__ == "__main__":
  fit, modules = "--fit" in sys.argv[1:], [a for a in sys.argv[1:] if a != "--fit"]
  result = {"fit": run_fit_checks() if fit else None,
            "keras_tests": run_keras_tests(modules) if modules else None}
  print(json.dumps(result), flush=True)
