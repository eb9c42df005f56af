"""Reliability of the interop layers and the graph module's inputs.

Every argument a Flax or Equinox user may write is either taken with the framework's meaning
(and then gives the framework's values, for float16/bfloat16/float32/float64 inputs) or refused
by an error that names the argument as the user wrote it. The graph module refuses labels out
of range (eagerly; NaN under jit), parameters that do not fit the graph and constructor
arguments of the wrong type, naming the node.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import checkify

import jaxpool.graph as jg

eqx = pytest.importorskip("equinox")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

from jaxpool.interop import equinox as jpe  # noqa: E402
from jaxpool.interop import flax_linen as jpl  # noqa: E402
from jaxpool.interop import flax_nnx as jpn  # noqa: E402

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
RNG = np.random.default_rng(0)


def quarters(shape, dtype):
  """Multiples of 1/4 in [-2, 2]: exact in every float dtype, and so are their window sums
  (ties everywhere, too). Averages then differ only by the rounding of one division."""
  return jnp.asarray((RNG.integers(-8, 9, size=shape) / 4).astype(dtype))


def x64(dtype):
  """float64 needs jax_enable_x64; the other dtypes run without it."""
  return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


def assert_same(ours, theirs):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
  np.testing.assert_array_equal(ours.astype(np.float64), theirs.astype(np.float64))


def assert_avg_close(ours, theirs, dtype):
  """Ours keeps the input dtype; within one rounding (2 ulp) of the framework's value."""
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.dtype == np.dtype(dtype) and ours.shape == theirs.shape
  eps = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), rtol=2 * eps,
                             atol=2 * eps)


# ============================================================================ Flax: errors

X4 = jnp.zeros((1, 6, 6, 2))

# (kwargs beside window_shape=(2, 2) unless given, exception, pattern naming the argument)
FLAX_BAD = [
    (dict(window_shape=2), TypeError, r"^window_shape .*got the int 2"),
    (dict(window_shape=np.int64(2)), TypeError, r"^window_shape .*got the int np.int64\(2\)"),
    (dict(window_shape=(0, 2)), ValueError, r"^window_shape entries must be >= 1"),
    (dict(window_shape=(-1, 2)), ValueError, r"^window_shape entries must be >= 1"),
    (dict(window_shape=(2.0, 2)), TypeError, r"^window_shape must be a sequence of ints"),
    (dict(window_shape=(True, 2)), TypeError, r"^window_shape .*a bool is not an int"),
    (dict(window_shape="22"), TypeError, r"^window_shape must be .*'22'"),
    (dict(window_shape=()), ValueError, r"^window_shape must name at least one"),
    (dict(window_shape=None), TypeError, r"^window_shape must be"),
    (dict(strides=2), TypeError, r"^strides .*got the int 2"),
    (dict(strides=(2, 2, 2)), ValueError, r"^strides .*of length 3"),
    (dict(strides=(0, 1)), ValueError, r"^strides entries must be >= 1"),
    (dict(strides=(1.5, 1)), TypeError, r"^strides must be"),
    (dict(dilation=2), TypeError, r"^dilation .*got the int 2"),
    (dict(dilation=(1, -1)), ValueError, r"^dilation entries must be >= 1"),
    (dict(padding=[1, 1]), TypeError, r"^padding .*\(lo, hi\) pair.*got \[1, 1\]"),
    (dict(padding=None), TypeError, r"^padding .*no padding=None"),
    (dict(padding="FULL"), ValueError, r"^padding must be .*got 'FULL'"),
    (dict(padding=-1), ValueError, r"^padding must be >= 0"),
    (dict(padding=1.5), TypeError, r"^padding must be"),
    (dict(padding=((1, 1),)), ValueError, r"^padding must be .*with 1 pairs"),
    (dict(padding=((1, 1), 1)), TypeError, r"^padding .*mixes ints and pairs"),
    (dict(padding=((1, 0, 1), (0, 0))), TypeError, r"^padding .*\(1, 0, 1\) is not a \(lo, hi\)"),
    (dict(padding=((-1, 0), (0, 0))), ValueError, r"^padding must be >= 0 \(negative padding"),
    (dict(ceil_mode="yes"), TypeError, r"^ceil_mode must be a bool; got 'yes'"),
    (dict(data_format="NHWC"), ValueError, r"^data_format must be one of"),
    (dict(data_format=None), TypeError, r"^data_format must be one of"),
    (dict(implementation="cuda"), ValueError, r"^implementation must be one of"),
]


