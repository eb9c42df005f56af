"""The Pallas kernels against jaxpool's XLA path, bit for bit (max) or to float32 rounding (avg).

On a CPU the kernels run in interpret mode (``implementation="pallas"``), on small, odd shapes:
sizes that are not multiples of the block, windows larger than the stride, padding on both sides.
The tests marked ``gpu`` run the same comparisons compiled, on larger shapes, plus determinism;
run them on a GPU machine with ``pytest -m gpu tests/kernels/test_pallas.py``.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_base import (CONFIGS, CONFIGS_ND, GPU_CONFIGS, ND_IDS, ON_GPU, bits_equal, check_avg,
                         check_avg_grad_zero_signs, check_empty_windows_and_all_neg_inf,
                         check_max, check_signed_zeros,
                         check_vmap_grad_and_jvp, data, kw_of)

import jaxpool
from jaxpool._src import dispatch, settings, windows, xla
from jaxpool._src.pallas.triton import config
from jaxpool._src.pallas import ops

# ----------------------------------------------------------------------------- CPU (interpret)


@pytest.mark.parametrize("cfg", [
    CONFIGS[0],
    # (`make test` checks dilation and ceil mode channels_last in
    # test_nd_and_channels_first_match_xla[3d_last_dilated_ceil])
    pytest.param(CONFIGS[1], marks=pytest.mark.slow),
    CONFIGS[2]], ids=["2d_overlap", "2d_dilated_ceil", "1d_edge"])
def test_max_matches_xla(rng, cfg):
  check_max(rng, cfg, jnp.float32)


# `make test` runs 3d_last_dilated_ceil and 2d_first_wide (channels_first, both code paths);
# the other layouts' configurations are marked slow (`make test-all`, the GPU session). The
# channels_first kernels keep a 1-D (stride 3) check there in test_small_blocks_take_both_paths.
SLOW_ND = ("2d_first", "3d_first", "1d_first")


@pytest.mark.parametrize("cfg", [
    pytest.param(cfg, id=i, marks=pytest.mark.slow if i in SLOW_ND else ())
    for cfg, i in zip(CONFIGS_ND, ND_IDS, strict=True)])
def test_nd_and_channels_first_match_xla(rng, cfg):
  check_max(rng, cfg, jnp.float32)
  check_avg(rng, cfg, jnp.float32, cfg[-1] == "channels_first", None)


def test_nd_bfloat16_avg_divisor(rng):
  # (bfloat16 max pooling: test_max_bfloat16_matches_xla. 1-D, 2-D and 3-D pools run the same
  # 3-D kernels, so a dtype's handling does not depend on the number of spatial dims.)
  check_avg(rng, CONFIGS_ND[2], jnp.bfloat16, False, 5)


@pytest.mark.slow  # (`make test` checks bfloat16 max pooling in test_signed_zeros_match_xla's
# 2d_last_bf16: values, taps, min and gradient on ties, NaN, -inf and signed zeros)
def test_max_bfloat16_matches_xla(rng):
  check_max(rng, ((1, 5, 7, 6), (3, 3), (2, 2), 1, None, False), jnp.bfloat16)


def test_avg_matches_xla(rng):
  check_avg(rng, CONFIGS[0], jnp.float32, False, None)
  check_avg(rng, CONFIGS[1], jnp.float32, True, None)


def test_avg_bfloat16_divisor_1d(rng):
  check_avg(rng, CONFIGS[2], jnp.bfloat16, False, 5)


def test_empty_windows_and_all_neg_inf():
  check_empty_windows_and_all_neg_inf()


def test_transformations(rng):
  """vmap(grad) and jvp, against the XLA path (shard_map and the hessian:
  test_transformations_shard_map_and_hessian)."""
  x = data(rng, (2, 6, 5, 3), jnp.float32, special=False)
  check_vmap_grad_and_jvp(rng, x, dict(window_shape=(3, 3), strides=(2, 2), padding=1))


@pytest.mark.slow  # (`make test` keeps vmap(grad) and jvp: test_transformations; the kernels in
# shard_map: test_sharding.py's Pallas check on the Explicit mesh; test_structure.py lowers their
# hessian)
def test_transformations_shard_map_and_hessian(rng):
  """vmap(grad), jvp, hessian and shard_map, against the XLA path."""
  shape, window, strides, padding = (2, 6, 5, 3), (3, 3), (2, 2), 1
  x = data(rng, shape, jnp.float32, special=False)
  # shard_map over the batch (on every device there is), in the same jit as vmap(grad) and jvp
  from jax.sharding import PartitionSpec as P
  try:
    from jax import shard_map
  except ImportError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map
  import inspect
  check = ({"check_vma": False} if "check_vma" in inspect.signature(shard_map).parameters
           else {"check_rep": False})
  n = len(jax.devices())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("b",))

  def sharded_grad(f, v):
    sm = shard_map(jax.grad(f), mesh=mesh, in_specs=P("b"), out_specs=P("b"), **check)
    return sm(jnp.concatenate([v] * n)), jax.grad(f)(v)

  p, q, ((sm_p, _), (_, grad_q)) = check_vmap_grad_and_jvp(
      rng, x, dict(window_shape=window, strides=strides, padding=padding), also=sharded_grad)
  np.testing.assert_allclose(sm_p, jnp.concatenate([grad_q] * n), rtol=1e-6, atol=1e-6)
  # second order: jacfwd over jacrev
  xs = x[:1, :4, :4, :1]
  np.testing.assert_allclose(jax.jit(jax.hessian(p))(xs), jax.jit(jax.hessian(q))(xs),
                             rtol=1e-5, atol=1e-6)


def test_backward_is_the_pallas_kernel():
  x = jnp.ones((1, 5, 5, 2))
  f = lambda v: jaxpool.max_pool(v, (2, 2), (1, 1), implementation="pallas").sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(f))(x))
  assert "jaxpool_max_pool_gather_transpose" in jaxpr and "scatter" not in jaxpr
  g = lambda v: jaxpool.avg_pool(v, (2, 2), (1, 1), implementation="pallas").sum()
  assert "jaxpool_avg_pool_transpose" in str(jax.make_jaxpr(jax.grad(g))(x))



def test_unsupported_says_why():
  def why(op, shape, dtype, geom):
    return ops.unsupported(op, shape, dtype, geom)

  g2 = windows.make_geometry((2, 8, 8, 4), (2, 2), (2, 2))
  assert why("max_pool", (2, 8, 8, 4), jnp.float32, g2) is None
  assert why("avg_pool", (2, 8, 8, 4), jnp.bfloat16, g2) is None
  assert "no Pallas kernel for lp_pool" in why("lp_pool", (2, 8, 8, 4), jnp.float32, g2)
  assert "not int32" in why("max_pool", (2, 8, 8, 4), jnp.int32, g2)
  cf = windows.make_geometry((2, 4, 8, 8), (2, 2), (2, 2), data_format="channels_first")
  assert why("max_pool", (2, 4, 8, 8), jnp.float32, cf) is None
  g3 = windows.make_geometry((1, 4, 4, 4, 2), (2, 2, 2))
  assert why("max_pool", (1, 4, 4, 4, 2), jnp.float32, g3) is None
  g4 = windows.make_geometry((1, 3, 3, 3, 3, 1), (2, 2, 2, 2))
  assert "1 to 3 spatial dims" in why("max_pool", (1, 3, 3, 3, 3, 1), jnp.float32, g4)
  huge = (2**16, 2**8, 2**7, 1)  # 2**31 elements: only the shape is looked at
  gh = windows.make_geometry(huge, (2, 2), (2, 2))
  assert "int32" in why("max_pool", huge, jnp.float32, gh)
  under = (2**16, 2**8, 2**7 - 1, 1)
  assert why("max_pool", under, jnp.float32, windows.make_geometry(under, (2, 2), (2, 2))) is None
  big = windows.make_geometry((1, 20, 20, 1), (9, 9))
  assert why("max_pool", (1, 20, 20, 1), jnp.float32, big) is None  # (a dim at a time)
  assert "81 taps" in why("max_pool_with_taps", (1, 20, 20, 1), jnp.float32, big)
  long = windows.make_geometry((1, 2, 40, 1), (1, 33))
  assert "33 taps" in why("max_pool", (1, 2, 40, 1), jnp.float32, long)


@pytest.mark.parametrize("call, reason", [
    (lambda: jaxpool.max_pool(jnp.ones((1, 3, 3, 3, 3, 1)), (2, 2, 2, 2),
                              implementation="pallas"), "1 to 3 spatial dims"),
    (lambda: jaxpool.max_pool_with_indices(jnp.ones((1, 20, 20, 1)), (9, 9),
                                           implementation="pallas"), "81 taps"),
    (lambda: jaxpool.avg_pool(jnp.ones((1, 3, 3, 3, 3, 1)), (2, 2, 2, 2),
                              implementation="pallas"), "1 to 3 spatial dims"),
    (lambda: jaxpool.lp_pool(jnp.ones((1, 8, 1)), 2, (2,), implementation="pallas"),
     "no Pallas kernel for lp_pool"),
    (lambda: jaxpool.l2_pool(jnp.ones((1, 8, 1)), (2,), implementation="pallas"),
     "no Pallas kernel for lp_pool"),
    (lambda: jaxpool.max_pool(jnp.ones((1, 8, 1), jnp.int32), (2,), implementation="pallas"),
     "not int32"),
])
def test_every_op_refuses_pallas_it_cannot_serve(call, reason):
  with pytest.raises(ValueError, match="implementation='pallas' cannot serve .*" + reason):
    call()


# ----------------------------------------------------------------------------- GPU (compiled)

gpu = pytest.mark.gpu


def _need_gpu():
  if not ON_GPU:
    pytest.skip("needs a GPU")


@gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=[str(i) for i in range(len(GPU_CONFIGS))])
def test_gpu_max_matches_xla(rng, cfg, dtype):
  _need_gpu()
  check_max(rng, cfg, dtype)


@gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cip,div", [(True, None), (False, None), (True, 7)])
def test_gpu_avg_matches_xla(rng, dtype, cip, div):
  _need_gpu()
  for cfg in GPU_CONFIGS:
    check_avg(rng, cfg, dtype, cip, div)


@gpu
def test_gpu_transformations(rng):
  _need_gpu()
  test_transformations_shard_map_and_hessian(rng)
  test_empty_windows_and_all_neg_inf()
  test_backward_is_the_pallas_kernel()


@gpu
def test_gpu_deterministic(rng):
  _need_gpu()
  x = data(rng, (16, 56, 56, 64), jnp.float32, special=False)
  x = jnp.round(x * 4) / 4  # many ties, many windows choosing the same element
  dy = data(rng, (16, 28, 28, 64), jnp.float32, special=False)
  f = jax.jit(functools.partial(jax.grad(
      lambda v, g: jnp.sum(jaxpool.max_pool(v, (3, 3), (2, 2), 1) * g))))
  a, b = f(x, dy), f(x, dy)
  assert np.array_equal(np.asarray(a), np.asarray(b))
  assert "jaxpool_max_pool_bwd" in f.lower(x, dy).as_text()


# (`make test` lowers 2d_first and 3d_last: every kernel in both layouts; 1-D and 2-D pools run
# the same 3-D kernels)
@pytest.mark.parametrize("cfg", [pytest.param(GPU_CONFIGS[0], marks=pytest.mark.slow),
                                 CONFIGS_ND[0], CONFIGS_ND[1],
                                 pytest.param(CONFIGS_ND[3], marks=pytest.mark.slow)],
                         ids=["2d_last", "2d_first", "3d_last", "1d_first"])
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)],
                         ids=["f32", "bf16"])
def test_lowers_to_triton(cfg, dtype):
  """Every kernel, compiled (not interpreted), lowers to a Triton call for CUDA, on any host:
  Pallas' Triton lowering runs; Triton's compiler (on a GPU) does not."""
  from jaxpool._src.pallas.triton import ops as pk
  shape, *geo = cfg
  geom = windows.make_geometry(shape, *kw_of(*geo).values())
  x = jnp.zeros(shape, dtype)
  y = jax.ShapeDtypeStruct(geom.output_shape(shape), dtype)
  idx = jax.ShapeDtypeStruct(y.shape, windows.taps_dtype(geom.num_taps))
  avg = dict(interpret=False, count_include_pad=False, divisor_override=None)
  fns = [
      (lambda a: pk.max_forward(a, geom, interpret=False), x),
      (lambda a: pk.max_forward_taps(a, geom, interpret=False), x),
      (lambda i, d: pk.max_backward(i, d, shape, geom, interpret=False), idx, y),
      (lambda a: pk.avg_forward(a, geom, **avg), x),
      (lambda d: pk.avg_backward(d, shape, geom, **avg), y),
  ]
  for fn, *args in fns:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


def test_avg_kernel_lowers_with_the_exact_reciprocal_for_cuda(monkeypatch):
  """Compiled for an NVIDIA GPU, the average forward kernel takes an edge window's reciprocal
  divisor with PTX's correctly rounded ``rcp.rn.f32`` (Triton's float32 division is
  approximate, and an interior window's reciprocal is the correctly rounded constant): the
  inline PTX lowers. (The backward divides on both of its paths.)"""
  from jaxpool._src.pallas.triton import ops as pk
  monkeypatch.setattr(config, "platform", lambda: "cuda")
  monkeypatch.setenv("JAXPOOL_TUNE", "off")  # (lowered, never run: nothing to tune)
  shape = (2, 9, 10, 5)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1)
  avg = dict(interpret=False, count_include_pad=False, divisor_override=None)
  fwd = lambda a: pk.avg_forward(a, geom, **avg)  # noqa: E731
  text = jax.jit(fwd).trace(jax.ShapeDtypeStruct(shape, jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text and "rcp.rn.f32" in text


def test_default_dispatch(monkeypatch):
  """None: the kernels on NVIDIA GPUs only (where they were compiled and tested); XLA on a CPU,
  a TPU, a ROCm GPU or when JAXPOOL_IMPLEMENTATION=xla; a bad value of that variable is an
  error naming it. implementation="pallas" is an explicit choice that wins everywhere."""
  x = jnp.ones((2, 8, 8, 4))
  geom = windows.make_geometry(x.shape, (2, 2), (2, 2))
  monkeypatch.delenv(dispatch.ENV, raising=False)
  for where, expected in (("cpu", "xla"), ("cuda", "pallas"), ("tpu", "xla"), ("rocm", "xla")):
    monkeypatch.setattr(dispatch, "platform", lambda w=where: w)
    for op in ("max_pool", "max_pool_with_taps", "avg_pool"):
      assert dispatch.choose(op, None, x, geom).name == expected, (where, op)
    assert dispatch.choose("lp_pool", None, x, geom).name == "xla"
    assert dispatch.choose("max_pool", "pallas", x, geom).name == "pallas"
  assert "NVIDIA GPUs only" in dispatch.pallas().not_default("rocm")
  monkeypatch.setattr(dispatch, "platform", lambda: "cuda")
  monkeypatch.setenv(dispatch.ENV, "xla")
  assert dispatch.choose("max_pool", None, x, geom).name == "xla"
  assert dispatch.choose("max_pool", "pallas", x, geom).name == "pallas"
  monkeypatch.setenv(dispatch.ENV, "triton")
  with pytest.raises(ValueError, match="JAXPOOL_IMPLEMENTATION.*'triton'"):
    dispatch.choose("max_pool", None, x, geom)


def test_platform_names_rocm(monkeypatch):
  from jax.extend import backend as jex_backend

  class FakeBackend:
    platform_version = "rocm 6.2"

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jex_backend, "get_backend", lambda *a: FakeBackend())
  assert dispatch.platform() == "rocm"
  FakeBackend.platform_version = "PJRT C API\ncuda 12080"
  assert dispatch.platform() == "cuda"


@pytest.mark.parametrize("cfg", [
    CONFIGS[0],
    # (`make test` keeps channels_first's two code paths at its own block size in
    # test_nd_and_channels_first_match_xla[2d_first_wide], small blocks in 1d_first_stride3)
    pytest.param(CONFIGS_ND[0], marks=pytest.mark.slow),
    CONFIGS_ND[3]], ids=["2d_last", "2d_first", "1d_first_stride3"])
def test_small_blocks_take_both_paths(rng, cfg):
  """Blocks of 2 columns and 2 lanes, so that a small image has interior blocks (no masks) and
  edge blocks: every kernel, both code paths, against the XLA path."""
  shape, *geo = cfg
  check_every_kernel(rng, shape, windows.make_geometry(shape, *kw_of(*geo).values()),
                     (2, 2, 1), (2, 2, 1))


def check_every_kernel(rng, shape, geom, launch, backward_launch):
  """Every kernel with ``launch`` (the backward's: ``backward_launch``) against the XLA path:
  the max forwards and backward bit for bit, the average's to float32 rounding."""
  from jaxpool._src.pallas.triton import ops as pk
  x = data(rng, shape, jnp.float32)
  dy = data(rng, geom.output_shape(shape), jnp.float32, special=False)
  xf = data(rng, shape, jnp.float32, special=False)

  @jax.jit  # every kernel and its reference in one compile
  def run(x, xf, dy):
    y, idx = pk._window_call(x, geom, "argmax", True, launch=launch)
    ymax = pk._window_call(x, geom, "max", True, launch=launch)[0]
    yb, ib = xla.max_pool_taps(x, geom)
    dx = pk._backward_call((ib, dy), shape, geom, "max", True, launch=backward_launch)
    dxb = jax.vjp(lambda t: xla.gather_at_taps(t, ib, geom), x)[1](dy)[0]
    a = pk._window_call(xf, geom, "avg", True, True, None, launch=launch)[0]
    ref, vjp = jax.vjp(lambda v: xla.avg_pool(v, geom, True, None), xf)
    da = pk._backward_call((dy,), shape, geom, "avg", True, True, None,
                           launch=backward_launch)
    return (y, yb), (idx, ib), (ymax, yb), (dx, dxb), (a, ref), (da, vjp(dy)[0])

  *maxes, avg, davg = run(x, xf, dy)
  for got, want in maxes:
    bits_equal(got, want)
  for got, want in (avg, davg):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _edge_paths(fn, *args) -> int:
  """How many ``pl.when`` branches (``cond``) the kernel of the ``pallas_call`` of ``fn`` has."""
  (kernel,) = [e.params["jaxpr"] for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns
               if e.primitive.name == "pallas_call"]
  return sum(e.primitive.name == "cond" for e in kernel.eqns)


@pytest.mark.parametrize("shape, window, strides, fmt, edges", [
    # (input, window, strides, layout, whether the forward and the backward need the edge path)
    ((2, 8, 12, 3), (2, 2), (2, 2), "channels_last", (False, False)),  # windows tile the input
    ((2, 7, 13, 3), (2, 2), (2, 2), "channels_last", (False, True)),  # a row, a column left over
    pytest.param((2, 9, 11, 3), (3, 3), (2, 2), "channels_last", (False, True),  # overlapping
                 marks=pytest.mark.slow),  # (`make test`: the backward's edge rows in left_over)
    ((2, 3, 9, 12), (3, 3), (3, 3), "channels_first", (False, False)),
    pytest.param((2, 3, 10, 12), (3, 3), (3, 3), "channels_first", (False, True),
                 marks=pytest.mark.slow),
    ((1, 4, 6, 7, 2), (2, 2, 2), (2, 2, 2), "channels_last", (False, True)),
], ids=["tiled", "left_over", "overlap", "first_tiled", "first_left_over", "3d"])
def test_the_edge_path_is_left_out_only_where_no_program_needs_it(rng, shape, window, strides,
                                                                   fmt, edges):
  """A kernel whose programs all lie inside the input (a valid pool whose windows tile it, or
  a forward of valid windows) is built without the edge path; where a program can need it
  (a row or column of the input that no window reads, the backward's first rows of
  overlapping windows) it is built, and every kernel gives the XLA path's results with small
  blocks and blocks of 2 and 3 rows, which put programs at every edge."""
  from jaxpool._src.pallas.triton import ops as pk
  geom = windows.make_geometry(shape, window, strides, "VALID", data_format=fmt)
  x = jnp.zeros(shape, jnp.float32)
  taps = pk.max_forward_taps(x, geom, interpret=True)[1]
  dy = jnp.zeros(geom.output_shape(shape), jnp.float32)
  # (the kernels as compiled for a GPU: traced, not run; interpreted, a kernel of one path
  # runs inside a cond of a constant predicate, tile.both_paths)
  fwd = _edge_paths(lambda v: pk.max_forward_taps(v, geom, interpret=False), x)
  bwd = _edge_paths(lambda t, g: pk.max_backward(t, g, shape, geom, interpret=False), taps, dy)
  assert (fwd > 0, bwd > 0) == edges, (fwd, bwd)
  for rows in ((1, 2), (1, 3)) if len(shape) == 4 else ((2, 1),):
    check_every_kernel(rng, shape, geom, (2, 2, 1), (2, 2, 1, *rows))


def check_avg_code_paths(rng, shape, geo, launches, count_include_pad, divisor, interpret):
  """Average pooling, forward and backward, with each of ``launches`` (None: the heuristic's):
  every launch gives the first one's bits."""
  from jaxpool._src.pallas.triton import ops as pk
  geom = windows.make_geometry(shape, *geo)
  x = jnp.asarray(rng.normal(size=shape), jnp.float32)
  dy = jnp.asarray(rng.normal(size=geom.output_shape(shape)), jnp.float32)
  cfg = (count_include_pad, divisor)

  @jax.jit
  def run(x, dy):
    return [(pk._window_call(x, geom, "avg", interpret, *cfg, launch=launch)[0],
             pk._backward_call((dy,), shape, geom, "avg", interpret, *cfg, launch=launch))
            for launch in launches]

  (want_y, want_dx), *others = run(x, dy)
  for y, dx in others:
    bits_equal(y, want_y)
    bits_equal(dx, want_dx)


@pytest.mark.parametrize("count_include_pad,divisor", [(False, None), (True, None), (False, 5)])
def test_avg_bits_do_not_depend_on_the_code_path(rng, count_include_pad, divisor):
  """A window's average has the same bits whichever code path computes it (interior programs,
  edge programs): every block size gives the heuristic's bits, forward and backward. One
  channel and a dilated window whose output has interior windows: on XLA's CPU backend, which
  runs interpret mode, a division by a constant and by a computed count differ in the last bit
  (the kernels once divided interior windows by a constant)."""
  check_avg_code_paths(rng, (2, 10, 1), ((3,), (1,), 6, (3,)),
                       (None, (1, 1, 1), (2, 1, 1), (4, 1, 1)), count_include_pad, divisor, True)


@gpu
@pytest.mark.parametrize("count_include_pad,divisor", [(False, None), (True, None), (False, 5)])
def test_gpu_avg_bits_do_not_depend_on_the_code_path(rng, count_include_pad, divisor):
  """Compiled: an interior window's constant reciprocal and an edge window's ``rcp.rn.f32``
  give the same bits, whatever the launch."""
  _need_gpu()
  check_avg_code_paths(rng, (2, 10, 1), ((3,), (1,), 6, (3,)),
                       (None, (1, 1, 1), (2, 1, 1), (4, 1, 1)), count_include_pad, divisor, False)
  check_avg_code_paths(rng, (4, 33, 40, 7), ((3, 3), (1, 1), 1, (1, 1)),
                       (None, (8, 8, 1), (16, 8, 2), (32, 4, 1)), count_include_pad, divisor,
                       False)


@pytest.mark.slow  # (`make test` checks the same rules in 2-D channels_last: test_transformations)
def test_nd_transformations(rng):
  """Per-example gradients (vmap of grad) and jvp through the 3-D and channels_first kernels."""
  for shape, window, strides, fmt in (((2, 3, 7, 9), (3, 3), (2, 2), "channels_first"),
                                      ((2, 5, 6, 4, 2), (2, 3, 2), (2, 2, 1), "channels_last")):
    x = data(rng, shape, jnp.float32, special=False)
    p, _, _ = check_vmap_grad_and_jvp(rng, x, dict(window_shape=window, strides=strides,
                                                    padding=1, data_format=fmt))
    assert "jaxpool_max_pool_gather_transpose" in str(jax.make_jaxpr(jax.grad(p))(x))


@pytest.mark.parametrize("cfg,dtype,form", [
    (CONFIGS[0], jnp.bfloat16, "canonical"), (CONFIGS[0], jnp.float32, "auto"),
    pytest.param(CONFIGS_ND[1], jnp.float32, "canonical", marks=pytest.mark.slow),
    pytest.param(CONFIGS_ND[4], jnp.bfloat16, "auto", marks=pytest.mark.slow)],
    ids=["2d_last_bf16_canonical", "2d_last_f32", "3d_last_dilated_ceil_f32_canonical",
         "2d_first_wide_bf16"])
def test_signed_zeros_match_xla(rng, monkeypatch, cfg, dtype, form):
  """Signed zeros (interpret mode; compiled: test_gpu_signed_zeros), with the running maximum
  interpret mode uses (``dtypes.beats``) and with the canonical NaN results that the compiled
  kernels' PTX maximum gives (the ``nan_max`` setting)."""
  monkeypatch.setitem(settings.overrides, "nan_max", form)
  jax.clear_caches()  # (the form is read while tracing)
  check_signed_zeros(rng, cfg, dtype)


@pytest.mark.parametrize("cfg,cip,div", [
    (CONFIGS[2], True, None), (CONFIGS[0], False, None), (CONFIGS_ND[1], True, 5),
    (CONFIGS_ND[0], True, None)], ids=["1d_edge", "2d_exclude_pad", "3d_divisor", "2d_first"])
def test_avg_grad_zero_signs_match_xla(rng, cfg, cip, div):
  check_avg_grad_zero_signs(rng, cfg, jnp.float32, cip, div)


NAN_BITS = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC0BEEF)  # (signs, payloads)


