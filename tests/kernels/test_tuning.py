"""The launch-configuration tuner (``_src/pallas/tuning.py``) and ``python -m jaxpool.tune``.

On a CPU: every candidate configuration of a few cases runs in interpret mode and gives the
heuristic's bits; the tuner's logic runs with a fake device (its environment) and a fake timer;
the disk cache is tested against what a shared cluster does to it (processes tuning at once,
corrupt and truncated entries, a read-only folder, entries of another environment). The
``gpu`` tests compile every candidate and tune for real.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kernel_base import ON_GPU, bits_equal, tied

from jaxpool import tune as tune_cmd
from jaxpool._src import windows
from jaxpool._src.pallas.triton import config
from jaxpool._src.pallas.tuning import trials
from jaxpool._src.pallas.triton import ops as triton
from jaxpool._src.pallas.tuning import tuner as tuning
from jaxpool._src.pallas.tuning import cache as tuning_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"jaxpool": "0.1.0", "jax": "0.10.2", "jaxlib": "0.10.2", "device_kind": "Fake GPU 80GB",
       "platform_version": "cuda 12080", "driver": "570.00"}
KEY = tuning.Key("max_fwd", "float32", "channels_last", "k3x3s2x2d1x1w64l64L")
MAX_FWD = ("max_fwd", "argmax_fwd")  # (the kernels that take blocks of rows)


def _entry(path):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
  for name in (tuning.TUNE_ENV, tuning.CACHE_ENV, tuning.BUDGET_ENV, tuning.CANDIDATES_ENV,
               tuning.THREADS_ENV):
    monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- same bits

# (shape, window, strides, padding, dilation, data_format): column and lane counts that no
# candidate's block divides, so every candidate has partial blocks and edge programs.
BIT_CASES = [
    ((1, 7, 11, 6), (3, 3), (2, 2), 1, None, "channels_last"),
    ((2, 3, 9, 13), (3, 2), (3, 3), ((1, 1), (0, 1)), None, "channels_first"),
    ((1, 5, 6, 7, 3), (2, 3, 2), (2, 1, 2), 1, (1, 1, 2), "channels_last"),
]


def _launches(op, shape, dtype, geom):
  """The heuristic, the tuner's candidates (the limit's one-row ones and the max forward's
  blocks of rows) and the distinct tiles to run in interpret mode (warps do not exist there;
  the max forward's with four blocks of rows where the geometry takes them)."""
  heuristic = triton.launch_for(op, shape, dtype, geom, interpret=True)
  g = geom.lift(3)
  forward = op.endswith("_fwd")
  view = triton._view_shape(geom.output_shape(shape) if forward else shape,
                            g.out_spatial if forward else g.in_spatial, g.channels_last)
  lanes = view[-1] if g.channels_last else view[0]
  cols = g.out_spatial[2] if forward else triton._backward_cols(g)
  assert heuristic == config.launch_config(cols, lanes, np.dtype(dtype).itemsize,
                                           g.channels_last)
  # (the max forward's blocks of rows: those the tuner tries on a GPU, and in interpret mode,
  # where the maximum is not PTX's and the tuner offers none, four blocks wherever the geometry
  # takes them)
  blocks = config.row_block_candidates(heuristic, g, dtype) if op in MAX_FWD else []
  cands = config.candidates(heuristic, cols, lanes, np.dtype(dtype).itemsize, g.channels_last,
                            64)
  tuned = config.candidates(heuristic, cols, lanes, np.dtype(dtype).itemsize, g.channels_last,
                            tuning.DEFAULT_MAX_CANDIDATES, blocks)
  tiles = list(dict.fromkeys((bw, bl, 1) for bw, bl, _ in cands))
  if op in MAX_FWD and config.separable(g):
    bw, bl = heuristic[:2]
    tiles += [(bw, bl, 1, 1, 2), (max(bw // 2, 1), bl, 1, 2, 2), (bw, bl, 1, 1, 4),
              (max(bw // 4, 1), bl, 1, 2, 1)]
  return heuristic, tuned, tiles


def _run(op, launch, x, dy, taps, shape, geom, interpret=True):
  kind, forward = op[:-4], op.endswith("_fwd")
  if forward:
    return triton._window_call(x, geom, kind, interpret, True, None, launch)
  if kind == "max":
    return (triton._backward_call((taps, dy), shape, geom, "max", interpret, launch=launch),)
  return (triton._backward_call((dy,), shape, geom, "avg", interpret, True, None, launch),)


def _check_every_candidate(rng, case, dtype, interpret, ops=triton.OPS):
  shape, window, strides, padding, dilation, fmt = case
  geom = windows.make_geometry(shape, window, strides, padding, dilation, data_format=fmt)
  x = tied(rng, shape, dtype)
  out_shape = geom.output_shape(shape)
  dy = tied(rng, out_shape, dtype)
  taps = triton.max_forward_taps(x, geom, interpret=interpret)[1]
  tried = 0
  for op in ops:
    heuristic, cands, tiles = _launches(op, shape, dtype, geom)
    assert len(cands) > 1, (op, cands)
    want = _run(op, heuristic, x, dy, taps, shape, geom, interpret)
    # (interpret mode: every tile; compiled: every configuration the tuner tries)
    for launch in (tiles if interpret else cands):
      same_tile = interpret and launch[:2] == heuristic[:2] and len(launch) == 3
      if launch == heuristic or same_tile:
        continue  # (itself)
      got = _run(op, launch, x, dy, taps, shape, geom, interpret)
      for a, b in zip(got, want, strict=True):
        bits_equal(a, b)
      tried += 1
  return tried


@pytest.mark.slow
def test_every_candidate_gives_the_same_bits_interpret_max(rng):
  # (the tie rule, the blocks of rows and the backward's order; every kernel and layout: the
  # slow tests below. `make test` runs the blocks of rows against one row in
  # test_row_blocks.py and test_backward_blocks.py instead, about 40 s less)
  g = windows.make_geometry(*BIT_CASES[0][:5], data_format=BIT_CASES[0][5]).lift(3)
  assert config.separable(g)  # (so the max forwards run their blocks of rows too)
  assert _check_every_candidate(rng, BIT_CASES[0], jnp.float32, True,
                                ("max_fwd", "argmax_fwd", "max_bwd")) >= 16


# At XLA:CPU's default optimisation level, LLVM fuses the average gradient's quotient with the
# sum's add (a fused multiply-add) in some vector widths only, so interpret-mode bits of that
# kernel depend on the tile there (docs/tuning.md); `make test` compiles without LLVM's
# optimisations, where they do not. Elsewhere the average gradient is left out.
_LLVM_UNOPTIMISED = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
_INTERPRET_OPS = triton.OPS if _LLVM_UNOPTIMISED else tuple(
    op for op in triton.OPS if op != "avg_bwd")


@pytest.mark.slow
@pytest.mark.parametrize("case", BIT_CASES, ids=["2d_last", "2d_first", "3d_last"])
def test_every_candidate_gives_the_same_bits_interpret(rng, case):
  assert _check_every_candidate(rng, case, jnp.float32, True, _INTERPRET_OPS) >= 8


@pytest.mark.slow
def test_every_candidate_gives_the_same_bits_interpret_bfloat16(rng):
  _check_every_candidate(rng, BIT_CASES[0], jnp.bfloat16, True, _INTERPRET_OPS)


def test_candidates_are_bounded_powers_of_two_heuristic_first():
  for args in [((8, 64, 8), 56, 64, 4, True), ((64, 16, 4), 112, 8192, 4, False),
               ((16, 128, 8), 28, 64, 2, True), ((8, 1, 1), 3, 1, 4, True)]:
    cands = config.candidates(*args, limit=6)
    assert cands[0] == args[0] and len(cands) == len(set(cands)) <= 6
    for bw, bl, warps in cands:
      assert all(v >= 1 and v & (v - 1) == 0 for v in (bw, bl, warps)) and warps <= 8
  assert config.candidates((8, 1, 1), 3, 1, 4, True, limit=100)[0] == (8, 1, 1)


def test_candidates_give_threads_sixteen_bytes_right_after_the_heuristic():
  # The heuristic gives each thread 8 bytes of a tile where 8 warps do not bound it: next come
  # its tile and half its columns with 16 bytes a thread (bfloat16 8 x 64: 2 warps; 4 x 64: 1).
  assert config.sixteen_byte_tiles(8, 64, 2) == [(8, 64, 2), (4, 64, 1)]
  assert config.sixteen_byte_tiles(64, 64, 4) == [(64, 64, 8), (32, 64, 8)]  # (8 warps at most)
  assert config.sixteen_byte_tiles(1, 2, 4) == [(1, 2, 1)]  # (no tile of half a column)
  assert config.warps_for(24, 64, 2, 16) == 4 and config.warps_for(8, 64, 4, 8) == 8
  # The heuristic's warps are the 8-byte ones (launch_config).
  for width, lanes, itemsize, fmt in [(56, 64, 2, True), (28, 64, 4, True), (3, 1, 4, True),
                                      (112, 8192, 4, False), (56, 96, 1, True)]:
    bw, bl, warps = config.launch_config(width, lanes, itemsize, fmt)
    assert warps == config.warps_for(bw, bl, itemsize, 8)
    assert warps == min(1 << (max(bw * bl * itemsize // 256, 1).bit_length() - 1), 8)
  assert config.candidates((8, 64, 4), 56, 64, 2, True, 6)[:3] == [(8, 64, 4), (8, 64, 2),
                                                                  (4, 64, 1)]
  # Where the heuristic's warps already give 16 bytes (float32 16 x 64, 8 warps), only half
  # its columns is new; none with one column.
  assert config.candidates((16, 64, 8), 28, 64, 4, True, 6)[:2] == [(16, 64, 8), (8, 64, 4)]
  assert config.candidates((1, 64, 1), 1, 64, 4, True, 2) == [(1, 64, 1), (1, 32, 1)]


def _padded(cols: int, bw: int) -> int:
  return -(-cols // bw) * bw


def test_candidates_offer_the_columns_that_pad_least():
  # 28 columns in tiles of 16 or 8 leave an eighth of the lanes idle, in tiles of 4 none: the
  # tile of 4 columns comes next, with 16 bytes a thread; in channels_last only (the other
  # candidates have at least half the heuristic's columns: 8 here).
  assert config.least_waste_tile(28, 16, 64, 4) == [(4, 64, 2)]
  assert config.candidates((16, 64, 8), 28, 64, 4, True, 6)[:3] == [(16, 64, 8), (8, 64, 4),
                                                                   (4, 64, 2)]
  assert min(c[0] for c in config.candidates((16, 64, 8), 28, 64, 4, False, 100)) == 8
  # Nothing where the heuristic pads nothing, or no narrower tile (down to a quarter of its
  # columns) pads less.
  for cols, bw in [(56, 8), (64, 16), (7, 8), (1, 1)]:
    assert config.least_waste_tile(cols, bw, 64, 4) == []
  assert config.least_waste_tile(100, 16, 64, 2) == [(4, 64, 1)]  # (100 = 25 x 4)
  assert config.least_waste_tile(24, 16, 256, 4) == [(8, 256, 8)]  # (8 warps at most)
  assert config.least_waste_tile(17, 8, 32, 4) == [(2, 32, 1)]  # (1 warp, 8 bytes a thread)
  # Against every tile from a quarter (or as few as the columns need) to half the columns:
  # the one that pads least, the widest of those, where it pads less than the heuristic's.
  for cols in range(1, 300):
    for bw in (1, 2, 4, 8, 16, 32, 64):
      tiles = [w for w in (1, 2, 4, 8, 16, 32)
               if min(bw // 4, config.pow2_ceil(cols)) <= w <= bw // 2]
      best = min(tiles, key=lambda w: (_padded(cols, w), -w), default=None)
      want = [] if best is None or _padded(cols, best) >= _padded(cols, bw) else [best]
      assert [w for w, _, _ in config.least_waste_tile(cols, bw, 64, 4)] == want, (cols, bw)


# ----------------------------------------------------------------------------- fakes


class FakeTrial:
  """A trial whose "compiled" functions return their launch, timed by a table of times."""

  def __init__(self, times, compile_error=()):
    self.times = times
    self.compiled = []
    self.compile_error = compile_error

  def trial(self):
    def compile_launch(launch):
      self.compiled.append(launch)
      if launch in self.compile_error:
        raise RuntimeError("out of resources")
      return lambda *args: launch
    return tuning.Trial(compile_launch, lambda: ())

  def measure(self, fn, args):
    return self.times[fn(*args)]


def _tuner(tmp_path, fake=None, env=ENV, **kw):
  kw.setdefault("measure", fake.measure if fake else None)
  return tuning.Tuner(cache=str(tmp_path), env=env, table=kw.pop("table", {}), **kw)


H = (8, 64, 8)
CANDS = [H, (16, 64, 8), (8, 32, 8), (8, 64, 4)]


def test_tuner_picks_the_fastest_and_caches_it(tmp_path):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.7, (8, 32, 8): 0.9, (8, 64, 4): 0.8})
  tuner = _tuner(tmp_path, fake)
  assert tuner.choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)
  assert sorted(fake.compiled) == sorted(CANDS)
  rec = tuner.records[-1]
  assert rec.source == "tuned" and rec.seconds >= 0 and len(rec.times_ms) == 4
  entry = _entry(tuner.path(KEY))
  assert entry["launch"] == [16, 64, 8] and entry["env"] == ENV and entry["key"] == KEY.name()
  # Again in this process: from memory; in a new process (a new tuner): from the disk.
  assert tuner.choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)
  assert tuner.records[-1].source == "memory"
  other = FakeTrial({})
  again = _tuner(tmp_path, other)
  assert again.choose(KEY, H, CANDS, other.trial()) == (16, 64, 8)
  assert again.records[-1].source == "cache" and other.compiled == []


def test_tuner_ties_go_to_the_heuristic_then_the_earlier(tmp_path):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 1.0, (8, 32, 8): 0.5, (8, 64, 4): 0.5})
  assert _tuner(tmp_path / "a", fake).choose(KEY, H, CANDS, fake.trial()) == (8, 32, 8)
  fake = FakeTrial(dict.fromkeys(CANDS, 1.0))
  assert _tuner(tmp_path / "b", fake).choose(KEY, H, CANDS, fake.trial()) == H


def test_tuner_keeps_the_heuristic_within_the_margin(tmp_path):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 1.0 / (1 + tuning.MARGIN / 2), (8, 32, 8): 2.0,
                    (8, 64, 4): 2.0})
  assert _tuner(tmp_path / "a", fake).choose(KEY, H, CANDS, fake.trial()) == H
  fake.times[(16, 64, 8)] = 1.0 / (1 + 2 * tuning.MARGIN)
  assert _tuner(tmp_path / "b", fake).choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)


def test_tuner_skips_candidates_that_fail_to_compile(tmp_path):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.1, (8, 32, 8): 0.9, (8, 64, 4): 0.8},
                   compile_error=[(16, 64, 8)])
  assert _tuner(tmp_path, fake).choose(KEY, H, CANDS, fake.trial()) == (8, 64, 4)


def test_tuner_samples_in_rounds_so_a_warming_gpu_favours_no_candidate(tmp_path):
  """A GPU whose first samples run slow (clocks still rising): timed one after the other, the
  heuristic (timed first) lost to an equal candidate timed later; in rounds it keeps its key."""
  fake = FakeTrial(dict.fromkeys(CANDS, 1.0))
  calls = []

  def warming(fn, args):
    calls.append(fn(*args))
    return fake.measure(fn, args) * (1.1 if len(calls) <= len(CANDS) - 1 else 1.0)

  tuner = _tuner(tmp_path, measure=warming)
  assert tuner.choose(KEY, H, CANDS, fake.trial()) == H
  # Every candidate sampled ROUNDS times, each round starting one candidate later.
  n = len(CANDS)
  assert len(calls) == tuning.ROUNDS * n
  assert [calls[r * n] for r in range(tuning.ROUNDS)] == [CANDS[r % n]
                                                          for r in range(tuning.ROUNDS)]
  assert set(tuner.records[-1].times_ms.values()) == {1.0}


def test_tuner_keeps_each_candidates_fastest_sample(tmp_path):
  """A slow spell over most of the heuristic's samples (another process, the host falling
  behind) does not hand its key to an equal candidate: each candidate's time is its fastest
  sample, which interference cannot lower. (A median took the spell in.)"""
  fake = FakeTrial(dict.fromkeys(CANDS, 1.0))
  seen = []

  def spell(fn, args):
    launch = fn(*args)
    seen.append(launch)
    slow = launch == H and seen.count(H) <= tuning.ROUNDS // 2 + 1
    return fake.measure(fn, args) * (1.5 if slow else 1.0)

  tuner = _tuner(tmp_path, measure=spell)
  assert tuner.choose(KEY, H, CANDS, fake.trial()) == H
  entry = _entry(tuner.path(KEY))
  assert sorted(entry["samples_ms"]["8x64x8"]) == [1.0] * (tuning.ROUNDS - tuning.ROUNDS // 2 - 1) \
      + [1.5] * (tuning.ROUNDS // 2 + 1)


@pytest.mark.parametrize("earlier", [1, 2, 3, 4, 5, 6, 7, 8])
def test_an_entry_of_an_earlier_format_is_not_used(tmp_path, earlier):
  """Entries tuned for the kernels before their programs' order changed (format 1), among
  candidates without the max forward's blocks of rows (format 2), without those of the max
  forward with taps (format 3) or without the loops over the output planes and the average
  forward's blocks (format 4), without the backwards' blocks (format 5), without the 16-byte
  tiles (format 6), for the one-lane select of the 16-bit max backward (format 7) or without
  the tiles that pad the columns least (format 8), are not used, without a warning: the kernel
  is tuned again and the entry rewritten."""
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.5, (8, 32, 8): 0.9, (8, 64, 4): 0.8})
  tuner = _tuner(tmp_path, fake)
  path = tuner.path(KEY)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"format": earlier, "key": KEY.name(), "env": ENV, "launch": [8, 32, 8]}, f)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert tuner.choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)
  assert tuner.records[-1].source == "tuned"
  assert _entry(path)["format"] == tuning.FORMAT == 9