def _flax_entry_points(kw):
  """The four ways to write a Flax max pool with jaxpool: function, linen, nnx, linen in a model
  (linen checks at construction, in __post_init__)."""
  kw = dict(kw)
  kw.setdefault("window_shape", (2, 2))
  return [
      lambda: jpl.max_pool(X4, **kw),
      lambda: jpl.MaxPool(**kw),
      lambda: jpn.MaxPool(**kw),
      lambda: jpl.L2Pool(**kw),
      lambda: jpn.AvgPool(**kw),
  ]


@pytest.mark.parametrize("kw,exc,match", FLAX_BAD, ids=[repr(c[0]) for c in FLAX_BAD])
def test_flax_bad_arguments_name_the_argument(kw, exc, match):
  for make in _flax_entry_points(kw):
    with pytest.raises(exc, match=match):
      make()


@pytest.mark.parametrize("kw,exc,match", [
    (dict(count_include_pad="no"), TypeError, r"^count_include_pad must be a bool"),
    (dict(count_include_pad=1), TypeError, r"^count_include_pad must be a bool"),
    (dict(divisor_override=0), ValueError, r"^divisor_override must be a positive int"),
    (dict(divisor_override=True), TypeError, r"^divisor_override must be a positive int"),
    (dict(divisor_override=2.0), TypeError, r"^divisor_override must be a positive int"),
])
def test_flax_avg_pool_bad_arguments(kw, exc, match):
  for make in (lambda: jpl.avg_pool(X4, (2, 2), **kw), lambda: jpl.AvgPool((2, 2), **kw),
               lambda: jpn.AvgPool((2, 2), **kw)):
    with pytest.raises(exc, match=match):
      make()


@pytest.mark.parametrize("p,exc,match", [
    (float("inf"), ValueError, r"^p must be finite"),
    (0.5, ValueError, r"^p must be a finite number >= 1"),
    (float("nan"), ValueError, r"^p must be a finite number >= 1"),
    ("2", TypeError, r"^p must be a finite number"),
    (True, TypeError, r"^p must be a finite number"),
])
def test_flax_lp_pool_bad_norm(p, exc, match):
  for make in (lambda: jpl.lp_pool(X4, p, (2, 2)), lambda: jpl.LPPool(p, (2, 2)),
               lambda: jpn.LPPool(p, (2, 2))):
    with pytest.raises(exc, match=match):
      make()


def test_flax_call_time_errors_name_the_argument():
  # inputs, as Flax calls it (the core calls it x)
  with pytest.raises(ValueError, match=r"^inputs must have at least 3 dims"):
    jpl.max_pool(jnp.zeros((6, 6)), (2, 2))
  with pytest.raises(ValueError, match=r"^inputs must have at least 3 dims"):
    jpn.MaxPool((2, 2))(jnp.zeros((6, 6)))
  with pytest.raises(ValueError, match=r"window larger than the padded input.*window_shape"):
    jpl.MaxPool((7, 7)).apply({}, jnp.zeros((1, 6, 6, 1)))
  # padding at least the window: every window must hold a real element (Flax allows it)
  with pytest.raises(ValueError, match=r"^padding must be smaller than the effective window"):
    jpl.avg_pool(jnp.zeros((1, 6, 6, 1)), (2, 2), padding=((2, 0), (0, 0)))


# ============================================================================ Flax: accepted forms


