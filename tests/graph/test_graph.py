"""Tests of jaxpool.graph: building, running, summaries, pictures, training graphs, errors."""

import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpool
from core_strategies import assert_trees_close

from jaxpool import graph as jg

# ----------------------------------------------------------------------------- fixtures


def every_kind_network():
  """A loss graph holding every node kind, with fan-out, FULL/SAME/explicit padding, offsets
  (one of which crops the input) and dilation. Per-example image (12, 12, 2)."""
  image = jg.Input("image", shape=(12, 12, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  c1 = jg.Conv("conv1", image, features=4, window=(3, 3), padding="SAME")
  r1 = jg.Activation("tanh1", c1, fn="tanh")
  a1 = jg.AvgPool("avg1", r1, window=(2, 2), strides=(1, 1), padding="SAME")
  s1 = jg.Add("add1", r1, a1)                                        # r1 feeds two nodes
  m1 = jg.MaxPool("max1", s1, window=(2, 2), strides=(2, 2), padding="SAME", offset=(1, 1))
  c2 = jg.Conv("conv2", m1, features=3, window=(2, 2), padding="FULL", dilation=(1, 1),
               accumulator_precision="half")
  r2 = jg.ReLU("relu2", c2)
  dm = jg.DilatedMaxPool("dmax", r2, window=(2, 2), dilation=(2, 2), strides=(1, 1))
  l2 = jg.L2Pool("l2", dm, window=(2, 2), strides=(2, 2), padding=((0, 0), (0, 0)),
                 offset=(1, 0))
  f = jg.Flatten("flat", l2)
  h = jg.Activation("gelu", jg.Dense("fc1", f, features=16), fn="gelu")
  logits = jg.Dense("logits", h, features=5)
  return jg.SoftmaxCrossEntropy("loss", logits, label)


def unique_batch(rng, n, shape=(12, 12, 2), classes=5):
  x = rng.permutation(n * int(np.prod(shape))).reshape(n, *shape).astype(np.float32)
  x = (x / x.size - 0.5) * 4  # unique values: no ties where ties are not meant
  return jnp.asarray(x), jnp.asarray(rng.integers(0, classes, n).astype(np.int32))


def max_abs_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                           jax.tree.leaves(b), strict=True))


@pytest.fixture(scope="module")
def net():
  loss = every_kind_network()
  g = jg.Graph(loss)
  tg = jg.training_graph(loss)
  params = g.init(jax.random.key(0))
  return loss, g, tg, params


@pytest.fixture(scope="module")
def jitted(net):
  """``jit(training graph)`` and ``jit(value_and_grad(apply))``, compiled once per module."""
  _, g, tg, _ = net
  run = jax.jit(lambda p, x, y: tg.run(p, image=x, label=y))
  ref = jax.jit(jax.value_and_grad(lambda p, x, y: g.apply(p, image=x, label=y)))
  return run, ref


# ----------------------------------------------------------------------------- building


def test_shapes_and_params(net):
  _, g, _, params = net
  shapes = {n.name: g.specs[n.name].shape for n in g.nodes}
  assert shapes["conv1"] == (12, 12, 4)
  assert shapes["max1"] == (6, 6, 4)       # SAME (0, 0), offset 1 -> crop 1, pad (0, 1)
  assert shapes["conv2"] == (7, 7, 3)      # FULL: (6 + 2 - 1)
  assert shapes["dmax"] == (5, 5, 3)
  assert shapes["l2"] == (2, 2, 3)
  assert shapes["flat"] == (12,)
  assert shapes["loss"] == ()
  assert set(params) == {"conv1", "conv2", "fc1", "logits"}
  assert params["conv1"]["w"].shape == (3, 3, 2, 4)
  assert params["fc1"]["w"].shape == (12, 16)
  assert g.num_params() == sum(x.size for x in jax.tree.leaves(params))
  # Topological order: every input comes before its consumer.
  seen = set()
  for n in g.nodes:
    assert set(n.inputs) <= seen
    seen.add(n.name)


