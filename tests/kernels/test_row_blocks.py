"""The max forward over blocks of output rows a program (``triton_rows.py``), with and without
the taps: the bits of the XLA path for every block (with ties, NaN, -inf and signed zeros),
both layouts, 1-3 spatial dims, the NumPy reference's maxima and taps on random
configurations, and compiled those of one row a program; which geometries and dtypes the tuner
offers blocks for; and blocks refused where they could give other bits. Interpret mode on a
CPU, and compiled on a GPU (the tests marked ``gpu``)."""

from __future__ import annotations

import dataclasses

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from core_strategies import pool_configs, split, tie_rich
from hypothesis import strategies as st
from kernel_base import bits_equal, data

from jaxpool._src import settings, windows, xla
from jaxpool._src.pallas.triton import config
from jaxpool._src.pallas.triton import ops as triton
from jaxpool._src.pallas.tuning import tuner as tuning
from tiers import draws

# (shape, window, strides, padding, ceil_mode, data_format): odd sizes, so blocks of rows and
# columns overhang the output.
CASES = {
    "2d_last": ((2, 9, 13, 3), (3, 3), (2, 2), ((1, 1), (1, 2)), False, "channels_last"),
    "3d_last": ((1, 7, 9, 11, 2), (3, 3, 3), (2, 2, 2), 1, False, "channels_last"),
    "2d_first_ceil": ((2, 3, 10, 9), (3, 2), (2, 2), ((1, 0), (0, 1)), True, "channels_first"),
    "1d_last": ((2, 17, 3), (4,), (3,), ((2, 1),), False, "channels_last"),
}


def _signed_zeros(x):
  flat = np.array(x, np.float32).reshape(-1)
  flat[::11] = -0.0
  flat[5::13] = 0.0
  return jnp.asarray(flat.reshape(x.shape))


# (`make test` runs the channels_first case with ceil mode and the 1-D one; `make test-all` the
# 2-D channels_last and the 3-D cases too: the hypothesis test's examples below put 3-D blocks of
# 2 x 2 rows and channels_last ones against the NumPy reference in `make test`)
@pytest.mark.parametrize("name", [n if n in ("2d_first_ceil", "1d_last")
                                  else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_every_block_of_rows_gives_the_bits_of_the_xla_path(name):
  shape, window, strides, padding, ceil_mode, fmt = CASES[name]
  geom = windows.make_geometry(shape, window, strides, padding, None, ceil_mode, fmt)
  assert config.separable(geom.lift(3))
  x = _signed_zeros(data(np.random.default_rng(5), shape, jnp.float32))
  want, want_taps = xla.max_pool_taps(x, geom)
  launches = [(4, 2, 1, 1, 2), (2, 2, 1, 2, 2), (8, 4, 1, 1, 4), (4, 2, 1, 2, 1)]
  if triton.shares_planes(geom.lift(3)):  # (and every output plane looped over)
    launches += [(4, 2, 1, 0, 2), (2, 2, 1, 0, 3)]

  @jax.jit
  def run(x):
    ys = [triton._window_call(x, geom, "max", True, launch=launch)[0] for launch in launches]
    with_taps = [triton._window_call(x, geom, "argmax", True, launch=launch)
                 for launch in launches[1:3]]  # (the others: the reference test below)
    relu = [triton._window_call(x, geom, mode, True, launch=launches[1], activation="relu")
            for mode in ("max", "argmax")]
    return ys, with_taps, relu

  ys, with_taps, relu = run(x)
  for y in ys:
    bits_equal(y, want)
  for y, taps in with_taps:
    bits_equal(y, want)
    np.testing.assert_array_equal(taps, want_taps)
  for y, *_ in relu:
    bits_equal(y, jax.nn.relu(want))
  np.testing.assert_array_equal(relu[1][1], np.where(want > 0, want_taps, -1))


@st.composite
def _separable_cases(draw):
  """A configuration whose max forward may run in blocks of rows, a block, a dtype and a seed."""
  cfg = draw(pool_configs(allow_dilation=False))
  shape, kw = split(cfg)
  geom = windows.make_geometry(shape, kw["window_shape"], kw["strides"], kw["padding"], None,
                               kw["ceil_mode"], kw["data_format"])
  hypothesis.assume(config.separable(geom.lift(3)))
  block = draw(st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 4), (0, 1), (0, 2)]))
  if block[0] == 0 and not triton.shares_planes(geom.lift(3)):
    block = (1, block[1] + 1)  # (no output planes that share input planes to loop over)
  dtype = draw(st.sampled_from([np.float32, jnp.bfloat16, np.int32]))
  return cfg, geom, (draw(st.sampled_from([1, 2, 4])), 2, 1, *block), dtype, draw(
      st.integers(0, 2**16))


