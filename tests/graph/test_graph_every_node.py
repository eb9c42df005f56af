"""One network that holds every forward node type: its training graph against
``jax.value_and_grad`` of the training-mode ``apply`` (under jit and vmap), channels_first against
channels_last; the ReLU fold in a Conv -> BatchNorm -> ReLU -> MaxPool training graph; pickling
with the default initializers; the example at the top of docs/graph.md."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from core_strategies import assert_trees_close

from jaxpool import graph as jg

# Equal "to float32 rounding": each leaf within 1e-5 of its largest entry (assert_trees_close).
# The batch-norm gradient is closed form (not jax.vjp) and batched convolutions may sum in
# another order, so the two sides are not bit for bit.


def assert_same_bits(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def to_first(x):
  """(*batch, H, W, C) -> (*batch, C, H, W)."""
  return jnp.moveaxis(x, -1, -3)


# ----------------------------------------------------------------------------- the network

FORWARD_KINDS = {jg.Input, jg.Conv, jg.ConvTranspose, jg.Dense, jg.MaxPool, jg.DilatedMaxPool,
                 jg.AvgPool, jg.L2Pool, jg.Activation, jg.Softmax, jg.Add, jg.Concat, jg.Flatten,
                 jg.Reshape, jg.Pad, jg.Upsample, jg.BatchNorm, jg.Dropout,
                 jg.SoftmaxCrossEntropy, jg.MeanSquaredError, jg.SigmoidCrossEntropy}


def every_node_network(fmt="channels_last"):
  """A loss graph holding every forward node type, in one data format.

  Per-example image (8, 8, 4) (channels_first: (4, 8, 8)). Fan-out at conv1 (the batch norm
  and the concat) and at tanh (the average pool and the add); a ReLU that the rewrite pass folds
  into pool1 and one that it leaves (relu2 reads an L2 pool); the three losses summed into one.
  The Dropout sits after the Flatten, where both formats have the same shape (and so the same
  mask for the same key).
  """
  cf = fmt == "channels_first"
  image = jg.Input("image", shape=(4, 8, 8) if cf else (8, 8, 4))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  target = jg.Input("target", shape=(3,))
  prob = jg.Input("prob", shape=(2,))
  kw = dict(data_format=fmt)
  c1 = jg.Conv("conv1", image, features=4, groups=2, use_bias=False, **kw)      # (8, 8, 4)
  bn = jg.BatchNorm("bn", c1, momentum=0.8, **kw)
  r1 = jg.ReLU("relu1", bn)                                                     # folded
  p1 = jg.MaxPool("pool1", r1, window=(2, 2), **kw)                             # (4, 4, 4)
  ct = jg.ConvTranspose("convt", p1, features=3, window=(3, 3), strides=(2, 2), **kw)
  t = jg.Activation("tanh", ct, fn="tanh")                                      # (8, 8, 3)
  a = jg.AvgPool("avg", t, window=(2, 2), strides=(1, 1), padding="SAME_LOWER", **kw)
  s = jg.Add("add", t, a)
  cat = jg.Concat("cat", [s, c1], **kw)                                         # (8, 8, 7)
  pad = jg.Pad("pad", cat, padding=((1, 0), (0, 1)), mode="reflect", **kw)      # (9, 9, 7)
  dm = jg.DilatedMaxPool("dmax", pad, window=(2, 2), dilation=(2, 2), **kw)     # (4, 4, 7)
  un = jg.Upsample("up_nearest", dm, scale=(2, 2), **kw)                        # (8, 8, 7)
  c2 = jg.Conv("conv2", un, features=4, strides=(2, 2), **kw)                   # (4, 4, 4)
  ub = jg.Upsample("up_bilinear", c2, method="bilinear", **kw)                  # (8, 8, 4)
  l2 = jg.L2Pool("l2", ub, window=(3, 3), strides=(2, 2), ceil_mode=True, **kw)  # (4, 4, 4)
  r2 = jg.ReLU("relu2", jg.Add("shift", l2, jg.L2Pool("l2b", ub, window=(2, 2), **kw)))
  sm = jg.Softmax("softmax", r2, axis=0 if cf else -1)
  fl = jg.Flatten("flat", sm, **kw)                                             # (64,)
  dr = jg.Dropout("drop", fl, rate=0.25)
  rs = jg.Reshape("reshape", dr, shape=(4, -1))                                 # (4, 16)
  h = jg.Dense("fc1", rs, features=8)
  ce = jg.SoftmaxCrossEntropy("ce", jg.Dense("logits", h, features=5), label)
  mse = jg.MeanSquaredError("mse", jg.Dense("regress", h, features=3), target)
  bce = jg.SigmoidCrossEntropy("bce", jg.Dense("binary", h, features=2), prob)
  return jg.Add("loss", jg.Add("ce+mse", ce, mse), bce)


def batch(rng, n=4):
  x = jnp.asarray(rng.standard_normal((n, 8, 8, 4)), jnp.float32)
  return dict(image=x, label=jnp.asarray(rng.integers(0, 5, n), jnp.int32),
              target=jnp.asarray(rng.standard_normal((n, 3)), jnp.float32),
              prob=jnp.asarray(rng.uniform(size=(n, 2)), jnp.float32))


@pytest.fixture(scope="module")
def net():
  loss = every_node_network()
  g, tg = jg.Graph(loss), jg.training_graph(loss)
  params, state = g.init(jax.random.key(0)), g.init_state()
  params["bn"] = {"scale": jnp.asarray([0.5, 1.5, -1.0, 2.0], jnp.float32),
                  "bias": jnp.asarray([0.1, 0.0, -0.2, 0.3], jnp.float32)}
  state["bn"] = {"mean": jnp.full((4,), 0.2, jnp.float32),
                 "var": jnp.full((4,), 1.5, jnp.float32)}
  return loss, g, tg, params, state


def reference(g):
  """``jax.value_and_grad`` of the training-mode apply: ``((loss, new_state), grads)``."""
  return jax.value_and_grad(
      lambda p, s, k, inputs: g.apply(p, state=s, key=k, training=True, **inputs), has_aux=True)


def test_the_network_holds_every_forward_node_type(net):
  loss, g, tg, params, _ = net
  unrewritten = jg.Graph(loss, passes=())
  kinds = {type(n) for n in unrewritten.nodes}
  assert kinds == FORWARD_KINDS
  assert {n.fn for n in unrewritten.nodes if type(n) is jg.Activation} == {"relu", "tanh"}
  assert {n.method for n in g.nodes if isinstance(n, jg.Upsample)} == {"nearest", "bilinear"}
  assert g.node("conv1").groups == 2
  # the rewrite: relu1 folded into pool1 (relu2 reads an Add, so it stays)
  assert g.removed == ("relu1",) and tg.removed == ("relu1",)
  assert g.node("pool1").activation == "relu" and g.node("relu2").fn == "relu"
  assert "relu1 -> pool1: ReLU folded into the max pool" in str(tg)
  assert {"conv1.state", "bn.state", "pool1.state", "dmax.state", "drop.state",
          "convt.state"} <= {n.name for n in tg.nodes}
  assert set(tg.gradients) == {n.name for n in g.nodes if not isinstance(n, jg.Input)}
  assert set(params) == {"conv1", "bn", "convt", "conv2", "fc1", "logits", "regress", "binary"}
  assert g.specs["pad"].shape == (9, 9, 7) and g.specs["reshape"].shape == (4, 16)


def test_training_graph_equals_value_and_grad_under_jit(net, rng):
  _, g, tg, params, state = net
  inputs, key = batch(rng), jax.random.key(1)
  run = jax.jit(lambda p, s, k, inputs: tg.run(p, state=s, key=k, **inputs))
  loss, grads, new_state = run(params, state, key, inputs)
  (loss_ref, state_ref), grads_ref = jax.jit(reference(g))(params, state, key, inputs)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  assert_trees_close(grads, grads_ref)
  assert_trees_close(new_state, state_ref, rtol=1e-6)
  assert all(float(jnp.max(jnp.abs(v))) > 0 for v in jax.tree.leaves(grads))  # all reached
  assert not np.allclose(new_state["bn"]["mean"], state["bn"]["mean"])


@pytest.mark.slow  # (make test-all and the GPU session run it)
def test_training_graph_per_example_under_vmap(net, rng):
  """vmap over examples: per-example losses and gradients. Inside the vmapped function an
  example has no batch dims, so BatchNorm normalises each example over its own spatial dims
  (docs/graph.md, BatchNorm's statistics) and the new state is one per example."""
  _, g, tg, params, state = net
  inputs = batch(rng)
  keys = jax.random.split(jax.random.key(2), 4)
  run = jax.jit(jax.vmap(lambda k, inputs: tg.run(params, state=state, key=k, **inputs)))
  loss, grads, new_state = run(keys, inputs)
  (loss_ref, state_ref), grads_ref = jax.jit(jax.vmap(
      reference(g), in_axes=(None, None, 0, 0)))(params, state, keys, inputs)
  assert loss.shape == (4,) and grads["conv1"]["w"].shape == (4, 3, 3, 2, 4)
  assert new_state["bn"]["mean"].shape == (4, 4)
  assert_trees_close(loss, loss_ref)
  assert_trees_close(grads, grads_ref)
  assert_trees_close(new_state, state_ref, rtol=1e-6)


@pytest.mark.slow  # (make test keeps test_graph_nodes.py's channels_first network)
def test_channels_first_equals_channels_last(net, rng):
  loss_l, g, tg, params, state = net
  loss_f = every_node_network("channels_first")
  gf, tgf = jg.Graph(loss_f), jg.training_graph(loss_f)
  assert gf.removed == ("relu1",)
  specs = lambda graph: jax.tree.map(lambda s: s.shape, graph.param_specs())
  assert specs(gf) == specs(g)           # the same parameters serve both
  inputs, key = batch(rng), jax.random.key(3)
  first = dict(inputs, image=to_first(inputs["image"]))
  run = lambda graph: jax.jit(lambda p, s, k, inputs: graph.run(p, state=s, key=k, **inputs))
  got = run(tgf)(params, state, key, first)
  want = run(tg)(params, state, key, inputs)
  assert_trees_close(got, want)
  # inference mode too
  assert_trees_close(gf.apply(params, state=state, **first), g.apply(params, state=state,
                                                                      **inputs))


# ----------------------------------------------------------------------------- rewrite + training


def conv_bn_relu_pool():
  image = jg.Input("image", shape=(8, 8, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = jg.Conv("conv", image, features=4, use_bias=False)
  x = jg.ReLU("relu", jg.BatchNorm("bn", x, momentum=0.8))
  x = jg.MaxPool("pool", x, window=(2, 2))
  return jg.SoftmaxCrossEntropy("loss", jg.Dense("fc", x, features=3), label)


def test_relu_fold_trains_the_same_with_batch_norm(rng):
  """Conv -> BatchNorm -> ReLU -> MaxPool, with and without the rewrite pass.

  Eager, the loss, the gradients and the new state agree bit for bit: the fold changes only the
  pool (relu(max_pool(x)) with the core's fused gradient, bit for bit the unfused one), what
  comes before it is computed by the same operations on the same values, and the batch norm's
  gradient gets the same source gradient. Under jit that source gradient is still the same bits,
  but XLA fuses the batch norm's ``sum(dy)`` (its bias gradient) with a different producer in
  the two programs (the pool's gradient, or the ReLU's) and may sum in another order: equal to
  float32 rounding there (measured: 1 ulp in one element of ``bn``'s bias gradient).
  """
  loss = conv_bn_relu_pool()
  train, train0 = jg.training_graph(loss), jg.training_graph(loss, passes=())
  assert train.removed == ("relu",) and train0.removed == ()
  names, names0 = {n.name for n in train.nodes}, {n.name for n in train0.nodes}
  assert names0 - names == {"relu", "relu.grad"}
  text = str(train)
  assert ("rewrites:\n  relu -> pool: ReLU folded into the max pool (activation='relu'); "
          "pool reads bn") in text
  assert "rewrites:" not in str(train0)
  params, state = train.init(jax.random.key(0)), train.init_state()
  x = jnp.asarray(rng.standard_normal((6, 8, 8, 2)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 3, 6), jnp.int32)
  got = train.run(params, state=state, image=x, label=y)
  assert_same_bits(got, train0.run(params, state=state, image=x, label=y))
  # under jit: the batch norm's source gradient bit for bit, the rest to rounding
  jitted = [jax.jit(lambda p, s, x, y, t=t: t.evaluate(p, state=s, training=True, image=x,
                                                       label=y))(params, state, x, y)
            for t in (train, train0)]
  (values, new_state), (values0, new_state0) = jitted
  assert_same_bits(values["pool.grad"].inputs[0], values0["relu.grad"].inputs[0])
  assert_same_bits((values["loss"], values["bn"], new_state),
                   (values0["loss"], values0["bn"], new_state0))
  grads = lambda v: {k: v[f"{k}.grad"].params for k in ("conv", "bn", "fc")}
  assert_trees_close(grads(values), grads(values0), rtol=1e-6)
  assert_trees_close(grads(values), got[1], rtol=1e-6)


# ----------------------------------------------------------------------------- pickling


@pytest.mark.slow  # (make test-all and the GPU session run it)
def test_pickle_with_the_default_initializers(net, rng):
  loss, g, tg, params, state = net
  assert g.node("conv1").weights_init == jg.Initializer("he_normal")   # the defaults
  g2, tg2 = pickle.loads(pickle.dumps(g)), pickle.loads(pickle.dumps(tg))
  assert g2 == g and tg2 == tg and str(tg2) == str(tg)
  assert tg2.gradients == tg.gradients and tg2.rewrites == tg.rewrites
  assert_same_bits(g2.init(jax.random.key(5)), g.init(jax.random.key(5)))
  inputs, key = batch(rng), jax.random.key(6)
  assert_same_bits(g2.apply(params, state=state, **inputs), g.apply(params, state=state,
                                                                      **inputs))
  assert_same_bits(g2.apply(params, state=state, key=key, training=True, **inputs),
                   g.apply(params, state=state, key=key, training=True, **inputs))
  # (the pickled training graph runs as the original: tests/graph/test_graph_train.py)


# ----------------------------------------------------------------------------- docs


def test_the_example_at_the_top_of_the_docs(rng):
  """docs/graph.md's first example, run as written (plus the optimizer it names)."""
  image = jg.Input("image", shape=(8, 8, 1))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = jg.ReLU("relu1", jg.Conv("conv1", image, features=32))
  x = jg.MaxPool("pool1", x, window=(2, 2))
  logits = jg.Dense("logits", x, features=10)
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)

  model = jg.Graph(logits)
  params = model.init(jax.random.key(0))
  assert jax.tree.map(lambda a: a.shape, params) == {
      "conv1": {"w": (3, 3, 1, 32), "b": (32,)}, "logits": {"w": (512, 10), "b": (10,)}}
  train = jg.training_graph(loss)
  assert "rewrites:\n  relu1 -> pool1" in str(train)
  opt = optax.adam(1e-3)

  @jax.jit
  def step(params, opt_state, x, y):
    value, grads = train.run(params, image=x, label=y)
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value

  xv = jnp.asarray(rng.standard_normal((16, 8, 8, 1)), jnp.float32)
  yv = jnp.asarray(rng.integers(0, 10, 16), jnp.int32)
  value, grads = train.run(params, image=xv, label=yv)
  want = jax.value_and_grad(lambda p: jg.Graph(loss).apply(p, image=xv, label=yv))(params)
  np.testing.assert_allclose(value, want[0], rtol=1e-6)
  assert_trees_close(grads, want[1])
  p, o = params, opt.init(params)
  losses = []
  for _ in range(5):
    p, o, v = step(p, o, xv, yv)
    losses.append(float(v))
  assert losses[-1] < losses[0]
  assert model.apply(p, image=xv).shape == (16, 10)
