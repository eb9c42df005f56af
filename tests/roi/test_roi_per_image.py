"""roi_align's per-image form: boxes ``(N, K, 4)`` with a mask ``(N, K)``. Values, the feature
gradient and the box gradient equal the ``(K, 5)`` form's for the same boxes, bit for bit (and
the NumPy reference); a padding row gives zeros and zero gradients whatever it holds (NaN
here); bad masks and boxes raise. The split over a batch-sharded mesh is in
tests/sharding/test_roi_sharding.py."""

import jax
import numpy as np
import pytest
import roi_reference as rref

import jaxpool

N, K, H, W, C = 3, 5, 9, 8, 3
CONFIGS = {
    "avg_ratio2": dict(sampling_ratio=2),
    "avg_adaptive_aligned": dict(sampling_ratio=-1, aligned=True),
    "max": dict(sampling_ratio=2, mode="max"),
}
SLOW = {"avg_adaptive_aligned", "max"}


def _case(rng):
  x = rng.standard_normal((N, H, W, C)).astype(np.float32)
  x[0, 2, 3, 1] = x[0, 2, 4, 1]  # a tie
  xy = rng.uniform(-2, 9, (N, K, 2))
  wh = rng.uniform(-0.5, 7, (N, K, 2))
  boxes = np.concatenate([xy, xy + wh], -1).astype(np.float32)
  mask = rng.uniform(size=(N, K)) < 0.7
  mask[2] = False  # an image without boxes
  mask[0, 0] = True
  boxes[~mask] = np.nan  # padding: any value
  live = np.argwhere(mask)
  rows = np.concatenate([live[:, :1], boxes[live[:, 0], live[:, 1]]], 1).astype(np.float32)
  return x, boxes, mask, live, rows


def _vjp(f, x, b, g):
  y, vjp = jax.vjp(f, x, b)
  return (y, *vjp(g))


def _bits(a):
  return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else [])
                                  for n in CONFIGS])
def test_per_image_boxes_give_the_bits_of_rows(rng, name):
  kw = dict(CONFIGS[name], output_size=(3, 2), spatial_scale=0.8)
  x, boxes, mask, live, rows = _case(rng)
  g = rng.standard_normal((N, K, 3, 2, C)).astype(np.float32)
  per = jax.jit(lambda x, b, g: _vjp(lambda v, c: jaxpool.roi_align(v, c, mask=mask, **kw),
                                     x, b, g))
  flat = jax.jit(lambda x, b, g: _vjp(lambda v, c: jaxpool.roi_align(v, c, **kw), x, b, g))
  y, dx, db = per(x, boxes, g)
  fy, fdx, fdb = flat(x, rows, g[live[:, 0], live[:, 1]])
  assert y.shape == (N, K, 3, 2, C)
  np.testing.assert_array_equal(_bits(y)[live[:, 0], live[:, 1]], _bits(fy))
  np.testing.assert_array_equal(_bits(dx), _bits(fdx))
  np.testing.assert_array_equal(_bits(db)[live[:, 0], live[:, 1]], _bits(fdb[:, 1:]))
  # padding rows: zeros, no gradient, whatever their coordinates
  np.testing.assert_array_equal(_bits(y)[~mask], 0)
  np.testing.assert_array_equal(_bits(db)[~mask], 0)
  ry = rref.roi_align(x, rows, **kw)
  np.testing.assert_allclose(fy, ry, rtol=1e-5, atol=2e-5)


def test_per_image_boxes_run_the_kernels_on_one_device(rng, monkeypatch):
  """On one device (here the kernels interpreted) the per-image form runs the GPU kernels, not
  the XLA path's batched form (it did before: 15-44 ms instead of 0.46-1.22 ms on an H200 for
  Mask R-CNN's shapes), with the bits of the (K, 5) form on the kernels. (On a batch-sharded
  mesh the kernels split with the batch: tests/sharding/roi_checks.py, and the GPU test
  below.)"""
  from jaxpool._src.roi import triton, triton_boxes
  calls = []
  for module, name in ((triton, "forward"), (triton, "feature_grad"),
                       (triton_boxes, "corner_grad")):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _f=real, _n=name, **k: (calls.append(_n),
                                                                         _f(*a, **k))[1])
  kw = dict(output_size=(3, 2), spatial_scale=0.8, sampling_ratio=2, implementation="pallas")
  x, boxes, mask, live, rows = _case(rng)
  g = rng.standard_normal((N, K, 3, 2, C)).astype(np.float32)
  f = lambda x, b, g: _vjp(lambda v, c: jaxpool.roi_align(v, c, mask=mask, **kw), x, b, g)
  y, dx, db = jax.jit(f)(x, boxes, g)
  assert sorted(set(calls)) == ["corner_grad", "feature_grad", "forward"], calls
  flat = jax.jit(lambda x, b, g: _vjp(lambda v, c: jaxpool.roi_align(v, c, **kw), x, b, g))
  fy, fdx, fdb = flat(x, rows, g[live[:, 0], live[:, 1]])
  np.testing.assert_array_equal(_bits(y)[live[:, 0], live[:, 1]], _bits(fy))
  np.testing.assert_array_equal(_bits(dx), _bits(fdx))
  np.testing.assert_array_equal(_bits(db)[live[:, 0], live[:, 1]], _bits(fdb[:, 1:]))


