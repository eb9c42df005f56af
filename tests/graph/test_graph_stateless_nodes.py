"""Tests of the graph's stateless nodes beyond the first set: Concat, Upsample, Reshape, Pad,
ConvTranspose, grouped Conv, Softmax, the second losses; channels_first; pickling.

Forward passes are checked against NumPy references written here from the documented rules
(loops in float64, sharing no code with the library); gradient nodes against ``jax.vjp`` of the
forward, under ``jit`` and ``vmap``.
"""

import itertools
import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from core_strategies import assert_trees_close as assert_close
from jaxpool import graph as jg

# ----------------------------------------------------------------------------- NumPy references


def ref_conv(x, w, b, strides, pads, dilation, groups):
  """Grouped convolution, channels-last: ``x (N, *spatial, C)``, ``w (*window, C/g, F)``."""
  n = x.ndim - 2
  window, cg, f = w.shape[:n], w.shape[n], w.shape[n + 1]
  fg = f // groups
  xp = np.pad(x, [(0, 0), *pads, (0, 0)])
  out = [(xp.shape[1 + i] - dilation[i] * (window[i] - 1) - 1) // strides[i] + 1
         for i in range(n)]
  y = np.zeros((x.shape[0], *out, f))
  for o in itertools.product(*map(range, out)):
    for t in itertools.product(*map(range, window)):
      xv = xp[(slice(None), *(o[i] * strides[i] + t[i] * dilation[i] for i in range(n)))]
      for g in range(groups):
        y[(slice(None), *o, slice(g * fg, (g + 1) * fg))] += (
            xv[:, g * cg:(g + 1) * cg] @ w[t][:, g * fg:(g + 1) * fg])
  return y + b


def ref_conv_transpose(x, w, b, strides, pads, dilation, groups):
  """Transposed convolution as a scatter (PyTorch's definition): input position ``i`` adds
  ``x[i] @ w[t]`` at output ``i * s + t * d - lo``; output size ``(L-1)s + d(k-1) + 1 - lo - hi``.
  """
  n = x.ndim - 2
  window, cg, f = w.shape[:n], w.shape[n], w.shape[n + 1]
  fg = f // groups
  sp = x.shape[1:-1]
  out = [(sp[i] - 1) * strides[i] + dilation[i] * (window[i] - 1) + 1 - pads[i][0] - pads[i][1]
         for i in range(n)]
  y = np.zeros((x.shape[0], *out, f))
  for i in itertools.product(*map(range, sp)):
    for t in itertools.product(*map(range, window)):
      o = tuple(i[k] * strides[k] + t[k] * dilation[k] - pads[k][0] for k in range(n))
      if all(0 <= o[k] < out[k] for k in range(n)):
        xv = x[(slice(None), *i)]
        for g in range(groups):
          y[(slice(None), *o, slice(g * fg, (g + 1) * fg))] += (
              xv[:, g * cg:(g + 1) * cg] @ w[t][:, g * fg:(g + 1) * fg])
  return y + b