def test_nodes_are_frozen_and_hashable():
  x = jg.Input("x", shape=(4, 4, 1))
  a = jg.MaxPool("p", x, window=[2, 2], padding=[[0, 1], [0, 1]])
  b = jg.MaxPool("p", "x", window=(2, 2), padding=((0, 1), (0, 1)))
  assert a == b and hash(a) == hash(b)     # lists normalised to tuples; refs not compared
  assert a.inputs == ("x",) and a.strides == (2, 2)  # MPS: stride = filter size by default
  with pytest.raises(AttributeError):
    a.window = (3, 3)
  assert "MaxPool(name='p', inputs=('x',), window=(2, 2)" in repr(a)
  g1 = jg.Graph(a)
  assert g1 == jg.Graph(jg.MaxPool("p", x, window=(2, 2), padding=((0, 1), (0, 1))))
  assert hash(g1) == hash(jg.Graph(jg.MaxPool("p", x, window=(2, 2), padding=((0, 1), (0, 1)))))
  # Nodes built twice with the same config (default initializers included) are equal.
  assert jg.Conv("c", x, features=2) == jg.Conv("c", "x", features=2)
  assert hash(jg.Dense("d", x, features=2)) == hash(jg.Dense("d", x, features=2))
  assert jg.Conv("c", x, features=2) != jg.Conv("c", x, features=3)


def test_apply_batch_dims_jit_vmap(rng):
  image = jg.Input("image", shape=(6, 6, 2))
  conv = jg.Conv("conv", image, features=3, strides=(2, 2))
  logits = jg.Graph(jg.Dense("fc", jg.L2Pool("pool", conv, window=(2, 2), strides=(1, 1)),
                             features=5))
  params = logits.init(jax.random.key(0))
  x = jnp.asarray(rng.standard_normal((6, 6, 6, 2)).astype(np.float32))
  y = logits.apply(params, image=x)
  assert y.shape == (6, 5)
  np.testing.assert_allclose(logits.apply(params, image=x[2]), y[2], rtol=1e-5, atol=1e-6)
  yy = logits.apply(params, image=x.reshape(2, 3, 6, 6, 2))                  # two batch dims
  np.testing.assert_allclose(yy.reshape(6, 5), y, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jax.jit(logits.apply)(params, image=x), y, rtol=1e-5, atol=1e-6)
  yv = jax.vmap(lambda xi: logits.apply(params, image=xi))(x)
  np.testing.assert_allclose(yv, y, rtol=1e-5, atol=1e-6)


def test_multiple_outputs_and_evaluate(net, rng):
  _, g, _, params = net
  two = jg.Graph([g.node("max1"), g.node("logits")])
  x, _ = unique_batch(rng, 2)
  m, lg = two.apply(params, image=x)
  assert m.shape == (2, 6, 6, 4) and lg.shape == (2, 5)
  values = two.evaluate(params, image=x)
  np.testing.assert_array_equal(values["max1"], m)