@pytest.mark.parametrize("line,version", [
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
     "(dvs-builder@U22)  Thu Sep 18 22:46:19 UTC 2025", "580.159.04"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023",
     "535.104.05"),
    ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  550.54.14  Thu Feb 22 01:25:25 UTC 2024",
     "550.54.14"),
])
def test_the_driver_version_is_read_from_either_form_of_the_line(tmp_path, line, version):
  path = tmp_path / "version"
  path.write_text(line + "\nGCC version: gcc 12\n")
  assert tuning_cache._driver_version(str(path)) == version
  assert tuning_cache._driver_version(str(tmp_path / "missing")) == ""


def test_tuner_drops_a_candidate_that_fails_to_run(tmp_path):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.5, (8, 32, 8): 0.9, (8, 64, 4): 0.8})
  runs = []

  def flaky(fn, args):
    launch = fn(*args)
    runs.append(launch)
    if launch == (16, 64, 8) and runs.count(launch) == 2:  # (fails in its second round)
      raise RuntimeError("launch failed")
    return fake.measure(fn, args)

  tuner = _tuner(tmp_path, measure=flaky)
  assert tuner.choose(KEY, H, CANDS, fake.trial()) == (8, 64, 4)
  assert runs.count((16, 64, 8)) == 2 and "16x64x8" not in tuner.records[-1].times_ms


