"""The measured cost tables and the cost model that reads them: a max pool (or its gradient)
whose measured cell ran slower than XLA stays XLA's, with the measurement in the report; one
measured faster is replaced; a GPU kind without a table keeps the rules before the tables and
the report says so. Each committed table is its results file regenerated."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxpool
from jaxpool._src import dispatch, platforms
from jaxpool._src.optimize import cost, cost_table
from jaxpool._src.optimize.cost_table import Cell, Table

ROOT = Path(__file__).resolve().parents[2]
TABLES = Path(cost_table.tables_dir())
REGENERATE = "python -m jaxpool._src.optimize.cost_table"

FAKE_KIND = "Fake GPU 9000"
# 65536 elements, above cost.SMALL_POOL: only the table decides.
X = jax.ShapeDtypeStruct((1, 64, 64, 16), jnp.float32)


def cell(window, strides, fwd, fwd_grad, dtype="float32"):
  return Cell(len(window), dtype, tuple(window), tuple(strides), fwd, fwd_grad)


FAKE = Table(FAKE_KIND, "benchmarks/results/windows_gpu_fake.json", cost_table.SCRIPT,
             "2026-11-29", (
                 cell((13, 13), (13, 13), 1.01, 0.05),   # the gradient slower
                 cell((13, 13), (1, 1), 4.0, 7.0),       # faster
                 cell((9, 9), (2, 2), 0.78, 1.52),       # the forward slower
                 cell((3, 3), (2, 2), 1.2, 2.1),         # faster (at most 32 taps)
                 cell((3, 3), (3, 3), 0.92, 1.9),        # the forward a little slower
             ))


@pytest.fixture
def gpu(monkeypatch):
  """As on an NVIDIA GPU of the fake kind, whose table is FAKE (only traced here)."""
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  if dispatch.default_implementation() is not None:
    pytest.skip("JAXPOOL_IMPLEMENTATION=xla: the kernels never run by default")
  monkeypatch.setattr(platforms, "device_kind", lambda: FAKE_KIND)
  real = cost_table.load
  monkeypatch.setattr(cost_table, "load", lambda kind: FAKE if kind == FAKE_KIND else real(kind))


def pool(k, s):
  return lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, k, k, 1), (1, s, s, 1), "SAME")


def loss_grad(k, s):
  return jax.grad(lambda x: pool(k, s)(x).sum())


def top_prims(f, x) -> list[str]:
  """The primitives of the optimized program, jaxpool's own calls not entered."""
  return [e.primitive.name for e in jax.make_jaxpr(f)(x).jaxpr.eqns]


# ----------------------------------------------------------------------------- the model


def test_a_pool_measured_slower_is_left_to_xla_with_the_measurement(gpu):
  g = jaxpool.optimize(pool(13, 13))
  rep = g.report(X)
  assert not rep.replaced and len(rep.left_to_xla) == 1, str(rep)
  want = (f"13x13/s13 float32 max pool: measured 0.05x XLA forward+gradient on {FAKE_KIND} "
          "(benchmarks/windows_gpu.py, 2026-11-29)")
  assert rep.left_to_xla[0].cost.startswith(want), str(rep)
  assert want.split(": ")[1] in " ".join(str(rep).split()), str(rep)
  assert "reduce_window_max" in top_prims(g, X)  # the program keeps XLA's pool
  # optimize(jax.grad(f)): the gradient (select_and_scatter_add) is judged by the same cell.
  g = jaxpool.optimize(loss_grad(13, 13))
  rep = g.report(X)
  assert [d.op for d in rep.left_to_xla] == ["reduce_window_max", "select_and_scatter_add"]
  assert "max pool gradient: measured 0.05x XLA forward+gradient" in rep.left_to_xla[1].cost
  assert {"reduce_window_max", "select_and_scatter_add"} <= set(top_prims(g, X))


def test_a_pool_measured_faster_is_replaced(gpu):
  for f in (pool(13, 1), loss_grad(13, 1)):
    g = jaxpool.optimize(f)
    rep = g.report(X)
    assert rep.replaced and not rep.left_to_xla and not rep.notes, str(rep)
    prims = top_prims(g, X)
    assert "reduce_window_max" not in prims and "select_and_scatter_add" not in prims, prims