def check_nan_bits(rng):
  """Windows holding NaNs of several signs and payloads, and others without: the tap is the
  first NaN's, the value a NaN (the compiled kernels give the canonical one; which NaN is not
  part of the contract, as XLA's maximum does not keep one either), every other value bit for
  bit."""
  nans = np.array(NAN_BITS, np.uint32).view(np.float32)
  x = rng.choice(np.concatenate([nans, np.float32([1.0, -0.0, 0.0, 2.0])]), (3, 40, 2),
                 p=[0.06] * 5 + [0.35, 0.15, 0.1, 0.1])
  x = jnp.asarray(x.astype(np.float32))
  got, want = (jaxpool.max_pool_with_taps(x, (3,), strides=(1,), padding=1,
                                          implementation=impl) for impl in ("pallas", "xla"))
  bits_equal(got[0], want[0])  # (NaN where the XLA path gives NaN)
  np.testing.assert_array_equal(got[1], want[1])
  nan = np.isnan(np.asarray(want[0]))
  assert nan.any() and not nan.all()


@pytest.mark.parametrize("form", ["auto", "canonical"])
def test_nan_bits_match_xla(rng, monkeypatch, form):
  monkeypatch.setitem(settings.overrides, "nan_max", form)
  jax.clear_caches()  # (the form is read while tracing)
  check_nan_bits(rng)


