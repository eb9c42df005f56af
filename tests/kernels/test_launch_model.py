"""No first-call tax (issue 48): by default a kernel's launch comes from the cache, the shipped
table or the launch model (``tuning/model.py``), never from tuning; tuning runs on request
(``JAXPOOL_TUNE=auto``, ``jaxpool.tune.pretune``, ``python -m jaxpool.tune``). On a CPU with
the fake-CUDA harness of test_tuning.py (``config.platform`` patched, a tuner of a fake GPU).

The launch model against the committed tuning data (``benchmarks/results/tune_*.json``): its
choice on keys and on geometries held out of the fit, against the best measured candidate of
each (the figures docs/tuning.md quotes), and on shapes of benchmarks/first_call_gpu.py that no
observation holds.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import pytest

from jaxpool._src import dispatch, platforms, settings, windows
from jaxpool._src.pallas.triton import config
from jaxpool._src.pallas.triton import ops as triton
from jaxpool._src.pallas.tuning import model
from jaxpool._src.pallas.tuning import tuner as tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORTS = [os.path.join(ROOT, "benchmarks", "results", f"tune_{name}.json")
           for name in ("h200", "h100", "classes_h200")]
ENV = {"jaxpool": "0.1.0", "jax": "0.10.2", "jaxlib": "0.10.2", "device_kind": "NVIDIA H200",
       "platform_version": "cuda 12080", "driver": "570.00"}
SHAPE = (2, 9, 11, 6)


class NeverTunes(tuning.Tuner):
  """A tuner of a fake GPU that fails if asked to tune."""

  def tune(self, *args, **kwargs):
    raise AssertionError("the tuner ran")


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
  for s in settings.SETTINGS.values():
    if s.env:
      monkeypatch.delenv(s.env, raising=False)
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setattr(platforms, "compute_capability", lambda: (9, 0))
  tuner = NeverTunes(cache=str(tmp_path), env=ENV, table={})
  with tuning.using(tuner):
    yield tuner


@pytest.mark.parametrize("op", triton.OPS)
def test_the_default_never_tunes(fake_cuda, op):
  """Fails on main at 9f515a7 (the default was "auto": the tuner ran on first use)."""
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  launch = triton.launch_for(op, SHAPE, jnp.float32, geom, interpret=False)
  assert settings.get("tune") == tuning.mode() == "model"
  record = fake_cuda.records[-1]
  assert record.source == "model" and record.launch == launch


def test_a_whole_gradient_is_lowered_without_tuning(fake_cuda):
  from jaxpool._src.pallas import ops
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  loss = lambda v: jnp.sum(ops.max_pool(v, geom, interpret=False) ** 2)
  jax.jit(jax.value_and_grad(loss)).trace(jax.ShapeDtypeStruct(SHAPE, jnp.float32)).lower(
      lowering_platforms=("cuda",))
  assert {r.key.split("|")[0] for r in fake_cuda.records} == {"argmax_fwd", "max_bwd"}
  assert {r.source for r in fake_cuda.records} == {"model"}


def test_auto_tunes_and_logs_one_info_line(fake_cuda, monkeypatch, caplog):
  """``JAXPOOL_TUNE=auto``: today's behaviour, and one INFO line a process naming the kernel,
  its time and how to tune ahead (not a warning)."""
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  tuned = []

  def fake_tune(key, heuristic, cands, trial, *, budget=None):
    tuned.append(key.name())
    tuning._announce(key, 1.5)
    return tuning.Record(key.name(), heuristic, "tuned", 1.5)

  monkeypatch.setattr(fake_cuda, "tune", fake_tune)
  monkeypatch.setattr(tuning, "_ANNOUNCED", False)
  with settings.override(tune="auto"), caplog.at_level(logging.INFO, "jaxpool.tune"):
    triton.launch_for("max_fwd", SHAPE, jnp.float32, geom, interpret=False)
    triton.launch_for("avg_bwd", SHAPE, jnp.float32, geom, interpret=False)
  assert len(tuned) == 2
  lines = [r for r in caplog.records if r.levelno == logging.INFO]
  assert len(lines) == 1 and "max_fwd" in lines[0].getMessage()
  assert "pretune" in lines[0].getMessage() and "python -m jaxpool.tune" in lines[0].getMessage()


def test_cached_and_off(fake_cuda):
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  heuristic = triton.launch_for("max_fwd", SHAPE, jnp.float32, geom, interpret=True)
  with settings.override(tune="cached"):
    assert triton.launch_for("max_fwd", SHAPE, jnp.float32, geom, interpret=False) == heuristic
  assert fake_cuda.records[-1].source == "heuristic"
  n = len(fake_cuda.records)
  with settings.override(tune="off"):
    assert triton.launch_for("max_fwd", SHAPE, jnp.float32, geom, interpret=False) == heuristic
  assert len(fake_cuda.records) == n  # (the tuner is not asked)


def test_pretune_tunes_what_the_trace_calls(fake_cuda, monkeypatch):
  from jaxpool import tune
  from jaxpool._src.pallas import ops
  tuned = []

  def fake_tune(key, heuristic, cands, trial, *, budget=None):
    tuned.append(key.name())
    return tuning.Record(key.name(), cands[-1], "tuned", 0.1)

  monkeypatch.setattr(fake_cuda, "tune", fake_tune)
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  loss = lambda v: jnp.sum(ops.max_pool(v, geom, interpret=False) ** 2)
  records = tune.pretune(jax.value_and_grad(loss), jax.ShapeDtypeStruct(SHAPE, jnp.float32))
  assert sorted(k.split("|")[0] for k in tuned) == ["argmax_fwd", "max_bwd"]
  assert [r.source for r in records] == ["tuned", "tuned"]
  # Now known (memory): the default mode takes the tuned launches, and a second pretune tunes
  # nothing.
  assert [r.source for r in tune.pretune(jax.value_and_grad(loss), jnp.ones(SHAPE))] == \
      ["memory", "memory"]
  assert len(tuned) == 2


def test_a_gpu_older_than_sm80(fake_cuda, monkeypatch):
  """The kernels' PTX needs sm_80: implementation=None takes XLA, "pallas" a clear error."""
  monkeypatch.setattr(platforms, "compute_capability", lambda: (7, 5))
  assert "compute capability 8.0" in dispatch.PALLAS_TRITON.not_default("cuda")
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  with pytest.raises(RuntimeError, match=r"compute capability 8\.0.*7\.5.*implementation='xla'"):
    triton.launch_for("max_fwd", SHAPE, jnp.float32, geom, interpret=False)
  monkeypatch.setattr(platforms, "compute_capability", lambda: (8, 0))
  assert dispatch.PALLAS_TRITON.not_default("cuda") is None
  monkeypatch.setattr(platforms, "compute_capability", lambda: None)  # (a CPU device)
  assert dispatch.PALLAS_TRITON.not_default("cuda") is None