def ref_upsample_nearest(x, scale):
  n = x.ndim - 2
  out = [x.shape[1 + i] * scale[i] for i in range(n)]
  y = np.zeros((x.shape[0], *out, x.shape[-1]))
  for o in itertools.product(*map(range, out)):
    y[(slice(None), *o)] = x[(slice(None), *(o[i] // scale[i] for i in range(n)))]
  return y


def ref_bilinear_taps(o, L, s):
  """PyTorch's ``align_corners=False`` source taps of output ``o``: ``[(index, weight), ...]``."""
  src = max((o + 0.5) / s - 0.5, 0.0)
  i0 = min(int(math.floor(src)), L - 1)
  i1 = min(i0 + 1, L - 1)
  lam = src - i0
  return [(i0, 1.0 - lam), (i1, lam)]


def ref_upsample_bilinear(x, scale):
  n = x.ndim - 2
  sp = x.shape[1:-1]
  out = [sp[i] * scale[i] for i in range(n)]
  y = np.zeros((x.shape[0], *out, x.shape[-1]))
  for o in itertools.product(*map(range, out)):
    for taps in itertools.product(*(ref_bilinear_taps(o[i], sp[i], scale[i]) for i in range(n))):
      weight = math.prod(wt for _, wt in taps)
      y[(slice(None), *o)] += weight * x[(slice(None), *(j for j, _ in taps))]
  return y


def ref_pad_source(j, L, mode):
  """The input index that padded position ``j`` (``-lo <= j < L + hi``) copies, or None."""
  if 0 <= j < L:
    return j
  if mode == "constant":
    return None
  if mode == "edge":
    return 0 if j < 0 else L - 1
  if mode == "reflect":           # ... 2 1 | 0 1 2 ... L-1 | L-2 L-3 ...
    return -j if j < 0 else 2 * (L - 1) - j
  if mode == "symmetric":         # ... 1 0 | 0 1 2 ... L-1 | L-1 L-2 ...
    return -j - 1 if j < 0 else 2 * L - 1 - j
  raise ValueError(mode)


def ref_pad(x, padding, mode, value):
  n = x.ndim - 2
  sp = x.shape[1:-1]
  out = [sp[i] + padding[i][0] + padding[i][1] for i in range(n)]
  y = np.full((x.shape[0], *out, x.shape[-1]), value, dtype=np.float64)
  for o in itertools.product(*map(range, out)):
    src = [ref_pad_source(o[i] - padding[i][0], sp[i], mode) for i in range(n)]
    if None not in src:
      y[(slice(None), *o)] = x[(slice(None), *src)]
  return y


def ref_softmax(x, axis):
  e = np.exp(x - x.max(axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


# ----------------------------------------------------------------------------- helpers


def randn(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def f64(a):
  return np.asarray(a, dtype=np.float64)


def to_first(x, batch=1):
  """A channels-last array ``(*batch, *spatial, C)`` as channels-first."""
  return jnp.moveaxis(x, -1, batch)


# ----------------------------------------------------------------------------- forward passes


@pytest.mark.parametrize("groups,window,strides,padding,dilation", [
    (2, (3, 3), (1, 1), "SAME", (1, 1)),
    (4, (2, 3), (2, 1), ((1, 0), (2, 1)), (1, 2)),    # depthwise (C_in = features = groups)
    (2, (3,), (2,), "VALID", (1,)),
])
def test_grouped_conv_forward(groups, window, strides, padding, dilation, rng):
  spatial = (7, 6)[:len(window)]
  x = randn(rng, 2, *spatial, 4)
  conv = jg.Conv("c", jg.Input("x", shape=(*spatial, 4)), features=4, window=window,
                 strides=strides, padding=padding, dilation=dilation, groups=groups)
  g = jg.Graph(conv)
  params = g.init(jax.random.key(0))
  params["c"]["b"] = randn(rng, 4)
  assert params["c"]["w"].shape == (*window, 4 // groups, 4)
  pads = (ref.resolve_padding(padding, spatial, window, strides, dilation)
          if isinstance(padding, str) else padding)
  want = ref_conv(f64(x), f64(params["c"]["w"]), f64(params["c"]["b"]), strides, pads,
                  dilation, groups)
  assert_close(g.apply(params, x=x), want)


@pytest.mark.parametrize("window,strides,padding,dilation,groups,features", [
    ((3, 3), (2, 2), "SAME", (1, 1), 1, 3),         # e > s
    ((2, 2), (3, 2), "SAME", (1, 1), 1, 2),         # e < s in dim 0: bias-only positions
    ((3, 2), (2, 1), "VALID", (1, 2), 2, 4),        # grouped, dilated
    ((3, 3), (2, 2), ((1, 0), (1, 1)), (1, 1), 1, 2),   # PyTorch p=1, output_padding=1 in dim 0
    ((3,), (3,), "FULL", (1,), 1, 2),
])
def test_conv_transpose_forward(window, strides, padding, dilation, groups, features, rng):
  spatial = (4, 3)[:len(window)]
  x = randn(rng, 2, *spatial, 2)
  node = jg.ConvTranspose("t", jg.Input("x", shape=(*spatial, 2)), features=features,
                          window=window, strides=strides, padding=padding, dilation=dilation,
                          groups=groups)
  g = jg.Graph(node)
  params = g.init(jax.random.key(0))
  params["t"]["b"] = randn(rng, features)
  eff = [d * (k - 1) + 1 for k, d in zip(window, dilation, strict=True)]
  if padding == "VALID":
    pads = [(0, 0)] * len(window)
  elif padding == "FULL":
    pads = [(e - 1, e - 1) for e in eff]
  elif padding == "SAME":  # out = L * s: crop e - s, the odd one at the end; e < s adds at the end
    pads = [(max(e - s, 0) // 2, e - s - max(e - s, 0) // 2)
            for e, s in zip(eff, strides, strict=True)]
  else:
    pads = padding
  want = ref_conv_transpose(f64(x), f64(params["t"]["w"]), f64(params["t"]["b"]), strides,
                            pads, dilation, groups)
  y = g.apply(params, x=x)
  assert y.shape == want.shape
  if padding == "SAME":
    assert y.shape[1:-1] == tuple(L * s for L, s in zip(spatial, strides, strict=True))
  if isinstance(padding, tuple):  # PyTorch's size rule: (L-1)s - 2p + d(k-1) + output_padding + 1
    p, op = 1, (1, 0)
    assert y.shape[1:-1] == tuple((L - 1) * s - 2 * p + d * (k - 1) + q + 1 for L, s, d, k, q in
                                  zip(spatial, strides, dilation, window, op, strict=True))
  assert_close(y, want)


@pytest.mark.parametrize("padding", ["SAME", "VALID", ((2, 1), (0, 1))])
def test_conv_transpose_is_the_input_gradient_of_conv(padding, rng):
  """ConvTranspose(padding=P) is the transpose of Conv(padding=P) from an input of its output
  size (weights with their channel axes swapped, no bias)."""
  x = randn(rng, 4, 3, 5)
  t = jg.ConvTranspose("t", jg.Input("x", shape=(4, 3, 5)), features=2, window=(3, 2),
                       strides=(2, 3), padding=padding, use_bias=False)
  gt = jg.Graph(t)
  params = gt.init(jax.random.key(2))
  y = gt.apply(params, x=x)
  conv = jg.Conv("c", jg.Input("z", shape=y.shape), features=5, window=(3, 2), strides=(2, 3),
                 padding=padding, use_bias=False)
  w = {"c": {"w": jnp.swapaxes(params["t"]["w"], -1, -2)}}
  _, vjp = jax.vjp(lambda z: jg.Graph(conv).apply(w, z=z), jnp.zeros(y.shape))
  assert_close(y, vjp(x)[0])


@pytest.mark.parametrize("method,scale,spatial", [
    ("nearest", (2, 3), (3, 2)), ("bilinear", (2, 2), (3, 4)), ("bilinear", (3, 1), (2, 3)),
    ("bilinear", (4,), (3,)),
])
def test_upsample_forward(method, scale, spatial, rng):
  x = randn(rng, 2, *spatial, 3)
  g = jg.Graph(jg.Upsample("u", jg.Input("x", shape=(*spatial, 3)), scale=scale, method=method))
  want = (ref_upsample_nearest if method == "nearest" else ref_upsample_bilinear)(f64(x), scale)
  y = g.apply({}, x=x)
  if method == "nearest":
    np.testing.assert_array_equal(y, want.astype(np.float32))
  else:
    assert_close(y, want)


@pytest.mark.parametrize("mode,padding,value", [
    ("constant", ((1, 2), (0, 3)), 0.0), ("constant", ((2, 0), (1, 1)), -1.5),
    ("edge", ((3, 1), (2, 0)), 0.0), ("reflect", ((2, 2), (1, 2)), 0.0),
    ("symmetric", ((3, 1), (0, 3)), 0.0),
])
def test_pad_forward(mode, padding, value, rng):
  x = randn(rng, 2, 4, 3, 2)
  g = jg.Graph(jg.Pad("p", jg.Input("x", shape=(4, 3, 2)), padding=padding, mode=mode,
                      value=value))
  np.testing.assert_array_equal(g.apply({}, x=x), ref_pad(f64(x), padding, mode, value)
                                .astype(np.float32))


def test_concat_reshape_softmax_forward(rng):
  a, b = jg.Input("a", shape=(3, 4, 2)), jg.Input("b", shape=(3, 4, 5))
  c = jg.Input("c", shape=(3, 1, 2))
  cat = jg.Concat("cat", [a, b, a])                        # channels, a repeated
  rows = jg.Concat("rows", (a, c), axis=1)                 # width
  r = jg.Reshape("r", cat, shape=(4, -1))
  sm = jg.Softmax("sm", cat, axis=0)
  g = jg.Graph([cat, rows, r, sm])
  av, bv, cv = randn(rng, 2, 3, 4, 2), randn(rng, 2, 3, 4, 5), randn(rng, 2, 3, 1, 2)
  ycat, yrows, yr, ysm = g.apply({}, a=av, b=bv, c=cv)
  want = np.concatenate([f64(av), f64(bv), f64(av)], axis=-1)
  np.testing.assert_array_equal(ycat, want.astype(np.float32))
  np.testing.assert_array_equal(yrows, np.concatenate([f64(av), f64(cv)], axis=2)
                                .astype(np.float32))
  assert g.specs["r"].shape == (4, 27)
  np.testing.assert_array_equal(yr, want.reshape(2, 4, 27).astype(np.float32))
  assert_close(ysm, ref_softmax(want, axis=1))
  assert_close(jg.Graph(jg.Softmax("s", a)).apply({}, a=av), ref_softmax(f64(av), axis=-1))


def test_losses_forward(rng):
  p, t = jg.Input("p", shape=(3, 2)), jg.Input("t", shape=(3, 2))
  pv, tv = randn(rng, 5, 3, 2), jnp.asarray(rng.uniform(size=(5, 3, 2)).astype(np.float32))
  mse = jg.Graph(jg.MeanSquaredError("mse", p, t)).apply({}, p=pv, t=tv)
  assert mse.shape == ()
  assert_close(mse, np.mean((f64(pv) - f64(tv)) ** 2))
  bce = jg.Graph(jg.SigmoidCrossEntropy("bce", p, t)).apply({}, p=pv, t=tv)
  sig = 1 / (1 + np.exp(-f64(pv)))
  assert_close(bce, np.mean(-f64(tv) * np.log(sig) - (1 - f64(tv)) * np.log(1 - sig)))


# ----------------------------------------------------------------------------- gradient nodes


def _gradient_cases():
  """(forward node, {input name: per-example shape}) for every new node kind."""
  x = jg.Input("x", shape=(4, 4, 4))
  y = jg.Input("y", shape=(4, 4, 2))
  v = jg.Input("v", shape=(6,))
  w = jg.Input("w", shape=(6,))
  return [
      (jg.Conv("conv", x, features=6, groups=2, strides=(2, 1)), {"x": (4, 4, 4)}),
      (jg.ConvTranspose("convt", x, features=2, window=(3, 3), strides=(2, 2), padding="SAME"),
       {"x": (4, 4, 4)}),
      (jg.Upsample("up", x, method="bilinear", scale=(2, 3)), {"x": (4, 4, 4)}),
      (jg.Upsample("upn", x, scale=(2, 2)), {"x": (4, 4, 4)}),
      (jg.Pad("pad", x, padding=((1, 2), (2, 0)), mode="reflect"), {"x": (4, 4, 4)}),
      (jg.Concat("cat", [x, y, x]), {"x": (4, 4, 4), "y": (4, 4, 2)}),
      (jg.Reshape("rs", x, shape=(-1, 8)), {"x": (4, 4, 4)}),
      (jg.Softmax("sm", x, axis=-2), {"x": (4, 4, 4)}),
      (jg.MeanSquaredError("mse", v, w), {"v": (6,), "w": (6,)}),
      (jg.SigmoidCrossEntropy("bce", v, w), {"v": (6,), "w": (6,)}),
  ]


def by_input(node, ct):
  """A gradient node's cotangents by input name, summed where an input is read twice."""
  out = {}
  for name, c in zip(node.inputs, ct.inputs, strict=True):
    out[name] = c if name not in out else out[name] + c
  return out


@pytest.mark.parametrize("case", range(len(_gradient_cases())),
                         ids=[n.name for n, _ in _gradient_cases()])
def test_gradient_node_equals_vjp(case, rng):
  node, shapes = _gradient_cases()[case]
  fwd = jg.Graph(node)
  params = fwd.init(jax.random.key(case))
  out_shape = fwd.specs[node.name].shape
  dy_node = None if out_shape == () else jg.Input("dy", shape=out_shape)
  grad = node.gradient_filter(dy_node)
  assert isinstance(grad, jg.ConvolutionGradient if node.has_params else jg.Gradient)
  assert (grad.state is not None) == node.has_params   # only the convolutions keep a state
  gg = jg.Graph(grad)   # a loss's gradient node alone: its seed is 1
  batch = 3
  xs = {k: randn(rng, batch, *s) for k, s in shapes.items()}
  dy = {} if dy_node is None else {"dy": randn(rng, batch, *out_shape)}

  def ref(p, xs, dy):
    y, vjp = jax.vjp(lambda p, xs: fwd.apply(p, **xs), p, xs)
    return vjp(dy.get("dy", jnp.ones_like(y)))

  dp, dxs = jax.jit(ref)(params, xs, dy)
  ct = jax.jit(lambda p, xs, dy: gg.apply(p, **xs, **dy))(params, xs, dy)
  assert_close(by_input(node, ct), dxs)
  if node.has_params:
    assert_close(ct.params, dp[node.name])
  if dy_node is None:
    return  # a loss averages over the batch: vmap gives per-example means, checked above
  # vmap: per-example gradient nodes, against the batched vjp (no parameter sum over examples)
  vct = jax.vmap(lambda xs, dy: gg.apply(params, **xs, **dy))(xs, dy)
  assert_close(by_input(node, vct), dxs)
  if node.has_params:
    assert_close(jax.tree.map(lambda a: a.sum(0), vct.params), dp[node.name])


# ----------------------------------------------------------------------------- channels_first


def _layout_network(fmt):
  """Every node with a channel axis, in one data format; per-example image (6, 5, 4)."""
  shape = (6, 5, 4) if fmt == "channels_last" else (4, 6, 5)
  image = jg.Input("image", shape=shape)
  target = jg.Input("target", shape=(3,))
  kw = dict(data_format=fmt)
  c1 = jg.Conv("conv1", image, features=6, groups=2, **kw)
  c2 = jg.Conv("conv2", image, features=2, window=(2, 2), strides=(2, 2), padding="SAME", **kw)
  up = jg.Upsample("up", c2, method="bilinear", **kw)
  up = jg.Pad("pad", up, padding=((0, 0), (0, 1)), mode="edge", **kw)
  crop = jg.Conv("crop", up, features=2, window=(1, 3), padding="VALID", **kw)   # (6, 5)
  cat = jg.Concat("cat", [c1, crop], **kw)
  t = jg.ConvTranspose("convt", cat, features=3, window=(3, 3), strides=(2, 1), padding="SAME",
                       **kw)
  flat = jg.Flatten("flat", t, **kw)
  d = jg.Dense("fc", flat, features=3)
  d2 = jg.Dense("fc2", t, features=3, **kw)
  return jg.MeanSquaredError("loss", jg.Add("sum", d, d2), target), [c1, up, cat, t, flat]


def test_channels_first_equals_channels_last(rng):
  loss_l, inner_l = _layout_network("channels_last")
  loss_f, inner_f = _layout_network("channels_first")
  gl, gf = jg.Graph([loss_l, *inner_l]), jg.Graph([loss_f, *inner_f])
  params = gl.init(jax.random.key(0))
  assert ({k: {n: s.shape for n, s in v.items()} for k, v in gf.param_specs().items()}
          == {k: {n: a.shape for n, a in v.items()} for k, v in params.items()})
  x, t = randn(rng, 2, 6, 5, 4), randn(rng, 2, 3)
  outs_l = gl.apply(params, image=x, target=t)
  outs_f = gf.apply(params, image=to_first(x), target=t)
  assert_close(outs_f[0], outs_l[0])
  for a, b in zip(outs_f[1:-1], outs_l[1:-1], strict=True):   # images
    assert_close(a, to_first(b))
  assert_close(outs_f[-1], outs_l[-1])           # Flatten: channels-last order either way
  # training graphs: same loss, same parameter gradients
  run_l = jax.jit(lambda p, x, t: jg.training_graph(loss_l).run(p, image=x, target=t))
  run_f = jax.jit(lambda p, x, t: jg.training_graph(loss_f).run(p, image=x, target=t))
  assert_close(run_f(params, to_first(x), t), run_l(params, x, t))


def test_flatten_memory_order_by_default(rng):
  """Without data_format a (C, H, W) array is flattened as it lies (PyTorch's order)."""
  img = jg.Input("x", shape=(2, 3, 4))
  x = randn(rng, 5, 2, 3, 4)
  np.testing.assert_array_equal(jg.Graph(jg.Flatten("f", img)).apply({}, x=x),
                                np.asarray(x).reshape(5, 24))
  np.testing.assert_array_equal(
      jg.Graph(jg.Flatten("f", img, data_format="channels_first")).apply({}, x=x),
      np.asarray(x).transpose(0, 2, 3, 1).reshape(5, 24))


# ----------------------------------------------------------------------------- pickling


def test_graph_pickles(rng):
  loss, inner = _layout_network("channels_first")
  sm = jg.Softmax("sm", inner[-1])
  bce = jg.SigmoidCrossEntropy("bce", jg.Reshape("rs", sm, shape=(-1,)),
                               jg.Input("z", shape=(180,)))
  g = jg.Graph([loss, bce])
  g2 = pickle.loads(pickle.dumps(g))
  assert g2 == g and [type(n) for n in g2.nodes] == [type(n) for n in g.nodes]
  p1, p2 = g.init(jax.random.key(3)), g2.init(jax.random.key(3))
  jax.tree.map(np.testing.assert_array_equal, p1, p2)
  inputs = dict(image=randn(rng, 2, 4, 6, 5), target=randn(rng, 2, 3),
                z=jnp.asarray(rng.uniform(size=(2, 180)).astype(np.float32)))
  jax.tree.map(np.testing.assert_array_equal, g2.apply(p1, **inputs), g.apply(p1, **inputs))
  tg = jg.training_graph(loss)
  tg2 = pickle.loads(pickle.dumps(tg))
  jax.tree.map(np.testing.assert_array_equal, tg2.run(p1, image=inputs["image"],
                                                      target=inputs["target"]),
               tg.run(p1, image=inputs["image"], target=inputs["target"]))


def test_initializer():
  init = jg.Initializer("variance_scaling", (2.0, "fan_in"), {"distribution": "uniform"})
  assert init == pickle.loads(pickle.dumps(init))
  assert hash(init) == hash(jg.Initializer("variance_scaling", [2.0, "fan_in"],
                                           (("distribution", "uniform"),)))
  key = jax.random.key(0)
  np.testing.assert_array_equal(
      init(key, (3, 3, 2, 4), jnp.float32),
      jax.nn.initializers.variance_scaling(2.0, "fan_in", "uniform")(key, (3, 3, 2, 4)))
  assert jg.Conv("c", "x").weights_init == jg.Initializer("he_normal")
  with pytest.raises(ValueError, match="jax.nn.initializers has no factory 'he_nrmal'"):
    jg.Initializer("he_nrmal")


# ----------------------------------------------------------------------------- errors


def test_errors_config():
  x = jg.Input("x", shape=(4, 4, 3))
  cases = [
      (ValueError, r"node 'c' \(Conv\): features \(4\) must be divisible by groups \(3\)",
       lambda: jg.Conv("c", x, features=4, groups=3)),
      (TypeError, r"node 'c' \(Conv\): groups must be a positive int; got True",
       lambda: jg.Conv("c", x, features=4, groups=True)),
      (ValueError, r"node 'c' \(Conv\): groups must be a positive int; got 0",
       lambda: jg.Conv("c", x, features=4, groups=0)),
      (ValueError, r"node 'c' \(Conv\): data_format must be one of \('channels_last', "
       r"'channels_first'\); got 'NCHW'", lambda: jg.Conv("c", x, data_format="NCHW")),
      (TypeError, r"node 'f' \(Flatten\): data_format must be one of",
       lambda: jg.Flatten("f", x, data_format=None)),
      (ValueError, r"node 'u' \(Upsample\): method must be one of \('nearest', 'bilinear'\); "
       r"got 'bicubic'", lambda: jg.Upsample("u", x, method="bicubic")),
      (ValueError, r"node 'u' \(Upsample\): scale entries must be >= 1",
       lambda: jg.Upsample("u", x, scale=(0, 2))),
      (TypeError, r"node 'u' \(Upsample\): scale must be a tuple of ints",
       lambda: jg.Upsample("u", x, scale=2)),
      (ValueError, r"node 'r' \(Reshape\): shape may hold -1 once",
       lambda: jg.Reshape("r", x, shape=(-1, -1))),
      (ValueError, r"node 'r' \(Reshape\): shape entries must be >= -1",
       lambda: jg.Reshape("r", x, shape=(-2, 24))),
      (ValueError, r"node 'p' \(Pad\): mode must be one of \('constant', 'edge', 'reflect', "
       r"'symmetric'\); got 'wrap'", lambda: jg.Pad("p", x, mode="wrap")),
      (ValueError, r"node 'p' \(Pad\): padding must be >= 0",
       lambda: jg.Pad("p", x, padding=((1, -1), (0, 0)))),
      (ValueError, r"node 'p' \(Pad\): value applies to mode='constant' only",
       lambda: jg.Pad("p", x, mode="edge", value=1.0)),
      (TypeError, r"node 'p' \(Pad\): value must be a real number",
       lambda: jg.Pad("p", x, value="0")),
      (ValueError, r"node 'cat' \(Concat\): sources must hold at least one node",
       lambda: jg.Concat("cat", [])),
      (TypeError, r"node 'cat' \(Concat\): axis must be an int",
       lambda: jg.Concat("cat", [x, x], axis=1.0)),
      (TypeError, r"node 's' \(Softmax\): axis must be an int",
       lambda: jg.Softmax("s", x, axis=None)),
      (ValueError, r"node 't' \(ConvTranspose\): features \(3\) must be divisible by groups",
       lambda: jg.ConvTranspose("t", x, features=3, groups=2)),
  ]
  for exc, msg, build in cases:
    with pytest.raises(exc, match=msg):
      build()


def test_errors_shapes():
  x = jg.Input("x", shape=(4, 4, 3))
  y = jg.Input("y", shape=(4, 5, 2))
  cases = [
      (r"node 'c' \(Conv\): input 'x' has 3 channels, not divisible by groups \(2\)",
       jg.Conv("c", x, features=4, groups=2)),
      (r"node 'c' \(Conv\): input 'x' must be \(C, \*spatial\) with 3 spatial dims",
       jg.Conv("c", x, window=(3, 3, 3), data_format="channels_first")),
      (r"node 'cat' \(Concat\): inputs 'x' \(4, 4, 3\) and 'y' \(4, 5, 2\) must have the same "
       r"shape except along axis -1", jg.Concat("cat", [x, y])),
      (r"node 'cat' \(Concat\): axis 3 is out of range for input 'x' of per-example shape",
       jg.Concat("cat", [x, x], axis=3)),
      (r"node 's' \(Softmax\): axis -4 is out of range", jg.Softmax("s", x, axis=-4)),
      (r"node 'r' \(Reshape\): cannot reshape input 'x' of per-example shape \(4, 4, 3\) "
       r"\(48 elements\) to \(5, -1\)", jg.Reshape("r", x, shape=(5, -1))),
      (r"node 'r' \(Reshape\): .* to \(4, 4\) \(16 elements\)", jg.Reshape("r", x, shape=(4, 4))),
      (r"node 'p' \(Pad\): mode 'reflect' needs padding < the input size; spatial dim 1 has "
       r"size 4", jg.Pad("p", x, padding=((1, 1), (0, 4)), mode="reflect")),
      (r"node 'p' \(Pad\): input 'x' must be \(\*spatial, C\) with 1 spatial dims \(padding",
       jg.Pad("p", x, padding=((1, 1),))),
      (r"node 'u' \(Upsample\): input 'x' must be \(\*spatial, C\) with 3 spatial dims \(scale",
       jg.Upsample("u", x, scale=(2, 2, 2))),
      (r"node 't' \(ConvTranspose\): padding \(\(3, 3\), \(0, 0\)\) crops the whole output in "
       r"spatial dim 0", jg.ConvTranspose("t", jg.Input("z", shape=(1, 4, 3)), window=(3, 3),
                                          padding=((3, 3), (0, 0)))),
      (r"node 'mse' \(MeanSquaredError\): predictions 'x' \(4, 4, 3\) and targets 'y' "
       r"\(4, 5, 2\) must have the same per-example shape", jg.MeanSquaredError("mse", x, y)),
  ]
  for msg, node in cases:
    with pytest.raises(ValueError, match=msg):
      jg.Graph(node)
  with pytest.raises(TypeError, match=r"node 'b' \(SigmoidCrossEntropy\): labels 'l' must be a "
                                      r"float input; got int32"):
    jg.Graph(jg.SigmoidCrossEntropy("b", jg.Input("v", shape=(2,)),
                                    jg.Input("l", shape=(2,), dtype=jnp.int32)))