def test_a_forward_a_little_slower_with_a_faster_gradient_is_replaced(gpu):
  """0.92x forward, 1.9x forward + gradient: a training step gains, the forward keeps jaxpool
  (between cost.FORWARD_SLOWER and cost.SLOWER)."""
  for f in (pool(3, 3), loss_grad(3, 3)):
    rep = jaxpool.optimize(f).report(X)
    assert rep.replaced and not rep.left_to_xla, str(rep)


def test_the_forward_is_judged_by_its_lower_ratio_the_gradient_by_its_own(gpu):
  """A forward much slower than XLA's (0.78x, below cost.FORWARD_SLOWER) with a faster
  gradient (1.52x): the forward pool stays XLA's (it may run without its gradient), its
  gradient is replaced."""
  rep = jaxpool.optimize(loss_grad(9, 2)).report(X)
  assert [d.op for d in rep.left_to_xla] == ["reduce_window_max"], str(rep)
  assert "9x9/s2 float32 max pool: measured 0.78x XLA forward on" in rep.left_to_xla[0].cost
  assert [d.op for d in rep.replaced] == ["select_and_scatter_add"], str(rep)
  # The forward of 13x13/s13 ran at 1.01x, its gradient at 0.05x: judged by the gradient.
  reason = jaxpool.optimize(pool(13, 13)).report(X).left_to_xla[0].cost
  assert "forward+gradient" in reason and "outside optimize" in reason


def test_the_nearest_cell_of_the_same_class_decides(gpu):
  # 15x15/s15 is nearest to 13x13/s13 (more than 32 taps, float32, 2-D): left to XLA.
  rep = jaxpool.optimize(pool(15, 15)).report(X)
  assert "nearest measured cell 13x13/s13 0.05x" in rep.left_to_xla[0].cost, str(rep)
  # 4x4/s2 has at most 32 taps: its class is 3x3/s2's (faster), never the large windows'.
  assert jaxpool.optimize(pool(4, 2)).report(X).replaced
  # bfloat16 is not in the fake table: the rules before the tables, and the report says so.
  rep = jaxpool.optimize(pool(13, 13)).report(X.update(dtype=jnp.bfloat16))
  assert rep.replaced and rep.notes == (
      f"no measurements of 2-D bfloat16 max pools of more than 32 taps on {FAKE_KIND}",)
  assert "cost model: no measurements of 2-D bfloat16" in str(rep)


def test_a_gpu_kind_without_a_table_keeps_the_rules_and_says_so(gpu, monkeypatch):
  monkeypatch.setattr(platforms, "device_kind", lambda: "Other GPU")
  rep = jaxpool.optimize(pool(13, 13)).report(X)
  assert rep.replaced and not rep.left_to_xla, str(rep)
  assert rep.notes == ("no measurements for Other GPU",)
  assert str(rep).splitlines()[1] == "  cost model: no measurements for Other GPU"
  assert rep.long().splitlines()[1] == "  cost model: no measurements for Other GPU"


def test_where_jaxpool_runs_xla_or_the_kernels_were_asked_for_nothing_changes(gpu, monkeypatch):
  for impl in ("pallas", "xla"):
    rep = jaxpool.optimize(pool(13, 13), implementation=impl).report(X)
    assert rep.replaced and not rep.left_to_xla and not rep.notes, (impl, str(rep))
  monkeypatch.setattr(dispatch, "platform", lambda: "cpu")
  rep = jaxpool.optimize(pool(13, 13)).report(X)
  assert rep.replaced and not rep.left_to_xla and not rep.notes, str(rep)


