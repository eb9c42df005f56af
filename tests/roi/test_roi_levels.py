"""The feature maps' levels on ROI align's GPU kernels: each level its own array, no copies.

``multi_scale_roi_align`` hands the kernels each level's map as a free reshape ``(N*H*W, C)``
(no concatenation into one table), and the feature gradient comes out of the kernel as one
array per level (no slices of a ``(P, C)`` table): checked on the lowering for CUDA (the
kernels as custom calls). The bits: a level's results on the kernels are those of the same
boxes pooled from that level alone (``roi_align`` on one map, the committed one-table path):
the forward and the box gradient per box, the feature gradient per pixel (a sum over the
level's boxes in their order), in interpret mode; under ``grad`` of one level only, ``jvp``,
``vmap`` (the level-major copies of ``primitive._batch_folded``) and the second order (slow).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool
from jaxpool._src.roi import multi_scale

C = 3
IMAGE = (64, 96)
KW = dict(canonical_scale=40.0, canonical_level=4, sampling_ratio=2, aligned=True)


def _features(rng, levels=3, images=2):
  return [rng.standard_normal((images, 16 // s, 24 // s, C)).astype(np.float32)
          for s in (1, 2, 4, 8)[:levels]]


def _boxes(rng, k, images=2):
  """``k`` random boxes, then one of each level (P2, P3, P4 here: sides 10, 24, 60)."""
  xy = rng.uniform(-4, 60, (k, 2))
  side = np.exp(rng.uniform(np.log(4), np.log(90), (k, 2)))
  rows = np.concatenate([rng.integers(0, images, (k, 1)), xy, xy + side], 1)
  fixed = [[1, 3.0, 5.0, 13.0, 15.0], [0, 30.0, 2.0, 54.0, 26.0], [1, -6.0, 8.0, 54.0, 68.0]]
  return np.concatenate([rows, fixed]).astype(np.float32)


def _msra(fs, boxes, size=(2, 3), impl="pallas"):
  return jaxpool.multi_scale_roi_align(fs, boxes, [IMAGE] * fs[0].shape[0], size,
                                       implementation=impl, **KW)


def test_the_levels_reach_the_kernels_without_copies(monkeypatch):
  """Lowered for CUDA (compiled kernels, not run), ``grad`` over three levels: no array of the
  levels' rows together ``(P, C)`` anywhere (before: a concatenate of the maps into one table
  for the kernels, and three slices of the gradient's table), and the gradient kernel gives
  three results, one a level."""
  from jaxpool._src.pallas import backend
  monkeypatch.setattr(backend, "_interpret", lambda: False)
  feats = [jax.ShapeDtypeStruct((2, 16 // s, 24 // s, C), jnp.float32) for s in (1, 2, 4)]
  boxes = jax.ShapeDtypeStruct((5, 5), jnp.float32)
  loss = lambda fs, b: jnp.sum(_msra(fs, b) ** 2)  # noqa: E731
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(feats, boxes).lower(
      lowering_platforms=("cuda",)).as_text()
  rows = 2 * (16 * 24 + 8 * 12 + 4 * 6)
  assert f"tensor<{rows}x{C}x" not in text
  calls = re.findall(r"(%\S+) = stablehlo.custom_call @__gpu\$xla.gpu.triton", text)
  assert len(calls) == 4, calls  # forward, feature gradient, the corner weights' two
  assert sum(c.endswith(":3") for c in calls) == 1, calls
  for shape in ("768x3", "192x3", "48x3"):  # each level's table, as the kernels' operand
    assert f"tensor<{shape}xf32>" in text


def _one_level(feats, boxes, dy, levels, lvl, size, boxes_too=True):
  """The boxes of level ``lvl``, pooled from that level's map alone (one table):
  ``(y, dx, dboxes)`` on the kernels (``dboxes`` None unless ``boxes_too``)."""
  scales = multi_scale.infer_scales([f.shape[1:3] for f in feats], [IMAGE])
  ks = np.flatnonzero(levels == lvl)

  @jax.jit
  def run(x, b, g):
    f = lambda v, c: jaxpool.roi_align(v, c, size, spatial_scale=scales[lvl],  # noqa: E731
                                       sampling_ratio=2, aligned=True, implementation="pallas")
    if not boxes_too:
      y, vjp = jax.vjp(lambda v: f(v, b), x)
      return (y, *vjp(g), None)
    y, vjp = jax.vjp(f, x, b)
    return (y, *vjp(g))

  return ks, run(feats[lvl], boxes[ks], dy[ks])


def _levels(feats, boxes):
  scales = multi_scale.infer_scales([f.shape[1:3] for f in feats], [IMAGE])
  return np.asarray(multi_scale.map_levels(jnp.asarray(boxes[:, 1:]), scales,
                                           KW["canonical_scale"], KW["canonical_level"], 1e-6))


def _bits(a):
  return np.asarray(a).view(np.uint32)


def _each_level(rng, levels, boxes_too):
  feats = _features(rng, levels=levels)
  boxes = _boxes(rng, 4)
  mapped = _levels(feats, boxes)
  assert set(mapped) == set(range(levels))
  dy = rng.standard_normal((len(boxes), 2, 2, C)).astype(np.float32)
  dy[int(np.flatnonzero(mapped == 1)[0]), 0, 1, 2] = np.nan

  @jax.jit
  def run(fs, b, g):
    y, vjp = jax.vjp(lambda v, c: _msra(v, c, size=(2, 2)), fs, b)
    return (y, *vjp(g))

  @jax.jit
  def run_maps(fs, b, g):
    y, vjp = jax.vjp(lambda v: _msra(v, b, size=(2, 2)), fs)
    return (y, *vjp(g), None)

  y, dfeats, dboxes = (run if boxes_too else run_maps)(feats, boxes, dy)
  for lvl in range(levels) if boxes_too else (1,):
    ks, (ly, ldx, ldb) = _one_level(feats, boxes, dy, mapped, lvl, (2, 2), boxes_too)
    np.testing.assert_array_equal(_bits(y[ks]), _bits(ly))
    np.testing.assert_array_equal(_bits(dfeats[lvl]), _bits(ldx))
    assert np.abs(np.nan_to_num(ldx)).max() > 0
    if boxes_too:
      np.testing.assert_array_equal(_bits(dboxes[ks]), _bits(ldb))
  assert np.isnan(dfeats[1]).any() and not np.isnan(dfeats[0]).any()


@pytest.mark.slow
def test_a_level_has_the_bits_of_that_level_alone(rng):
  """Two levels, the maps' gradient: the second level's values and feature gradient have the
  bits of its boxes pooled from its map alone; a NaN cotangent included."""
  _each_level(rng, 2, boxes_too=False)


@pytest.mark.slow
def test_each_level_has_the_bits_of_that_level_alone(rng):
  """Three levels, and the boxes' gradient too: each box's value and box gradient, and each
  level's feature gradient, have the bits of the same boxes pooled from its level alone."""
  _each_level(rng, 3, boxes_too=True)