def test_tuner_budget_bounds_the_time(tmp_path):
  cands = [H] + [(8, 64, w) for w in (1, 2, 4)] + [(16, 64, w) for w in (1, 2, 4, 8)]
  fake = FakeTrial(dict.fromkeys(cands, 1.0))

  def slow(fn, args):
    time.sleep(0.1)
    return fake.measure(fn, args)

  tuner = _tuner(tmp_path, measure=slow)
  t0 = time.perf_counter()
  tuner.choose(KEY, H, cands, fake.trial(), budget=0.25)
  took = time.perf_counter() - t0
  rec = tuner.records[-1]
  assert 1 <= len(rec.times_ms) <= 4 < len(cands), rec.times_ms
  assert took < 0.25 + 0.3 and "x".join(map(str, H)) in rec.times_ms


def test_tuner_drops_candidates_that_compile_past_the_budget(tmp_path):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.1, (8, 32, 8): 0.9, (8, 64, 4): 0.8})
  trial = fake.trial()
  slow = tuning.Trial(lambda c: (time.sleep(2.0), trial.compile(c))[1] if c == (16, 64, 8)
                      else trial.compile(c), trial.args)
  tuner = _tuner(tmp_path, fake)
  t0 = time.perf_counter()
  assert tuner.choose(KEY, H, CANDS, slow, budget=0.5) == (8, 64, 4)
  assert time.perf_counter() - t0 < 1.5 and len(tuner.records[-1].times_ms) == 3


