"""Bad arguments name themselves; what jit cannot check (an image index out of range, a NaN
coordinate) raises outside jit and gives the documented result under it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool

X = np.ones((2, 5, 6, 3), np.float32)
BOX = np.array([[0, 1.0, 1.0, 4.0, 3.0]], np.float32)


@pytest.mark.parametrize("call,kwargs,error,match", [
    (jaxpool.roi_align, dict(boxes=np.ones((3, 4))), ValueError, r"boxes must be a \(K, 5\).*"
     r"got an array of shape \(3, 4\)"),
    (jaxpool.roi_pool, dict(boxes=np.ones((5,))), ValueError, r"shape \(5,\)"),
    (jaxpool.roi_align, dict(boxes=[np.ones((2, 4))]), ValueError, r"one array per image \(2\)"),
    (jaxpool.roi_align, dict(boxes=[np.ones((2, 4)), np.ones((1, 5))]), ValueError,
     r"boxes\[1\] of shape \(1, 5\)"),
    (jaxpool.roi_align, dict(output_size=0), ValueError, r"output_size entries must be >= 1"),
    (jaxpool.roi_pool, dict(output_size=(2, -1)), ValueError, r"output_size entries must be >= 1"),
    (jaxpool.roi_align, dict(output_size=(2, 2, 2)), ValueError, r"output_size must have one"),
    (jaxpool.roi_align, dict(output_size=2.5), TypeError, r"output_size must be a tuple"),
    (jaxpool.roi_align, dict(spatial_scale=0.0), ValueError, r"spatial_scale must be a positive"),
    (jaxpool.roi_align, dict(sampling_ratio=1.5), TypeError, r"sampling_ratio must be an int"),
    (jaxpool.roi_align, dict(max_samples=0), ValueError, r"max_samples entries must be >= 1"),
    (jaxpool.roi_align, dict(aligned=1), TypeError, r"aligned must be a bool"),
    (jaxpool.roi_align, dict(mode="mean"), ValueError, r"mode must be one of \('avg', 'max'\)"),
    (jaxpool.roi_align, dict(data_format="NCHW"), ValueError, r"data_format must be one of"),
    (jaxpool.roi_align, dict(x=np.ones((5, 6, 3))), ValueError, r"x must be a 4-D array"),
    (jaxpool.roi_align, dict(x=np.ones((1, 5, 6, 3), np.int32)), TypeError, r"x must have a float"),
    (jaxpool.roi_align, dict(implementation="pallas", mode="max", boxes=np.ones((2, 1, 4))),
     ValueError, r"cannot serve roi_align.*per-image boxes \(N, K, 4\) run it on the XLA path"),
    (jaxpool.roi_align, dict(boxes=np.array([[2, 0, 0, 1, 1.0]])), ValueError,
     r"boxes\[:, 0\] must be image indices, integers in \[0, 2\); box 0 has 2.0"),
    (jaxpool.roi_pool, dict(boxes=np.array([[0.5, 0, 0, 1, 1.0]])), ValueError,
     r"image indices.*box 0 has 0.5"),
    (jaxpool.roi_align, dict(boxes=np.array([[0, 0, 0, 1, 1.0], [0, np.nan, 0, 1, 1]])),
     ValueError, r"finite coordinates; box 1 has \[nan, 0.0, 1.0, 1.0\]"),
    (jaxpool.roi_align, dict(x=np.ones((0, 5, 6, 3))), ValueError,
     r"x must have at least one image and one channel; got shape \(0, 5, 6, 3\)"),
    (jaxpool.roi_pool, dict(x=np.ones((2, 5, 6, 0))), ValueError,
     r"x must have at least one image and one channel; got shape \(2, 5, 6, 0\)"),
    (jaxpool.roi_align, dict(spatial_scale="a"), TypeError, r"spatial_scale must be a positive"),
    (jaxpool.roi_align, dict(spatial_scale=np.float32(np.nan)), ValueError,
     r"spatial_scale must be a positive finite number; got np.float32\(nan\)"),
])
def test_bad_arguments(call, kwargs, error, match):
  args = dict(x=X, boxes=BOX, output_size=2)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    call(args.pop("x"), args.pop("boxes"), args.pop("output_size"), **args)


@pytest.mark.parametrize("mode", ["avg", pytest.param("max", marks=pytest.mark.slow)])
def test_what_jit_cannot_check_has_a_documented_result(mode):
  boxes = np.array([[0, 1.0, 1.0, 4.0, 3.0], [7, 1.0, 1.0, 4.0, 3.0],
                    [-1, 1.0, 1.0, 4.0, 3.0], [1, np.nan, 1.0, 4.0, 3.0],
                    [1, 1.0, np.inf, 4.0, 3.0]], np.float32)
  x = np.arange(2 * 5 * 6 * 3, dtype=np.float32).reshape(2, 5, 6, 3)
  f = lambda v, b: jaxpool.roi_align(v, b, 2, sampling_ratio=2, mode=mode)


  def loss(v, b):
    y = f(v, b)
    return jnp.nansum(y), y

  (_, y), (dx, db) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, boxes)
  y = np.asarray(y)
  assert np.isfinite(y[0]).all() and np.abs(y[0]).sum() > 0
  np.testing.assert_array_equal(y[1:3], 0)  # image index out of range: zeros
  assert np.isnan(y[3:]).all()  # a NaN or infinite coordinate: NaN
  assert np.isfinite(dx).all() and np.isfinite(db).all()
  np.testing.assert_array_equal(db[1:], 0)
  if mode == "max":
    return
  y, idx = jax.jit(lambda v, b: jaxpool.roi_pool(v, b, 2, return_indices=True))(x, boxes)
  np.testing.assert_array_equal(y[1:3], 0)
  np.testing.assert_array_equal(idx[1:], -1)
  assert np.isnan(y[3:]).all()


P2, P3 = np.ones((1, 8, 8, 2), np.float32), np.ones((1, 4, 4, 2), np.float32)
MBOX = [np.array([[0.0, 0.0, 8.0, 8.0]], np.float32)]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(features=[P3, P2]), ValueError, r"features must be the levels finest first.*"
     r"strictly decreasing; got scales \[0.25, 0.5\]"),
    (dict(features=[P2, P2]), ValueError, r"got scales \[0.5, 0.5\]"),
    (dict(image_shapes=[]), ValueError, r"image_shapes must hold the \(height, width\) of at"),
    (dict(image_shapes=7), TypeError, r"image_shapes must be a sequence.*got 7"),
    (dict(image_shapes=[(16, 0)]), ValueError, r"pairs of positive ints; got \(16, 0\)"),
    (dict(eps="a"), TypeError, r"eps must be a finite number.*got 'a'"),
    (dict(eps=float("nan")), ValueError, r"eps must be a finite number; got nan"),
    (dict(features=[np.ones((0, 8, 8, 2))]), ValueError,
     r"features\[0\] must have at least one image and one channel"),
])
def test_multi_scale_bad_arguments(kwargs, error, match):
  args = dict(features=[P2, P3], boxes=MBOX, image_shapes=[(16, 16)])
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jaxpool.multi_scale_roi_align(args.pop("features"), args.pop("boxes"),
                                  args.pop("image_shapes"), 2, **args)


def test_number_forms_accepted():
  """A concrete 0-d JAX array is a number as NumPy's scalars are; an array of image shapes is a
  sequence of them."""
  want = jaxpool.roi_align(X, BOX, 2, spatial_scale=0.5)
  for scale in (np.float32(0.5), jnp.float32(0.5), jnp.asarray(0.5)):
    np.testing.assert_array_equal(jaxpool.roi_align(X, BOX, 2, spatial_scale=scale), want)
  want = jaxpool.multi_scale_roi_align([P2, P3], MBOX, [(16, 16)], 2)
  for shapes in (np.array([[16, 16]]), jnp.array([[16, 16]])):
    np.testing.assert_array_equal(jaxpool.multi_scale_roi_align([P2, P3], MBOX, shapes, 2),
                                  want)