class _FakeGpu:
  def __init__(self, kind, cc):
    self.device_kind, self.compute_capability = kind, cc


def test_a_host_with_an_older_gpu_beside_a_newer_one(monkeypatch):
  """The kernels run on every device of a program: a host whose second GPU is older than
  sm_80 takes XLA by default, and the reason names that GPU. (Before, device 0 alone was
  read: (9, 0) and no reason.)"""
  devices = [_FakeGpu("NVIDIA H100 80GB HBM3", "9.0"), _FakeGpu("Tesla T4", "7.5")]
  monkeypatch.setattr(platforms.jax, "devices", lambda *a: devices)
  assert platforms.compute_capability() == (7, 5)
  reason = platforms.old_gpu()
  assert reason is not None and "Tesla T4 is 7.5" in reason
  assert "compute capability 8.0" in dispatch.PALLAS_TRITON.not_default("cuda")
  devices[1] = _FakeGpu("NVIDIA A100-SXM4-40GB", "8.0")
  assert platforms.compute_capability() == (8, 0) and platforms.old_gpu() is None
  monkeypatch.setattr(platforms.jax, "devices", lambda *a: [object()])  # (a CPU: no capability)
  assert platforms.compute_capability() is None and platforms.old_gpu() is None


# ----------------------------------------------------------------------------- the model