def test_shipped_table_is_used_and_the_cache_wins(tmp_path):
  fake = FakeTrial({})
  tuner = _tuner(tmp_path, fake, table={KEY.name(): (4, 64, 2)})
  assert tuner.choose(KEY, H, CANDS, fake.trial()) == (4, 64, 2)
  assert tuner.records[-1].source == "table" and fake.compiled == []
  tuner.write(KEY, (16, 64, 8), {})
  fresh = _tuner(tmp_path, fake, table={KEY.name(): (4, 64, 2)})
  assert fresh.choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)
  # ``fresh=True`` (``--retune``) tunes whatever the cache and the table hold.
  fake = FakeTrial({H: 1.0, (16, 64, 8): 2.0, (8, 32, 8): 2.0, (8, 64, 4): 2.0})
  retune = _tuner(tmp_path, fake, table={KEY.name(): (4, 64, 2)}, fresh=True)
  assert retune.choose(KEY, H, CANDS, fake.trial()) == H


def test_the_packaged_tables_parse():
  folder = os.path.join(ROOT, "jaxpool", "_src", "pallas", "tuning", tuning.TABLES)
  names = [n for n in os.listdir(folder) if n.endswith(".json")]
  assert "NVIDIA_H100_80GB_HBM3.json" in names
  for name in names:
    data = _entry(os.path.join(folder, name))
    assert data["format"] == tuning.FORMAT and tuning.table_name(data["device_kind"]) == name
    assert all(tuning._valid_launch(v) for v in data["entries"].values())
    # (blocks of rows only where a kernel takes them)
    assert all(k.startswith(("max_fwd|", "argmax_fwd|", "avg_fwd|", "max_bwd|", "avg_bwd|"))
               for k, v in data["entries"].items() if len(v) == 5)
    # (a backward's blocks of rows: no loop over the planes)
    assert all(v[3] >= 1 for k, v in data["entries"].items() if len(v) == 5 and "_bwd|" in k)
    # (the average forward's keys hold how it counts its divisor)
    assert all(k.rsplit("/", 1)[-1] in ("pad", "real", "divisor")
               for k in data["entries"] if k.startswith("avg_fwd|"))
    assert tuning.shipped_table(data["device_kind"]) == {
        k: tuple(v) for k, v in data["entries"].items()}
  assert tuning.shipped_table("No Such GPU") == {}
  assert tuning.table_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"


def test_a_shipped_table_round_trips_through_the_launch_type():
  """Every entry of the shipped tables loads as a :class:`config.Launch` with named fields and
  writes back as the same JSON: a table re-serialized from its launches is the file's text."""
  folder = os.path.join(ROOT, "jaxpool", "_src", "pallas", "tuning", tuning.TABLES)
  for name in sorted(n for n in os.listdir(folder) if n.endswith(".json")):
    path = os.path.join(folder, name)
    data = _entry(path)
    table = tuning.shipped_table(data["device_kind"])
    assert list(table) == list(data["entries"])
    for key, v in data["entries"].items():
      launch = table[key]
      assert type(launch) is config.Launch
      assert [launch.block_cols, launch.block_lanes, launch.num_warps] == v[:3]
      assert launch.rows == (tuple(v[3:]) if len(v) == 5 else None)
      assert (launch.block_depth, launch.block_height) == (tuple(v[3:]) or (None, None))
      assert list(launch) == v and config.Launch.of(v) == launch == tuple(v)
      assert hash(launch) == hash(tuple(v)) and tuning.launch_name(launch) == "x".join(
          map(str, v))
    again = dict(data, entries={k: list(launch) for k, launch in table.items()})
    with open(path, encoding="utf-8") as f:
      text = f.read()
    assert json.loads(json.dumps(again)) == json.loads(text)
    assert json.dumps(again) == json.dumps(json.loads(text))


