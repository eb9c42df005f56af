"""jaxpool.graph in isolation: build a graph, print it, export it, hand-build a gradient node.

    .venv/bin/python examples/graph_basics.py

Writes examples/out/graph_basics*.dot (and .svg when Graphviz's `dot` is installed).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool import graph as jg  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def main() -> None:
  os.makedirs(OUT, exist_ok=True)

  # 1. Nodes: frozen, hashable descriptions (op + static config + names of their inputs).
  image = jg.Input("image", shape=(16, 16, 3))                 # an image node (named input)
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  conv = jg.Conv("conv", image, features=8, window=(3, 3), padding="SAME",
                 accumulator_precision="float")                # weights from its initializers
  relu = jg.ReLU("relu", conv)
  pool = jg.MaxPool("pool", relu, window=(2, 2), padding="VALID")        # MPS: stride = window
  l2 = jg.L2Pool("l2", pool, window=(3, 3), strides=(2, 2), padding="FULL")
  dil = jg.DilatedMaxPool("dilated", relu, window=(2, 2), dilation=(4, 4), strides=(2, 2),
                          offset=(1, 1))                       # a kernel offset, as MPS's
  both = jg.Add("both", jg.AvgPool("avg", dil, window=(3, 3)),
                jg.AvgPool("avg2", l2, window=(2, 2)))         # relu feeds two branches
  logits = jg.Dense("logits", both, features=10)               # flattens what it gets
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)
  print(repr(pool))

  # 2. A graph: a topologically ordered tuple of nodes, built from its outputs.
  g = jg.Graph(loss)
  print(g.summary())
  params = g.init(jax.random.key(0))                           # {node name: {"w", "b"}}
  x = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  y = jnp.array([1, 2, 3, 4], jnp.int32)
  print(f"\nloss on a batch of 4: {float(jax.jit(g.apply)(params, image=x, label=y)):.4f}")

  # 3. The training graph: gradient-state and gradient nodes, built node by node.
  tg = jg.training_graph(loss)
  print()
  print(tg.summary())
  value, grads = jax.jit(tg.run)(params, image=x, label=y)
  ref_value, ref_grads = jax.value_and_grad(lambda p: g.apply(p, image=x, label=y))(params)
  diff = max(float(jnp.max(jnp.abs(a - b)))
             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True))
  print(f"\ntraining graph: loss {float(value):.6f}; jax.value_and_grad: {float(ref_value):.6f}; "
        f"max |grad difference| {diff:.3g}")
  per_example = jax.vmap(lambda xi, yi: tg.run(params, image=xi, label=yi))(x, y)[1]
  print(f"per-example gradients (vmap): conv w {per_example['conv']['w'].shape}")

  # 4. Pictures: DOT text always, SVG when Graphviz is installed.
  for name, graph in (("graph_basics", g), ("graph_basics_training", tg)):
    print("wrote", graph.save(os.path.join(OUT, f"{name}.dot")))
    if jg.has_graphviz():
      print("wrote", graph.save(os.path.join(OUT, f"{name}.svg")))
  if not jg.has_graphviz():
    print("(Graphviz's `dot` is not installed: no SVG; `dot -Tsvg file.dot` renders one.)")

  # 5. A gradient node built by hand, as MPS's gradientFilter(withSource:): the pooling node's
  #    gradient, fed by its gradient state (the argmax the forward kept) and a source gradient.
  small = jg.Input("x", shape=(3, 3, 1))
  mp = jg.MaxPool("mp", small, window=(2, 2), strides=(1, 1))
  dy = jg.Input("dy", shape=(2, 2, 1))
  state = mp.gradient_state()                                  # MPSNNGradientStateNode
  grad = jg.PoolingGradient("mp.grad", mp, dy, small, state)   # source gradient, image, state
  assert grad == mp.gradient_filter(dy)
  print()
  print(jg.Graph(grad).summary())
  xv = jnp.array([[1., 2., 3.], [2., 4., 2.], [5., 6., 7.]])[..., None]  # DirectML's example
  dyv = jnp.array([[1., 2.], [4., 5.]])[..., None]
  values = jg.Graph(grad).evaluate({}, x=xv, dy=dyv)
  dx = values["mp.grad"].inputs[0]
  print("argmax kept by the forward (flat indices):\n", np.asarray(values["mp.state"][..., 0]))
  print("dx from the hand-built gradient node:\n", np.asarray(dx[..., 0]))
  np.testing.assert_array_equal(dx, jaxpool.max_pool_grad(xv, dyv, (2, 2)))
  print("== jaxpool.max_pool_grad (DirectML's DML_MAX_POOLING_GRAD)")


if __name__ == "__main__":
  main()