def _example(shape, window, strides, padding, ceil_mode, fmt, launch, dtype):
  """A case of :func:`_separable_cases` written out."""
  n = len(window)
  cfg = dict(shape=shape, window_shape=window, strides=strides, padding=padding,
             dilation=(1,) * n, ceil_mode=ceil_mode, data_format=fmt)
  geom = windows.make_geometry(shape, window, strides, padding, None, ceil_mode, fmt)
  return cfg, geom, launch, dtype, 7


@hypothesis.settings(max_examples=draws(8, 4), deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(_separable_cases(), st.booleans())
# (besides the drawn ones: planes and rows that overlap, blocks of 2 x 2 and 1 x 4 rows)
@hypothesis.example(_example((2, 7, 9, 10, 3), (3, 3, 3), (2, 2, 2), 1, False, "channels_last",
                             (4, 2, 1, 2, 2), np.float32), False)
@hypothesis.example(_example((2, 3, 12, 9), (3, 3), (2, 2), ((1, 0), (0, 1)), True,
                             "channels_first", (4, 2, 1, 1, 4), jnp.bfloat16), True)
@hypothesis.example(_example((1, 9, 5, 7, 2), (4, 3, 3), (2, 2, 1), ((2, 1), (1, 1), (1, 1)), True,
                             "channels_last", (2, 2, 1, 0, 2), np.float32), False)
def test_blocks_give_the_reference_maxima_and_taps(case, relu):
  """Random configurations (either layout, 1-3 dims, padding, ceil mode), tie-rich inputs
  (floats with NaN, infinities and signed zeros): a block's maxima, bit for bit, and taps are
  the NumPy reference's (the first tap, row-major, of the window's maximum; the first NaN;
  +0.0 above -0.0)."""
  cfg, geom, launch, dtype, seed = case
  shape, kw = split(cfg)
  rng = np.random.default_rng(seed)
  floats = dtype != np.int32
  x = tie_rich(rng, shape, specials=floats)
  if floats:  # (zeros of both signs in many windows)
    x[x == 3] = 0.0
    x[(x == 0) & (rng.random(shape) < 0.5)] = -0.0
  x = np.asarray(jnp.asarray(x).astype(dtype))
  activation = "relu" if relu else None
  y, taps = triton._window_call(jnp.asarray(x), geom, "argmax", True, launch=launch,
                                activation=activation)
  want, want_taps = reference.max_pool_with_taps(x, activation=activation, **kw)
  bits_equal(y, want)  # (zeros' signs too; any NaN for a NaN)
  np.testing.assert_array_equal(np.asarray(taps), want_taps)


@pytest.mark.parametrize("mode", ["max", "argmax", "avg"])
def test_blocks_lower_to_triton_for_cuda(monkeypatch, mode):
  """Compiled (PTX's maximum; the average's correctly rounded reciprocal), blocks of rows and
  the loop over the output planes, with and without the taps, lower to a Triton call for CUDA
  on any host: Pallas' Triton lowering runs; Triton's compiler (on a GPU) does not."""
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")  # (lowered, never run: nothing to tune)
  shape = (1, 7, 9, 11, 2)
  geom = windows.make_geometry(shape, (3, 3, 3), (2, 2, 2), 1)
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  for launch in [(4, 2, 1, 2, 2), (4, 2, 1, 1, 4), (4, 2, 1, 0, 2)]:
    fn = jax.jit(lambda a, launch=launch: triton._window_call(a, geom, mode, False,
                                                              launch=launch))
    text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    assert ("rcp.rn.f32" if mode == "avg" else "max.NaN.f32") in text


def test_blocks_are_refused_where_they_could_give_other_bits(monkeypatch):
  x = jnp.zeros((1, 8, 9, 2), jnp.float32)
  dilated = windows.make_geometry(x.shape, (3, 3), (1, 1), 0, (2, 1), False, "channels_last")
  # (make_geometry gives no window without a real tap; a geometry built by hand can)
  x4 = jnp.zeros((1, 4, 4, 2), jnp.float32)
  empty = dataclasses.replace(
      windows.make_geometry(x4.shape, (2, 2), (2, 2), 0, None, False, "channels_last"),
      padding=((0, 0), (0, 4)), out_spatial=(2, 4))
  assert windows.window_counts_1d(empty.lift(3), 2, False).tolist() == [2, 2, 0, 0]
  for v, geom in ((x, dilated), (x4, empty)):
    assert not config.separable(geom.lift(3))
    with pytest.raises(ValueError, match="block of output rows"):
      triton._window_call(v, geom, "max", True, launch=(4, 2, 1, 1, 2))
  fine = windows.make_geometry(x.shape, (3, 3), (2, 2), 1, None, False, "channels_last")
  with pytest.raises(ValueError, match="block of output rows"):
    triton._window_call(x, dilated, "argmax", True, launch=(4, 2, 1, 1, 2))
  # Compiled, a maximum whose bits depend on the order (a select that keeps the first NaN:
  # another form than PTX's; refused before anything compiles).
  monkeypatch.setattr(config, "_ptx", lambda interpret: not interpret)
  monkeypatch.setitem(settings.overrides, "nan_max", "beats")
  for mode in ("max", "argmax"):
    with pytest.raises(ValueError, match="block of output rows"):
      triton._window_call(x, fine, mode, False, launch=(4, 2, 1, 1, 2))
  # The average forward takes blocks with dilation 1 (its sums' order is fixed), not dilated;
  # a loop over the output planes only where windows share input planes (one plane here).
  with pytest.raises(ValueError, match="block of output rows"):
    triton._window_call(x, dilated, "avg", True, False, None, launch=(4, 2, 1, 1, 2))
  for mode in ("max", "avg"):
    with pytest.raises(ValueError, match="block of output rows"):
      triton._window_call(x, fine, mode, True, launch=(4, 2, 1, 0, 2))


def test_which_launches_the_tuner_offers(monkeypatch):
  g3 = windows.make_geometry((2, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1).lift(3)
  g2 = windows.make_geometry((8, 112, 112, 64), (3, 3), (2, 2), 1).lift(3)
  g1 = windows.make_geometry((8, 100, 64), (3,), (2,), 1).lift(3)
  dilated = windows.make_geometry((8, 112, 112, 64), (3, 3), (1, 1), 2, (2, 2)).lift(3)
  h = (16, 32, 8)
  # Compiled for a CUDA GPU, float maxima are PTX's (the same bits in any order).
  monkeypatch.setattr(config, "_ptx", lambda interpret: not interpret)
  # (rd = 0: every output plane, looped; the 28 output columns in tiles of 4, which pad
  # none of them, with all lanes and half, 16 bytes a thread: config.least_waste_tile)
  loops = [(16, 32, 8, 0, 2), (8, 32, 4, 0, 2), (4, 32, 1, 0, 2), (4, 16, 1, 0, 2)]
  three_d = [(16, 32, 8, 1, 2), (16, 16, 8, 1, 2), (8, 16, 8, 2, 2), *loops]
  assert config.row_block_candidates(h, g3, jnp.float32) == three_d
  # With the taps, the loops with half the lanes too, and one row of every plane.
  assert config.row_block_candidates(h, g3, jnp.float32, "argmax_fwd") == three_d + [
      (16, 16, 8, 0, 2), (8, 16, 4, 0, 2), (16, 32, 8, 0, 1)]
  # The average forward: 1 x 2 rows, and the loops where output planes share input planes.
  assert config.row_block_candidates(h, g3, jnp.float32, "avg_fwd") == [(16, 32, 8, 1, 2),
                                                                         *loops]
  assert config.row_block_candidates(h, g3, jnp.float64, "avg_fwd") == [
      (16, 32, 8, 1, 2), (16, 32, 8, 0, 2), (8, 32, 4, 0, 2), (4, 32, 2, 0, 2),
      (4, 16, 1, 0, 2)]  # (a sum's order: fixed)
  # 56 columns: tiles of 8 pad none (16: 64); 64 columns: tiles of 16 pad none, no such loop;
  # nor in channels_first (its columns contiguous in memory: a narrow tile, short rows).
  g56 = windows.make_geometry((2, 16, 112, 112, 64), (3, 3, 3), (2, 2, 2), 1).lift(3)
  assert config.row_block_candidates(h, g56, jnp.float32)[-2:] == [(8, 32, 2, 0, 2),
                                                                   (8, 16, 1, 0, 2)]
  g64 = windows.make_geometry((2, 16, 128, 128, 64), (3, 3, 3), (2, 2, 2), 1).lift(3)
  assert config.row_block_candidates(h, g64, jnp.float32)[-2:] == [(16, 32, 8, 0, 2),
                                                                   (8, 32, 4, 0, 2)]
  g3f = windows.make_geometry((2, 64, 16, 56, 56), (3, 3, 3), (2, 2, 2), 1,
                              data_format="channels_first").lift(3)
  assert config.row_block_candidates(h, g3f, jnp.float32)[-2:] == [(16, 32, 8, 0, 2),
                                                                   (8, 32, 4, 0, 2)]
  assert config.row_block_candidates(h, g2, jnp.float32, "avg_fwd") == [(16, 32, 8, 1, 2)]
  assert config.row_block_candidates(h, dilated, jnp.float32, "avg_fwd") == []
  assert config.row_block_candidates(h, g2, jnp.bfloat16) == [(16, 32, 8, 1, 2),
                                                              (16, 16, 8, 1, 2), (8, 16, 8, 1, 4)]
  assert config.row_block_candidates((8, 1, 1), g2, jnp.float32) == [(8, 1, 1, 1, 2),
                                                                     (4, 1, 1, 1, 4)]
  assert config.row_block_candidates(h, g1, jnp.float32) == []  # one output row
  # windows that share no input row (2x2/s2): nothing to gain
  g22 = windows.make_geometry((8, 112, 112, 64), (2, 2), (2, 2), 0).lift(3)
  assert config.row_block_candidates(h, g22, jnp.float32) == []
  assert config.row_block_candidates(h, dilated, jnp.float32) == []
  # float64 is compared by a select that keeps the first NaN: its bits depend on the order.
  assert config.row_block_candidates(h, g3, jnp.float64) == []
  # Elsewhere (interpret mode's select) only integers, whose maximum has no order.
  monkeypatch.setattr(config, "_ptx", lambda interpret: False)
  assert config.row_block_candidates(h, g3, jnp.float32) == []
  assert config.row_block_candidates(h, g3, jnp.int32) == three_d
  # The tuner tries them after the limit's one-row candidates, the heuristic first.
  cands = config.candidates(h, 28, 64, 4, True, 6, three_d)
  assert cands[0] == h and cands[-7:] == three_d and len(cands) == 13
  assert config.candidates(h, 28, 64, 4, True, 1, three_d) == [h, *three_d]


def test_launches_of_five_numbers_are_valid_within_bounds():
  assert tuning._valid_launch([8, 32, 8, 2, 2]) and tuning._valid_launch([8, 32, 8, 1, 4])
  assert not tuning._valid_launch([8, 32, 8, 4, 2])  # more than MAX_ROWS rows
  assert not tuning._valid_launch([8, 32, 8, 2])
  assert not tuning._valid_launch([8, 32, 8, 3, 1])
  # (0 planes: rows of every output plane, looped over)
  assert tuning._valid_launch([8, 32, 8, 0, 2]) and tuning._valid_launch([8, 32, 8, 0, 4])
  assert not tuning._valid_launch([8, 32, 8, 0, 8]) and not tuning._valid_launch([8, 32, 8, 0, 0])
  assert not tuning._valid_launch([8, 32, 8, -1, 2]) and not tuning._valid_launch([8, 32, 0, 1, 2])
  assert not tuning._valid_launch([8, 32, 8, False, 2])
  assert not tuning._valid_launch([8, 32, 8, True, 2])
  assert not tuning._valid_launch([8, 32, 8, 0, True])
  assert not tuning._valid_launch([True, True, True])


def test_a_block_chosen_for_another_geometry_of_the_class_is_not_used(monkeypatch):
  """A key's class leaves out the rows: a table's block of rows, tuned on many output rows,
  is not used for a pool of one output row, nor where the maximum's bits would depend on the
  order (the heuristic launch instead)."""
  shape = (512, 3, 56, 64)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 0, None, False, "channels_last")
  assert geom.lift(3).out_spatial[:2] == (1, 1)

  class Table:
    def choose(self, key, heuristic, cands, trial, *, tune=True, default=None):
      return (8, 32, 8, 1, 2)

  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "cached")
  with tuning.using(Table()):  # type: ignore[arg-type]
    got = triton.launch_for("max_fwd", shape, jnp.float32, geom, interpret=False)
    # nor where the maximum's bits depend on the order (another form than PTX's)
    monkeypatch.setattr(config, "_ptx", lambda interpret: not interpret)
    many_rows = (2, 57, 56, 64)
    g2 = windows.make_geometry(many_rows, (3, 3), (2, 2), 0, None, False, "channels_last")
    ptx = triton.launch_for("max_fwd", many_rows, jnp.float32, g2, interpret=False)
    monkeypatch.setitem(settings.overrides, "nan_max", "beats")
    beats = triton.launch_for("max_fwd", many_rows, jnp.float32, g2, interpret=False)
  assert got == triton.launch_for("max_fwd", shape, jnp.float32, geom, interpret=True)  # heuristic
  assert len(got) == 3
  assert ptx == (8, 32, 8, 1, 2)
  assert beats == triton.launch_for("max_fwd", many_rows, jnp.float32, g2, interpret=True)


