"""Training mode in jaxpool.graph: BatchNorm, Dropout, the model state, the optimizer step,
saving and loading, pickling."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from core_strategies import assert_trees_close

from jaxpool import graph as jg

# ----------------------------------------------------------------------------- helpers


def np_batch_norm(x, axis, scale, bias, eps, mean=None, var=None):
  """NumPy reference in float64: batch statistics (biased variance) unless given."""
  x = np.asarray(x, np.float64)
  axes = tuple(i for i in range(x.ndim) if i != axis % x.ndim)
  shape = [1] * x.ndim
  shape[axis] = -1
  if mean is None:
    mean, var = x.mean(axes), x.var(axes)  # np.var: biased (ddof=0)
  y = (x - np.reshape(mean, shape)) / np.sqrt(np.reshape(var, shape) + eps)
  return y * np.reshape(scale, shape) + np.reshape(bias, shape), mean, var


def small_net(rate=0.25):
  """Conv -> BatchNorm -> ReLU -> MaxPool -> Dropout -> Dense -> SoftmaxCrossEntropy."""
  image = jg.Input("image", shape=(6, 6, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = jg.Conv("conv", image, features=4, window=(3, 3), use_bias=False)  # BN has the bias
  x = jg.ReLU("relu", jg.BatchNorm("bn", x, momentum=0.8))
  x = jg.Dropout("drop", jg.MaxPool("pool", x, window=(2, 2)), rate=rate)
  logits = jg.Dense("fc", x, features=3)
  return logits, jg.SoftmaxCrossEntropy("loss", logits, label)


@pytest.fixture(scope="module")
def net():
  logits, loss = small_net()
  g, tg = jg.Graph(loss), jg.training_graph(loss)
  params, state = g.init(jax.random.key(0)), g.init_state()
  # non-trivial BN parameters and running statistics
  params["bn"] = {"scale": jnp.asarray([0.5, 1.5, -1.0, 2.0]),
                  "bias": jnp.asarray([0.1, 0, -.2, .3])}
  state["bn"] = {"mean": jnp.full((4,), 0.2, jnp.float32),   # not weak-typed: no retrace
                 "var": jnp.full((4,), 1.5, jnp.float32)}
  return jg.Graph(logits), g, tg, params, state


def batch(rng, n=8):
  x = jnp.asarray(rng.standard_normal((n, 6, 6, 2)), jnp.float32)
  return x, jnp.asarray(rng.integers(0, 3, n), jnp.int32)


# ----------------------------------------------------------------------------- BatchNorm


@pytest.mark.parametrize("shape,fmt,axis", [
    ((5, 4, 3, 3), "channels_last", -1),
    ((5, 3, 4, 3), "channels_first", 1),
    ((2, 5, 6), "channels_last", -1),          # a (C,) per-example input, two batch dims
])
def test_batch_norm_forward_against_numpy(rng, shape, fmt, axis):
  per_example = shape[2:] if len(shape) == 3 else shape[1:]
  x = jg.Input("x", shape=per_example)
  bn = jg.BatchNorm("bn", x, momentum=0.7, epsilon=1e-3, data_format=fmt)
  g = jg.Graph(bn)
  c = shape[axis]
  params = {"bn": {"scale": jnp.asarray(rng.standard_normal(c), jnp.float32),
                   "bias": jnp.asarray(rng.standard_normal(c), jnp.float32)}}
  state = g.init_state()
  np.testing.assert_array_equal(state["bn"]["mean"], np.zeros(c))
  np.testing.assert_array_equal(state["bn"]["var"], np.ones(c))
  xv = jnp.asarray(3 * rng.standard_normal(shape) + 1, jnp.float32)
  # training: batch statistics over every dim but the channel one, running-statistics update
  y, new = jax.jit(lambda p, s, v: g.apply(p, state=s, training=True, x=v))(params, state, xv)
  want, mean, var = np_batch_norm(xv, axis, params["bn"]["scale"], params["bn"]["bias"], 1e-3)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new["bn"]["mean"], 0.3 * mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new["bn"]["var"], 0.7 + 0.3 * var, rtol=1e-5)
  assert new["bn"]["mean"].dtype == jnp.float32
  # inference: the running statistics, the state unchanged
  y2, same = g.apply(params, state=new, x=xv)
  want2, _, _ = np_batch_norm(xv, axis, params["bn"]["scale"], params["bn"]["bias"], 1e-3,
                              np.asarray(new["bn"]["mean"]), np.asarray(new["bn"]["var"]))
  np.testing.assert_allclose(y2, want2, rtol=1e-5, atol=1e-5)
  assert same.keys() == new.keys() and same["bn"] is new["bn"]


def test_batch_norm_without_scale_and_bias_and_bfloat16(rng):
  x = jg.Input("x", shape=(4, 3), dtype=jnp.bfloat16)
  g = jg.Graph(jg.BatchNorm("bn", x, use_scale=False, use_bias=False))
  assert g.init(jax.random.key(0)) == {"bn": {}}
  xv = jnp.asarray(rng.standard_normal((6, 4, 3)), jnp.bfloat16)
  y, _ = g.apply({"bn": {}}, state=g.init_state(), training=True, x=xv)
  assert y.dtype == jnp.bfloat16
  want, _, _ = np_batch_norm(np.asarray(xv, np.float32), -1, 1.0, 0.0, 1e-5)
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("use_scale,use_bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("fmt", ["channels_last", "channels_first"])
def test_batch_norm_gradient_node_against_vjp(rng, use_scale, use_bias, fmt):
  x = jg.Input("x", shape=(4, 5, 3))
  bn = jg.BatchNorm("bn", x, use_scale=use_scale, use_bias=use_bias, data_format=fmt)
  dy = jg.Input("dy", shape=(4, 5, 3))
  grad = bn.gradient_filter(dy)
  assert isinstance(grad, jg.BatchNormalizationGradient)
  g = jg.Graph([grad, grad.refs[-1]])
  assert isinstance(g.node("bn.state"), jg.BatchNormalizationState)
  params = g.init(jax.random.key(1))
  params = jax.tree.map(lambda p: p + jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
  xv = jnp.asarray(rng.standard_normal((2, 3, 4, 5, 3)), jnp.float32)  # two batch dims
  dyv = jnp.asarray(rng.standard_normal(xv.shape), jnp.float32)
  (ct, kept), _ = g.apply(params, state=g.init_state(), training=True, x=xv, dy=dyv)
  spec = g.specs["x"]
  _, vjp = jax.vjp(lambda p, v: bn.forward(p, (v,), (spec,)), params["bn"], xv)
  dparams, dx = vjp(dyv)
  assert_trees_close(ct.inputs[0], dx)
  assert_trees_close(ct.params, dparams)
  # the state: the batch mean and inverse std, (C,) each
  c = 4 if fmt == "channels_first" else 3
  axis = 2 if fmt == "channels_first" else -1
  _, mean, var = np_batch_norm(xv, axis, 1.0, 0.0, 1e-5)
  assert kept["mean"].shape == kept["inv_std"].shape == (c,)
  np.testing.assert_allclose(kept["mean"], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(kept["inv_std"], 1 / np.sqrt(var + 1e-5), rtol=1e-5)
  # the gradient state exists in training mode only
  with pytest.raises(ValueError, match="training mode only"):
    g.apply(params, state=g.init_state(), x=xv, dy=dyv)


def test_batch_norm_errors():
  x = jg.Input("x", shape=(4, 4, 2))
  with pytest.raises(TypeError, match=r"node 'bn' \(BatchNorm\): momentum must be a number"):
    jg.BatchNorm("bn", x, momentum=True)
  with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\]; got 1.5"):
    jg.BatchNorm("bn", x, momentum=1.5)
  with pytest.raises(ValueError, match=r"epsilon must be a number in \(0, inf\)"):
    jg.BatchNorm("bn", x, epsilon=0)
  with pytest.raises(ValueError, match="data_format must be one of"):
    jg.BatchNorm("bn", x, data_format="NHWC")
  g = jg.Graph(jg.BatchNorm("bn", x))
  params = g.init(jax.random.key(0))
  with pytest.raises(ValueError, match=r"node 'bn' \(BatchNorm\) keeps a model state.*state="):
    g.apply(params, x=jnp.ones((2, 4, 4, 2)))
  with pytest.raises(ValueError, match=r"node 'bn' \(BatchNorm\): state has no entry 'bn'"):
    g.apply(params, state={}, x=jnp.ones((2, 4, 4, 2)))
  with pytest.raises(ValueError, match=r"parameter 'var' must have shape \(2,\); got \(3,\)"):
    g.apply(params, state={"bn": {"mean": jnp.zeros(2), "var": jnp.ones(3)}},
            x=jnp.ones((2, 4, 4, 2)))
  with pytest.raises(TypeError, match="training must be a bool"):
    g.apply(params, state=g.init_state(), training="yes", x=jnp.ones((2, 4, 4, 2)))


# ----------------------------------------------------------------------------- Dropout


def test_dropout_rate_scaling_and_inference():
  x = jg.Input("x", shape=(200, 500))
  g = jg.Graph(jg.Dropout("drop", x, rate=0.3))
  xv = jnp.asarray(np.random.default_rng(0).uniform(1, 2, (200, 500)), jnp.float32)
  y = jax.jit(lambda v, k: g.apply({}, key=k, training=True, x=v))(xv, jax.random.key(0))
  dropped = np.asarray(y == 0)
  # 100,000 Bernoulli(0.3) draws: the standard deviation of the fraction is 0.0014
  assert abs(dropped.mean() - 0.3) < 0.007
  kept = ~dropped
  np.testing.assert_array_equal(np.asarray(y)[kept], np.asarray(xv / jnp.float32(0.7))[kept])
  # another key, another mask; inference is the identity and needs no key
  y2 = g.apply({}, key=jax.random.key(1), training=True, x=xv)
  assert (np.asarray(y2 == 0) != dropped).mean() > 0.3
  assert g.apply({}, x=xv) is not None
  np.testing.assert_array_equal(g.apply({}, x=xv), xv)
  # rate 0: the identity in training too, no key needed
  g0 = jg.Graph(jg.Dropout("drop", x, rate=0.0))
  np.testing.assert_array_equal(g0.apply({}, training=True, x=xv), xv)


def test_dropout_nodes_draw_their_own_masks():
  x = jg.Input("x", shape=(64,))
  a, b = jg.Dropout("a", x), jg.Dropout("b", x)
  ya, yb = jg.Graph([a, b]).apply({}, key=jax.random.key(0), training=True, x=jnp.ones(64))
  assert not np.array_equal(ya, yb)
  # the mask depends on the node's name, not on its place in the graph
  ya2 = jg.Graph(jg.Dropout("a", jg.Activation("id", x, fn="identity"))).apply(
      {}, key=jax.random.key(0), training=True, x=jnp.ones(64))
  np.testing.assert_array_equal(ya, ya2)


def test_dropout_gradient_node_against_vjp(rng):
  x = jg.Input("x", shape=(5, 4))
  drop = jg.Dropout("drop", x, rate=0.4)
  dy = jg.Input("dy", shape=(5, 4))
  grad = drop.gradient_filter(dy)
  assert isinstance(grad, jg.DropoutGradient)
  g = jg.Graph([grad, grad.gradient_state, drop])
  assert isinstance(g.node("drop.state"), jg.DropoutGradientState)
  xv = jnp.asarray(rng.standard_normal((3, 5, 4)), jnp.float32)
  dyv = jnp.asarray(rng.standard_normal((3, 5, 4)), jnp.float32)
  key = jax.random.key(7)
  ct, mask, y = g.apply({}, key=key, training=True, x=xv, dy=dyv)
  assert mask.dtype == jnp.bool_ and mask.shape == xv.shape   # 1 byte per element
  np.testing.assert_array_equal(mask, drop.mask(key, xv.shape))
  np.testing.assert_array_equal(y == 0, ~mask)
  train_fwd = lambda v: drop.forward_mode(None, (v,), (g.specs["x"],), state=None, key=key,
                                          training=True)[0]
  _, vjp = jax.vjp(train_fwd, xv)
  np.testing.assert_array_equal(ct.inputs[0], vjp(dyv)[0])
  with pytest.raises(ValueError, match="training mode only"):
    g.apply({}, x=xv, dy=dyv)


def test_dropout_errors():
  x = jg.Input("x", shape=(4,))
  with pytest.raises(ValueError, match=r"node 'd' \(Dropout\): rate must be a number in \[0, 1\)"):
    jg.Dropout("d", x, rate=1.0)
  with pytest.raises(TypeError, match="rate must be a number"):
    jg.Dropout("d", x, rate="0.5")
  with pytest.raises(ValueError, match=r"node 'd' \(Dropout\): needs a PRNG key in training"):
    jg.Graph(jg.Dropout("d", x)).apply({}, training=True, x=jnp.ones(4))
  with pytest.raises(ValueError, match=r"input node\(s\) \['key'\].*rename the Input"):
    jg.Graph(jg.Dropout("d", jg.Input("key", shape=(4,)))).apply({})


# ----------------------------------------------------------------------------- training graph


def test_training_graph_equals_value_and_grad_of_training_apply(net, rng):
  model, g, tg, params, state = net
  xv, yv = batch(rng)
  key = jax.random.key(3)
  run = jax.jit(lambda p, s, k, x, y: tg.run(p, state=s, key=k, image=x, label=y))
  ref = jax.jit(jax.value_and_grad(
      lambda p, s, k, x, y: g.apply(p, state=s, key=k, training=True, image=x, label=y),
      has_aux=True))
  loss, grads, new_state = run(params, state, key, xv, yv)
  (loss_ref, state_ref), grads_ref = ref(params, state, key, xv, yv)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  assert_trees_close(grads, grads_ref)
  assert_trees_close(new_state, state_ref, rtol=1e-6)
  assert set(grads) == {"conv", "bn", "fc"}
  assert not np.allclose(new_state["bn"]["mean"], state["bn"]["mean"])
  # the training graph's masks are apply's: the same key, the same dropped elements
  values, _ = tg.evaluate(params, state=state, key=key, training=True, image=xv, label=yv)
  vals_apply, _ = g.evaluate(params, state=state, key=key, training=True, image=xv, label=yv)
  mask = values["drop.state"]
  np.testing.assert_array_equal(mask, tg.node("drop").mask(key, mask.shape))
  np.testing.assert_array_equal(vals_apply["drop"],
                                jnp.where(mask, vals_apply["pool"] / jnp.float32(0.75), 0))
  # a repeated call does not retrace
  n = run._cache_size()
  run(params, new_state, jax.random.key(4), xv, yv)
  assert run._cache_size() == n
  # eager, the same
  loss_e, grads_e, _ = tg.run(params, state=state, key=key, image=xv, label=yv)
  np.testing.assert_allclose(loss_e, loss_ref, rtol=1e-6)
  assert_trees_close(grads_e, grads_ref)


def test_training_graph_under_vmap(net, rng):
  _, g, tg, params, state = net
  xv, yv = batch(rng, 4)
  xv = xv.reshape(2, 2, 6, 6, 2)    # vmap over 2, a batch of 2 inside
  yv = yv.reshape(2, 2)
  keys = jax.random.split(jax.random.key(5), 2)
  run = jax.jit(jax.vmap(lambda k, x, y: tg.run(params, state=state, key=k, image=x, label=y)))
  ref = jax.jit(jax.vmap(jax.value_and_grad(
      lambda p, k, x, y: g.apply(p, state=state, key=k, training=True, image=x, label=y),
      has_aux=True), in_axes=(None, 0, 0, 0)))
  loss, grads, new_state = run(keys, xv, yv)
  (loss_ref, state_ref), grads_ref = ref(params, keys, xv, yv)
  assert loss.shape == (2,) and grads["conv"]["w"].shape == (2, 3, 3, 2, 4)
  assert_trees_close(loss, loss_ref)
  assert_trees_close(grads, grads_ref)
  assert_trees_close(new_state, state_ref)


def test_old_graphs_keep_their_call_forms(rng):
  image = jg.Input("image", shape=(6, 6, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  loss = jg.SoftmaxCrossEntropy("loss", jg.Dense("fc", image, features=3), label)
  g, tg = jg.Graph(loss), jg.training_graph(loss)
  params = g.init(jax.random.key(0))
  assert g.init_state() == {}
  xv, yv = batch(rng)
  out = g.apply(params, image=xv, label=yv)
  assert out.shape == ()
  value, grads = tg.run(params, image=xv, label=yv)
  # passing the (empty) state gives the state back; training mode changes nothing here
  (value2, state), grads2 = jax.value_and_grad(
      lambda p: g.apply(p, state={}, training=True, image=xv, label=yv), has_aux=True)(params)
  assert state == {} and value2 == out
  assert_trees_close(grads, grads2)


# ----------------------------------------------------------------------------- optimizer step


def test_make_step_equals_optax_by_hand_and_learns(net, rng):
  model, g, tg, params, state = net
  opt = optax.adam(1e-2)
  step = jax.jit(tg.make_step(opt))
  xv, yv = batch(rng, 16)
  opt_state = opt.init(params)
  key = jax.random.key(0)
  p1, o1, s1, loss1 = step(params, opt_state, state=state, key=key, image=xv, label=yv)
  # by hand
  loss_h, grads, s_h = tg.run(params, state=state, key=key, image=xv, label=yv)
  updates, o_h = opt.update(grads, opt_state, params)
  p_h = optax.apply_updates(params, updates)
  np.testing.assert_allclose(loss1, loss_h, rtol=1e-6)
  assert_trees_close(p1, p_h)
  assert_trees_close(s1, s_h)
  assert_trees_close(o1, o_h)
  # it learns: 30 steps on this one batch (dropout on, new keys) lower the training loss
  p, o, s = p1, o1, s1
  for k in range(30):
    p, o, s, _ = step(p, o, state=s, key=jax.random.key(k + 1), image=xv, label=yv)
  before = g.apply(params, state=state, image=xv, label=yv)[0]
  after = g.apply(p, state=s, image=xv, label=yv)[0]
  assert float(after) < 0.5 * float(before)


def test_make_step_without_state_and_errors(rng):
  image = jg.Input("image", shape=(6, 6, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  tg = jg.training_graph(jg.SoftmaxCrossEntropy("loss", jg.Dense("fc", image, features=3),
                                                label))
  params = tg.init(jax.random.key(0))
  opt = optax.sgd(0.1)
  xv, yv = batch(rng)
  out = jax.jit(tg.make_step(opt))(params, opt.init(params), image=xv, label=yv)
  assert len(out) == 3 and out[2].shape == ()
  with pytest.raises(TypeError, match="make_step needs an optax optimizer"):
    tg.make_step(lambda g: g)


# ----------------------------------------------------------------------------- saving, pickling


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_and_load_round_trip(tmp_path, rng, dtype):
  params = {"conv1": {"w": jnp.asarray(rng.standard_normal((3, 3, 1, 4)), dtype),
                      "b": jnp.asarray(rng.standard_normal(4), dtype)},
            "odd/name": {"scale": jnp.asarray(rng.standard_normal(2), jnp.float32)},
            "empty": {}}
  path = jg.save_params(tmp_path / "params.npz", params)
  assert path == str(tmp_path / "params.npz")
  back = jg.load_params(path)
  assert list(back) == list(params) and back["empty"] == {}
  for node in params:
    for k, v in params[node].items():
      assert back[node][k].dtype == v.dtype and isinstance(back[node][k], jax.Array)
      np.testing.assert_array_equal(np.asarray(back[node][k]).view(np.uint8),
                                    np.asarray(v).view(np.uint8))
  # nothing pickled: NumPy reads it with allow_pickle=False
  with np.load(path, allow_pickle=False) as f:
    assert "conv1/w" in f.files and "odd/name/scale" in f.files


def test_save_and_load_a_trained_model(tmp_path, net, rng):
  model, g, tg, params, state = net
  jg.save_params(tmp_path / "p.npz", params)
  jg.save_params(tmp_path / "s.npz", state)
  p2, s2 = jg.load_params(tmp_path / "p.npz"), jg.load_params(tmp_path / "s.npz")
  xv, _ = batch(rng)
  np.testing.assert_array_equal(model.apply(p2, state=s2, image=xv)[0],
                                model.apply(params, state=state, image=xv)[0])


def test_save_and_load_errors(tmp_path):
  with pytest.raises(ValueError, match="without '/'"):
    jg.save_params(tmp_path / "p.npz", {"n": {"a/b": jnp.ones(2)}})
  with pytest.raises(TypeError, match="params must be a dict"):
    jg.save_params(tmp_path / "p.npz", [jnp.ones(2)])
  np.savez(tmp_path / "other.npz", a=np.ones(2))
  with pytest.raises(ValueError, match="is not a file that jaxpool.graph.save_params wrote"):
    jg.load_params(tmp_path / "other.npz")


def test_pickle_graphs_with_batch_norm_and_dropout(rng):
  image = jg.Input("image", shape=(4, 4, 2))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = jg.Dropout("drop", jg.BatchNorm("bn", image, momentum=0.5), rate=0.5)
  x = jg.Conv("conv", x, features=3, use_bias=False)          # the default initializers:
  logits = jg.Dense("fc", x, features=3)                       # jg.Initializer("he_normal")
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)
  g, tg = jg.Graph(loss), jg.training_graph(loss)
  g2, tg2 = pickle.loads(pickle.dumps(g)), pickle.loads(pickle.dumps(tg))
  assert g2 == g and tg2 == tg and tg2.summary() == tg.summary()
  assert g.node("fc").weights_init == jg.Initializer("he_normal")
  assert isinstance(tg2, jg.TrainingGraph) and tg2.gradients == tg.gradients
  params, state = g.init(jax.random.key(0)), g.init_state()
  # equal init (the same key, the same arrays) and equal outputs
  assert_trees_close(g2.init(jax.random.key(0)), params, rtol=0)
  assert_trees_close(tg2.init(jax.random.key(0)), tg.init(jax.random.key(0)), rtol=0)
  assert_trees_close(g2.init_state(), state, rtol=0)
  xv = jnp.asarray(rng.standard_normal((4, 4, 4, 2)), jnp.float32)
  yv = jnp.asarray([0, 1, 2, 0], jnp.int32)
  kw = dict(state=state, key=jax.random.key(1), image=xv, label=yv)
  assert_trees_close(tg2.run(params, **kw), tg.run(params, **kw), rtol=0)
  assert_trees_close(g2.apply(params, training=True, **kw), g.apply(params, training=True, **kw),
                     rtol=0)
  assert_trees_close(g2.apply(params, state=state, image=xv, label=yv),
                     g.apply(params, state=state, image=xv, label=yv), rtol=0)


def test_summary_shows_the_training_nodes(net):
  _, _, tg, _, _ = net
  text = tg.summary()
  for part in ("BatchNorm momentum 0.8", "Dropout rate 0.25", "bn.state", "drop.state",
               "GradientState (the keep mask, bool)", "BatchNormGradient", "DropoutGradient"):
    assert part in text, part


def test_save_params_into_a_missing_folder_names_the_path(tmp_path):
  """The error names the path the user gave and its missing folder, not the hidden temporary
  file the atomic write uses."""
  path = tmp_path / "ckpt" / "params.npz"
  with pytest.raises(FileNotFoundError, match=r"params\.npz.*folder.*ckpt.*does not exist"):
    jg.save_params(path, {"fc": {"b": jnp.zeros(3)}})
  assert not (tmp_path / "ckpt").exists()