def test_pooling_nodes_call_the_functional_api(rng):
  x = jnp.asarray(rng.standard_normal((3, 9, 7, 2)).astype(np.float32))
  img = jg.Input("x", shape=(9, 7, 2))
  cases = [
      (jg.MaxPool("p", img, window=(3, 2), strides=(2, 1), padding="SAME"),
       jaxpool.max_pool(x, (3, 2), (2, 1), "SAME")),
      (jg.AvgPool("p", img, window=(2, 2), padding="FULL", count_include_pad=True),
       jaxpool.avg_pool(x, (2, 2), (2, 2), ((1, 1), (1, 1)), count_include_pad=True)),
      (jg.L2Pool("p", img, window=(2, 3), strides=(1, 1)),
       jaxpool.l2_pool(x, (2, 3), (1, 1))),
      (jg.DilatedMaxPool("p", img, window=(2, 2), strides=(1, 2), dilation=(3, 2)),
       jaxpool.max_pool(x, (2, 2), (1, 2), dilation=(3, 2))),
  ]
  for node, want in cases:
    got = jg.Graph(node).apply({}, x=x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("policy,spatial,want", [
    ("VALID", (7,), ((0, 0),)),
    ("SAME", (7,), ((1, 1),)),       # k=3, s=2: 4 outputs
    ("FULL", (7,), ((2, 2),)),       # k - 1 on both sides
    (((1, 0),), (7,), ((1, 0),)),
    ("same", (7,), ((1, 1),)),       # any case, as the nodes and the ops take it
    ("Full", (7,), ((2, 2),)),
    ("same_lower", (8,), ((1, 0),)),
])
def test_resolve_padding(policy, spatial, want):
  assert jg.resolve_padding(policy, spatial, (3,), (2,), (1,)) == want


def test_resolve_padding_names_a_bad_policy():
  with pytest.raises(ValueError, match=r"padding must be one of .* got 'ful'"):
    jg.resolve_padding("ful", (7,), (3,), (2,), (1,))


def test_full_padding_and_kernel_offset_semantics(rng):
  x = rng.standard_normal((1, 5, 5, 1)).astype(np.float32)
  img = jg.Input("x", shape=(5, 5, 1))
  # FULL, stride 1: every window that touches a real element, out = L + k - 1.
  full = jg.Graph(jg.MaxPool("p", img, window=(2, 2), strides=(1, 1), padding="FULL"))
  xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
  want = np.max([xp[:, i:i + 6, j:j + 6] for i in range(2) for j in range(2)], axis=0)
  np.testing.assert_array_equal(full.apply({}, x=x), want)
  # offset o moves every window o elements toward the end: (lo, hi) -> (lo - o, hi + o);
  # a negative lo crops. VALID, window 2, stride 2, offset 1: windows [1, 2] and [3, 4].
  off = jg.Graph(jg.MaxPool("p", img, window=(2, 2), offset=(1, 1)))
  want = x[:, 1:5, 1:5].reshape(1, 2, 2, 2, 2, 1).max(axis=(2, 4))
  np.testing.assert_array_equal(off.apply({}, x=x), want)
  # offset -1: windows start one element before the input (padding never wins).
  neg = jg.Graph(jg.MaxPool("p", img, window=(2, 2), offset=(-1, 0)))
  want = jaxpool.max_pool(x[:, :4], (2, 2), (2, 2), ((1, 0), (0, 0)))
  np.testing.assert_array_equal(neg.apply({}, x=x), want)
  assert jg.MaxPool("p", img, window=(2, 2), offset=(1, -1)).geometry((5, 5)) == (
      ((1, 0), (0, 1)), ((0, 1), (1, 0)))


# ----------------------------------------------------------------------------- training graph


def test_training_graph_equals_value_and_grad(net, jitted, rng):
  _, _, _, params = net
  run, ref = jitted
  x, y = unique_batch(rng, 4)
  got_loss, got_grads = run(params, x, y)
  want_loss, want_grads = ref(params, x, y)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  assert_trees_close(got_grads, want_grads)


def test_training_graph_per_example_vmap(net, jitted, rng):
  _, g, tg, params = net
  run, ref = jitted
  x, y = unique_batch(rng, 4)
  per_example = jax.jit(jax.vmap(lambda xi, yi: tg.run(params, image=xi, label=yi)))
  losses, grads = per_example(x, y)
  chex.assert_shape(losses, (4,))
  # One gradient per example, each shaped like the parameters.
  chex.assert_tree_shape_prefix(grads, (4,))
  chex.assert_trees_all_equal_shapes_and_dtypes(jax.tree.map(lambda a: a[0], grads), params)
  want_losses, want_grads = jax.jit(jax.vmap(ref, in_axes=(None, 0, 0)))(params, x, y)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  assert_trees_close(grads, want_grads)
  # The mean of the per-example gradients is the batch gradient.
  _, batch = run(params, x, y)
  assert_trees_close(jax.tree.map(lambda a: a.mean(0), grads), batch)


def test_training_graph_eager_small(rng):
  """Without jit (a plain Python loop over the nodes), on a small graph."""
  image = jg.Input("image", shape=(6, 6, 1))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  h = jg.MaxPool("pool", jg.ReLU("relu", jg.Conv("conv", image, features=2)), padding="SAME")
  loss = jg.SoftmaxCrossEntropy("loss", jg.Dense("fc", h, features=3), label)
  g, tg = jg.Graph(loss), jg.training_graph(loss)
  params = g.init(jax.random.key(3))
  x = jnp.asarray(rng.standard_normal((5, 6, 6, 1)).astype(np.float32))
  y = jnp.asarray(rng.integers(0, 3, 5).astype(np.int32))
  got = tg.run(params, image=x, label=y)
  want = jax.value_and_grad(lambda p: g.apply(p, image=x, label=y))(params)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  assert_trees_close(got[1], want[1])


def test_training_graph_structure(net):
  loss, g, tg, _ = net
  names = [n.name for n in tg.nodes]
  for fwd in ("max1", "dmax", "conv1", "conv2", "fc1", "logits"):
    assert f"{fwd}.state" in names and f"{fwd}.grad" in names
  for fwd in ("avg1", "l2", "add1", "tanh1", "flat", "loss"):
    assert f"{fwd}.grad" in names and f"{fwd}.state" not in names
  assert set(tg.gradients) == {n.name for n in g.nodes if not isinstance(n, jg.Input)}
  pg = tg.node("max1.grad")
  assert isinstance(pg, jg.PoolingGradient)
  assert (pg.window, pg.strides, pg.padding, pg.offset) == ((2, 2), (2, 2), "SAME", (1, 1))
  assert pg.inputs == ("conv2.grad", "add1", "max1.state")  # source grad, image, state
  assert isinstance(tg.node("conv2.grad"), jg.ConvolutionGradient)
  # r1 feeds avg1 and add1: its gradient sums both consumers' gradients, in order.
  assert tg.node("tanh1.grad").source_gradients == ("avg1.grad", "add1.grad")
  # The image is not differentiated (no parameter upstream).
  assert tg.node("conv1.grad").wrt == (False,)
  text = str(tg)
  assert "max1.state" in text and "GradientState (argmax taps, 1 byte)" in text
  assert "MaxPoolGradient 2x2/2x2 SAME" in text


def test_max_pool_gradient_state_is_the_argmax(rng):
  x = jnp.asarray(rng.standard_normal((2, 6, 6, 3)).astype(np.float32))
  img = jg.Input("x", shape=(6, 6, 3))
  pool = jg.MaxPool("pool", img, window=(3, 3), strides=(2, 2), padding="SAME")
  st = pool.gradient_state()
  values = jg.Graph(st).evaluate({}, x=x)
  y, taps = jaxpool.max_pool_with_taps(x, (3, 3), (2, 2), "SAME")
  # The node's output and its state: the values, shapes and dtypes of max_pool_with_taps.
  chex.assert_trees_all_equal((values["pool"], values["pool.state"]), (y, taps), strict=True)


# ----------------------------------------------------------------------------- hand-built


@pytest.mark.parametrize("kind", ["max", "dilated", "avg", "l2"])
def test_hand_built_pooling_gradient(kind, rng):
  x = jnp.asarray(rng.standard_normal((2, 7, 6, 3)).astype(np.float32))
  img = jg.Input("x", shape=(7, 6, 3))
  kw = dict(window=(3, 2), strides=(2, 1), padding="SAME")
  pool = {"max": jg.MaxPool, "dilated": jg.DilatedMaxPool, "avg": jg.AvgPool,
          "l2": jg.L2Pool}[kind]("pool", img, **kw)
  out_shape = jg.Graph(pool).specs["pool"].shape
  dy_node = jg.Input("dy", shape=out_shape)
  dy = jnp.asarray(rng.standard_normal((2, *out_shape)).astype(np.float32))
  state = pool.gradient_state() if pool.keeps_state else None
  grad = jg.PoolingGradient("pool.grad", pool, dy_node, img, state)   # MPS's initializer
  assert grad == pool.gradient_filter(dy_node)                        # gradientFilter(withSource:)
  g = jg.Graph(grad)
  ct = g.apply({}, x=x, dy=dy)
  assert isinstance(ct, jg.Cotangents) and ct.params is None
  (dx,) = ct.inputs
  pads = jg.resolve_padding("SAME", (7, 6), (3, 2), (2, 1), pool.dilation_)
  if kind in ("max", "dilated"):
    want = jaxpool.max_pool_grad(x, dy, (3, 2), (2, 1), pads, dilation=pool.dilation_)
    np.testing.assert_array_equal(dx, want)                          # the same bits
  elif kind == "avg":
    want = jaxpool.avg_pool_grad(dy, x.shape, (3, 2), (2, 1), pads, count_include_pad=False)
    np.testing.assert_array_equal(dx, want)
  else:
    want = jaxpool.lp_pool_grad(x, dy, 2, (3, 2), (2, 1), pads)
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-7)
  if kind == "max":  # under jit and vmap too
    np.testing.assert_array_equal(jax.jit(g.apply)({}, x=x, dy=dy).inputs[0], dx)
    dxv = jax.jit(jax.vmap(lambda a, b: g.apply({}, x=a, dy=b).inputs[0]))(x, dy)
    np.testing.assert_allclose(dxv, dx, rtol=1e-6, atol=1e-7)
  assert pool.describe().split()[0] + "Gradient" in g.summary()


