"""The max backward of 16-bit floats selects two lanes an instruction on NVIDIA GPUs
(``triton_backward.pick16``, inline PTX on lanes paired in 32-bit registers): where it applies
(``triton._packed_select``), that its PTX lowers, the encoding it rests on (a NumPy model of
its instructions against the one-lane select, over every 16-bit cotangent), and compiled on a
GPU (the tests marked ``gpu``) the bits of every launch the tuner offers against the one-lane
select's, with ties, zeros of both signs, NaN, infinities, subnormals, and windows that take no
element."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kernel_base import ON_GPU, bits_equal, tied

from jaxpool._src import settings, windows
from jaxpool._src.pallas.triton import config
from jaxpool._src.pallas.triton import ops as triton
from jaxpool._src.pallas.triton import backward as triton_backward
from jaxpool._src.pallas.tuning import tuner as tuning

gpu = pytest.mark.gpu

# (shape, window, strides, padding, data_format): odd sizes (edges on every side), both
# layouts, 3-D, and a stride of 1, where a phase visits every tap of the window.
CASES = {
    "2d_last": ((8, 57, 45, 72), (3, 3), (2, 2), 1, "channels_last"),
    "2d_first": ((4, 24, 37, 61), (3, 3), (2, 2), 1, "channels_first"),
    "3d_last": ((2, 9, 21, 19, 40), (3, 3, 3), (2, 2, 2), 1, "channels_last"),
    "2d_s1": ((4, 15, 17, 64), (3, 2), (1, 1), 1, "channels_last"),
    # (channels_first, stride 3: each lane its own column phase, the column taps masked per lane)
    "2d_first_s3": ((2, 24, 37, 61), (4, 4), (3, 3), 1, "channels_first"),
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
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  g = windows.make_geometry((2, 8, 8, 64), (3, 3), (2, 2), 1).lift(3)
  ops = _operands(dtype, taps)
  if mode == "avg":
    ops = ops[1:]
  assert triton._packed_select(mode, ops, g, tile, warps, interpret) is want
  monkeypatch.setitem(settings.overrides, "packed_select", False)
  assert triton._packed_select(mode, ops, g, tile, warps, interpret) is False


def test_no_packed_select_for_taps_past_finite_half_floats(monkeypatch):
  """A window of more taps than :data:`triton_backward.PICK16_TAPS` (int16 taps whose bits
  would be a half float's infinity or NaN) selects one lane at a time."""
  monkeypatch.setattr(config, "platform", lambda: "cuda")
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
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv(tuning.TUNE_ENV, "off")  # (lowered, never run: nothing to tune)
  shape = (2, 16, 16, 64)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  y = jax.ShapeDtypeStruct(geom.output_shape(shape), dtype)
  taps = jax.ShapeDtypeStruct(y.shape, windows.taps_dtype(geom.num_taps))

  def lowered():
    fn = lambda i, d: triton.max_backward(i, d, shape, geom, interpret=False)  # noqa: E731
    return jax.jit(fn).trace(taps, y).lower(lowering_platforms=("cuda",)).as_text()

  assert ("set.eq.u32.f16x2" in lowered()) is packed
  monkeypatch.setitem(settings.overrides, "packed_select", False)
  assert "set.eq.u32.f16x2" not in lowered()


def _set_eq_f16x2(a, b):
  """PTX's ``set.eq.u32.f16x2`` on one lane: ``0xFFFF`` where the 16-bit patterns ``a`` and
  ``b``, read as half floats, compare equal (IEEE: NaN equals nothing, ``-0 == +0``,
  subnormals kept: no ``.ftz``)."""
  with np.errstate(invalid="ignore"):
    return np.where(a.view(np.float16) == b.view(np.float16), 0xFFFF, 0).astype(np.uint16)


def _model_pick16(dy_bits, taps16, tap, plus_zero):
  """:func:`triton_backward.pick16`'s instructions on one lane, in NumPy."""
  mask = _set_eq_f16x2(taps16.view(np.uint16), np.full_like(dy_bits, tap))
  if not plus_zero:
    return dy_bits & mask
  zero = _set_eq_f16x2(dy_bits, np.zeros_like(dy_bits))
  return dy_bits & mask & ~zero  # (lop3 with table 0x40)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # (NaN compared)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
def test_the_packed_select_encoding_gives_the_one_lane_select(dtype):
  """Every 16-bit cotangent (all 65536 patterns: NaN, infinities, subnormals, zeros of both
  signs) against taps of -1, 0, a few taps and the largest a window may have: the model of
  :func:`triton_backward.pick16` gives the one-lane select's bits, ``where(taps == t, dy, 0)``
  and, for a sum's first term, ``where(c == 0, +0.0, c)`` in the cotangents' own dtype."""
  dy_bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
  dy = dy_bits.view(dtype)
  last = triton_backward.PICK16_TAPS - 1
  for taps_value in (-1, 0, 1, 8, 1023, 1024, last):
    taps16 = np.full(dy.shape, taps_value, np.int16)
    for tap in (0, 1, 8, 1023, 1024, last):
      want = np.where(taps16 == tap, dy, dtype(0))
      for plus_zero in (False, True):
        if plus_zero:
          want = np.where(want == 0, dtype(0), want)
        got = _model_pick16(dy_bits, taps16, tap, plus_zero)
        np.testing.assert_array_equal(got, want.view(np.uint16))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # (NaN compared)
def test_the_packed_select_encoding_test_can_fail():
  """The check above finds a first term's select that keeps ``-0.0`` (``and`` alone), and a
  tap past :data:`triton_backward.PICK16_TAPS` (``0x7C01``: a half float's NaN, equal to
  nothing, so its cotangents would be dropped)."""
  dy_bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
  dy = dy_bits.view(ml_dtypes.bfloat16)
  taps16 = np.zeros(dy.shape, np.int16)
  want = np.where(dy == 0, ml_dtypes.bfloat16(0), dy).view(np.uint16)
  assert (_model_pick16(dy_bits, taps16, 0, False) != want).sum() == 1  # (-0.0)
  past = np.full(dy.shape, 0x7C01, np.int16)
  assert triton_backward.PICK16_TAPS <= 0x7C01
  assert (_model_pick16(dy_bits, past, 0x7C01, False) == 0).all()


def _with_extremes(rng, v):
  """``v`` (a 16-bit float array) with 5% of it NaN, infinities, the largest finite values
  and subnormals."""
  out = np.array(v)
  info = jnp.finfo(v.dtype)
  special = np.array([np.nan, np.inf, -np.inf, info.max, -info.max, info.tiny / 4,
                      -info.tiny / 4, info.smallest_subnormal], dtype=out.dtype)
  pick = rng.random(out.shape) < 0.05
  out[pick] = special[rng.integers(0, special.size, int(pick.sum()))]
  return jnp.asarray(out)


def _offered(shape, dtype, geom):
  """The heuristic and every launch the tuner offers for the max backward of ``shape``."""
  g = geom.lift(3)
  heuristic = triton.launch_for("max_bwd", shape, dtype, geom, interpret=False)
  view = triton._view_shape(shape, g.in_spatial, g.channels_last)
  lanes = view[-1] if g.channels_last else view[0]
  itemsize = np.dtype(dtype).itemsize
  blocks = config.backward_block_candidates(heuristic, g, itemsize)
  return config.candidates(heuristic, triton._backward_cols(g), lanes, itemsize,
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
  x = tied(rng, shape, dtype)
  taps = triton.max_forward_taps(x, geom, interpret=False)[1]
  # (-1: windows that take no element, as a masked or empty window's taps)
  taps = jnp.where(jnp.asarray(rng.random(taps.shape) < 0.05), -1, taps).astype(taps.dtype)
  dy = _with_extremes(rng, tied(rng, geom.output_shape(shape), dtype))
  g = geom.lift(3)
  packed = 0
  for launch in _offered(shape, dtype, geom):
    call = jax.jit(lambda i, d, launch=launch: triton._backward_call(
        (i, d), shape, geom, "max", False, launch=launch))
    monkeypatch.setitem(settings.overrides, "packed_select", True)
    bw, bl, warps = launch[:3]
    packed += triton._packed_select("max", (taps, dy), g, bw * bl, warps, False)
    got = call(taps, dy)
    monkeypatch.setitem(settings.overrides, "packed_select", False)
    jax.clear_caches()
    want = call(taps, dy)
    jax.clear_caches()
    bits_equal(got, want)
  assert packed >= 3
