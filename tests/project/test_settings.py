"""The settings module (``jaxpool/_src/settings.py``): every ``JAXPOOL_*`` variable and kernel
setting in one place, read when used (override, then environment, then default), checked, and
documented in docs/tuning.md."""

from __future__ import annotations

import os
import re
import threading

import pytest

from jaxpool._src import dispatch, platforms, settings
from jaxpool._src.pallas.tuning import tuner as tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
  for s in settings.SETTINGS.values():
    if s.env:
      monkeypatch.delenv(s.env, raising=False)


def test_every_jaxpool_variable_is_a_setting():
  """No module reads a ``JAXPOOL_*`` variable but through the settings module."""
  names = set()
  for folder, _, files in os.walk(os.path.join(ROOT, "jaxpool")):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
          text = f.read()
        names |= set(re.findall(r"\"(JAXPOOL_[A-Z_]+)\"", text))
        if not name == "settings.py":
          assert "os.environ.get(\"JAXPOOL" not in text, name
  assert names == {s.env for s in settings.SETTINGS.values() if s.env}
  assert len(names) == 8


def test_defaults_environment_and_overrides(monkeypatch):
  assert settings.get("tune") == "model" and settings.get("tune_budget_s") == 10.0
  assert settings.get("nan_max") == "auto" and settings.get("packed_select") is True
  assert settings.get("implementation") is None and settings.get("cache_dir") is None
  monkeypatch.setenv("JAXPOOL_TUNE", "1")
  monkeypatch.setenv("JAXPOOL_TUNE_BUDGET_S", "2.5")
  assert settings.get("tune") == "auto" and tuning.budget_s() == 2.5
  with settings.override(tune="cached", nan_max="beats", tune_budget_s=1):
    assert settings.get("tune") == "cached" and settings.get("nan_max") == "beats"
    assert tuning.budget_s() == 1.0
    seen = []
    worker = threading.Thread(target=lambda: seen.append(settings.get("tune")))
    worker.start()
    worker.join()
    assert seen == ["cached"]  # (every thread: the tuner compiles in threads)
    with settings.override(tune="off"):
      assert tuning.mode() == "off"
    assert settings.get("tune") == "cached"
  assert settings.get("tune") == "auto" and settings.get("nan_max") == "auto"
  monkeypatch.setenv("JAXPOOL_TUNE", "")
  assert settings.get("tune") == "model"
  monkeypatch.setenv("JAXPOOL_IMPLEMENTATION", "auto")
  assert dispatch.default_implementation() is None
  monkeypatch.setenv("JAXPOOL_PALLAS_BACKEND", "TPU")
  assert platforms.pallas_kernels() == "tpu"


@pytest.mark.parametrize("name,value,message", [
    ("tune", "sometimes", r"JAXPOOL_TUNE must be one of .*'sometimes'"),
    ("tune_budget_s", "-1", r"JAXPOOL_TUNE_BUDGET_S must be a positive, finite float, got '-1'"),
    ("tune_max_candidates", "many", r"JAXPOOL_TUNE_MAX_CANDIDATES .*'many'"),
    ("tune_threads", "0", r"JAXPOOL_TUNE_THREADS .*'0'"),
    ("implementation", "triton", r"JAXPOOL_IMPLEMENTATION .*'triton'"),
    ("pallas_backend", "gpu", r"JAXPOOL_PALLAS_BACKEND .*'gpu'"),
    ("tune_table", "maybe", r"JAXPOOL_TUNE_TABLE .*'maybe'"),
])
def test_bad_values_name_the_variable(monkeypatch, name, value, message):
  monkeypatch.setenv(settings.SETTINGS[name].env, value)
  with pytest.raises(ValueError, match=message):
    settings.get(name)
  with pytest.raises(ValueError, match=message.split(" ")[0]):
    with settings.override(**{name: value}):
      pass


def test_kernel_settings_and_unknown_names():
  with pytest.raises(ValueError, match=r"nan_max must be one of .*'fast'"):
    with settings.override(nan_max="fast"):
      pass
  with pytest.raises(ValueError, match=r"packed_select must be True or False .*got .maybe."):
    settings.override(packed_select="maybe").__enter__()
  with pytest.raises(ValueError, match="no jaxpool setting is named 'order'"):
    settings.get("order")
  assert settings.overrides == {}


def test_the_docs_show_the_settings_table():
  with open(os.path.join(ROOT, "docs", "tuning.md"), encoding="utf-8") as f:
    assert settings.table() in f.read()


def test_overrides_of_two_blocks_interleaved_keep_each_others_values():
  """A block that ends restores only its own settings: another block still inside keeps its
  values (two threads' blocks interleave: A enters, B enters, A leaves, B leaves)."""
  a = settings.override(tune="cached")
  b = settings.override(tune_budget_s=3)
  a.__enter__()
  b.__enter__()
  a.__exit__(None, None, None)
  assert settings.get("tune_budget_s") == 3  # (B is still inside)
  b.__exit__(None, None, None)
  assert "tune" not in settings.overrides and "tune_budget_s" not in settings.overrides


@pytest.mark.parametrize("name, value", [("tune_budget_s", float("nan")),
                                         ("tune_budget_s", float("inf")),
                                         ("tune_max_candidates", 2.5)])
def test_numbers_that_are_no_count_or_budget_are_refused(name, value):
  with pytest.raises(ValueError, match="must be a positive, finite"):
    with settings.override(**{name: value}):
      pass