def test_subnormals_beside_zeros_match_xla():
  """Interpret mode runs on XLA's CPU backend, whose comparisons treat subnormals as zeros: the
  kernels' rule there (bits of equal values compared) still finds a subnormal above a zero,
  as the XLA path's taps do."""
  f = lambda b: np.array(b, np.uint32).view(np.float32)  # noqa: E731
  tiny, neg_tiny = f(1), f(0x80000001)  # +-1.4e-45
  rows = [[0.0, tiny], [-0.0, tiny], [tiny, 0.0], [neg_tiny, -0.0], [-0.0, neg_tiny],
          [tiny, neg_tiny], [0.0, -0.0], [-0.0, 0.0]]
  x = jnp.asarray(np.array(rows, np.float32)[..., None])
  got, want = (jaxpool.max_pool_with_taps(x, (2,), implementation=impl)
               for impl in ("pallas", "xla"))
  bits_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  # (rows 0-2 and 5: the positive subnormal wins. Rows 3 and 4, a negative subnormal beside
  # -0.0, are left out: there both paths follow the CPU, which compares the two as equal.)
  assert list(np.asarray(got[1]).ravel()[[0, 1, 2, 5, 6, 7]]) == [1, 1, 0, 0, 0, 1]


@gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_signed_zeros(rng, dtype):
  _need_gpu()
  for cfg in GPU_CONFIGS:
    check_signed_zeros(rng, cfg, dtype)


@gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_avg_grad_zero_signs(rng, dtype):
  _need_gpu()
  for cfg in GPU_CONFIGS:
    for cip, div in ((True, None), (False, None), (True, 7)):
      check_avg_grad_zero_signs(rng, cfg, dtype, cip, div)


@gpu
def test_gpu_nan_bits(rng):
  _need_gpu()
  check_nan_bits(rng)


@gpu
@pytest.mark.parametrize("form", ["beats", "canonical"])
def test_gpu_other_max_forms(rng, monkeypatch, form):
  """The compiled kernels with the other forms of the running maximum (the ``nan_max`` setting, as
  docs/design/running-max.md compares them) give the same bits too."""
  _need_gpu()
  monkeypatch.setitem(settings.overrides, "nan_max", form)
  jax.clear_caches()
  for cfg in GPU_CONFIGS:
    for dtype in (jnp.float32, jnp.bfloat16):
      check_signed_zeros(rng, cfg, dtype)
    check_max(rng, cfg, jnp.bfloat16)
  check_nan_bits(rng)
  jax.clear_caches()


_LOWER_ONLY = """
import sys
import jax, jax.numpy as jnp
import jaxpool
from jaxpool._src import platforms
from jaxpool._src.pallas import backend
from jaxpool._src.pallas.triton import config
config.platform = lambda: "cuda"
platforms.compute_capability = lambda: (9, 0)
backend._interpret = lambda: False  # (the kernels as compiled for a GPU: lowered, never run)
loss = lambda x: jnp.sum(jaxpool.max_pool(x, (2, 2), implementation="pallas"))
text = jax.jit(jax.grad(loss)).trace(jax.ShapeDtypeStruct((2, 8, 8, 4), jnp.float32)).lower(
    lowering_platforms=("cuda",)).as_text()
assert text.count("xla.gpu.triton") == 2, text.count("xla.gpu.triton")
print(sorted(m for m in sys.modules if m.startswith("jax._src.pallas.mosaic_gpu.")))
"""