def test_hand_built_gradient_with_offset_crop(rng):
  x = jnp.asarray(rng.standard_normal((5, 5, 1)).astype(np.float32))
  img = jg.Input("x", shape=(5, 5, 1))
  pool = jg.MaxPool("pool", img, window=(2, 2), offset=(1, 1))
  dy_node = jg.Input("dy", shape=(2, 2, 1))
  dy = jnp.arange(1.0, 5.0).reshape(2, 2, 1)
  (dx,) = jg.Graph(pool.gradient_filter(dy_node)).apply({}, x=x, dy=dy).inputs
  f = lambda v: jg.Graph(pool).apply({}, x=v)
  np.testing.assert_array_equal(dx, jax.vjp(f, x)[1](dy)[0])
  assert float(jnp.abs(dx[0]).sum() + jnp.abs(dx[:, 0]).sum()) == 0  # cropped row/column


def test_hand_built_conv_gradient(rng):
  img = jg.Input("x", shape=(6, 6, 2))
  conv = jg.Conv("conv", img, features=3, window=(3, 3), strides=(2, 2), padding="SAME")
  params = jg.Graph(conv).init(jax.random.key(1))
  x = jnp.asarray(rng.standard_normal((4, 6, 6, 2)).astype(np.float32))
  dy_node = jg.Input("dy", shape=(3, 3, 3))
  dy = jnp.asarray(rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
  grad = conv.gradient_filter(dy_node)
  assert isinstance(grad, jg.ConvolutionGradient) and grad.state == "conv.state"
  ct = jg.Graph(grad).apply(params, x=x, dy=dy)
  _, vjp = jax.vjp(lambda p, v: jg.Graph(conv).apply({"conv": p}, x=v), params["conv"], x)
  dp, dx = vjp(dy)
  np.testing.assert_allclose(ct.inputs[0], dx, rtol=1e-6, atol=1e-6)
  assert_trees_close(ct.params, dp)


def test_hand_built_loss_gradient_without_the_loss_node(rng):
  """A loss's gradient node built by hand makes a graph on its own (the loss is not a node of
  it): the seed is 1, and it equals the gradient taken beside the loss and jax.grad."""
  logits = jg.Input("logits", shape=(5,))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)
  grad = loss.gradient_filter()
  g = jg.Graph(grad)
  assert "loss" not in [n.name for n in g.nodes]
  z = jnp.asarray(rng.standard_normal((4, 5)).astype(np.float32))
  y = jnp.asarray([0, 4, 2, 1], jnp.int32)
  ct = g.apply({}, logits=z, label=y)
  assert ct.inputs[1] is None and ct.params is None
  _, beside = jg.Graph([loss, grad]).apply({}, logits=z, label=y)
  np.testing.assert_array_equal(ct.inputs[0], beside.inputs[0])
  want = jax.grad(lambda v: jg.Graph(loss).apply({}, logits=v, label=y))(z)
  np.testing.assert_allclose(ct.inputs[0], want, rtol=1e-6, atol=1e-7)
  # under jit XLA fuses the softmax: float32 rounding against the eager run (seen on a GPU)
  np.testing.assert_allclose(jax.jit(g.apply)({}, logits=z, label=y).inputs[0], ct.inputs[0],
                             rtol=1e-6, atol=1e-7)
  # a float loss with two differentiated inputs, under vmap (per-example means)
  p, t = jg.Input("p", shape=(3,)), jg.Input("t", shape=(3,))
  mse = jg.Graph(jg.MeanSquaredError("mse", p, t).gradient_filter())
  pv, tv = (jnp.asarray(rng.standard_normal((4, 3)).astype(np.float32)) for _ in range(2))
  dp, dt = jax.vmap(lambda a, b: mse.apply({}, p=a, t=b).inputs)(pv, tv)
  np.testing.assert_allclose(dp, 2 * (pv - tv) / 3, rtol=1e-6)
  np.testing.assert_allclose(dt, -dp, rtol=1e-6)