def test_a_launch_names_its_fields():
  launch = config.Launch(8, 64, 4, 0, 2)
  assert (launch.block_cols, launch.block_lanes, launch.num_warps) == (8, 64, 4)
  assert launch.rows == (0, 2) and launch.astuple() == (8, 64, 4, 0, 2) and len(launch) == 5
  assert config.Launch(8, 64, 4).rows is None and len(config.Launch(8, 64, 4)) == 3
  assert config.Launch(8, 64, 4) != config.Launch(8, 64, 4, 1, 1)  # (the one-row kernels)
  assert {config.Launch(8, 64, 4): 1}[(8, 64, 4)] == 1
  with pytest.raises(ValueError, match="a depth and a height or neither"):
    config.Launch(8, 64, 4, 1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    launch.num_warps = 8  # type: ignore[misc]


# ----------------------------------------------------------------------------- the disk cache


@pytest.mark.parametrize("content", ["", f"{{\"format\": {tuning.FORMAT}, \"launch\": [16, 6",
                                     "not json", "[1, 2]",
                                     f"{{\"format\": {tuning.FORMAT}, \"launch\": [16, 3, 8]}}",
                                     f"{{\"format\": {tuning.FORMAT}, \"launch\": [64, 1024, 8]}}"],
                         ids=["empty", "truncated", "garbage", "list", "bad_launch", "huge_tile"])
def test_corrupt_entry_is_ignored_retuned_and_warned_once(tmp_path, content):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.5, (8, 32, 8): 0.9, (8, 64, 4): 0.8})
  tuner = _tuner(tmp_path, fake)
  os.makedirs(os.path.dirname(tuner.path(KEY)))
  with open(tuner.path(KEY), "w") as f:
    f.write(content)
  with pytest.warns(tuning.TuningWarning, match="tuned again") as caught:
    assert tuner.read(KEY) is None
    assert tuner.read(KEY) is None  # (once a file)
    assert tuner.choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)
  assert len(caught) == 1
  assert _entry(tuner.path(KEY))["launch"] == [16, 64, 8]  # rewritten


def _readonly_cache(tmp_path, how):
  if how == "file_in_the_way":
    path = tmp_path / "cache"
    path.write_text("a file where the cache folder should be")
    return str(path)
  if os.geteuid() == 0:
    pytest.skip("root writes into read-only folders")
  path = tmp_path / "ro"
  path.mkdir()
  path.chmod(0o500)
  return str(path)


@pytest.mark.parametrize("how", ["chmod", "file_in_the_way"])
def test_readonly_cache_tunes_in_memory_with_one_warning(tmp_path, how):
  cache = _readonly_cache(tmp_path, how)
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.5, (8, 32, 8): 0.9, (8, 64, 4): 0.8})
  tuner = tuning.Tuner(cache=cache, env=ENV, table={}, measure=fake.measure)
  key2 = tuning.Key("avg_fwd", "float32", "channels_last", KEY.geometry)
  try:
    with pytest.warns(tuning.TuningWarning, match="kept in memory") as caught:
      assert tuner.choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)
      assert tuner.choose(key2, H, CANDS, fake.trial()) == (16, 64, 8)
    assert len(caught) == 1
    n = len(fake.compiled)
    assert tuner.choose(KEY, H, CANDS, fake.trial()) == (16, 64, 8)  # (memory: no retune)
    assert len(fake.compiled) == n and tuner.records[-1].source == "memory"
    if os.path.isdir(cache):
      assert not [n for _, _, files in os.walk(cache) for n in files]  # no partial file left
  finally:
    if os.path.isdir(cache):
      os.chmod(cache, 0o700)


@pytest.mark.parametrize("field", sorted(ENV))
def test_entry_of_another_environment_is_not_used(tmp_path, field):
  fake = FakeTrial({H: 1.0, (16, 64, 8): 0.5, (8, 32, 8): 0.9, (8, 64, 4): 0.8})
  _tuner(tmp_path, fake).choose(KEY, H, CANDS, fake.trial())
  other_env = dict(ENV, **{field: ENV[field] + "-other"})
  other = _tuner(tmp_path, fake, env=other_env)
  assert other.path(KEY) != _tuner(tmp_path, env=ENV).path(KEY)
  assert other.read(KEY) is None
  # The entry itself is checked too (a file copied or renamed onto the other's name).
  os.makedirs(os.path.dirname(other.path(KEY)), exist_ok=True)
  os.replace(_tuner(tmp_path, env=ENV).path(KEY), other.path(KEY))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert other.read(KEY) is None
  n = len(fake.compiled)
  other.choose(KEY, H, CANDS, fake.trial())
  assert other.records[-1].source == "tuned" and len(fake.compiled) > n


