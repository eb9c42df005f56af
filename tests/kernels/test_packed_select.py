"""The max backward of 16-bit floats selects two lanes an instruction on NVIDIA GPUs
(``triton_backward.pick16``, inline PTX on lanes paired in 32-bit registers): where it applies
(``triton._packed_select``), that its PTX lowers, and compiled on a GPU (the tests marked
``gpu``) the bits of every launch the tuner offers against the one-lane select's, with ties,
zeros of both signs and windows that take no element."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import ON_GPU, bits_equal

from jaxpool._src import windows
from jaxpool._src.pallas import triton, tuning

gpu = pytest.mark.gpu

# (shape, window, strides, padding, data_format): odd sizes (edges on every side), both
# layouts, 3-D, and a stride of 1, where a phase visits every tap of the window.
CASES = {
    "2d_last": ((8, 57, 45, 72), (3, 3), (2, 2), 1, "channels_last"),
    "2d_first": ((4, 24, 37, 61), (3, 3), (2, 2), 1, "channels_first"),
    "3d_last": ((2, 9, 21, 19, 40), (3, 3, 3), (2, 2, 2), 1, "channels_last"),
    "2d_s1": ((4, 15, 17, 64), (3, 2), (1, 1), 1, "channels_last"),
}


def _operands(op_dtype, taps_dtype, n=4):
  return (jax.ShapeDtypeStruct((n,), taps_dtype), jax.ShapeDtypeStruct((n,), op_dtype))


@pytest.mark.parametrize("mode, dtype, taps, tile, warps, interpret, want", [
    ("max", jnp.bfloat16, jnp.int8, 8 * 64, 2, False, True),
    ("max", jnp.float16, jnp.int8, 8 * 64, 8, False, True),
    ("max", jnp.bfloat16, jnp.int16, 4 * 64, 2, False, True),
    ("max", jnp.float32, jnp.int8, 8 * 64, 2, False, False),  # (one lane a register)
    ("avg", jnp.bfloat16, jnp.int8, 8 * 64, 2, False, False),  # (no select)
    ("max", jnp.bfloat16, jnp.int8, 8 * 64, 2, True, False),  # (interpret mode: no PTX)
    ("max", jnp.bfloat16, jnp.int8, 8 * 64, 16, False, False),  # (one element a thread)
    ("max", jnp.bfloat16, jnp.int8, 2 * 64, 1, False, True),
    ("max", jnp.bfloat16, jnp.int8, 1 * 32, 1, False, False),  # (one element a thread)
    ("max", jnp.bfloat16, jnp.int32, 8 * 64, 2, False, False),
])
def test_where_the_packed_select_applies(monkeypatch, mode, dtype, taps, tile, warps, interpret,
                                         want):
  monkeypatch.setattr(triton, "platform", lambda: "cuda")
  g = windows.make_geometry((2, 8, 8, 64), (3, 3), (2, 2), 1).lift(3)
  ops = _operands(dtype, taps)
  if mode == "avg":
    ops = ops[1:]
  assert triton._packed_select(mode, ops, g, tile, warps, interpret) is want
  monkeypatch.setattr(triton, "PACKED_SELECT", False)
  assert triton._packed_select(mode, ops, g, tile, warps, interpret) is False


def test_no_packed_select_for_taps_past_finite_half_floats(monkeypatch):
  """A window of more taps than :data:`triton_backward.PICK16_TAPS` (int16 taps whose bits
  would be a half float's infinity or NaN) selects one lane at a time."""
  monkeypatch.setattr(triton, "platform", lambda: "cuda")
  small = windows.make_geometry((1, 180, 176, 2), (180, 176), (1, 1), 0).lift(3)
  big = windows.make_geometry((1, 180, 177, 2), (180, 177), (1, 1), 0).lift(3)
  assert small.num_taps <= triton.PICK16_TAPS < big.num_taps
  assert windows.taps_dtype(big.num_taps) == jnp.int16
  ops = _operands(jnp.bfloat16, jnp.int16)
  assert triton._packed_select("max", ops, small, 512, 2, False)
  assert not triton._packed_select("max", ops, big, 512, 2, False)


@pytest.mark.parametrize("dtype, packed", [(jnp.bfloat16, True), (jnp.float16, True),
                                           (jnp.float32, False)])
def test_the_packed_select_lowers_for_cuda(monkeypatch, dtype, packed):
  """Compiled for an NVIDIA GPU, the 16-bit max backward's selects are the inline PTX (on any
  host: Pallas' Triton lowering runs; Triton's compiler, on a GPU, does not)."""
  monkeypatch.setattr(triton, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")  # (lowered, never run: nothing to tune)
  shape = (2, 16, 16, 64)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  y = jax.ShapeDtypeStruct(geom.output_shape(shape), dtype)
  taps = jax.ShapeDtypeStruct(y.shape, windows.taps_dtype(geom.num_taps))

  def lowered():
    fn = lambda i, d: triton.max_backward(i, d, shape, geom, interpret=False)  # noqa: E731
    return jax.jit(fn).trace(taps, y).lower(lowering_platforms=("cuda",)).as_text()

  assert ("set.eq.u32.f16x2" in lowered()) is packed
  monkeypatch.setattr(triton, "PACKED_SELECT", False)
  assert "set.eq.u32.f16x2" not in lowered()


def _tied(rng, shape, dtype):
  """Small integers (many ties), zeros of both signs."""
  v = rng.integers(-3, 4, shape).astype(np.float32)
  v[rng.random(shape) < 0.1] = -0.0
  return jnp.asarray(v).astype(dtype)


def _offered(shape, dtype, geom):
  """The heuristic and every launch the tuner offers for the max backward of ``shape``."""
  g = geom.lift(3)
  heuristic = triton.launch_for("max_bwd", shape, dtype, geom, interpret=False)
  view = triton._view_shape(shape, g.in_spatial, g.channels_last)
  lanes = view[-1] if g.channels_last else view[0]
  itemsize = np.dtype(dtype).itemsize
  blocks = triton.backward_block_candidates(heuristic, g, itemsize)
  return tuning.candidates(heuristic, triton._backward_cols(g), lanes, itemsize,
                           g.channels_last, 64, blocks)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_packed_select_gives_the_one_lane_bits(rng, monkeypatch, case, dtype):
  if not ON_GPU:
    pytest.skip("needs a GPU")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")  # (the launches are given: nothing to tune)
  shape, window, strides, padding, fmt = CASES[case]
  geom = windows.make_geometry(shape, window, strides, padding, data_format=fmt)
  x = _tied(rng, shape, dtype)
  taps = triton.max_forward_taps(x, geom, interpret=False)[1]
  # (-1: windows that take no element, as a masked or empty window's taps)
  taps = jnp.where(jnp.asarray(rng.random(taps.shape) < 0.05), -1, taps).astype(taps.dtype)
  dy = _tied(rng, geom.output_shape(shape), dtype)
  g = geom.lift(3)
  packed = 0
  for launch in _offered(shape, dtype, geom):
    call = jax.jit(lambda i, d, launch=launch: triton._backward_call(
        (i, d), shape, geom, "max", False, launch=launch))
    monkeypatch.setattr(triton, "PACKED_SELECT", True)
    bw, bl, warps = launch[:3]
    packed += triton._packed_select("max", (taps, dy), g, bw * bl, warps, False)
    got = call(taps, dy)
    monkeypatch.setattr(triton, "PACKED_SELECT", False)
    jax.clear_caches()
    want = call(taps, dy)
    jax.clear_caches()
    bits_equal(got, want)
  assert packed >= 3