# ----------------------------------------------------------------------------- printing


def test_summary_text():
  x = jg.Input("image", shape=(8, 8, 1))
  c = jg.Conv("conv1", x, features=4)
  p = jg.MaxPool("pool1", jg.ReLU("relu1", c))
  d = jg.Dense("fc", p, features=10)
  # (passes=(): the table of the graph as built; the default would fold relu1 into pool1)
  text = jg.Graph(d, passes=()).summary()
  lines = text.splitlines()
  assert lines[0] == "Graph: 5 nodes, 690 parameters, outputs fc"
  assert re.match(r"#\s+node\s+op\s+inputs\s+shape\s+params$", lines[1])
  assert re.match(r"0\s+image\s+Input float32\s+-\s+\(8, 8, 1\)\s+-$", lines[2])
  assert re.match(r"1\s+conv1\s+Conv 3x3/1x1 SAME -> 4\s+image\s+\(8, 8, 4\)\s+40$", lines[3])
  assert re.match(r"3\s+pool1\s+MaxPool 2x2/2x2 VALID\s+relu1\s+\(4, 4, 4\)\s+-$", lines[5])
  assert re.match(r"4\s+fc\s+Dense -> 10\s+pool1\s+\(10,\)\s+650$", lines[6])
  assert str(jg.Graph(d, passes=())) == text
  assert [n.name for n in jg.Graph(d, passes=())] == ["image", "conv1", "relu1", "pool1", "fc"]