def test_concurrent_writers_never_leave_a_partial_entry(tmp_path):
  """Threads rewrite one entry while a reader reads it: every read is a whole entry."""
  tuner = _tuner(tmp_path)
  tuner.write(KEY, H, {})
  launches = [(2**i, 64, 4) for i in range(6)]
  stop = threading.Event()
  seen, errors = set(), []

  def writer(launch):
    w = _tuner(tmp_path)
    while not stop.is_set():
      w.write(KEY, launch, {"pad": "x" * 20000})

  def reader():
    r = _tuner(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      while not stop.is_set():
        seen.add(r.read(KEY))
    errors.extend(caught)

  threads = [threading.Thread(target=writer, args=(c,)) for c in launches]
  threads.append(threading.Thread(target=reader))
  for t in threads:
    t.start()
  time.sleep(1.0)
  stop.set()
  for t in threads:
    t.join()
  assert not errors and None not in seen and seen <= set(launches) | {H}
  assert os.listdir(os.path.dirname(tuner.path(KEY))) == [os.path.basename(tuner.path(KEY))]


_CHILD = """
import json, sys, time
from jaxpool._src.pallas.tuning import tuner as tuning
env, cache, launch = json.loads(sys.argv[1]), sys.argv[2], tuple(json.loads(sys.argv[3]))
key = tuning.Key("max_fwd", "float32", "channels_last", "k3x3s2x2d1x1w64l64L")
cands = [tuple(env["heuristic"]), launch]
while time.time() < env["start"]:
  time.sleep(0.005)
def measure(fn, args):
  time.sleep(0.2)  # (the processes overlap)
  return 0.5 if fn() == launch else 1.0
tuner = tuning.Tuner(cache=cache, env=env["env"], table={}, measure=measure)
trial = tuning.Trial(lambda c: (lambda: c), lambda: ())
print(json.dumps(tuner.choose(key, cands[0], cands, trial)))
"""


def test_processes_tuning_at_once_leave_one_whole_entry(tmp_path):
  cache = str(tmp_path / "shared")
  launches = [(16, 64, 8), (8, 32, 8), (8, 64, 4), (4, 64, 8)]
  spec = json.dumps({"env": ENV, "heuristic": list(H), "start": time.time() + 6})
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", _CHILD, spec, cache, json.dumps(c)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for c in launches]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (_, err) in zip(procs, outs, strict=True):
    assert p.returncode == 0, err
  chosen = [tuple(json.loads(out.strip().splitlines()[-1])) for out, _ in outs]
  assert chosen == launches  # each tuned (its own fake timer) and used its result
  folder = os.path.join(cache, "tune")
  files = os.listdir(folder)
  assert len(files) == 1 and files[0].endswith(".json") and not files[0].startswith(".tmp")
  entry = _entry(os.path.join(folder, files[0]))
  assert tuple(entry["launch"]) in launches and entry["env"] == ENV  # one whole winner
  reader = tuning.Tuner(cache=cache, env=ENV, table={})
  assert reader.read(tuning.Key("max_fwd", "float32", "channels_last",
                                "k3x3s2x2d1x1w64l64L")) == tuple(entry["launch"])


# ----------------------------------------------------------------------------- in a jit trace


def test_tuning_inside_a_jit_trace_runs_eagerly_with_the_real_timer(tmp_path, rng):
  """The real timer (``time_ms``) on interpret-mode kernels, tuned while a jit traces."""
  shape = (2, 9, 11, 6)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  heuristic, _, tiles = _launches("max_fwd", shape, jnp.float32, geom)
  aval = jax.ShapeDtypeStruct(shape, jnp.float32)

  def compile_launch(launch):
    return jax.jit(lambda v: triton._window_call(v, geom, "max", True, launch=launch)[0]
                   ).lower(aval).compile()

  trial = tuning.Trial(compile_launch,
                       lambda: (jax.random.normal(jax.random.key(1), shape, jnp.float32),))
  tuner = tuning.Tuner(cache=str(tmp_path), env=ENV, table={},
                       measure=lambda f, a: tuning.time_ms(f, a, samples=2, sample_ms=0.0))
  chosen = []

  @jax.jit
  def user_fn(v):
    chosen.append(tuner.choose(KEY, heuristic, tiles, trial, budget=300))
    return v * 2

  x = tied(rng, shape, jnp.float32)
  np.testing.assert_array_equal(user_fn(x), np.asarray(x) * 2)
  rec = tuner.records[-1]
  assert rec.source == "tuned" and len(rec.times_ms) == len(tiles) and chosen[0] in tiles
  assert all(t > 0 for t in rec.times_ms.values())


# ----------------------------------------------------------------------------- launch_for


class RecordingTuner:
  def __init__(self):
    self.calls = []

  env = ENV

  def choose(self, key, heuristic, cands, trial, *, tune=True, default=None):
    self.calls.append((key, heuristic, cands, trial, tune))
    return cands[-1]


@pytest.mark.parametrize("op", triton.OPS)
def test_launch_for_modes(monkeypatch, op):
  shape = (2, 9, 11, 6)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  heuristic = triton.launch_for(op, shape, jnp.float32, geom, interpret=True)
  # On a CPU, or compiled for CUDA from a CPU (the lowering tests): the heuristic, untouched.
  fake = RecordingTuner()
  with tuning.using(fake):  # type: ignore[arg-type]
    monkeypatch.setattr(config, "platform", lambda: "cpu")
    assert triton.launch_for(op, shape, jnp.float32, geom, interpret=False) == heuristic
    monkeypatch.setattr(config, "platform", lambda: "cuda")
    assert triton.launch_for(op, shape, jnp.float32, geom, interpret=True) == heuristic
    monkeypatch.setenv(tuning.TUNE_ENV, "off")
    assert triton.launch_for(op, shape, jnp.float32, geom, interpret=False) == heuristic
    assert fake.calls == []
    monkeypatch.setenv(tuning.TUNE_ENV, "cached")
    triton.launch_for(op, shape, jnp.float32, geom, interpret=False)
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    got = triton.launch_for(op, shape, jnp.float32, geom, interpret=False)
  assert [c[4] for c in fake.calls] == [False, True]
  key, h, cands, trial, _ = fake.calls[-1]
  assert h == heuristic and cands[0] == heuristic and got == cands[-1]
  assert key.op == op and key.dtype == "float32" and key.layout == "channels_last"
  # (the forwards and backwards try their blocks of rows beyond the limit)
  blocks = config.row_block_candidates(heuristic, geom.lift(3), jnp.float32, op) \
      if op.endswith("_fwd") else config.backward_block_candidates(heuristic, geom.lift(3), 4)
  assert len(blocks) == {"max_fwd": 3, "argmax_fwd": 3, "avg_fwd": 1}.get(op, 4)
  assert len(cands) <= tuning.DEFAULT_MAX_CANDIDATES + len(blocks)
  assert cands[len(cands) - len(blocks):] == blocks
  # The trial's inputs: the kernel's operands (taps in range for the max backward).
  args = trial.args()
  out_shape = geom.output_shape(shape)
  if op.endswith("_fwd"):
    assert [a.shape for a in args] == [shape]
  elif op == "max_bwd":
    assert [a.shape for a in args] == [out_shape, out_shape]
    assert args[0].dtype == jnp.int8 and -1 <= int(args[0].min()) <= int(args[0].max()) < 9
  else:
    assert [a.shape for a in args] == [out_shape]


def test_trial_inputs_compile_once_a_shape_and_spread(monkeypatch):
  """A trial's inputs come from one compiled program a shape, shared by the kernels of that
  shape, also while a jit trace runs: drawn op by op (as ``ensure_compile_time_eval`` runs
  jax.random), the random bits of a large input took most of a kernel's tuning budget on a GPU.
  The program computes the positions it hashes (an iota), not a constant of the input's size."""
  trials._inputs_program.cache_clear()
  shape = (3, 37, 41, 5)
  programs = []
  lower = jax.stages.Traced.lower

  def counting_lower(self, *a, **kw):
    if self.fun_name == "draw":  # (not a candidate an earlier test may still be compiling)
      programs.append(self)
    return lower(self, *a, **kw)

  monkeypatch.setattr(jax.stages.Traced, "lower", counting_lower)

  @jax.jit
  def traced(x):
    data, = trials.trial_inputs(shape, "bfloat16")
    taps, again = trials.trial_inputs(shape, "float32", ("int8", 27))
    assert not isinstance(data, jax.core.Tracer) and not isinstance(taps, jax.core.Tracer)
    return x + 1, data, taps, again

  _, data, taps, again = traced(jnp.zeros(()))
  assert len(programs) == 2  # (bfloat16; float32 with taps)
  assert data.shape == taps.shape == again.shape == shape and data.dtype == jnp.bfloat16
  assert taps.dtype == jnp.int8 and sorted(np.unique(np.asarray(taps))) == list(range(-1, 27))
  values = np.asarray(again)
  assert -1 <= values.min() < -0.99 and 0.99 < values.max() < 1
  assert len(np.unique(values)) > values.size // 2  # (few ties: no pattern a tile could favour)
  trials.trial_inputs(shape, "float32", ("int8", 27))
  assert len(programs) == 2  # (the program reused)
  ints, = trials.trial_inputs(shape, "int32")
  assert len(np.unique(np.asarray(ints))) > ints.size // 2
  with jax.ensure_compile_time_eval():  # (as the tuner calls it)
    text = trials._inputs_program(shape, "float32", None).func.as_text()
  assert "iota" in text and "{...}" not in text  # (XLA prints a large constant as {...})


def test_no_tuning_inside_shard_map(monkeypatch):
  """Inside a shard_map (a user's, or the one an Explicit mesh runs the kernels under) a tuning
  run's random inputs, drawn with jax.random before they were a hash, raised a bare
  AssertionError from JAX in an Explicit-mesh training step on a GPU: "auto" acts as "cached"
  there (now "model": the launch model, never tuning), and outside as before."""
  shape = (2, 9, 11, 6)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "auto")
  fake = RecordingTuner()
  seen = []

  def body(x):
    seen.append(tuning.mode())
    triton.launch_for("max_fwd", shape, jnp.float32, geom, interpret=False)
    return x

  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  with tuning.using(fake):  # type: ignore[arg-type]
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).lower(
        jnp.ones((2,)))
    triton.launch_for("max_fwd", shape, jnp.float32, geom, interpret=False)
  assert seen == ["model"]
  assert [c[4] for c in fake.calls] == [False, True]