def _observations():
  obs = []
  for path in REPORTS:
    with open(path, encoding="utf-8") as f:
      obs += model.observations_from_report(json.load(f))
  return obs


H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
# How many keys the model's choice (and the heuristic) brings within 5% of the best measured
# candidate, each key held out of the fit with its group (``model.cross_validate``): what
# docs/tuning.md quotes. The model of 66c763d (the neighbours of one window, strides and
# dilation only; the heuristic where none) on the same data: by key 104 of 146 and 34 of 36, by
# geometry the heuristic's, 87 and 33.
HELD_OUT = {("key", H200): (146, 106, 86), ("key", H100): (36, 36, 33),
            ("geometry", H200): (146, 109, 86), ("geometry", H100): (36, 32, 33),
            ("gpu", H200): (146, 91, 86), ("gpu", H100): (36, 36, 33)}


@pytest.fixture(scope="module")
def held_out():
  obs = _observations()
  return {kind: model.summary(model.cross_validate(obs, kind))
          for kind in ("key", "geometry", "gpu")}


def test_the_model_on_held_out_keys_and_geometries(held_out):
  """Each key held out of the fit (on both GPUs), each geometry (layout, window, strides and
  dilation: every op, dtype, size and GPU of it), and each GPU's data, in turn."""
  for (kind, device), (keys, model_within, heuristic_within) in HELD_OUT.items():
    s = held_out[kind][device]
    assert (s["keys"], s["model_within"], s["heuristic_within"]) == \
        (keys, model_within, heuristic_within), (kind, device)
  # A geometry that no observation holds, on the H200: 3 in 4 keys within 5%, the mean 4% over
  # the best (the heuristic: 3 in 5, 6%).
  s = held_out["geometry"][H200]
  assert s["model_within"] / s["keys"] >= 0.74 and s["model_mean"] < 1.045
  assert s["heuristic_mean"] > 1.06


def test_the_docs_quote_the_held_out_figures(held_out):
  with open(os.path.join(ROOT, "docs", "tuning.md"), encoding="utf-8") as f:
    page = " ".join(f.read().split())
  for kind in ("key", "geometry", "gpu"):
    for device, s in held_out[kind].items():
      gpu = device.split()[1]
      label = "GPU" if kind == "gpu" else kind
      row = (f"| {label} | {gpu} | {s['keys']} | {s['model_within']} | "
             f"{s['heuristic_within']} | {s['model_mean']:.3f} | {s['heuristic_mean']:.3f} |")
      assert row in page, row


# Shapes of benchmarks/first_call_gpu.py (seed 48) that no observation holds, where the default
# launch ran slowest against a tuned one on an H200 (benchmarks/results/first_call_gpu_h200.json):
# the tuned forward's launch. Fails at dc9163b^ (the heuristic: no observation of these windows
# and strides).
FIRST_CALL = [
    # (3, 256, 127, 151) bfloat16 channels_first 3x3/(1, 2): 1.45x slower by default, the
    # forward in blocks of 1 x 4 rows of half the heuristic's tile when tuned.
    ((3, 256, 127, 151), (3, 3), (1, 2), "channels_first", jnp.bfloat16, (32, 8, 8, 1, 4)),
    ((4, 256, 113, 153), (2, 3), (1, 1), "channels_first", jnp.bfloat16, (32, 8, 8, 1, 4)),
    # (128, 90, 143, 16) float32 channels_last 2x4/(1, 2): 1.31x, blocks of 1 x 2 rows.
    ((128, 90, 143, 16), (2, 4), (1, 2), "channels_last", jnp.float32, (8, 16, 2, 1, 2)),
]


@pytest.mark.parametrize("shape,window,strides,layout,dtype,tuned", FIRST_CALL)
def test_the_model_on_first_call_shapes(fake_cuda, shape, window, strides, layout, dtype, tuned):
  geom = windows.make_geometry(shape, window, strides, data_format=layout)
  launch = triton.launch_for("argmax_fwd", shape, dtype, geom, interpret=False)
  assert fake_cuda.records[-1].source == "model"
  assert launch == tuned