@pytest.mark.slow
def test_levels_under_the_transforms(rng):
  """Three levels: ``grad`` of one level only (the others closed over) is that level's part of
  the whole gradient; ``jvp`` in the maps has the XLA path's bits (the forward's); ``vmap``
  over the maps and the boxes, and over one level only, has the bits of each element on its
  own; the second order (the boxes' gradient of the features' gradient's norm) agrees with the
  XLA path."""
  feats = _features(rng)
  boxes = _boxes(rng, 6)
  assert len(set(_levels(feats, boxes))) == 3
  loss = lambda fs, b, impl="pallas": jnp.sum(jnp.sin(_msra(fs, b, impl=impl)) ** 2)  # noqa
  whole = jax.jit(jax.grad(loss))(feats, boxes)
  only = jax.jit(jax.grad(lambda p3: loss([feats[0], p3, feats[2]], boxes)))(feats[1])
  np.testing.assert_array_equal(_bits(only), _bits(whole[1]))

  ts = [rng.standard_normal(f.shape).astype(np.float32) for f in feats]
  jvp = {impl: jax.jit(lambda fs, t, i=impl: jax.jvp(lambda v: _msra(v, boxes, impl=i),
                                                      (fs,), (t,)))(feats, ts)
         for impl in ("pallas", "xla")}
  for a, b in zip(jvp["pallas"], jvp["xla"], strict=True):
    np.testing.assert_array_equal(_bits(a), _bits(b))

  def one(fs, b):
    y, vjp = jax.vjp(_msra, fs, b)
    return (y, *vjp(jnp.cos(y)))

  fs2 = [np.stack([f, 2 * f - 1]) for f in feats]
  bs2 = np.stack([boxes, boxes + 0.5])
  mapped = jax.jit(jax.vmap(one))(fs2, bs2)
  for e in range(2):
    alone = jax.jit(one)([f[e] for f in fs2], bs2[e])
    for a, b in zip(jax.tree.leaves(mapped), jax.tree.leaves(alone), strict=True):
      np.testing.assert_array_equal(_bits(a[e]), _bits(b))
  g1 = jax.jit(jax.vmap(jax.grad(lambda p2: loss([p2, feats[1], feats[2]], boxes))))(fs2[0])
  for e in range(2):
    alone = jax.jit(jax.grad(lambda p2: loss([p2, feats[1], feats[2]], boxes)))(fs2[0][e])
    np.testing.assert_array_equal(_bits(g1[e]), _bits(alone))

  def second(b, impl):
    g = jax.grad(lambda fs: jnp.sum(_msra(fs, b, impl=impl) ** 2))(feats)
    return sum(jnp.sum(v ** 2) for v in g)

  hess = {impl: jax.jit(jax.grad(functools.partial(second, impl=impl)))(boxes)
          for impl in ("pallas", "xla")}
  np.testing.assert_allclose(hess["pallas"], hess["xla"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_second_order_through_the_gradient_of_one_level(rng):
  """Reverse over reverse where the inner gradient is of one level only (the others closed
  over): the transpose of a feature gradient that gives some of the levels reads zeros for the
  others. It raised a ``KeyError`` on the kernels (the XLA path, one table, never gives some
  levels only); it agrees with the XLA path."""
  feats = _features(rng, levels=2)
  boxes = _boxes(rng, 2)[:-1]  # (P2 and P3 boxes: the levels the two maps make)

  def outer(b, impl):
    inner = lambda p2: jnp.sum(_msra([p2, feats[1]], b, impl=impl) ** 2)  # noqa: E731
    return jnp.sum(jax.grad(inner)(feats[0]) ** 2)

  got = {impl: jax.jit(jax.grad(functools.partial(outer, impl=impl)))(boxes)
         for impl in ("pallas", "xla")}
  np.testing.assert_allclose(got["pallas"], got["xla"], rtol=1e-4, atol=1e-4)