def test_dot_export(tmp_path):
  loss = every_kind_network()
  tg = jg.training_graph(loss)
  dot = tg.to_dot()
  assert dot.startswith('digraph "TrainingGraph" {') and dot.rstrip().endswith("}")
  for n in tg.nodes:
    assert f'"{n.name}" [label=' in dot
    for i in n.inputs:
      assert f'"{i}" -> "{n.name}";' in dot
  edges = [ln for ln in dot.splitlines() if re.fullmatch(r'  "[^"]+" -> "[^"]+";', ln)]
  assert len(edges) == sum(len(n.inputs) for n in tg.nodes)
  assert "shape=note" in dot                                           # gradient states
  path = tg.save(tmp_path / "train.dot")
  assert pathlib.Path(path).read_text() == dot
  with pytest.raises(ValueError, match="must end in"):
    tg.save(tmp_path / "train.txt")
  if jg.has_graphviz():
    svg = tg.save(tmp_path / "train.svg")
    assert "<svg" in pathlib.Path(svg).read_text()
  else:
    with pytest.raises(RuntimeError, match="Graphviz"):
      tg.save(tmp_path / "train.svg")


# ----------------------------------------------------------------------------- errors


def test_error_unknown_input():
  c = jg.Conv("conv1", "nope", features=2)
  with pytest.raises(ValueError, match=r"node 'conv1' \(Conv\): unknown input 'nope'"):
    jg.Graph(c)


