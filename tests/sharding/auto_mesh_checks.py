"""Data-parallel training steps with the Pallas kernels on an Auto mesh, against one device.

Run by tests/sharding/test_auto_mesh.py, in its own process with 8 CPU devices (the kernels in
interpret mode)::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python tests/sharding/auto_mesh_checks.py [--quick]

Two steps, each jitted once on one device and once with the batch split over an Auto mesh
(``jax.sharding.Mesh`` with ``AxisType.Auto``, ``NamedSharding`` on the batch, the parameters
replicated), the style of most pjit code:

* ``jaxpool.optimize`` of a small CNN's loss written in plain ``lax`` (convolution, ReLU, a 3x3/s2
  max pool, a 2x2 average pool, a dense layer), ``implementation="pallas"``;
* the graph module's training step (``training_graph(...).make_step(optax.sgd(...))``) of the
  same network, its pooling nodes with ``implementation="pallas"``.

Each check asserts: the kernels run (the traced program holds jaxpool's kernel primitive, and
none of XLA's pooling); loss, gradients and updated parameters equal one device's within the
rounding of the gradients' all-reduce; and the compiled program gathers nothing: no all-gather,
all-to-all or collective-permute of an array, and all-reduces only of parameter-sized arrays (the
gradients) or scalars (the loss), never of an activation.

``--quick`` (what ``make test`` runs) leaves out the graph's step. Each check prints one JSON
line ``{"name": ..., "ok": bool, "detail": ...}``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from device_checks import check  # noqa: E402  (tests/support: not on a script's path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpool  # noqa: E402
from jaxpool import graph as jg  # noqa: E402
from jaxpool._src.pallas.sharding.partition import kernel_p  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
BATCH, H, W, C, F, CLASSES = 16, 12, 12, 3, 4, 5
RTOL, ATOL = 2e-5, 1e-6  # the gradients' all-reduce sums in another order than one device
QUICK = "--quick" in sys.argv


def collectives(hlo: str) -> list[tuple[str, int]]:
  """``(op, elements)`` for every array that a collective of ``hlo`` (an HLO module's text)
  produces, each member of a tuple-shaped (combined) collective apart."""
  out = []
  pattern = r"= (\(?[^=]*?\)?) (" + "|".join(COLLECTIVES) + r")(-start)?\("
  for m in re.finditer(pattern, hlo):
    for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1)):
      out.append((m.group(2), math.prod(int(d) for d in dims.split(",") if d)))
  return out


def assert_no_gather(hlo: str, param_sizes: set[int]) -> list[tuple[str, int]]:
  """Only all-reduces of a parameter's size or of a scalar; nothing else moves an array."""
  moved = collectives(hlo)
  bad = [(op, n) for op, n in moved
         if n > 1 and (op != "all-reduce" or n not in param_sizes)]
  assert not bad, f"collectives that move activations: {bad} (all: {moved})"
  return moved


def assert_close(got, want, what):
  for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                          strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=RTOL, atol=ATOL,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


def assert_kernels(fn, *args):
  text = str(jax.make_jaxpr(fn)(*args))
  assert kernel_p.name in text, "the Pallas kernels do not run"
  for prim in ("reduce_window", "select_and_scatter_add"):
    assert prim not in text, f"{prim}: XLA's pooling is left in the step"


rng = np.random.default_rng(0)
IMAGES = jnp.asarray(rng.standard_normal((BATCH, H, W, C)), jnp.float32)
LABELS = jnp.asarray(rng.integers(0, CLASSES, BATCH), jnp.int32)
MESH = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def on_mesh(params, *batch):
  """Parameters replicated, the batch split over the mesh."""
  return (jax.device_put(params, NamedSharding(MESH, P())),
          *(jax.device_put(b, NamedSharding(MESH, P("data"))) for b in batch))


# ----------------------------------------------------------------------------- optimize


def cnn_loss(params, x, labels):
  """conv 3x3 -> ReLU -> max pool 3x3/s2/p1 -> average pool 2x2 -> dense -> cross-entropy,
  written in plain ``lax`` (as Flax emits it)."""
  y = lax.conv_general_dilated(x, params["conv"], (1, 1), "SAME",
                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  y = jax.nn.relu(y)
  y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                        ((0, 0), (1, 1), (1, 1), (0, 0)))
  y = lax.reduce_window(y, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
  logits = y.reshape(y.shape[0], -1) @ params["dense"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@check("optimize/auto/batch")
def _optimize():
  k1, k2 = rng.standard_normal((3, 3, C, F)), rng.standard_normal((3 * 3 * F, CLASSES))
  params = {"conv": jnp.asarray(k1 / 3, jnp.float32), "dense": jnp.asarray(k2 / 6, jnp.float32)}
  opt = jaxpool.optimize(cnn_loss, implementation="pallas")
  rep = opt.report(params, IMAGES, LABELS)
  assert len(rep.replaced) == 3 and not rep.left_alone, str(rep)  # ReLU folded, max, average
  step = jax.jit(jax.value_and_grad(opt))
  assert_kernels(step, params, IMAGES, LABELS)
  single = step(params, IMAGES, LABELS)
  placed = on_mesh(params, IMAGES, LABELS)
  compiled = step.lower(*placed).compile()
  out = compiled(*placed)
  assert_close(out, single, "optimize: Auto mesh vs one device")
  assert_close(out, jax.jit(jax.value_and_grad(cnn_loss))(params, IMAGES, LABELS),
               "optimize vs plain XLA")
  moved = assert_no_gather(compiled.as_text(), {v.size for v in params.values()})
  assert any(op == "all-reduce" for op, _ in moved), "no gradient all-reduce: not data-parallel?"
  return f"collectives: {moved}"


# ----------------------------------------------------------------------------- the graph


def graph_step():
  image = jg.Input("image", shape=(H, W, C))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  x = jg.ReLU("relu", jg.Conv("conv", image, features=F, window=(3, 3), padding="SAME"))
  x = jg.MaxPool("max", x, window=(3, 3), strides=(2, 2), padding=((1, 1), (1, 1)),
                 implementation="pallas")
  x = jg.AvgPool("avg", x, window=(2, 2), strides=(2, 2), implementation="pallas")
  loss = jg.SoftmaxCrossEntropy("loss", jg.Dense("dense", x, features=CLASSES), label)
  net = jg.Graph(loss)
  params = net.init(jax.random.key(1), image=IMAGES, label=LABELS)
  sgd = optax.sgd(0.1)
  step = jg.training_graph(loss).make_step(sgd)
  return jax.jit(lambda p, s, x, y: step(p, s, image=x, label=y)), params, sgd.init(params)


def _graph():
  step, params, opt_state = graph_step()
  assert_kernels(step, params, opt_state, IMAGES, LABELS)
  single = step(params, opt_state, IMAGES, LABELS)
  p, x, y = on_mesh(params, IMAGES, LABELS)
  s = jax.device_put(opt_state, NamedSharding(MESH, P()))
  compiled = step.lower(p, s, x, y).compile()
  out = compiled(p, s, x, y)
  assert_close(out, single, "graph step: Auto mesh vs one device")
  sizes = {v.size for v in jax.tree.leaves(params)}
  moved = assert_no_gather(compiled.as_text(), sizes)
  assert any(op == "all-reduce" for op, _ in moved), "no gradient all-reduce: not data-parallel?"
  return f"collectives: {moved}"


# ----------------------------------------------------------------------------- the layers


def _layers():
  """A Flax linen model and an Equinox model with jaxpool's pooling layers (the kernels):
  a data-parallel step equals one device and all-reduces only gradients."""
  import equinox as eqx
  import flax.linen as nn

  from jaxpool.interop import equinox as jeqx
  from jaxpool.interop import flax_linen as jpl

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(F, (3, 3))(x))
      x = jpl.MaxPool((3, 3), strides=(2, 2), padding=((1, 1), (1, 1)),
                      implementation="pallas")(x)
      x = jpl.AvgPool((2, 2), strides=(2, 2), implementation="pallas")(x)
      return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))

  net = Net()
  params = net.init(jax.random.key(2), IMAGES[:1])

  def flax_loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(net.apply(p, x), y).mean()

  keys = jax.random.split(jax.random.key(3), 2)
  conv = eqx.nn.Conv2d(C, F, 3, padding=1, key=keys[0])
  pools = (jeqx.MaxPool2d(3, 2, padding=1, implementation="pallas"),
           jeqx.AvgPool2d(2, 2, implementation="pallas"))
  dense = eqx.nn.Linear(F * 3 * 3, CLASSES, key=keys[1])
  model = (conv, dense)

  def eqx_loss(m, x, y):
    def one(image):  # Equinox's layout: (channels, height, width), one example
      z = jax.nn.relu(m[0](jnp.transpose(image, (2, 0, 1))))
      return m[1](pools[1](pools[0](z)).reshape(-1))
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(one)(x), y).mean()

  found = []
  for name, loss, p in (("flax", flax_loss, params), ("equinox", eqx_loss, model)):
    step = jax.jit(jax.value_and_grad(loss))
    assert_kernels(step, p, IMAGES, LABELS)
    single = step(p, IMAGES, LABELS)
    placed = on_mesh(p, IMAGES, LABELS)
    compiled = step.lower(*placed).compile()
    assert_close(compiled(*placed), single, f"{name} layers: Auto mesh vs one device")
    sizes = {v.size for v in jax.tree.leaves(eqx.filter(p, eqx.is_array))}
    moved = assert_no_gather(compiled.as_text(), sizes)
    assert any(op == "all-reduce" for op, _ in moved), f"{name}: no gradient all-reduce"
    found.append(f"{name}: {moved}")
  return "; ".join(found)


if not QUICK:
  check("graph/auto/batch")(_graph)
  check("layers/auto/batch")(_layers)

print(json.dumps(dict(name="summary", ok=True, detail="")), flush=True)