def test_flax_accepted_forms_equal_flax():
  x = quarters((2, 7, 6, 3), np.float32)
  want = nn.max_pool(x, (2, 3), (2, 1), ((1, 0), (0, 2)))
  np_int = (np.int64(2), np.int32(3))
  for window, strides, padding in [
      ((2, 3), (2, 1), ((1, 0), (0, 2))),
      ([2, 3], [2, 1], [[1, 0], [0, 2]]),                      # lists (Flax: pairs only)
      (np_int, (np.int64(2), np.int8(1)), ((np.int64(1), 0), (0, np.int16(2)))),
      (np.array([2, 3]), np.array([2, 1]), np.array([[1, 0], [0, 2]])),
  ]:
    assert_same(jpl.max_pool(x, window, strides, padding), want)
    assert_same(jpn.MaxPool(window, strides, padding)(x), want)
    assert_same(jpl.MaxPool(window, strides, padding).apply({}, x), want)
  # strides=() (or []) means ones, as Flax's `strides or (1,) * n`; strings in any case, as lax
  assert_same(jpl.max_pool(x, (3, 3), ()), nn.max_pool(x, (3, 3), ()))
  for pad in ("same", "Same", "SAME_LOWER", "same_lower", "valid"):
    assert_same(jpl.max_pool(x, (3, 2), (2, 2), pad), nn.max_pool(x, (3, 2), (2, 2), pad))
  # an int pads both sides of every spatial dim (jaxpool's form; Flax refuses ints)
  assert_same(jpl.avg_pool(x, (3, 3), padding=1), nn.avg_pool(x, (3, 3), padding=((1, 1),) * 2))
  # numpy bools are bools for the flags; numpy ints are ints for divisor_override
  layer = jpn.AvgPool((2, 2), count_include_pad=np.bool_(False), divisor_override=np.int64(4))
  assert_same(layer(x), nn.avg_pool(x, (2, 2)))


def test_flax_layers_keep_checked_config():
  layer = jpn.MaxPool([np.int64(2), 2], [2, 2], "same", dilation=[1, 1])
  assert layer.window_shape == (2, 2) and type(layer.window_shape[0]) is int
  assert layer.strides == (2, 2) and layer.padding == "SAME" and layer.dilation == (1, 1)
  hash((layer.window_shape, layer.strides, layer.padding))  # static, hashable config


# ============================================================================ Flax: parity