def test_error_shape_mismatch():
  a = jg.Input("a", shape=(4, 4, 2))
  b = jg.Input("b", shape=(4, 4, 3))
  with pytest.raises(ValueError, match=r"node 'sum' \(Add\): inputs 'a' \(4, 4, 2\) and 'b'"):
    jg.Graph(jg.Add("sum", a, b))
  flat = jg.Input("v", shape=(16,))
  with pytest.raises(ValueError, match=r"node 'pool' \(MaxPool\): input 'v' must be"):
    jg.Graph(jg.MaxPool("pool", flat, window=(2, 2)))
  with pytest.raises(ValueError, match=r"node 'conv' \(Conv\): input 'v' must be"):
    jg.Graph(jg.Conv("conv", flat, features=2))
  small = jg.Input("s", shape=(3, 3, 1))
  with pytest.raises(ValueError, match=r"node 'big' \(MaxPool\): window larger"):
    jg.Graph(jg.MaxPool("big", small, window=(4, 4)))
  with pytest.raises(ValueError, match=r"node 'big' \(Conv\): window larger than the padded "
                                       r"input in spatial dim 0.*window=\(5, 5\)"):
    jg.Graph(jg.Conv("big", small, window=(5, 5), padding="VALID"))
  with pytest.raises(ValueError, match=r"node 'crop' \(MaxPool\): offset \(3, 0\) crops"):
    jg.Graph(jg.MaxPool("crop", small, window=(1, 1), offset=(3, 0)))
  logits = jg.Input("logits", shape=(10,))
  labels = jg.Input("labels", shape=(), dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"node 'loss' \(SoftmaxCrossEntropy\): labels 'labels'"):
    jg.Graph(jg.SoftmaxCrossEntropy("loss", logits, labels))


def test_error_cycle():
  a = jg.ReLU("a", "c")
  b = jg.ReLU("b", a)
  c = jg.ReLU("c", b)
  with pytest.raises(ValueError, match=r"node '[abc]': the graph has a cycle: .*->.*->"):
    jg.Graph(c)
  with pytest.raises(ValueError, match=r"node 'self': the graph has a cycle: self -> self"):
    jg.Graph(jg.ReLU("self", "self"))


def test_error_duplicate_name():
  x = jg.Input("x", shape=(4, 4, 1))
  with pytest.raises(ValueError, match=r"node 'x': two different nodes share this name"):
    jg.Graph(jg.Add("s", x, jg.Input("x", shape=(4, 4, 2))))


