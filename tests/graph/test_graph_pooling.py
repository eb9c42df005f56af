"""The graph on the core: pooling nodes and their gradients through jaxpool's public functions
(1-byte taps, the Pallas backward kernel), ceil_mode / SAME_LOWER / channels_first pools, and the
rewrite pass that folds a ReLU into the max pool after it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from core_strategies import assert_same_bits

import jaxpool
from jaxpool import graph as jg

POOLS = {"max": jg.MaxPool, "dilated": jg.DilatedMaxPool, "avg": jg.AvgPool, "l2": jg.L2Pool}


def _ties(rng, shape):
  """Small integers with many zeros and negatives (ties everywhere), as float32."""
  return jnp.asarray(rng.integers(-2, 3, size=shape).astype(np.float32))


def _same_trees(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb, strict=True):
    assert_same_bits(x, y)


# ----------------------------------------------------------------------------- gradient state


@pytest.mark.parametrize("window", [(2, 2), (3, 3)])
def test_max_pool_state_is_one_byte_per_output(window, rng):
  img = jg.Input("x", shape=(9, 9, 4))
  pool = jg.MaxPool("pool", img, window=window, strides=(2, 2), padding="SAME")
  g = jg.Graph(pool.gradient_state())
  x = _ties(rng, (2, 9, 9, 4))
  values = g.evaluate({}, x=x)
  state, y = values["pool.state"], values["pool"]
  assert state.dtype == jnp.int8 and state.shape == y.shape
  assert state.nbytes == y.size                                   # 1 byte per output
  assert g.specs["pool.state"].dtype == jnp.int8
  assert_same_bits(state, jaxpool.max_pool_with_taps(x, window, (2, 2), "SAME")[1])


def test_avg_and_l2_pools_take_a_state_that_carries_nothing(rng):
  img = jg.Input("x", shape=(6, 6, 2))
  x = _ties(rng, (3, 6, 6, 2))
  for kind in ("avg", "l2"):
    pool = POOLS[kind]("pool", img, window=(2, 2))
    assert not pool.keeps_state and pool.accepts_state
    dy_node = jg.Input("dy", shape=(3, 3, 2))
    grad = jg.PoolingGradient("pool.grad", pool, dy_node, img, pool.gradient_state())
    values = jg.Graph(grad).evaluate({}, x=x, dy=jnp.ones((3, 3, 3, 2)))
    assert values["pool.state"] is None
    without = jg.Graph(pool.gradient_filter(dy_node)).apply({}, x=x, dy=jnp.ones((3, 3, 3, 2)))
    _same_trees(values["pool.grad"], without)
    assert "GradientState (nothing" in str(jg.Graph(grad))


# ----------------------------------------------------------------------------- Pallas


def _net(implementation, kind="max"):
  image = jg.Input("image", shape=(8, 8, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = jg.Conv("conv", image, features=3)
  x = POOLS[kind]("pool", x, window=(2, 2), implementation=implementation)
  return jg.SoftmaxCrossEntropy("loss", jg.Dense("fc", x, features=4), label)


@pytest.mark.parametrize("kind,primitive", [("max", "jaxpool_max_pool_gather_transpose"),
                                            ("avg", "jaxpool_avg_pool_transpose")])
def test_training_graph_runs_the_pallas_backward_kernel(kind, primitive, rng):
  loss = _net("pallas", kind)
  train = jg.training_graph(loss)
  params = _integer_params(jg.Graph(loss), rng)  # (no initializer to compile)
  x = _ties(rng, (2, 8, 8, 2))
  y = jnp.array([0, 3], jnp.int32)
  jaxpr = str(jax.make_jaxpr(lambda p: train.run(p, image=x, label=y))(params))
  assert primitive in jaxpr
  # the same bits as jax.grad of the graph; the XLA path's: the same bits for the max pool (one
  # winner per window), to rounding for the average (the kernels sum in another order)
  xla = jg.training_graph(_net("xla", kind)).run(params, image=x, label=y)
  got = train.run(params, image=x, label=y)
  if kind == "max":
    _same_trees(got, xla)
  else:
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), got, xla)
  want = jax.value_and_grad(lambda p: jg.Graph(loss).apply(p, image=x, label=y))(params)
  _same_trees(got, want)


# ----------------------------------------------------------------------------- rewrite pass


def _relu_pool_net(pool_cls=jg.MaxPool, second_reader=False, **pool_kw):
  image = jg.Input("image", shape=(9, 8, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  conv = jg.Conv("conv", image, features=3, use_bias=False)
  relu = jg.ReLU("relu", conv)
  pool = pool_cls("pool", relu, window=(3, 2), strides=(2, 2), padding="SAME", **pool_kw)
  x = jg.Dense("fc", pool, features=4)
  if second_reader:
    x = jg.Add("sum", x, jg.Dense("fc2", relu, features=4))
  return jg.SoftmaxCrossEntropy("loss", x, label)


def _integer_params(graph, rng):
  """Small-integer weights: the conv's outputs (the ReLU's inputs) tie, and are 0 or negative."""
  return jax.tree.map(lambda s: jnp.asarray(rng.integers(-1, 2, s.shape).astype(np.float32)),
                      graph.param_specs())


@pytest.mark.parametrize("pool_cls", [
    jg.MaxPool,
    # (`make test` folds into MaxPool: DilatedMaxPool is a MaxPool, which the pass treats alike)
    pytest.param(jg.DilatedMaxPool, marks=pytest.mark.slow)], ids=["MaxPool", "DilatedMaxPool"])
def test_relu_folded_into_max_pool_bit_for_bit(pool_cls, rng):
  loss = _relu_pool_net(pool_cls)
  g, g0 = jg.Graph(loss), jg.Graph(loss, passes=())
  assert [n.name for n in g0.nodes if n.name == "relu"] == ["relu"]
  assert "relu" not in [n.name for n in g.nodes] and g.removed == ("relu",)
  pool = g.node("pool")
  assert pool.activation == "relu" and pool.inputs == ("conv",)
  params = _integer_params(g, rng)
  x = _ties(rng, (6, 9, 8, 2))
  y = jnp.asarray(rng.integers(0, 4, 6).astype(np.int32))
  conv_out = jg.Graph(g.node("conv")).apply(params, image=x)
  assert bool(jnp.any(conv_out == 0)) and bool(jnp.any(conv_out < 0))  # the data is tie-rich
  # values and gradients, with and without the pass, through jax.grad and the training graph
  vg = lambda graph: jax.value_and_grad(lambda p: graph.apply(p, image=x, label=y))(params)
  _same_trees(vg(g), vg(g0))
  train, train0 = jg.training_graph(loss), jg.training_graph(loss, passes=())
  got = train.run(params, image=x, label=y)
  _same_trees(got, train0.run(params, image=x, label=y))
  _same_trees(got, vg(g0))
  _same_trees(jax.jit(train.run)(params, image=x, label=y), jax.jit(train0.run)(params, image=x,
                                                                                label=y))
  # the training graph runs the rewritten forward: no ReLU node, no ReLU gradient
  names = [n.name for n in train.nodes]
  assert "relu" not in names and "relu.grad" not in names
  assert train.node("pool.grad").forward_node.activation == "relu"
  # the summary shows the move
  note = ("relu -> pool: ReLU folded into the max pool (activation='relu'); pool reads conv")
  for graph in (g, train):
    text = str(graph)
    assert "rewrites:\n  " + note in text and "+relu" in text
  assert "rewrites:" not in str(g0)
  with pytest.raises(KeyError, match="'relu' was removed by a rewrite .*passes=\\(\\)"):
    g.node("relu")
  assert "relu" not in g.evaluate(params, image=x, label=y)


def test_relu_with_a_second_reader_is_not_moved(rng):
  loss = _relu_pool_net(second_reader=True)
  g = jg.Graph(loss)
  assert g.rewrites == () and g.node("pool").activation is None
  assert g.node("relu").fn == "relu"


def test_relu_that_is_an_output_or_not_a_relu_is_not_moved():
  img = jg.Input("x", shape=(4, 4, 1))
  relu = jg.ReLU("r", img)
  pool = jg.MaxPool("p", relu)
  assert jg.Graph([pool, relu]).rewrites == ()
  assert jg.Graph(jg.MaxPool("p", jg.Activation("t", img, fn="tanh"))).rewrites == ()
  assert jg.Graph(jg.AvgPool("p", relu)).rewrites == ()
  # a hand-built gradient of the pool reads the ReLU: not moved
  dy = jg.Input("dy", shape=(2, 2, 1))
  assert jg.Graph(pool.gradient_filter(dy)).rewrites == ()


def test_two_folds_in_a_chain_and_custom_passes(rng):
  img = jg.Input("x", shape=(8, 8, 1))
  p1 = jg.MaxPool("p1", jg.ReLU("r1", img), window=(2, 2))
  p2 = jg.MaxPool("p2", jg.ReLU("r2", p1), window=(2, 2))
  g = jg.Graph(p2)
  assert [n.name for n in g.nodes] == ["x", "p1", "p2"] and g.removed == ("r1", "r2")
  x = _ties(rng, (3, 8, 8, 1))
  assert_same_bits(g.apply({}, x=x), jg.Graph(p2, passes=()).apply({}, x=x))
  seen = []

  def spy(nodes, outputs):
    seen.append((tuple(n.name for n in nodes), outputs))
    return nodes, ["spy: looked"]

  g2 = jg.Graph(p2, passes=(spy,))
  assert seen == [(("x", "r1", "p1", "r2", "p2"), ("p2",))]
  assert g2.rewrites == ("spy: looked",) and "rewrites:\n  spy: looked" in str(g2)
  with pytest.raises(TypeError, match="passes must be functions"):
    jg.Graph(p2, passes=("fold",))


# ----------------------------------------------------------------------------- configurations


def _pool_values(node, x, dy):
  """The node's output and its gradient node's input cotangent."""
  img = next(r for r in node.refs)
  out = jg.Graph(node).specs[node.name].shape
  dy_node = jg.Input("dy", shape=out)
  graph = jg.Graph([node, node.gradient_filter(dy_node)])
  values = graph.evaluate({}, **{img.name: x, "dy": dy})
  return values[node.name], values[f"{node.name}.grad"].inputs[0]


CONFIGS = [
    dict(window=(3, 2), strides=(2, 2), padding="SAME_LOWER"),
    dict(window=(3, 3), strides=(2, 2), padding="VALID", ceil_mode=True),
    dict(window=(2, 3), strides=(2, 1), padding=((1, 0), (0, 1)), ceil_mode=True,
         offset=(1, -1)),
    dict(window=(3, 2), strides=(1, 2), padding="FULL"),
]


@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
@pytest.mark.parametrize("kind", list(POOLS))
def test_channels_first_equals_channels_last(kind, cfg, rng):
  kw = CONFIGS[cfg]
  x = _ties(rng, (2, 9, 7, 3))
  last = POOLS[kind]("pool", jg.Input("x", shape=(9, 7, 3)), **kw)
  first = POOLS[kind]("pool", jg.Input("x", shape=(3, 9, 7)), **kw, data_format="channels_first")
  out = jg.Graph(last).specs["pool"].shape
  assert jg.Graph(first).specs["pool"].shape == (out[2], out[0], out[1])
  dy = _ties(rng, (2, *out))
  y, dx = _pool_values(last, x, dy)
  to_first = lambda a: jnp.moveaxis(a, -1, 1)
  yf, dxf = _pool_values(first, to_first(x), to_first(dy))
  assert_same_bits(yf, to_first(y))
  assert_same_bits(dxf, to_first(dx))


@pytest.mark.parametrize("padding,ceil_mode", [("SAME_LOWER", False), ("VALID", True),
                                               ("SAME_LOWER", True)])
@pytest.mark.parametrize("kind", list(POOLS))
def test_ceil_mode_and_same_lower_against_the_core(kind, padding, ceil_mode, rng):
  x = _ties(rng, (2, 8, 7, 2))
  node = POOLS[kind]("pool", jg.Input("x", shape=(8, 7, 2)), window=(3, 2), strides=(2, 2),
                     padding=padding, ceil_mode=ceil_mode)
  kw = dict(window_shape=(3, 2), strides=(2, 2), padding=padding, ceil_mode=ceil_mode,
            dilation=node.dilation_)
  core = {"max": jaxpool.max_pool, "dilated": jaxpool.max_pool,
          "avg": functools.partial(jaxpool.avg_pool, count_include_pad=False),
          "l2": jaxpool.l2_pool}[kind]
  assert_same_bits(jg.Graph(node).apply({}, x=x), core(x, **kw))
  assert jg.resolve_padding("SAME_LOWER", (8,), (3,), (2,), (1,)) == ((1, 0),)


# The ReLU: only the max pools have a fused activation. `make test` runs it with MaxPool;
# DilatedMaxPool's (a MaxPool with a default dilation: the same gradient node) is marked slow.
@pytest.mark.parametrize("kind,cfg,activation", [
    pytest.param(kind, cfg, act, id=f"{kind}-{cfg}-{act}",
                 marks=pytest.mark.slow if (kind, act) == ("dilated", "relu") else ())
    for act in (None, "relu") for cfg in range(len(CONFIGS)) for kind in POOLS
    if act is None or kind in ("max", "dilated")])
def test_pooling_gradient_node_is_the_vjp_of_its_forward(kind, cfg, activation, rng):
  kw = dict(CONFIGS[cfg])
  if activation:
    kw["activation"] = activation
  x = _ties(rng, (2, 9, 7, 3))
  node = POOLS[kind]("pool", jg.Input("x", shape=(9, 7, 3)), **kw)
  dy = _ties(rng, (2, *jg.Graph(node).specs["pool"].shape))
  y, dx = _pool_values(node, x, dy)
  fwd = lambda v: node.forward(None, (v,), (jax.ShapeDtypeStruct(x.shape[1:], x.dtype),))
  y_want, vjp = jax.vjp(fwd, x)
  assert_same_bits(y, y_want)
  assert_same_bits(dx, vjp(dy)[0])
  # and under jit and vmap
  img = jg.Input("x", shape=(9, 7, 3))
  grad_graph = jg.Graph(POOLS[kind]("pool", img, **kw).gradient_filter(
      jg.Input("dy", shape=dy.shape[1:])))
  run = lambda a, b: grad_graph.apply({}, x=a, dy=b).inputs[0]
  assert_same_bits(jax.jit(run)(x, dy), dx)
  np.testing.assert_array_equal(jax.vmap(run)(x, dy), dx)


def test_node_config_errors():
  x = jg.Input("x", shape=(4, 4, 1))
  with pytest.raises(ValueError, match=r"node 'p' \(MaxPool\): data_format must be one of"):
    jg.MaxPool("p", x, data_format="NHWC")
  with pytest.raises(ValueError, match=r"node 'p' \(AvgPool\): implementation must be one of"):
    jg.AvgPool("p", x, implementation="triton")
  with pytest.raises(ValueError, match=r"node 'p' \(MaxPool\): activation must be one of"):
    jg.MaxPool("p", x, activation="tanh")
  with pytest.raises(TypeError, match=r"node 'p' \(L2Pool\): ceil_mode must be a bool"):
    jg.L2Pool("p", x, ceil_mode=1)
  with pytest.raises(ValueError, match=r"node 'p' \(MaxPool\): .*implementation='pallas' cannot "
                                       "serve"):
    jg.Graph(jg.MaxPool("p", jg.Input("i", shape=(4, 4, 1), dtype=jnp.int32),
                        implementation="pallas"))