_FAILED_DIALECT_IMPORTS = _LOWER_ONLY.replace("print(sorted(", """failed = []
real_import = builtins.__import__
def counting(name, *args, **kwargs):
  try:
    return real_import(name, *args, **kwargs)
  except ImportError:
    failed.append(name)
    raise
builtins.__import__ = counting
loss = lambda x: jnp.sum(jaxpool.max_pool(x, (3, 3), (1, 1), implementation="pallas"))
jax.jit(jax.grad(loss)).trace(jax.ShapeDtypeStruct((2, 9, 9, 4), jnp.float32)).lower(
    lowering_platforms=("cuda",))
builtins.__import__ = real_import
print(len(failed), sorted(set(failed))[:5])
print(sorted(""").replace("import sys\n", "import builtins, sys\n", 1)


def test_lowering_the_kernels_does_not_retry_imports_for_each_op():
  """MLIR's Python bindings look up the Python module of each op's dialect, and retry while none
  is found: Triton's ops ("tt") made each op of the kernels' lowering try failed imports again
  (hundreds a kernel, a sixth of the Python lowering time). jaxpool names Triton's module where
  the bindings look (``tile._name_the_triton_dialect_module``): a second lowering, of other
  kernels, tries none. In a new process. Fails before: 936 failed imports (of ``*.tt``
  modules) in the second lowering."""
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPOOL_")}
  env["JAXPOOL_TUNE"] = "off"
  out = subprocess.run([sys.executable, "-c", _FAILED_DIALECT_IMPORTS], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  line = out.stdout.strip().splitlines()[-2]
  assert line.split()[0] == "0", line


def test_lowering_the_kernels_does_not_import_mosaic_gpu():
  """A first call lowers the Triton kernels without importing Mosaic GPU's Pallas backend
  (with jax 0.10 Pallas tries it first unless the Triton lowering is registered: 0.2-0.5 s of
  a new process's first call). In a new process, since another test may have imported it. Fails
  before the kernels imported the Triton lowering up front (``tile.compiler_params``):
  ``core`` and ``pallas_call_registration`` were imported."""
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPOOL_")}
  env["JAXPOOL_TUNE"] = "off"
  out = subprocess.run([sys.executable, "-c", _LOWER_ONLY], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  imported = eval(out.stdout.strip().splitlines()[-1])  # (a list of module names)
  assert "jax._src.pallas.mosaic_gpu.core" not in imported, imported
  assert "jax._src.pallas.mosaic_gpu.pallas_call_registration" not in imported, imported