@pytest.mark.slow
def test_per_image_boxes_on_the_kernels_under_vmap(rng):
  """vmap over the features and the boxes: the mapped axis joins the images (the kernels run
  once), each element its own call's bits."""
  kw = dict(output_size=(3, 2), spatial_scale=0.8, sampling_ratio=2, implementation="pallas")
  x, boxes, mask, _, _ = _case(rng)
  g = rng.standard_normal((N, K, 3, 2, C)).astype(np.float32)
  f = lambda x, b, g: _vjp(lambda v, c: jaxpool.roi_align(v, c, mask=mask, **kw), x, b, g)
  two = jax.jit(jax.vmap(f))(np.stack([x, x[::-1]]), np.stack([boxes, boxes]), np.stack([g, g]))
  for i, xi in enumerate((x, x[::-1])):
    for a, b in zip(two, jax.jit(f)(xi, boxes, g), strict=True):
      np.testing.assert_array_equal(_bits(a[i]), _bits(b))


def test_channels_first_and_no_mask(rng):
  x, boxes, mask, _, _ = _case(rng)
  boxes = np.where(mask[..., None], boxes, 1.0).astype(np.float32)
  y = jaxpool.roi_align(x, boxes, 2, sampling_ratio=2)
  assert y.shape == (N, K, 2, 2, C)
  yc = jaxpool.roi_align(np.moveaxis(x, -1, 1), boxes, 2, sampling_ratio=2,
                         data_format="channels_first")
  np.testing.assert_array_equal(np.moveaxis(np.asarray(yc), 2, -1), y)
  ym = jaxpool.roi_align(x, boxes, 2, sampling_ratio=2, mask=mask)
  np.testing.assert_array_equal(np.asarray(ym)[mask], np.asarray(y)[mask])
  np.testing.assert_array_equal(np.asarray(ym)[~mask], 0)


@pytest.mark.slow
def test_vmap_over_the_features_keeps_the_bits(rng):
  """vmap with the features mapped (each element its own table, a batch axis kept): each
  element's values and gradients are those of its own call, bit for bit."""
  x, boxes, mask, _, _ = _case(rng)
  boxes = np.where(mask[..., None], boxes, 1.0).astype(np.float32)
  rows = np.concatenate([np.zeros((N, K, 1), np.float32), boxes], -1)
  g = rng.standard_normal((N, K, 2, 2, C)).astype(np.float32)
  f = lambda v, b, g: _vjp(lambda v, c: jaxpool.roi_align(v, c, 2, sampling_ratio=-1), v, b, g)
  got = jax.jit(jax.vmap(f))(x[:, None], rows, g)
  for i in range(N):
    one = jax.jit(f)(x[i:i + 1], rows[i], g[i])
    for a, b in zip(got, one):
      np.testing.assert_array_equal(_bits(a[i]), _bits(b))