def test_error_gradient_state_of_another_node():
  x = jg.Input("x", shape=(4, 4, 1))
  p1 = jg.MaxPool("p1", x)
  p2 = jg.MaxPool("p2", x, window=(1, 1))
  dy = jg.Input("dy", shape=(2, 2, 1))
  with pytest.raises(ValueError, match=r"node 'g' \(PoolingGradient\): gradient_state "
                                       r"'p2.state' belongs to forward node 'p2', not to 'p1'"):
    jg.PoolingGradient("g", p1, dy, x, p2.gradient_state())
  # Given by name, it is caught when the graph is built.
  g = jg.PoolingGradient("g", p1, dy, x, "p2.state")
  with pytest.raises(ValueError, match=r"node 'g' \(PoolingGradient\): gradient_state "
                                       r"'p2.state' belongs to 'p2', not to its forward node"):
    jg.Graph([g, p2.gradient_state()])
  with pytest.raises(ValueError, match=r"node 'g' \(PoolingGradient\): MaxPool 'p1' needs its "
                                       "gradient state"):
    jg.PoolingGradient("g", p1, dy, x, None)
  with pytest.raises(ValueError, match=r"node 'g' \(PoolingGradient\): source_image \('dy',\) "
                                       "must be the inputs of its forward node 'p1'"):
    jg.PoolingGradient("g", p1, dy, dy, p1.gradient_state())
  # (a pooling node's gradient takes a state even where it needs none, as MPS's: AvgPool's)
  with pytest.raises(ValueError, match=r"node 's' \(GradientState\): Activation 'a' keeps no"):
    jg.GradientState("s", jg.ReLU("a", x))


def test_error_gradient_shapes():
  x = jg.Input("x", shape=(4, 4, 1))
  p = jg.MaxPool("p", x)
  wrong = jg.Input("dy", shape=(4, 4, 1))
  with pytest.raises(ValueError, match=r"node 'p.grad' \(PoolingGradient\): source gradient "
                                       r"'dy' has shape \(4, 4, 1\), but the output of 'p'"):
    jg.Graph(p.gradient_filter(wrong))
  with pytest.raises(ValueError, match=r"node 'p.grad' \(PoolingGradient\): needs a "
                                       "source_gradient"):
    jg.Graph(p.gradient_filter())
  d = jg.Dense("d", x, features=3)
  with pytest.raises(ValueError, match=r"node 'd' \(Dense\): a loss must be a scalar"):
    jg.training_graph(d)
  with pytest.raises(ValueError, match=r"node 'l' \(SoftmaxCrossEntropy\): nothing to train"):
    jg.training_graph(jg.SoftmaxCrossEntropy("l", jg.Input("z", shape=(3,)),
                                             jg.Input("y", shape=(), dtype=jnp.int32)))


def test_error_config():
  x = jg.Input("x", shape=(4, 4, 1))
  with pytest.raises(ValueError, match=r"node 'p' \(MaxPool\): padding must be one of"):
    jg.MaxPool("p", x, padding="SAME_UPPER")
  with pytest.raises(ValueError, match=r"node 'p' \(AvgPool\): strides must have one entry per "
                                       r"spatial dim \(2\)"):
    jg.AvgPool("p", x, strides=(1, 1, 1))
  with pytest.raises(ValueError, match=r"node 'c' \(Conv\): accumulator_precision must be"):
    jg.Conv("c", x, features=2, accumulator_precision="double")
  with pytest.raises(ValueError, match=r"node 'a' \(Activation\): fn must be one of"):
    jg.Activation("a", x, fn="swish2")
  with pytest.raises(TypeError, match=r"node 'r': source must be a node or a node name"):
    jg.ReLU("r", 3)


def test_error_apply_inputs(net, rng):
  _, g, _, params = net
  x, y = unique_batch(rng, 2)
  with pytest.raises(ValueError, match=r"missing input\(s\) \['label'\]"):
    g.apply(params, image=x)
  with pytest.raises(ValueError, match=r"unknown input\(s\) \['img'\]"):
    g.apply(params, img=x, label=y)
  with pytest.raises(ValueError, match=r"input 'image' must have shape \(\*batch, \*\(12, 12, 2"):
    g.apply(params, image=x[:, :6], label=y)
  with pytest.raises(ValueError, match="different batch dims"):
    g.apply(params, image=x, label=y[:1])
  with pytest.raises(TypeError, match=r"input 'label' must have a int32 dtype"):
    g.apply(params, image=x, label=y.astype(jnp.float32))