def test_the_shipped_observations_are_the_committed_reports(tmp_path):
  assert list(model.shipped_observations()) == json.loads(json.dumps(_observations()))
  # (``python -m jaxpool._src.pallas.tuning.model REPORT...`` rebuilds them)
  out = tmp_path / "observations.json"
  assert model.main([*REPORTS, "--out", str(out)]) == 0
  assert json.loads(out.read_text())["observations"] == list(model.shipped_observations())


def test_parts():
  parts = model._parts("max_bwd|float16|channels_first|k1x1x3s1x1x2d1x1x1w256l512M")
  assert (parts["pass"], parts["dims"], parts["geometry"]) == ("bwd", 1, "k1x1x3s1x1x2d1x1x1")
  assert model._parts("avg_fwd|float32|channels_last|k1x3x3s1x2x2d1x1x1w64l64L/pad")["dims"] == 2
  assert model._parts("max_fwd|float32|channels_last|k1x1x1s2x1x1d1x1x1w8l8S")["dims"] == 3
  with pytest.raises(ValueError, match="geometry"):
    model._parts("max_fwd|float32|channels_last|w8l8S")
  with pytest.raises(ValueError, match="held out must be"):
    model.held_out_group("op", {"key": "max_fwd|float32|channels_last|k1x1x2s1x1x2d1x1x1"})


def test_a_form_needs_a_margin_over_the_heuristic():
  """Another form than the heuristic's is chosen only where it rates 1% faster."""
  key = "max_fwd|float32|channels_last|k1x3x3s1x2x2d1x1x1w64l64L"
  h = config.Launch(8, 64, 8)
  cands = [h, config.Launch(16, 64, 8)]
  for gain, chosen in ((0.005, h), (0.05, cands[1])):
    obs = [{"device": "A", "key": key, "times": {"+0+0+0": gain, "+1+0+0": 0.0}}] * 4
    assert model.choose(key, "A", h, cands, obs) == chosen


def test_form():
  assert model.form((8, 32, 4), (8, 64, 8)) == "+0-1-1"
  assert model.form((16, 64, 8, 0, 2), (8, 64, 8)) == "+1+0+0/0x2"


def test_the_table_setting(fake_cuda, monkeypatch):
  """``JAXPOOL_TUNE_TABLE``: ``on`` takes the shipped table's entry, ``off`` the model's launch,
  ``foreign`` the model without this GPU's data (what a GPU without a table gets)."""
  geom = windows.make_geometry(SHAPE, (3, 3), (2, 2), 1)
  call = lambda: triton.launch_for("max_fwd", SHAPE, jnp.float32, geom, interpret=False)
  call()
  key = fake_cuda.records[-1].key
  table = (1, 8, 1)
  monkeypatch.setattr(fake_cuda, "_table", {key: config.Launch.of(table)})
  for setting, source in (("on", "table"), ("off", "model"), ("foreign", "model")):
    fake_cuda.memory.clear()
    monkeypatch.setenv("JAXPOOL_TUNE_TABLE", setting)
    launch = call()
    assert fake_cuda.records[-1].source == source
    assert (launch == table) == (setting == "on")


def test_foreign_leaves_out_this_gpus_data(monkeypatch):
  """Two observations of one geometry on two GPUs, each preferring another form."""
  key = "max_fwd|float32|channels_last|k1x3x3s1x2x2d1x1x1w64l64L"
  obs = [{"device": "A", "key": key, "times": {"+0+0+0": 0.1, "+1+0+0": 0.0}},
         {"device": "B", "key": key, "times": {"+0+0+0": 0.1, "-1+0+0": 0.0}}]
  h = config.Launch(8, 64, 8)
  cands = [h, config.Launch(16, 64, 8), config.Launch(4, 64, 8)]
  assert model.choose(key, "A", h, cands, obs) == (16, 64, 8)
  monkeypatch.setenv("JAXPOOL_TUNE_TABLE", "foreign")
  assert model.choose(key, "A", h, cands, obs) == (4, 64, 8)
  assert model.choose(key, "C", h, cands, obs[:0]) == h  # (no neighbour: the heuristic)
