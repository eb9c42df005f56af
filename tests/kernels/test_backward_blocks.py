"""The backward kernel over blocks of rows a program (``block = (block_depth, block_height)`` of
``triton_backward.backward_kernel``): every block gives the bits of one block a program and of
the XLA path (max pooling: the same sums in the same order; average pooling: the same
divisors), both layouts, 1-3 spatial dims, padding, dilation and ceil mode, blocks that
overhang the input; the NumPy reference's gradients on random configurations; which blocks the
tuner offers; and compiled on a GPU (the tests marked ``gpu``), every offered block's bits."""

from __future__ import annotations

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from core_strategies import pool_configs, split, tie_rich
from hypothesis import strategies as st
from kernel_base import bits_equal

from jaxpool._src import windows, xla
from jaxpool._src.pallas.triton import config
from jaxpool._src.pallas.triton import ops as triton
from jaxpool._src.pallas.tuning import tuner as tuning
from tiers import draws

# (shape, window, strides, padding, dilation, ceil_mode, data_format): odd sizes, so blocks of
# rows and columns overhang the input.
CASES = {
    "2d_last": ((2, 11, 13, 3), (3, 3), (2, 2), ((1, 1), (1, 2)), None, False, "channels_last"),
    "3d_last": ((1, 7, 9, 11, 2), (3, 3, 3), (2, 2, 2), 1, None, False, "channels_last"),
    # (small: blocks in depth and height that share tiles, in `make test`)
    "3d_small": ((1, 5, 6, 3, 2), (3, 3, 2), (2, 2, 2), 1, None, False, "channels_last"),
    # (channels_first, stride 2: the phases' columns interleaved into whole lines)
    "2d_first_ceil": ((2, 3, 10, 9), (3, 2), (2, 2), ((1, 0), (0, 1)), None, True,
                      "channels_first"),
    # (channels_first, stride 3: each lane its own column phase)
    "2d_first_s3_dilated": ((1, 2, 14, 11), (3, 2), (2, 3), 1, (2, 1), False, "channels_first"),
    "1d_last": ((2, 17, 3), (4,), (3,), ((2, 1),), None, False, "channels_last"),
}
BLOCKS = [(1, 2), (2, 1), (2, 2), (1, 3)]


def _geometry(name):
  shape, window, strides, padding, dilation, ceil_mode, fmt = CASES[name]
  return shape, windows.make_geometry(shape, window, strides, padding, dilation, ceil_mode, fmt)


def _cotangent(rng, shape):
  """Normal values with signed zeros (the gradient's zeros keep the XLA path's signs)."""
  dy = np.array(rng.normal(size=shape), np.float32).reshape(-1)
  dy[::7] = -0.0
  dy[3::11] = 0.0
  return jnp.asarray(dy.reshape(shape))


# (`make test` runs the channels_first column path with ceil mode, the hypothesis test's explicit
# examples (blocks in height, and in depth and height) and 3 drawn ones; `make test-all` every
# case, 2d_last's channels_last column path included)
@pytest.mark.parametrize("name", [n if n == "2d_first_ceil"
                                  else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_every_backward_block_gives_the_bits_of_one_block(name):
  """Max pooling (tie-rich input: many windows choose the same element) and average pooling
  (counting the padding, not, and an override): every block gives one block's bits, and the
  max gradient the XLA path's.

  (With one lane a program, XLA:CPU, which runs interpret mode, rounds the average gradient
  differently from wider launches, one block or several: docs/tuning.md. So the average's
  blocks are compared with one block of as many lanes.)"""
  shape, geom = _geometry(name)
  rng = np.random.default_rng(2)
  x = jnp.asarray(tie_rich(rng, shape))
  dy = _cotangent(rng, geom.output_shape(shape))
  launches = [(2, 2, 1, *b) for b in BLOCKS] + [(4, 4, 1, 2, 2)]
  settings = [(True, None), (False, None), (False, 5)]
  # (one block, then blocks of its lanes)
  avg_launches = [((2, 2, 1), [(2, 2, 1, 1, 2), (2, 2, 1, 2, 2), (4, 2, 1, 1, 3)]),
                  ((4, 1, 1), [(4, 1, 1, 2, 2)])]

  @jax.jit
  def run(x, dy):
    _, taps = xla.max_pool_taps(x, geom)
    want = jax.vjp(lambda t: xla.gather_at_taps(t, taps, geom), x)[1](dy)[0]
    maxes = [triton._backward_call((taps, dy), shape, geom, "max", True, launch=launch)
             for launch in [(2, 2, 1), *launches, (4, 1, 1, 2, 2)]]
    avgs = [[triton._backward_call((dy,), shape, geom, "avg", True, pad, div, launch=launch)
             for launch in [one, *blocks]] for pad, div in settings for one, blocks in avg_launches]
    return want, maxes, avgs

  want, (one, *blocks), avgs = run(x, dy)
  bits_equal(one, want)
  for got in blocks:
    bits_equal(got, want)
  for one, *blocks in avgs:
    for got in blocks:
      bits_equal(got, one)


@st.composite
def _cases(draw):
  """A configuration (dilation too), a launch with a block of rows, and a seed."""
  cfg = draw(pool_configs())
  block = draw(st.sampled_from([*BLOCKS, (1, 4)]))
  launch = (draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2])), 1, *block)
  return cfg, launch, draw(st.integers(0, 2**16))


