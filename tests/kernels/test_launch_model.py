"""No first-call tax (issue 48): by default a kernel's launch comes from the cache, the shipped
table or the launch model (``tuning/model.py``), never from tuning; tuning runs on request
(``JAXPOOL_TUNE=auto``, ``jaxpool.tune.pretune``, ``python -m jaxpool.tune``). On a CPU with
the fake-CUDA harness of test_tuning.py (``config.platform`` patched, a tuner of a fake GPU).

The launch model against the committed tuning data (``benchmarks/results/tune_*.json``): its
choice on keys held out of the fit, against the best measured candidate of each.
"""

from __future__ import annotations

import json
import logging
import math
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
REPORTS = [os.path.join(ROOT, "benchmarks", "results", f"tune_{gpu}.json")
           for gpu in ("h200", "h100")]
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


# ----------------------------------------------------------------------------- the model


def _observations():
  obs = []
  for path in REPORTS:
    with open(path, encoding="utf-8") as f:
      obs += model.observations_from_report(json.load(f))
  return obs


def _reports():
  rows = []
  for path in REPORTS:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    rows += [(data["env"]["device_kind"], r) for r in data["rows"] if r.get("times_ms")]
  return rows


def _held_out_ratios(held_out):
  """For each measured key: the model's choice's time over the best candidate's, fitted on the
  observations ``held_out(row, obs)`` leaves in."""
  obs = _observations()
  out = {}
  for device, row in _reports():
    times = row["times_ms"]
    names = list(times)
    heuristic = model._parse(names[0])
    cands = [config.Launch.of(model._parse(n)) for n in names]
    fit = [o for o in obs if not held_out(row, o)]
    choice = model.choose(row["key"], device, config.Launch.of(heuristic), cands, fit)
    out[(device, row["key"])] = times[tuning.launch_name(choice)] / min(times.values())
  return out


# The keys held out by key (on both GPUs) where the model's choice is more than 5% from the
# best measured candidate, with what it measured (the data hold 4 geometries; a neighbour of a
# key is the same geometry's other dtypes, ops and GPU).
KNOWN_MISSES = {
    ("NVIDIA H200", "argmax_fwd|float32|channels_last|k3x3x3s2x2x2d1x1x1w32l64M"): 1.137,
    ("NVIDIA H100 80GB HBM3", "max_fwd|float32|channels_last|k3x3x3s2x2x2d1x1x1w32l64M"): 1.081,
    ("NVIDIA H100 80GB HBM3", "max_bwd|float32|channels_first|k1x3x3s1x2x2d1x1x1w64l1024L"):
        1.066,
    ("NVIDIA H200", "max_bwd|float32|channels_first|k1x3x3s1x2x2d1x1x1w64l1024L"): 1.057,
}


def test_the_model_on_held_out_keys():
  """Each key is held out (on both GPUs) of the fit in turn: the model's launch is within 5%
  of the best measured candidate on 68 of the 72 keys, the 4 others as measured
  (:data:`KNOWN_MISSES`); the heuristic misses 5% on 20 of them."""
  ratios = _held_out_ratios(lambda row, o: o["key"] == row["key"])
  assert len(ratios) == 72
  misses = {k: round(v, 3) for k, v in ratios.items() if v > 1.05}
  assert misses.keys() == KNOWN_MISSES.keys()
  for k, v in misses.items():
    assert v == pytest.approx(KNOWN_MISSES[k], abs=0.002)
  assert sum(ratios.values()) / len(ratios) < 1.0126
  heuristic = [r["times_ms"][next(iter(r["times_ms"]))] / min(r["times_ms"].values())
               for _, r in _reports()]
  assert sum(h > 1.05 for h in heuristic) == 20


def test_the_model_on_held_out_geometries_is_no_worse_than_the_heuristic():
  """A geometry (window, strides, layout) that no observation shares: the heuristic."""
  ratios = _held_out_ratios(
      lambda row, o: model._parts(o["key"])["window"] == model._parts(row["key"])["window"]
      and model._parts(o["key"])["layout"] == model._parts(row["key"])["layout"])
  heuristic = {(d, r["key"]): r["times_ms"][next(iter(r["times_ms"]))]
               / min(r["times_ms"].values()) for d, r in _reports()}
  assert ratios == heuristic


def test_the_shipped_observations_are_the_committed_reports():
  assert list(model.shipped_observations()) == json.loads(json.dumps(_observations()))


def test_form():
  assert model.form((8, 32, 4), (8, 64, 8)) == "+0-1-1"
  assert model.form((16, 64, 8, 0, 2), (8, 64, 8)) == "+1+0+0/0x2"
  assert math.isclose(model.PRIOR, 0.03)


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
