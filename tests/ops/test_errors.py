"""Bad input: ValueError/TypeError naming the argument and the value (docs/semantics.md)."""

import re

import numpy as np
import pytest
from core_strategies import jp

X = np.zeros((1, 6, 6, 2), np.float32)
DY = np.zeros((1, 5, 5, 2), np.float32)  # the output of a 2x2 window, stride 1

# Every op that takes a pooling configuration, as a function of its keyword arguments.
# ``rank_name``: what the op calls the array whose rank is checked.
OPS = {
    "max_pool": (lambda **kw: jp.max_pool(X, **kw), "x"),
    "max_pool_with_indices": (lambda **kw: jp.max_pool_with_indices(X, **kw), "x"),
    "min_pool": (lambda **kw: jp.min_pool(X, **kw), "x"),
    "avg_pool": (lambda **kw: jp.avg_pool(X, **kw), "x"),
    "lp_pool": (lambda **kw: jp.lp_pool(X, 2, **kw), "x"),
    "l2_pool": (lambda **kw: jp.l2_pool(X, **kw), "x"),
    "max_pool_grad": (lambda **kw: jp.max_pool_grad(X, DY, **kw), "x"),
    "avg_pool_grad": (lambda **kw: jp.avg_pool_grad(DY, X.shape, **kw), "input_shape"),
    "lp_pool_grad": (lambda **kw: jp.lp_pool_grad(X, DY, 2, **kw), "x"),
}

E = re.escape
# (overrides of window_shape=(2, 2), exception type, pattern naming the argument and value)
BAD_CONFIGS = {
    "window_zero": (dict(window_shape=(0, 2)), ValueError, E("window_shape") + ".*" + E("(0, 2)")),
    "window_negative": (dict(window_shape=(2, -1)), ValueError,
                        E("window_shape") + ".*" + E("(2, -1)")),
    "window_int": (dict(window_shape=2), TypeError, "window_shape.*2"),
    "window_float": (dict(window_shape=(2.0, 2)), TypeError,
                     E("window_shape") + ".*" + E("(2.0, 2)")),
    "window_empty": (dict(window_shape=()), ValueError, E("window_shape") + ".*" + E("()")),
    "window_none": (dict(window_shape=None), TypeError, "window_shape.*None"),
    "strides_length": (dict(strides=(1,)), ValueError, E("strides") + ".*" + E("(1,)")),
    "strides_zero": (dict(strides=(0, 1)), ValueError, E("strides") + ".*" + E("(0, 1)")),
    "strides_int": (dict(strides=2), TypeError, "strides.*2"),
    "dilation_length": (dict(dilation=(1, 1, 1)), ValueError,
                        E("dilation") + ".*" + E("(1, 1, 1)")),
    "dilation_zero": (dict(dilation=(1, 0)), ValueError, E("dilation") + ".*" + E("(1, 0)")),
    "padding_negative_int": (dict(padding=-1), ValueError, "padding.*-1"),
    "padding_negative_pair": (dict(padding=((0, -1), (0, 0))), ValueError,
                              E("padding") + ".*" + E("((0, -1), (0, 0))")),
    "padding_length": (dict(padding=((0, 0),)), ValueError, E("padding") + ".*" + E("((0, 0),)")),
    "padding_not_pairs": (dict(padding=((0, 0, 0), (0, 0))), TypeError,
                          E("padding") + ".*" + E("((0, 0, 0), (0, 0))")),
    "padding_float": (dict(padding=1.5), TypeError, "padding.*1.5"),
    "padding_unknown_string": (dict(padding="sane"), ValueError, "padding.*'sane'"),
    "padding_full": (dict(padding="FULL"), ValueError, "padding.*'VALID'.*'FULL'"),
    "padding_too_large_lo": (dict(padding=((2, 0), (0, 0))), ValueError,
                             "padding.*" + E("(2, 0)")),
    "padding_too_large_int": (dict(padding=2), ValueError, "padding.*2"),
    "padding_too_large_dilated": (dict(padding=((0, 0), (0, 4)), dilation=(1, 3)), ValueError,
                                  "padding.*" + E("(0, 4)")),
    "window_larger_than_input": (dict(window_shape=(7, 2)), ValueError,
                                 E("window_shape=(7, 2)")),
    "dilated_window_larger_than_input": (dict(dilation=(6, 1)), ValueError,
                                         E("dilation=(6, 1)")),
    "data_format": (dict(data_format="NHWC"), ValueError, "data_format.*'NHWC'"),
    "implementation": (dict(implementation="cuda"), ValueError, "implementation.*'cuda'"),
    "ceil_mode": (dict(ceil_mode="yes"), TypeError, "ceil_mode.*'yes'"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
@pytest.mark.parametrize("op", list(OPS))
def test_bad_config(op, case):
  fn, _ = OPS[op]
  overrides, exc, pattern = BAD_CONFIGS[case]
  kw = dict(window_shape=(2, 2))
  kw.update(overrides)
  with pytest.raises(exc, match=pattern):
    fn(**kw)


@pytest.mark.parametrize("op", list(OPS))
def test_wrong_rank(op):
  fn, name = OPS[op]
  # four spatial dims need at least five dims; the array has four
  with pytest.raises(ValueError, match=E(name) + ".*" + E("(1, 6, 6, 2)")):
    fn(window_shape=(1, 1, 1, 1))


@pytest.mark.parametrize("p,exc,pattern", [
    (0.5, ValueError, "p.*0.5"),
    (0, ValueError, "p.*0"),
    (-2, ValueError, "p.*-2"),
    (float("inf"), ValueError, "p.*inf.*max_pool"),
    (float("nan"), ValueError, "p.*nan"),
    ("2", TypeError, "p.*'2'"),
    (True, TypeError, "p.*True"),
    (None, TypeError, "p.*None"),
])
@pytest.mark.parametrize("op", ["lp_pool", "lp_pool_grad"])
def test_bad_p(op, p, exc, pattern):
  with pytest.raises(exc, match=pattern):
    if op == "lp_pool":
      jp.lp_pool(X, p, (2, 2))
    else:
      jp.lp_pool_grad(X, DY, p, (2, 2))


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(divisor_override=0), ValueError, "divisor_override.*0"),
    (dict(divisor_override=-3), ValueError, "divisor_override.*-3"),
    (dict(divisor_override=1.5), TypeError, "divisor_override.*1.5"),
    (dict(divisor_override=True), TypeError, "divisor_override.*True"),
    (dict(count_include_pad="no"), TypeError, "count_include_pad.*'no'"),
    (dict(count_include_pad=None), TypeError, "count_include_pad.*None"),
])
@pytest.mark.parametrize("op", ["avg_pool", "avg_pool_grad"])
def test_bad_avg_options(op, kw, exc, pattern):
  with pytest.raises(exc, match=pattern):
    OPS[op][0](window_shape=(2, 2), **kw)