def test_bad_masks_and_boxes(rng):
  x, boxes, mask, _, rows = _case(rng)
  with pytest.raises(ValueError, match="mask goes with boxes"):
    jaxpool.roi_align(x, rows, 2, mask=mask)
  with pytest.raises(ValueError, match=r"B must be x's batch \(3\)"):
    jaxpool.roi_align(x, boxes[:2], 2, mask=mask[:2])
  with pytest.raises(ValueError, match="the last dim 4"):
    jaxpool.roi_align(x, np.zeros((N, K, 5), np.float32), 2)
  with pytest.raises(ValueError, match=r"mask must be a bool array of shape \(3, 5\)"):
    jaxpool.roi_align(x, boxes, 2, mask=mask[:, :2])
  with pytest.raises(ValueError, match="mask must be a bool array"):
    jaxpool.roi_align(x, boxes, 2, mask=mask.astype(np.int32))
  with pytest.raises(TypeError, match="boxes must have a float or integer dtype"):
    jaxpool.roi_align(x, np.zeros((N, K, 4), bool), 2)
  bad = np.where(mask[..., None], boxes, 0).astype(np.float32)
  bad[0, 0, 2] = np.inf
  with pytest.raises(ValueError, match=r"box \[0, 0\] has"):
    jaxpool.roi_align(x, bad, 2, mask=mask)
  # under jit: that box gives NaN, the others their values
  y = jax.jit(lambda b: jaxpool.roi_align(x, b, 2, mask=mask, sampling_ratio=2))(bad)
  assert np.isnan(np.asarray(y)[0, 0]).all()
  assert np.isfinite(np.asarray(y)[1:]).all()


@pytest.mark.slow
def test_jvp_is_the_transpose_of_the_vjp_and_second_order_runs(rng):
  x, boxes, mask, _, _ = _case(rng)
  boxes = np.where(mask[..., None], boxes, 1.0).astype(np.float32)
  f = lambda v, b: jaxpool.roi_align(v, b, 2, sampling_ratio=2, mask=mask)
  tx = rng.standard_normal(x.shape).astype(np.float32)
  tb = rng.standard_normal(boxes.shape).astype(np.float32)
  y, ty = jax.jvp(f, (x, boxes), (tx, tb))
  g = rng.standard_normal(y.shape).astype(np.float32)
  dx, db = jax.vjp(f, x, boxes)[1](g)
  lhs = float(np.sum(np.asarray(ty, np.float64) * g))
  rhs = float(np.sum(np.asarray(dx, np.float64) * tx) + np.sum(np.asarray(db, np.float64) * tb))
  assert abs(lhs - rhs) < 1e-4 * max(1.0, abs(lhs))
  h = jax.hessian(lambda b: (f(x, b) ** 2).sum())(boxes)
  assert h.shape == (*boxes.shape, *boxes.shape) and np.isfinite(h).all()


@pytest.mark.gpu
def test_gpu_per_image_boxes_split_with_the_batch_on_the_kernels(rng):
  """On several GPUs (a batch-sharded mesh), under ``jit`` and inside ``shard_map``, each
  device runs the kernels on its images: one device's bits (which are not the XLA path's), the
  outputs split, no collective in the program."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs 2 or more GPUs")
  n = 2 * len(devices)
  x = rng.standard_normal((n, 40, 48, 64)).astype(np.float32)
  xy = rng.uniform(-2, 40, (n, 12, 2))
  boxes = np.concatenate([xy, xy + rng.uniform(1, 20, (n, 12, 2))], -1).astype(np.float32)
  mask = rng.uniform(size=(n, 12)) < 0.8
  g = rng.standard_normal((n, 12, 7, 7, 64)).astype(np.float32)

  def fwd_grad(impl):
    def run(v, b, m, g):
      pool = lambda v, b: jaxpool.roi_align(v, b, (7, 7), spatial_scale=0.5, sampling_ratio=2,
                                            aligned=True, mask=m, implementation=impl)
      return _vjp(pool, v, b, g)
    return run

  one = jax.jit(fwd_grad("pallas"))(*(jax.device_put(a, devices[0]) for a in (x, boxes, mask, g)))
  on_xla = jax.jit(fwd_grad("xla"))(x, boxes, mask, g)
  assert not (_bits(one[1]) == _bits(on_xla[1])).all()  # (the kernels ran: other bits)
  mesh = jax.make_mesh((len(devices),), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = P("b")
  args = tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, boxes, mask, g))
  for fn in (jax.jit(fwd_grad("pallas")),
             jax.jit(jax.shard_map(fwd_grad("pallas"), mesh=mesh, in_specs=(spec,) * 4,
                                   out_specs=(spec,) * 3))):
    compiled = fn.lower(*args).compile()
    text = compiled.as_text()
    assert not any(op in text for op in ("all-gather", "all-reduce", "all-to-all",
                                         "collective-permute")), "a collective"
    got = compiled(*args)
    for a, b in zip(got, one, strict=True):
      np.testing.assert_array_equal(_bits(a), _bits(b))
      assert len({str(s.index) for s in a.addressable_shards}) == len(devices)