# (input shape, window, strides, padding): Flax's forms; unbatched and two batch dims included
FLAX_PARITY = [
    ((2, 9, 3), (3,), (2,), "VALID"),
    ((2, 10, 3), (4,), None, "SAME"),
    ((7, 8, 3), (3, 3), (2, 2), "SAME"),                      # no batch dim
    ((2, 7, 8, 3), (3, 2), (1, 2), ((1, 2), (0, 1))),
    ((2, 3, 7, 8, 2), (2, 2), (2, 2), "VALID"),              # two batch dims
    ((2, 5, 6, 4, 2), (2, 3, 2), (2, 2, 1), "SAME"),           # 3-D
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_flax_parity_across_dtypes(dtype):
  with x64(dtype):
    xs = [quarters(shape, dtype) for shape, *_ in FLAX_PARITY]

    @jax.jit  # every configuration, ours and Flax's: one compile
    def run(xs):
      maxes, avgs = [], []
      for k, (x, (_, window, strides, padding)) in enumerate(zip(xs, FLAX_PARITY, strict=True)):
        theirs = nn.max_pool(x, window, strides, padding)
        maxes.append((jpl.max_pool(x, window, strides, padding), theirs))
        if k % 2 == 0:
          maxes.append((jpl.MaxPool(window, strides, padding).apply({}, x), theirs))
        else:
          maxes.append((jpn.MaxPool(window, strides, padding)(x), theirs))
        for cip in (True, False):
          avgs.append((jpl.avg_pool(x, window, strides, padding, cip),
                       nn.avg_pool(x, window, strides, padding, cip)))
        avgs.append((jpn.AvgPool(window, strides, padding)(x),
                     nn.avg_pool(x, window, strides, padding)))
      return maxes, avgs

    maxes, avgs = run(xs)
    for ours, theirs in maxes:
      assert_same(ours, theirs)
    for ours, theirs in avgs:
      assert_avg_close(ours, theirs, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_flax_channels_first_equals_flax_on_moved_axes(dtype):
  with x64(dtype):
    x = quarters((2, 7, 8, 3), dtype)
    xc = jnp.moveaxis(x, -1, -3)
    window, strides, padding = (3, 2), (2, 1), ((1, 1), (0, 1))
    want = jnp.moveaxis(nn.max_pool(x, window, strides, padding), -1, -3)
    assert_same(jpl.max_pool(xc, window, strides, padding, data_format="channels_first"), want)
    assert_same(jpn.MaxPool(window, strides, padding, data_format="channels_first")(xc), want)
    assert_same(jpl.MaxPool(window, strides, padding, data_format="channels_first").apply({}, xc),
                want)
    want = jnp.moveaxis(nn.avg_pool(x, window, strides, padding, False), -1, -3)
    assert_avg_close(jpl.AvgPool(window, strides, padding, False,
                                 data_format="channels_first").apply({}, xc), want, dtype)
    l2 = jpn.L2Pool(window, strides, padding, data_format="channels_first")(xc)
    want = jnp.moveaxis(jpl.lp_pool(x, 2, window, strides, padding), -1, -3)
    assert_avg_close(l2, want, dtype)


# ============================================================================ Equinox: errors

XE = jnp.zeros((2, 6, 6))

EQX_BAD = [
    (dict(kernel_size=True), TypeError, r"^kernel_size .*a bool is not an int"),
    (dict(kernel_size="2"), TypeError, r"^kernel_size must be an int or a sequence"),
    (dict(kernel_size=2.0), TypeError, r"^kernel_size must be an int or a sequence"),
    (dict(kernel_size=None), TypeError, r"^kernel_size must be an int or a sequence"),
    (dict(kernel_size=0), ValueError, r"^kernel_size must be >= 1; got 0"),
    (dict(kernel_size=-2), ValueError, r"^kernel_size must be >= 1"),
    (dict(kernel_size=(2, 2, 2)), ValueError, r"^kernel_size .*of length 3"),
    (dict(kernel_size=(2, 0)), ValueError, r"^kernel_size entries must be >= 1"),
    (dict(kernel_size=(2, True)), TypeError, r"^kernel_size .*a bool is not an int"),
    (dict(stride=0), ValueError, r"^stride must be >= 1"),
    (dict(stride=(1,)), ValueError, r"^stride .*of length 1"),
    (dict(stride=np.float32(2)), TypeError, r"^stride must be an int or a sequence"),
    (dict(dilation=0), ValueError, r"^dilation must be >= 1"),
    (dict(padding=(1, (1, 1))), TypeError, r"^padding .*mixes ints and pairs"),
    (dict(padding=None), TypeError, r"^padding .*no padding=None"),
    (dict(padding="SAME"), TypeError, r"^padding must be an int, a sequence"),
    (dict(padding=-1), ValueError, r"^padding must be >= 0"),
    (dict(padding=(1, -1)), ValueError, r"^padding must be >= 0 \(negative padding"),
    (dict(padding=(1, 1, 1)), ValueError, r"^padding .*of length 3"),
    (dict(padding=((1, 2, 3), (0, 0))), TypeError, r"^padding .*\(1, 2, 3\) is not a \(lo, hi\)"),
    (dict(padding=2), ValueError, r"^padding must be smaller than the window \(kernel_size 2\)"),
    (dict(padding=((0, 2), (0, 0))), ValueError, r"^padding must be smaller than the window"),
    (dict(use_ceil="yes"), TypeError, r"^use_ceil must be a bool; got 'yes'"),
    (dict(use_ceil=1), TypeError, r"^use_ceil must be a bool"),
    (dict(implementation="cuda"), ValueError, r"^implementation must be one of"),
]


@pytest.mark.parametrize("kw,exc,match", EQX_BAD, ids=[repr(c[0]) for c in EQX_BAD])
def test_equinox_bad_arguments_name_the_argument(kw, exc, match):
  kw = dict(kw)
  kw.setdefault("kernel_size", 2)
  for make in (lambda: jpe.MaxPool2d(**kw), lambda: jpe.AvgPool2d(**kw),
               lambda: jpe.LPPool2d(2, **kw)):
    with pytest.raises(exc, match=match) as info:
      make()
    assert "ceil_mode" not in str(info.value) and "window_shape" not in str(info.value)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(norm_type=float("inf")), ValueError, r"^norm_type must be finite"),
    (dict(norm_type=0), ValueError, r"^norm_type must be a finite number >= 1"),
    (dict(norm_type=True), TypeError, r"^norm_type must be a finite number"),
    (dict(norm_type="2"), TypeError, r"^norm_type must be a finite number"),
])
def test_equinox_lp_norm_type_is_named_norm_type(kw, exc, match):
  with pytest.raises(exc, match=match) as info:
    jpe.LPPool2d(kernel_size=2, **kw)
  assert "p must" not in str(info.value)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(count_include_pad="no"), TypeError, r"^count_include_pad must be a bool"),
    (dict(divisor_override=0), ValueError, r"^divisor_override must be a positive int"),
    (dict(divisor_override=True), TypeError, r"^divisor_override must be a positive int"),
])
def test_equinox_avg_bad_arguments(kw, exc, match):
  with pytest.raises(exc, match=match):
    jpe.AvgPool2d(2, **kw)