def test_settings_are_checked(monkeypatch):
  monkeypatch.setenv(tuning.TUNE_ENV, "sometimes")
  with pytest.raises(ValueError, match="JAXPOOL_TUNE.*'sometimes'"):
    tuning.mode()
  monkeypatch.setenv(tuning.BUDGET_ENV, "-1")
  with pytest.raises(ValueError, match="JAXPOOL_TUNE_BUDGET_S.*'-1'"):
    tuning.budget_s()
  monkeypatch.setenv(tuning.CANDIDATES_ENV, "many")
  with pytest.raises(ValueError, match="JAXPOOL_TUNE_MAX_CANDIDATES.*'many'"):
    tuning.max_candidates()
  monkeypatch.setenv(tuning.CACHE_ENV, "/somewhere/else")
  assert tuning.cache_dir() == "/somewhere/else"
  monkeypatch.delenv(tuning.CACHE_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
  assert tuning.cache_dir() == os.path.join("/xdg", "jaxpool")


def test_geometry_classes():
  a = tuning.geometry_class((3, 3), (2, 2), (1, 1), 56, 64, 128 * 56 * 56 * 64)
  assert a == "k3x3s2x2d1x1w64l64L"
  assert tuning.geometry_class((3, 3), (2, 2), (1, 1), 50, 64, 96 * 56 * 56 * 64) == a
  assert tuning.geometry_class((3, 3), (2, 2), (1, 1), 56, 64, 1000) != a
  assert tuning.geometry_class((3, 3), (1, 1), (1, 1), 56, 64, 128 * 56 * 56 * 64) != a


# ----------------------------------------------------------------------------- the command


def test_tune_command_cases_and_cpu_refusal(capsys):
  case = tune_cmd.parse_case("32x56x56x256:3x3:2x2:1:float32,bfloat16:channels_last")
  assert case[1:] == ((32, 56, 56, 256), (3, 3), (2, 2), 1, "channels_last",
                      ("float32", "bfloat16"))
  assert tune_cmd.parse_case("4x8x8x3:2x2:2x2:SAME:float16:channels_first")[4] == "SAME"
  with pytest.raises(ValueError, match="SHAPE:WINDOW"):
    tune_cmd.parse_case("32x56x56x256:3x3")
  with pytest.raises(ValueError, match="non-integer"):
    tune_cmd.parse_case("32xAx56x256:3x3:2x2:1:float32:channels_last")
  with pytest.raises(TypeError):
    tune_cmd.parse_case("4x8x8x3:2x2:2x2:1:float99:channels_last")
  if not ON_GPU:
    assert tune_cmd.main(["--preset", "gpu-benchmark"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_gpu_benchmark_preset_is_gpu_py_cases():
  import importlib.util
  spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "benchmarks",
                                                                          "pooling_gpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.CASES == tune_cmd.PRESETS["gpu-benchmark"]


# ----------------------------------------------------------------------------- GPU


GPU_BIT_CASES = [
    ((8, 57, 45, 72), (3, 3), (2, 2), 1, None, "channels_last"),
    ((4, 24, 37, 61), (3, 3), (2, 2), 1, None, "channels_first"),
    ((2, 9, 21, 19, 40), (3, 3, 3), (2, 2, 2), 1, None, "channels_last"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case, dtype", [
    (GPU_BIT_CASES[0], jnp.float32), (GPU_BIT_CASES[0], jnp.bfloat16),
    (GPU_BIT_CASES[1], jnp.float32), (GPU_BIT_CASES[2], jnp.float32)],
    ids=["2d_last", "2d_last_bf16", "2d_first", "3d_last"])
def test_every_candidate_gives_the_same_bits_compiled(rng, monkeypatch, case, dtype):
  monkeypatch.setenv(tuning.TUNE_ENV, "off")  # (the candidates are given: nothing to tune)
  assert _check_every_candidate(rng, case, dtype, interpret=False) >= 10


@pytest.mark.gpu
def test_tuning_on_the_gpu(tmp_path, monkeypatch, rng):
  """Real tuning (first use), the entry on disk, a second process-like tuner reading it."""
  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
  shape = (16, 56, 56, 64)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  x = tied(rng, shape, jnp.float32)
  monkeypatch.setenv(tuning.TUNE_ENV, "off")
  want = triton.max_forward_taps(x, geom, interpret=False)  # (the heuristic's)
  monkeypatch.setenv(tuning.TUNE_ENV, "auto")  # (tuning on first use: not the default)
  with tuning.using(tuning.Tuner(table={})) as tuner:
    got = jax.jit(lambda v: triton.max_forward_taps(v, geom, interpret=False))(x)
    rec = [r for r in tuner.records if r.key.startswith("argmax_fwd")][0]
  # (the limit's one-row candidates, then the blocks of rows, as far as the budget reaches)
  heuristic = config.launch_config(28, 64, 4, True)
  blocks = config.row_block_candidates(heuristic, geom.lift(3), jnp.float32)
  offered = config.candidates(heuristic, 28, 64, 4, True, tuning.DEFAULT_MAX_CANDIDATES, blocks)
  assert len(blocks) == 3 and set(rec.times_ms) <= {tuning.launch_name(c) for c in offered}
  assert rec.source == "tuned" and len(rec.times_ms) > 1  # (more than the heuristic timed)
  assert rec.seconds <= tuning.DEFAULT_BUDGET_S + 30  # (the heuristic's compile is waited for)
  for a, b in zip(got, want, strict=True):
    bits_equal(a, b)
  with tuning.using(tuning.Tuner(table={})) as again:
    launch = triton.launch_for("argmax_fwd", shape, jnp.float32, geom, interpret=False)
  assert again.records[-1].source == "cache" and launch == rec.launch


def test_tuning_while_a_gradient_is_traced_and_lowered(monkeypatch, tmp_path):
  """The kernels' launch is chosen where they are traced or lowered (the backward kernel in
  the gradient primitive's lowering): tuning runs eagerly there, threads included. (On a CPU
  the trials run an interpret-mode kernel; the program is lowered for CUDA, not run.)"""
  from jaxpool._src.pallas import ops
  small = (1, 7, 11, 6)
  geom_small = windows.make_geometry(small, (3, 3), (2, 2), 1)
  aval = jax.ShapeDtypeStruct(small, jnp.float32)

  class InterpretTrials(tuning.Tuner):
    def choose(self, key, heuristic, cands, trial, *, tune=True, budget=None, default=None):
      args = trial.args()  # (the real operands, made eagerly)
      assert all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in args)
      interp = tuning.Trial(
          lambda launch: jax.jit(lambda v: triton._window_call(
              v, geom_small, "argmax", True, launch=launch)).lower(aval).compile(),
          lambda: (jnp.ones(small, jnp.float32),))
      return super().choose(key, heuristic, cands[:1], interp, tune=tune, budget=budget,
                            default=default)

  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "auto")  # (the default, "model", never tunes)
  tuner = InterpretTrials(cache=str(tmp_path), env=ENV, table={},
                          measure=lambda f, a: tuning.time_ms(f, a, samples=1, sample_ms=0.0))
  shape = (2, 9, 10, 4)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  loss = lambda v: jnp.sum(ops.max_pool(v, geom, interpret=False) ** 2)
  with tuning.using(tuner):
    try:
      text = jax.jit(jax.grad(loss)).trace(jax.ShapeDtypeStruct(shape, jnp.float32)).lower(
          lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
      # JAX 0.11.2 lowers a Triton kernel for CUDA only where it finds a GPU (the GPU tier's
      # tuning tests run this path compiled); JAX 0.10 lowers it anywhere.
      if "No supported GPU devices found" in str(e):
        pytest.skip(f"this JAX cannot lower a Triton kernel for CUDA without a GPU: {e}")
      raise
  assert "xla.gpu.triton" in text
  ops_tuned = {r.key.split("|")[0] for r in tuner.records if r.source == "tuned"}
  # (The gradient lowers the forward with taps and the backward; the plain forward, the
  # primal that reverse mode never runs, is not lowered, so not tuned.)
  assert {"argmax_fwd", "max_bwd"} <= ops_tuned


def test_tune_command_writes_the_cache_the_table_and_a_report(monkeypatch, tmp_path, capsys):
  """The command's whole path, with a fake device and timer (the GPU run: tune_gpu.sh)."""
  fast = {}

  class FakeDevice(tuning.Tuner):
    def __init__(self, **kw):
      super().__init__(env=ENV, measure=lambda fn, args: fn(*args), **kw)

    def choose(self, key, heuristic, cands, trial, *, tune=True, budget=None, default=None):
      fast[key.name()] = cands[-1]
      times = {c: (0.5 if c == cands[-1] else 1.0) for c in cands}
      fake = tuning.Trial(lambda c: (lambda: times[c]), lambda: ())
      return super().choose(key, heuristic, cands, fake, tune=tune, budget=budget)

  monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "cache"))
  monkeypatch.setattr(tune_cmd, "platform", lambda: "cuda")
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setattr(tuning, "Tuner", FakeDevice)
  table, report = tmp_path / "t" / "table.json", tmp_path / "report.json"
  argv = ["--case", "4x20x20x16:3x3:2x2:1:float32,bfloat16:channels_last", "--ops",
          "argmax_fwd,max_bwd", "--retune", "--write-table", str(table), "--json", str(report)]
  assert tune_cmd.main(argv) == 0
  out = capsys.readouterr().out
  assert "4 kernels, 4 tuned" in out and "2.00x the heuristic" in out
  data = _entry(table)
  assert data["format"] == tuning.FORMAT and data["device_kind"] == ENV["device_kind"]
  assert {k: tuple(v) for k, v in data["entries"].items()} == fast and len(fast) == 4
  assert len(_entry(report)["rows"]) == 4
  # A second run reads the cache (no --retune): nothing tuned.
  assert tune_cmd.main(argv[:4]) == 0
  assert "4 kernels, 0 tuned" in capsys.readouterr().out