def test_a_cached_loop_over_planes_where_windows_share_none_is_not_used(monkeypatch):
  """A loop over the output planes (``rd = 0``) from the cache or a table, for a geometry whose
  windows share no input plane (a hand-edited entry: the key holds the window and strides),
  gives the heuristic launch, not an error."""
  shape = (2, 6, 29, 28, 16)
  geom = windows.make_geometry(shape, (1, 3, 3), (1, 2, 2), 0, None, False, "channels_last")
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setattr(config, "_ptx", lambda interpret: not interpret)
  assert not triton.shares_planes(geom.lift(3))
  assert config.row_block_candidates((8, 16, 4), geom.lift(3), jnp.float32)  # (rows: shared)

  class Table:
    def choose(self, key, heuristic, cands, trial, *, tune=True, default=None):
      return (8, 16, 4, 0, 2)

  monkeypatch.setenv(tuning.TUNE_ENV, "cached")
  with tuning.using(Table()):  # type: ignore[arg-type]
    for op in ("max_fwd", "avg_fwd"):
      got = triton.launch_for(op, shape, jnp.float32, geom, interpret=False)
      assert got == triton.launch_for(op, shape, jnp.float32, geom, interpret=True)  # heuristic


@pytest.mark.gpu
@pytest.mark.parametrize("shape,window,strides,fmt,dtype", [
    ((4, 57, 45, 64), (3, 3), (2, 2), "channels_last", jnp.float32),
    ((4, 57, 45, 64), (3, 3), (2, 2), "channels_last", jnp.bfloat16),
    ((2, 9, 30, 33, 32), (3, 3, 3), (2, 2, 2), "channels_last", jnp.float32),
    ((4, 64, 56, 57), (3, 3), (2, 2), "channels_first", jnp.float32),
    ((3, 31, 29, 96), (5, 3), (2, 3), "channels_last", jnp.int32),
], ids=["2d_f32", "2d_bf16", "3d_f32", "2d_first_f32", "2d_int32"])
def test_gpu_blocks_of_rows_give_the_bits_of_the_xla_path(monkeypatch, shape, window, strides,
                                                          fmt, dtype):
  """Compiled (PTX's maximum): every block the tuner offers, and a few more, with NaN, -inf,
  ties and signed zeros: the XLA path's values and taps, and one row a program's bits (NaN's
  too), with and without the taps."""
  from kernel_base import ON_GPU
  if not ON_GPU:
    pytest.skip("needs a GPU")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")
  geom = windows.make_geometry(shape, window, strides, 1, None, False, fmt)
  rng = np.random.default_rng(11)
  if jnp.issubdtype(dtype, jnp.integer):
    x = jnp.asarray(rng.integers(-50, 50, shape), dtype)
  else:
    x = _signed_zeros(data(rng, shape, jnp.float32)).astype(dtype)
  want, want_taps = xla.max_pool_taps(x, geom)
  h = triton.launch_for("max_fwd", shape, dtype, geom, interpret=False)
  # (the forward with the taps is offered what the max forward is, and in 3-D more loops)
  offered = config.row_block_candidates(h, geom.lift(3), dtype, "argmax_fwd")
  bw, bl, warps = h
  # (3-D: the loops over the planes, two of them with tiles of 2 of 17 columns, which pad
  # them least: config.least_waste_tile)
  assert len(offered) == (10 if len(shape) == 5 else 3)
  assert len(shape) < 5 or (2, bl, 1, 0, 2) in offered
  one_row = np.asarray(triton._window_call(x, geom, "max", False, launch=h)[0])
  raw = one_row.view(f"u{one_row.dtype.itemsize}")
  for launch in offered + [(bw, bl, warps, 2, 1), (max(bw // 4, 1), bl, warps, 1, 4)]:
    got = np.asarray(triton._window_call(x, geom, "max", False, launch=launch)[0])
    bits_equal(got, want)
    np.testing.assert_array_equal(got.view(raw.dtype), raw)  # (NaN's bits too)
    got, taps = triton._window_call(x, geom, "argmax", False, launch=launch)
    np.testing.assert_array_equal(np.asarray(got).view(raw.dtype), raw)
    np.testing.assert_array_equal(taps, want_taps)


AVG_CASES = {
    "3d_last": ((2, 9, 10, 11, 3), (3, 3, 3), (2, 2, 2), 1, False, "channels_last"),
    # (windows sharing two planes: stride 1 in depth; three: 5 over stride 2)
    "3d_stride1": ((1, 6, 7, 8, 2), (3, 3, 3), (1, 2, 2), 1, False, "channels_last"),
    "3d_k5_first": ((1, 2, 9, 5, 6), (5, 3, 3), (2, 2, 2), ((2, 2), (1, 1), (0, 1)), True,
                    "channels_first"),
    "3d_first_ceil": ((2, 2, 7, 8, 9), (4, 2, 3), (2, 1, 2), ((2, 1), (0, 1), (1, 0)), True,
                      "channels_first"),
    "2d_last": ((2, 9, 13, 3), (3, 3), (2, 2), ((1, 1), (1, 2)), False, "channels_last"),
}


def _avg_launches(geom):
  launches = [(4, 2, 1, 1, 2), (2, 2, 1, 2, 2), (8, 4, 1, 1, 3)]
  if triton.shares_planes(geom.lift(3)):
    launches += [(4, 2, 1, 0, 2), (2, 4, 1, 0, 1)]
  return launches


# (`make test` runs the 2-D float32 cases; `make test-all` the 3-D ones and bfloat16 too, 10-30 s
# each in interpret mode)
@pytest.mark.parametrize("name,dtype", [
    pytest.param(n, d, marks=[pytest.mark.slow] if n.startswith("3d") or d == jnp.bfloat16
                 else [])
    for n in AVG_CASES for d in (jnp.float32, jnp.bfloat16)
    if d == jnp.float32 or n in ("3d_last", "2d_last")])
def test_average_blocks_give_the_bits_of_one_row(name, dtype):
  """The average forward over blocks of rows and looped over the output planes: the one-row
  kernel's bits (the same sums in the same order, the same divisors: counting the padding,
  not, and an override), with ties and signed zeros (the first batch all -0.0: inside the
  input -0.0, at the edges +0.0 from the masked taps, in every launch); and the XLA path's
  values to rounding."""
  shape, window, strides, padding, ceil_mode, fmt = AVG_CASES[name]
  geom = windows.make_geometry(shape, window, strides, padding, None, ceil_mode, fmt)
  x = _signed_zeros(data(np.random.default_rng(3), shape, jnp.float32)).astype(dtype)
  x = x.at[0].set(-0.0)
  settings = [(True, None), (False, None), (False, 5)]
  launches = _avg_launches(geom)

  @jax.jit
  def run(x):
    return [(triton._window_call(x, geom, "avg", True, pad, div)[0],
             [triton._window_call(x, geom, "avg", True, pad, div, launch=lc)[0]
              for lc in launches]) for pad, div in settings]

  for (pad, div), (one, blocks) in zip(settings, run(x), strict=True):
    want = xla.avg_pool(x.astype(jnp.float32), geom, pad, div)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(one, np.float32), want, rtol=tol, atol=tol)
    zeros = np.asarray(one[0], np.float32)
    assert not zeros.any()
    if name != "3d_k5_first":  # (there every window has a masked tap: +0.0 everywhere)
      assert np.signbit(zeros).any() and (~np.signbit(zeros)).any()
    for got in blocks:
      bits_equal(got, one)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["3d_last", "2d_last"])
def test_gpu_average_blocks_give_the_bits_of_one_row(monkeypatch, name):
  """Compiled: every average block the tuner offers, and a few more, give the one-row
  kernel's bits (the divisor's reciprocal computed per window there, a constant inside the
  input here: the same number)."""
  from kernel_base import ON_GPU
  if not ON_GPU:
    pytest.skip("needs a GPU")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")
  shape = {"3d_last": (2, 9, 30, 33, 32), "2d_last": (4, 57, 45, 64)}[name]
  n = len(shape) - 2
  geom = windows.make_geometry(shape, (3,) * n, (2,) * n, 1, None, False, "channels_last")
  x = _signed_zeros(data(np.random.default_rng(4), shape, jnp.float32))
  h = triton.launch_for("avg_fwd", shape, jnp.float32, geom, interpret=False)
  offered = config.row_block_candidates(h, geom.lift(3), jnp.float32, "avg_fwd")
  assert len(offered) == (5 if n == 3 else 1)  # (3-D: 4 loops, 2 with tiles of 2 columns)
  for pad, div in [(True, None), (False, None), (False, 7)]:
    one = triton._window_call(x, geom, "avg", False, pad, div, launch=h)[0]
    for launch in offered + _avg_launches(geom):
      bits_equal(triton._window_call(x, geom, "avg", False, pad, div, launch=launch)[0], one)