def test_equinox_call_time_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"^x must have at least 3 dims, \(\*batch, C, \*spatial"):
    jpe.MaxPool2d(2)(jnp.zeros((6, 6)))
  with pytest.raises(ValueError, match=r"^kernel_size \(7, 7\) .* larger than the padded input"):
    jpe.MaxPool2d(7)(XE)
  with pytest.raises(ValueError, match=r"^kernel_size \(4, 4\) \(dilation \(2, 2\)\)"):
    jpe.AvgPool2d(4, dilation=2)(XE)


# ============================================================================ Equinox: parity


def test_equinox_accepted_forms_equal_equinox():
  x = quarters((3, 9, 8), np.float32)
  want = eqx.nn.MaxPool2d(3, 2, padding=1)(x)
  for kernel, stride, padding in [
      (np.int64(3), np.int32(2), np.int64(1)),                     # numpy ints (Equinox refuses)
      ([3, 3], [2, 2], [1, 1]),
      ((np.int64(3), 3), np.array([2, 2]), ((1, 1), (1, 1))),
      (3, 2, [(1, 1), [1, 1]]),
  ]:
    assert_same(jpe.MaxPool2d(kernel, stride, padding)(x), want)
  layer = jpe.MaxPool2d(np.int64(3), [2, np.int64(2)], [1, 0], use_ceil=np.bool_(False))
  assert layer.kernel_size == (3, 3) and type(layer.kernel_size[0]) is int
  assert layer.stride == (2, 2) and layer.padding == ((1, 1), (0, 0)) and layer.use_ceil is False
  assert_same(layer(x), eqx.nn.MaxPool2d(3, 2, [1, 0])(x))