def _example(shape, window, strides, padding, fmt, launch):
  """A case of :func:`_cases` written out."""
  n = len(window)
  cfg = dict(shape=shape, window_shape=window, strides=strides, padding=padding,
             dilation=(1,) * n, ceil_mode=False, data_format=fmt)
  return cfg, launch, 3


@hypothesis.settings(max_examples=draws(6, 1), deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(_cases())
# (besides the drawn ones: blocks that share tiles in height, and in depth and height)
@hypothesis.example(_example((2, 3, 11, 10), (3, 3), (2, 2), 1, "channels_first", (2, 2, 1, 1, 3)))
@hypothesis.example(_example((1, 6, 7, 5, 2), (3, 3, 2), (2, 2, 2), 1, "channels_last",
                             (2, 2, 1, 2, 2)))
def test_backward_blocks_give_the_reference_gradients(case):
  """Random configurations (either layout, 1-3 dims, padding, dilation, ceil mode), tie-rich
  inputs and small integer cotangents (exact sums): a block's max gradient is the NumPy
  reference's (each window's cotangent to its first maximum), its average gradient too."""
  cfg, launch, seed = case
  shape, kw = split(cfg)
  geom = windows.make_geometry(shape, kw["window_shape"], kw["strides"], kw["padding"],
                               kw["dilation"], kw["ceil_mode"], kw["data_format"])
  rng = np.random.default_rng(seed)
  x = tie_rich(rng, shape)
  dy = rng.integers(-4, 5, geom.output_shape(shape)).astype(np.float32)
  _, taps = xla.max_pool_taps(jnp.asarray(x), geom)
  got = triton._backward_call((taps, jnp.asarray(dy)), shape, geom, "max", True, launch=launch)
  np.testing.assert_array_equal(got, reference.max_pool_grad(x, dy, **kw))
  for pad in (True, False):
    got = triton._backward_call((jnp.asarray(dy),), shape, geom, "avg", True, pad, None,
                                launch=launch)
    want = reference.avg_pool_grad(dy, shape, **kw, count_include_pad=pad)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_backward_blocks_lower_to_triton_for_cuda(monkeypatch):
  """Compiled, blocks of rows lower to a Triton call for CUDA on any host (Triton's compiler, on
  a GPU, does not run here)."""
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")
  shape, geom = _geometry("3d_last")
  out = jax.ShapeDtypeStruct(geom.output_shape(shape), jnp.float32)
  taps = jax.ShapeDtypeStruct(out.shape, jnp.int8)
  for launch in [(4, 2, 1, 1, 2), (4, 2, 1, 2, 2)]:
    for mode, ops in (("max", (taps, out)), ("avg", (out,))):
      fn = jax.jit(lambda *a, launch=launch, mode=mode: triton._backward_call(
          a, shape, geom, mode, False, launch=launch))
      assert "xla.gpu.triton" in fn.trace(*ops).lower(lowering_platforms=("cuda",)).as_text()


def test_a_backward_block_of_no_rows_is_refused():
  shape, geom = _geometry("2d_last")
  dy = jnp.zeros(geom.output_shape(shape), jnp.float32)
  for block in [(0, 2), (1, 0)]:
    with pytest.raises(ValueError, match="block of rows must be at least 1 x 1"):
      triton._backward_call((dy,), shape, geom, "avg", True, launch=(2, 2, 1, *block))


def test_which_backward_blocks_the_tuner_offers(monkeypatch):
  h = (8, 64, 4)
  g2 = windows.make_geometry((8, 112, 112, 64), (3, 3), (2, 2), 1).lift(3)
  assert config.backward_block_candidates(h, g2, 4) == [(8, 64, 4, 1, 2), (8, 32, 4, 1, 2),
                                                        (8, 32, 4, 1, 4), (4, 64, 2, 1, 2)]
  # bfloat16: the heuristic's tile and half its columns with 16 bytes a thread (2 warps, 1)
  assert config.backward_block_candidates(h, g2, 2)[-2:] == [(8, 64, 2, 1, 2), (4, 64, 1, 1, 2)]
  # Windows that overlap in depth too: 2 x 2 blocks, where a block reads at most 4 tiles (a
  # 3 x 3 x 1 window at stride 2 x 2 x 1); not a 3x3x3/s2 pool's 8 (slower on both GPUs).
  g331 = windows.make_geometry((2, 16, 56, 56, 64), (3, 3, 1), (2, 2, 1), 0).lift(3)
  assert config.backward_block_candidates(h, g331, 4)[2] == (8, 32, 4, 2, 2)
  g3 = windows.make_geometry((2, 16, 56, 56, 64), (3, 3, 3), (2, 2, 2), 1).lift(3)
  assert config._block_tiles(g3) == 8 and config.backward_block_candidates(h, g3, 4) == []
  # Windows that do not overlap in height (2x2/s2, or a 1 x 3 window at stride 1 x 3): each
  # block reads its own cotangent rows, nothing to share.
  for window, strides in (((2, 2), (2, 2)), ((1, 3), (1, 3))):
    g = windows.make_geometry((8, 112, 111, 64), window, strides, 0).lift(3)
    assert config.backward_block_candidates(h, g, 4) == []
  # one block of rows in height (a 1-D pool)
  g1 = windows.make_geometry((8, 100, 64), (3,), (2,), 1).lift(3)
  assert config.backward_block_candidates(h, g1, 4) == []
  # The tuner tries them after the one-block candidates; a loop over the planes (a hand-edited
  # cache entry: no backward loops) gives the heuristic.

  class Table:
    def choose(self, key, heuristic, cands, trial, *, tune=True, default=None):
      blocks = config.backward_block_candidates(heuristic, g2, 4)
      assert blocks and cands[-len(blocks):] == blocks
      return (*heuristic, Table.rows, 2)

  shape = (8, 112, 112, 64)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "cached")
  heuristic = triton.launch_for("max_bwd", shape, jnp.float32, geom, interpret=True)
  with tuning.using(Table()):  # type: ignore[arg-type]
    Table.rows = 1
    assert triton.launch_for("max_bwd", shape, jnp.float32, geom, interpret=False) == (
        *heuristic, 1, 2)
    Table.rows = 0
    assert triton.launch_for("avg_bwd", shape, jnp.float32, geom, interpret=False) == heuristic

  # The cotangents' dtype sets the 16-byte blocks' warps: bfloat16 8 x 64 tiles, 2 warps.
  class Offered:
    def choose(self, key, heuristic, cands, trial, *, tune=True, default=None):
      Offered.cands = cands
      return heuristic

  with tuning.using(Offered()):  # type: ignore[arg-type]
    triton.launch_for("max_bwd", shape, jnp.bfloat16, geom, interpret=False)
  assert Offered.cands[-2:] == [(8, 64, 2, 1, 2), (4, 64, 1, 1, 2)]

  # A block from the cache or a table for a call that is offered none (a 3x3x3/s2 pool, whose
  # key's class may hold a block tuned elsewhere): the heuristic.
  class Blocks:
    def choose(self, key, heuristic, cands, trial, *, tune=True, default=None):
      return (*heuristic, 1, 2)

  shape3 = (2, 16, 56, 56, 64)
  geom3 = windows.make_geometry(shape3, (3, 3, 3), (2, 2, 2), 1)
  with tuning.using(Blocks()):  # type: ignore[arg-type]
    got = triton.launch_for("max_bwd", shape3, jnp.float32, geom3, interpret=False)
  assert got == triton.launch_for("max_bwd", shape3, jnp.float32, geom3, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,fmt,dtype", [
    ((4, 57, 45, 64), "channels_last", jnp.float32),
    ((4, 57, 45, 64), "channels_last", jnp.bfloat16),
    ((2, 9, 30, 33, 32), "channels_last", jnp.float32),
    ((4, 64, 56, 57), "channels_first", jnp.float32),
], ids=["2d_f32", "2d_bf16", "3d_f32", "2d_first_f32"])
def test_gpu_backward_blocks_give_the_bits_of_one_block(monkeypatch, shape, fmt, dtype):
  """Compiled: every block the tuner offers, and a few more (in 3-D, blocks in depth), give the
  bits of one block a program (max and average pooling) and, for max pooling, the XLA
  path's."""
  from kernel_base import ON_GPU
  if not ON_GPU:
    pytest.skip("needs a GPU")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")
  n = len(shape) - 2
  geom = windows.make_geometry(shape, (3,) * n, (2,) * n, 1, None, False, fmt)
  rng = np.random.default_rng(12)
  x = jnp.asarray(tie_rich(rng, shape), dtype)
  dy = _cotangent(rng, geom.output_shape(shape)).astype(dtype)
  _, taps = xla.max_pool_taps(x, geom)
  want = jax.vjp(lambda t: xla.gather_at_taps(t, taps, geom), x)[1](dy)[0]
  h = triton.launch_for("max_bwd", shape, dtype, geom, interpret=False)
  offered = config.backward_block_candidates(h, geom.lift(3), np.dtype(dtype).itemsize)
  # (3x3x3/s2: 8 tiles a block, none offered; channels_first: the heuristic's 16-byte tile is
  # itself)
  assert len(offered) == (0 if n == 3 else 4 if fmt == "channels_first" else 5)
  bw, bl, warps = h
  one = triton._backward_call((dy,), shape, geom, "avg", False, True, None, launch=h)
  for launch in offered + [(bw, bl, warps, 2, 1), (max(bw // 2, 1), bl, warps, 1, 3)]:
    bits_equal(triton._backward_call((taps, dy), shape, geom, "max", False, launch=launch), want)
    bits_equal(triton._backward_call((dy,), shape, geom, "avg", False, True, None,
                                     launch=launch), one)