def test_the_shipped_table_leaves_its_slowest_cell_to_xla(monkeypatch):
  """The committed H200 table, read as on an H200: its slowest max pool is left to XLA with its
  measured ratio (before the tables, every large max pool on a GPU was replaced)."""
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  if dispatch.default_implementation() is not None:
    pytest.skip("JAXPOOL_IMPLEMENTATION=xla: the kernels never run by default")
  monkeypatch.setattr(platforms, "device_kind", lambda: "NVIDIA H200")
  table = cost_table.load("NVIDIA H200")
  assert table is not None and table.device_kind == "NVIDIA H200"
  worst = min((c for c in table.cells if c.nspatial == 2),
              key=lambda c: min(c.fwd, c.fwd_grad))
  ratio = min(worst.fwd, worst.fwd_grad)
  if ratio >= cost.SLOWER:
    pytest.skip(f"every cell of the H200 table is at least {cost.SLOWER}x XLA")
  k, s = worst.window[0], worst.strides[0]
  x = jax.ShapeDtypeStruct((1, 64, 64, 16), jnp.dtype(worst.dtype))
  rep = jaxpool.optimize(pool(k, s)).report(x)
  assert not rep.replaced, str(rep)
  assert rep.left_to_xla[0].cost.startswith(
      f"{worst.name} {worst.dtype} max pool: measured {ratio:.2f}x XLA"), str(rep)
  assert f"on NVIDIA H200 ({table.source})" in rep.left_to_xla[0].cost


def test_the_model_is_a_function_of_the_site(gpu):
  from jaxpool._src.optimize.layout import layout
  from jaxpool._src.optimize.site import Site
  lay = layout((1, 64, 64, 16), (1, 13, 13, 1), (1, 13, 13, 1), ((0, 0),) * 4, None)
  site = Site("max_pool", (1, 64, 64, 16), "float32", lay, implementation=None, kernels=True,
              device_kind=FAKE_KIND)
  answers = {cost.default_cost(dataclasses.replace(site)) for _ in range(3)}
  assert len(answers) == 1 and "0.05x" in answers.pop()
  assert cost.default_cost(dataclasses.replace(site, device_kind="Other GPU")) is None
  assert cost.default_cost(dataclasses.replace(site, op="max_pool_jvp")) is None  # not measured
  dilated = dataclasses.replace(lay, dilation=(2, 2))
  assert cost.default_cost(dataclasses.replace(site, layout=dilated)) is None
  assert "dilated" in cost.note(dataclasses.replace(site, layout=dilated))


# ----------------------------------------------------------------------------- the tables


def test_nearest_keeps_the_class_and_takes_the_closest_cell():
  assert cost_table.nearest(FAKE, "float32", (13, 13), (13, 13)) == FAKE.cells[0]
  assert cost_table.nearest(FAKE, "float32", (13, 13), (12, 12)) == FAKE.cells[0]
  assert cost_table.nearest(FAKE, "float32", (11, 11), (1, 1)) == FAKE.cells[1]
  assert cost_table.nearest(FAKE, "float32", (9, 9), (3, 3)) == FAKE.cells[2]
  assert cost_table.nearest(FAKE, "float32", (2, 2), (1, 1)) == FAKE.cells[3]
  assert cost_table.nearest(FAKE, "float32", (2, 2), (2, 2)) == FAKE.cells[4]
  assert cost_table.nearest(FAKE, "bfloat16", (13, 13), (13, 13)) is None
  assert cost_table.nearest(FAKE, "float32", (13, 13, 13), (1, 1, 1)) is None
  assert cost_table.distance(FAKE.cells[0], (13, 13), (13, 13)) == 0


def test_every_committed_table_is_its_results_file_regenerated():
  """A rerun of benchmarks/windows_gpu.py changes its results file; the table must follow."""
  tables = sorted(TABLES.glob("*.json"))
  assert tables, f"no cost table in {TABLES}"
  for path in tables:
    text = path.read_text()
    table = cost_table.parse(text, path.name)
    assert path.name == cost_table.table_name(table.device_kind)
    with open(ROOT / table.results) as f:
      results = json.load(f)
    again = cost_table.dumps(cost_table.build(results, table.results))
    assert text == again, (f"{path.name} is not {table.results} regenerated: run "
                           f"`{REGENERATE} {table.results}`")
  # and every GPU kind with a sweep has its table (smoke runs, --quick, are no measurements;
  # a GPU's other results files, such as a part timed inside one jit, share its table)
  kinds = {cost_table.parse(p.read_text(), p.name).device_kind for p in tables}
  for results in sorted((ROOT / "benchmarks" / "results").glob("windows_gpu_*.json")):
    meta = json.loads(results.read_text()).get("meta", {})
    if meta.get("quick") or str(meta.get("device", "cpu")).lower() == "cpu":
      continue
    rel = results.relative_to(ROOT).as_posix()
    assert meta["device"] in kinds, f"{rel}: no cost table for its GPU: run `{REGENERATE} {rel}`"