# (layer name, input shape (C, *spatial), kwargs): Equinox's forms
EQX_PARITY = [
    ("MaxPool1d", (3, 11), dict(kernel_size=3, stride=2, padding=1)),
    ("MaxPool2d", (3, 9, 8), dict(kernel_size=(3, 2), stride=(2, 1), padding=((1, 0), (1, 1)))),
    ("MaxPool2d", (3, 9, 8), dict(kernel_size=3, stride=2, padding=1, use_ceil=True)),
    ("MaxPool3d", (2, 5, 6, 7), dict(kernel_size=2, stride=2, padding=[1, 0, 1])),
    ("AvgPool1d", (3, 11), dict(kernel_size=3, stride=2, padding=1)),
    ("AvgPool2d", (3, 9, 8), dict(kernel_size=(2, 3), padding=(1, 1))),
    ("AvgPool2d", (3, 8, 8), dict(kernel_size=2, stride=2, use_ceil=True)),   # no overhang
    ("AvgPool3d", (2, 5, 6, 7), dict(kernel_size=3, stride=2)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_equinox_parity_across_dtypes(dtype):
  with x64(dtype):
    xs = [quarters(shape, dtype) for _, shape, _ in EQX_PARITY]

    @jax.jit  # every layer, ours and Equinox's: one compile
    def run(xs):
      return [(getattr(jpe, name)(**kw)(x), getattr(eqx.nn, name)(**kw)(x))
              for x, (name, _, kw) in zip(xs, EQX_PARITY, strict=True)]

    for (name, _, _), (ours, theirs) in zip(EQX_PARITY, run(xs), strict=True):
      if name.startswith("Max"):
        assert_same(ours, theirs)
      else:
        assert_avg_close(ours, theirs, dtype)


# ============================================================================ graph: labels


@pytest.fixture(scope="module")
def classifier():
  image = jg.Input("image", shape=(6, 6, 1))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  conv = jg.Conv("conv1", image, features=2)
  logits = jg.Dense("fc", jg.Flatten("flat", jg.MaxPool("pool", conv)), features=3)
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)
  g = jg.Graph(loss)
  params = g.init(jax.random.key(0))
  x = jnp.asarray(RNG.standard_normal((4, 6, 6, 1)).astype(np.float32))
  return g, jg.training_graph(loss), params, x


LABEL_ERR = (r"^node 'loss' \(SoftmaxCrossEntropy\): labels 'label' must be class indices in "
             r"\[0, 3\) \(logits 'fc' has 3 classes\); got {}")


@pytest.mark.parametrize("bad", [7, 3, -1, -4])
def test_labels_out_of_range_raise_eagerly(classifier, bad):
  g, tg, params, x = classifier
  labels = jnp.array([0, 1, bad, 2])
  with pytest.raises(ValueError, match=LABEL_ERR.format(bad) + r" at batch index \(2,\)"):
    g.apply(params, image=x, label=labels)
  with pytest.raises(ValueError, match=LABEL_ERR.format(bad)):
    tg.run(params, image=x, label=labels)
  with pytest.raises(ValueError, match=LABEL_ERR.format(bad)):   # one example, no batch dim
    g.apply(params, image=x[0], label=jnp.array(bad))
  # closed over by jit, the labels are concrete: still an error
  with pytest.raises(ValueError, match=LABEL_ERR.format(bad)):
    jax.jit(lambda p, v: g.apply(p, image=v, label=labels))(params, x)


def test_labels_out_of_range_under_jit_give_nan(classifier):
  g, tg, params, x = classifier
  good = jnp.array([0, 1, 2, 2])
  apply = jax.jit(lambda p, v, y: g.apply(p, image=v, label=y))
  run = jax.jit(lambda p, v, y: tg.run(p, image=v, label=y))
  ref = g.apply(params, image=x, label=good)
  np.testing.assert_allclose(apply(params, x, good), ref, rtol=1e-6)
  for bad in (3, 7, -1):
    labels = good.at[2].set(bad)
    assert np.isnan(apply(params, x, labels))           # -1 is not the last class
    loss, grads = run(params, x, labels)
    assert np.isnan(loss)
    assert all(np.isnan(np.asarray(v)).all() for v in jax.tree.leaves(grads))
  labels = good.at[2].set(-1)
  # per example (vmap): only the bad example's loss is NaN
  per = jax.jit(jax.vmap(lambda v, y: g.apply(params, image=v, label=y)))(x, labels)
  assert np.isnan(per).tolist() == [False, False, True, False]
  # checkify's NaN checks locate it, as docs/graph.md says
  checked = jax.jit(checkify.checkify(apply, errors=checkify.nan_checks))
  err, _ = checked(params, x, labels)
  assert err.get() is not None and "nan generated" in err.get()
  err, _ = checked(params, x, good)
  assert err.get() is None


# ============================================================================ graph: parameters


def test_params_that_do_not_fit_raise_naming_node_and_parameter(classifier):
  g, tg, params, x = classifier
  labels = jnp.array([0, 1, 2, 0])
  conv, fc = params["conv1"], params["fc"]
  cases = [
      ({"fc": fc}, ValueError,
       r"^node 'conv1' \(Conv\): params has no entry 'conv1' \(expected \{w: \(3, 3, 1, 2\), "
       r"b: \(2,\)\}\); it has entries for \['fc'\]"),
      ({"conv1": {"w": conv["w"]}, "fc": fc}, ValueError,
       r"^node 'conv1' \(Conv\): params\['conv1'\] has no parameter 'b'"),
      ({"conv1": conv, "fc": {"w": fc["w"].T, "b": fc["b"]}}, ValueError,
       r"^node 'fc' \(Dense\): parameter 'w' must have shape \(18, 3\); got \(3, 18\) "
       r"\(transposed\?\)"),
      ({"conv1": conv, "fc": {**fc, "scale": fc["b"]}}, ValueError,
       r"^node 'fc' \(Dense\): params\['fc'\] has unexpected parameter\(s\) \['scale'\]"),
      ({"conv1": conv, "fc": [fc["w"], fc["b"]]}, TypeError,
       r"^node 'fc' \(Dense\): params\['fc'\] must be a dict"),
      ({"conv1": conv, "fc": {"w": fc["w"].tolist(), "b": fc["b"]}}, TypeError,
       r"^node 'fc' \(Dense\): parameter 'w' must be an array of shape \(18, 3\); got list"),
      ({"conv1": {**conv, "b": conv["b"].astype(jnp.int32)}, "fc": fc}, TypeError,
       r"^node 'conv1' \(Conv\): parameter 'b' must have a float dtype"),
      (None, TypeError, r"^params must be a dict \{node name: \{parameter name: array\}\}"),
      ([conv, fc], TypeError, r"^params must be a dict"),
  ]
  for bad, exc, match in cases:
    with pytest.raises(exc, match=match):
      g.apply(bad, image=x, label=labels)
    with pytest.raises(exc, match=match):
      tg.run(bad, image=x, label=labels)
  with pytest.raises(ValueError, match=r"^node 'fc' \(Dense\): parameter 'w' must have shape"):
    jax.jit(lambda p: g.apply(p, image=x, label=labels))(cases[2][0])


def test_params_of_another_graph(classifier):
  g, _, params, x = classifier
  other = jg.Graph(jg.Dense("fc", jg.Flatten("flat", jg.Input("image", shape=(6, 6, 1))),
                            features=3))
  with pytest.raises(ValueError, match=r"^node 'conv1' \(Conv\): params has no entry 'conv1'.*"
                                       r"another graph"):
    g.apply(other.init(jax.random.key(1)), image=x, label=jnp.zeros(4, jnp.int32))
  # the other way round: a sub-graph takes the whole model's parameters (extra entries ignored)
  # but its Dense sees another input size
  with pytest.raises(ValueError, match=r"^node 'fc' \(Dense\): parameter 'w' must have shape "
                                       r"\(36, 3\); got \(18, 3\)"):
    other.apply(params, image=x)
  no_bias = jg.Graph(jg.Dense("fc", jg.Flatten("flat", g.node("pool")), features=3,
                              use_bias=False))
  with pytest.raises(ValueError, match=r"unexpected parameter\(s\) \['b'\].*use_bias=False"):
    no_bias.apply(params, image=x)
  sub = jg.Graph(g.node("fc"))                                   # takes the model's params
  assert sub.apply(params, image=x).shape == (4, 3)
  assert jg.Graph(g.node("pool")).apply(params, image=x).shape == (4, 3, 3, 2)


# ============================================================================ graph: constructors

IMG = jg.Input("img", shape=(6, 6, 2))


GRAPH_BAD = [
    (lambda: jg.Dense("d", IMG, features=True), TypeError,
     r"^node 'd' \(Dense\): features must be a positive int; got True \(a bool is not an int\)"),
    (lambda: jg.Dense("d", IMG, features=2.0), TypeError, r"^node 'd' \(Dense\): features"),
    (lambda: jg.Dense("d", IMG, features="4"), TypeError, r"^node 'd' \(Dense\): features"),
    (lambda: jg.Dense("d", IMG, features=0), ValueError, r"^node 'd' \(Dense\): features"),
    (lambda: jg.Dense("d", IMG, features=3, use_bias=1), TypeError,
     r"^node 'd' \(Dense\): use_bias must be a bool"),
    (lambda: jg.Dense("d", IMG, features=3, param_dtype="int32"), TypeError,
     r"^node 'd' \(Dense\): param_dtype must be a float dtype"),
    (lambda: jg.Dense("d", IMG, features=3, param_dtype="nope"), TypeError,
     r"^node 'd' \(Dense\): param_dtype must be a dtype"),
    (lambda: jg.Dense("d", IMG, features=3, weights_init="he"), TypeError,
     r"^node 'd' \(Dense\): weights_init must be an initializer"),
    (lambda: jg.Conv("c", IMG, features=2, use_bias="no"), TypeError,
     r"^node 'c' \(Conv\): use_bias must be a bool \(True or False\); got 'no'"),
    (lambda: jg.Conv("c", IMG, features=False), TypeError, r"^node 'c' \(Conv\): features"),
    (lambda: jg.Conv("c", IMG, features=2, strides=0), TypeError,
     r"^node 'c' \(Conv\): strides must be a tuple of 2 ints, one per spatial dim; got the "
     r"int 0"),
    (lambda: jg.Conv("c", IMG, features=2, dilation=(True, 1)), TypeError,
     r"^node 'c' \(Conv\): dilation must be a tuple of ints"),
    (lambda: jg.Conv("c", IMG, features=2, window=(0, 3)), ValueError,
     r"^node 'c' \(Conv\): window entries must be >= 1"),
    (lambda: jg.Conv("c", IMG, features=2, accumulator_precision=None), TypeError,
     r"^node 'c' \(Conv\): accumulator_precision must be one of"),
    (lambda: jg.Conv("c", IMG, features=2, bias_init=0.0), TypeError,
     r"^node 'c' \(Conv\): bias_init must be an initializer"),
    (lambda: jg.Input("i", shape=(2,), dtype=None), TypeError,
     r"^node 'i' \(Input\): dtype must be a dtype; got None"),
    (lambda: jg.Input("i", shape=(True, 2)), TypeError, r"^node 'i' \(Input\): shape"),
    (lambda: jg.MaxPool("p", IMG, window=2), TypeError, r"^node 'p' \(MaxPool\): window"),
    (lambda: jg.MaxPool("p", IMG, strides=(0, 1)), ValueError,
     r"^node 'p' \(MaxPool\): strides entries must be >= 1"),
    (lambda: jg.MaxPool("p", IMG, padding=None), TypeError, r"^node 'p' \(MaxPool\): padding"),
    (lambda: jg.MaxPool("p", IMG, padding=[1, 1]), TypeError, r"^node 'p' \(MaxPool\): padding"),
    (lambda: jg.DilatedMaxPool("p", IMG, dilation=0), TypeError,
     r"^node 'p' \(DilatedMaxPool\): dilation must be a tuple of 2 ints, one per spatial dim; "
     r"got the int 0"),
    (lambda: jg.AvgPool("a", IMG, count_include_pad="no"), TypeError,
     r"^node 'a' \(AvgPool\): count_include_pad must be a bool"),
    (lambda: jg.Activation("a", IMG, fn=None), TypeError,
     r"^node 'a' \(Activation\): fn must be one of"),
    (lambda: jg.MaxPool("p", IMG).gradient_filter(jg.Input("dy", shape=(3, 3, 2)), wrt=1),
     TypeError, r"^node 'p' \(MaxPool\): wrt must be a sequence of bools; got 1"),
    (lambda: jg.MaxPool("p", IMG).gradient_filter(jg.Input("dy", shape=(3, 3, 2)), wrt=(1,)),
     TypeError, r"^node 'p' \(MaxPool\): wrt must be a sequence of bools"),
]


@pytest.mark.parametrize("make,exc,match", GRAPH_BAD, ids=[str(i) for i in range(len(GRAPH_BAD))])
def test_node_constructor_arguments_are_type_checked(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


def test_node_constructors_take_numpy_ints_and_bools():
  a = jg.Dense("d", IMG, features=np.int64(3), use_bias=np.bool_(False))
  assert a == jg.Dense("d", IMG, features=3, use_bias=False)
  assert type(a.features) is int and a.use_bias is False
  c = jg.Conv("c", IMG, features=np.int32(2), window=(np.int64(3), 3), strides=np.array([1, 1]))
  assert c == jg.Conv("c", IMG, features=2, window=(3, 3), strides=(1, 1))
  assert jg.AvgPool("a", IMG, count_include_pad=np.bool_(True)).count_include_pad is True