@pytest.mark.parametrize("op", ["max_pool_grad", "lp_pool_grad", "avg_pool_grad"])
@pytest.mark.parametrize("dy_shape", [(1, 4, 4, 2), (1, 5, 5), (5, 5, 2), (1, 5, 5, 3)])
def test_dy_shape_mismatch(op, dy_shape):
  dy = np.zeros(dy_shape, np.float32)
  pattern = "dy.*" + E("(1, 5, 5, 2)") + ".*" + E(str(dy_shape))
  with pytest.raises(ValueError, match=pattern):
    if op == "max_pool_grad":
      jp.max_pool_grad(X, dy, (2, 2))
    elif op == "lp_pool_grad":
      jp.lp_pool_grad(X, dy, 3, (2, 2))
    else:
      jp.avg_pool_grad(dy, X.shape, (2, 2))


def test_bad_dtypes():
  xi = X.astype(np.int32)
  # Integer inputs pool (avg, Lp in the default float dtype), but have no gradient.
  for fn in (lambda: jp.max_pool_grad(xi, DY, (2, 2)),
             lambda: jp.lp_pool_grad(xi, DY, 2, (2, 2))):
    with pytest.raises(TypeError, match="x.*int32"):
      fn()
  with pytest.raises(TypeError, match="dy.*int32"):
    jp.avg_pool_grad(DY.astype(np.int32), X.shape, (2, 2))
  for fn in (jp.max_pool, jp.min_pool, jp.avg_pool):
    with pytest.raises(TypeError, match="x"):
      fn("not an array", (2, 2))
  # Complex: no order for max/min, no |x|^p; averages take it.
  for fn in (jp.max_pool, jp.min_pool, jp.max_pool_with_indices):
    with pytest.raises(TypeError, match="x.*complex64.*no order"):
      fn(X.astype(np.complex64), (2, 2))
  with pytest.raises(TypeError, match="x.*complex64.*real"):
    jp.lp_pool(X.astype(np.complex64), 2, (2, 2))
  for fn in (jp.max_pool, jp.min_pool, jp.avg_pool):
    with pytest.raises(TypeError, match="x.*uint4"):
      fn(X.astype(np.uint8).astype("uint4"), (2, 2))