def test_regenerating_a_changed_run_changes_the_table(tmp_path):
  """The round trip can fail: a results file with one cell moved gives another table."""
  rel = "benchmarks/results/windows_gpu_h200.json"
  with open(ROOT / rel) as f:
    results = json.load(f)
  before = cost_table.dumps(cost_table.build(results, rel))
  results["cells"][0]["speedup"]["fwd_grad"] *= 0.5
  after = cost_table.dumps(cost_table.build(results, rel))
  assert before != after
  out = tmp_path / "t.json"
  (tmp_path / "r.json").write_text(json.dumps(results))
  assert cost_table.main([str(tmp_path / "r.json"), "--out", str(out)]) == 0
  table = cost_table.parse(out.read_text(), "t.json")
  assert table.device_kind == results["meta"]["device"] and table.date == "2026-11-29"
  assert len(table.cells) == len(results["cells"])


@pytest.mark.parametrize("meta,cells,match", [
    ({"device": "NVIDIA H200", "time": "2026-11-29 07:12:46", "quick": True}, 1, "--quick"),
    ({"device": "cpu", "time": "2026-11-29 07:12:46"}, 1, "names no GPU"),
    ({"device": "NVIDIA H200", "time": "2026-11-29 07:12:46"}, 0, "holds no cells"),
    ({"device": "NVIDIA H200"}, 1, "no date"),
])
def test_build_refuses_what_is_no_measurement(meta, cells, match):
  c = {"dtype": "float32", "window": [3, 3], "strides": [1, 1],
       "speedup": {"fwd": 1.0, "fwd_grad": 2.0}}
  with pytest.raises(ValueError, match=match):
    cost_table.build({"meta": meta, "cells": [c] * cells}, "r.json")


def test_a_broken_table_names_its_file():
  with pytest.raises(ValueError, match="the cost table X.json cannot be read"):
    cost_table.parse('{"format": 99, "cells": []}', "X.json")
  assert cost_table.load("No Such GPU") is None
  assert cost_table.table_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"


# ----------------------------------------------------------------------------- the registry


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_whole_window_forward_bits(dtype):
  """What jaxpool's forward without taps relies on where it takes one whole-window
  ``lax.reduce_window`` (``xla_taps.reads_windows_whole``: windows overlapping fewer than 3
  times a dim) and where the registry would send a forward-only large window to XLA: the same
  bits as the separable form (one ``reduce_window`` a dim, called directly) on zeros of both
  signs, subnormals, infinities and NaN (as NaN)."""
  import numpy as np
  from core_strategies import assert_bitwise

  from jaxpool._src import xla_taps
  from jaxpool._src.windows import make_geometry
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(0)
  vals = np.float32([-0.0, 0.0, 1e-40, -1e-40, 1.0, -1.0, np.nan, -np.inf, np.inf])
  x = jnp.asarray(rng.choice(vals, (4, 40, 40, 8), p=[.3, .3, .08, .08, .08, .08, .02, .03, .03]))
  x = x.astype(dtype)
  for k, s in [(7, 1), (9, 2), (13, 13), (17, 8), (25, 25)]:
    whole = jax.jit(pool(k, s))(x)
    geom = make_geometry(x.shape, (k, k), (s, s), "SAME")
    separable = jax.jit(lambda v, geom=geom: xla_taps._reduce_by_dims(
        v, geom, xla_taps.lowest(v.dtype), lax.max))(x)
    assert_bitwise(whole, separable, f"{k}x{k}/s{s} {dtype}")