def test_avg_pool_grad_bad_input_shape():
  with pytest.raises(TypeError, match="input_shape.*'abc'"):
    jp.avg_pool_grad(DY, "abc", (2, 2))
  with pytest.raises(TypeError, match="input_shape.*None"):
    jp.avg_pool_grad(DY, None, (2, 2))
  with pytest.raises(TypeError, match=E("input_shape") + ".*" + E("(1, 6.0, 6, 2)")):
    jp.avg_pool_grad(DY, (1, 6.0, 6, 2), (2, 2))


# ------------------------------------------------------------------------------ max_unpool

Y = np.zeros((1, 3, 3, 2), np.float32)
IDX = np.zeros((1, 3, 3, 2), np.int32)


@pytest.mark.parametrize("args,kw,exc,pattern", [
    ((Y, IDX.astype(np.float32), (6, 6)), {}, TypeError, "indices.*int32.*float32"),
    ((Y, IDX.astype(np.int16), (6, 6)), {}, TypeError, "indices.*int32.*int16"),
    ((Y, IDX.astype(np.uint8), (6, 6)), {}, TypeError, "indices.*int32.*uint8"),
    ((Y, IDX[..., :1], (6, 6)), {}, ValueError, "indices.*" + E("(1, 3, 3, 2)") + ".*"
     + E("(1, 3, 3, 1)")),
    ((Y, IDX[0], (6, 6)), {}, ValueError, "indices.*" + E("(3, 3, 2)")),
    ((Y, IDX, (6, 0)), {}, ValueError, "output_size.*" + E("(6, 0)")),
    ((Y, IDX, (6, -6)), {}, ValueError, "output_size.*" + E("(6, -6)")),
    ((Y, IDX, 36), {}, TypeError, "output_size.*36"),
    ((Y, IDX, (6.0, 6)), {}, TypeError, "output_size.*" + E("(6.0, 6)")),
    ((Y, IDX, ()), {}, ValueError, "output_size.*" + E("()")),
    ((Y[0, 0, 0], IDX[0, 0, 0], (6, 6)), {}, ValueError, "y.*" + E("(2,)")),
    ((Y, IDX, (6, 6)), dict(data_format="NCHW"), ValueError, "data_format.*'NCHW'"),
])
def test_bad_max_unpool(args, kw, exc, pattern):
  with pytest.raises(exc, match=pattern):
    jp.max_unpool(*args, **kw)


# ------------------------------------------------------------------------------ not errors


def test_valid_edge_cases_do_not_raise():
  """Zero batch, no batch dims, a window equal to the padded input, numpy integer configs."""
  y = jp.max_pool(np.zeros((0, 6, 6, 2), np.float32), (2, 2))
  assert y.shape == (0, 5, 5, 2)
  dx = jp.max_pool_grad(np.zeros((0, 6, 6, 2), np.float32), np.zeros((0, 5, 5, 2), np.float32),
                        (2, 2))
  assert dx.shape == (0, 6, 6, 2)
  assert jp.avg_pool(np.zeros((6, 2), np.float32), (6,)).shape == (1, 2)
  assert jp.max_pool(X, (7, 7), padding=((1, 0), (0, 1))).shape == (1, 1, 1, 2)
  assert jp.max_pool(X, np.array([2, 2]), strides=(np.int64(2), 2)).shape == (1, 3, 3, 2)
  assert jp.lp_pool(X, np.float32(1.5), [3, 3]).shape == (1, 4, 4, 2)
