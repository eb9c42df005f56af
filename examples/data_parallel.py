"""Data-parallel training over every device of the machine, with jaxpool's pooling.

The batch is sharded over all devices (``NamedSharding``), the parameters are replicated, and
one ``jax.jit`` step computes the loss and gradients: each device pools its own block, and the
only communication is the all-reduce of the parameter gradients. The script checks that the
sharded step gives the same loss and parameters as the same step on one device.

It trains twice, once per kind of mesh axis: an *Explicit* mesh (the sharding is part of the
arrays' types) and an *Auto* mesh (the compiler decides the sharding of intermediates: the style
of ``jax.sharding.Mesh``, Keras's distribution API and most pjit code). jaxpool's ops split with
either (docs/sharding.md).

    .venv/bin/python examples/data_parallel.py                  # the devices there are
    .venv/bin/python examples/data_parallel.py --cpu-devices 8  # 8 CPU devices (forced)
    .venv/bin/python examples/data_parallel.py --mesh auto --implementation pallas  # kernels

Data: scikit-learn's 1,797 8x8 digit images (shipped with it, no download).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="force this many CPU devices (sets XLA_FLAGS; CPU only)")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch-per-device", type=int, default=32)
  p.add_argument("--mesh", choices=("explicit", "auto", "both"), default="both",
                 help="the kind of mesh axis to train on (both: one run each)")
  p.add_argument("--implementation", choices=("default", "xla", "pallas"), default="default",
                 help="jaxpool's implementation= (pallas on a CPU: the kernels interpreted)")
  return p.parse_args()


ARGS = parse()
if ARGS.cpu_devices:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={ARGS.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaxpool  # noqa: E402

IMPL = None if ARGS.implementation == "default" else ARGS.implementation


def init(key):
  k1, k2, k3 = jax.random.split(key, 3)
  he = lambda k, shape, fan_in: jax.random.normal(k, shape) * np.sqrt(2.0 / fan_in)
  return {"conv1": he(k1, (3, 3, 1, 16), 9), "conv2": he(k2, (3, 3, 16, 32), 144),
          "dense": he(k3, (2 * 2 * 32, 10), 128), "bias": jnp.zeros(10)}


def conv(x, w):
  return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def forward(params, x):
  x = jax.nn.relu(conv(x, params["conv1"]))                        # (B, 8, 8, 16)
  x = jaxpool.max_pool(x, (3, 3), strides=(2, 2), padding=1,
                       implementation=IMPL)                        # (B, 4, 4, 16)
  x = jax.nn.relu(conv(x, params["conv2"]))                        # (B, 4, 4, 32)
  x = jaxpool.avg_pool(x, (2, 2), strides=(2, 2), implementation=IMPL)  # (B, 2, 2, 32)
  return x.reshape(x.shape[0], -1) @ params["dense"] + params["bias"]


def loss_fn(params, x, y):
  logits = forward(params, x)
  # One-hot labels rather than optax's integer-label loss: its take_along_axis has no sharding
  # rule for a batch-sharded operand under Explicit meshes (jax 0.11).
  labels = jax.nn.one_hot(y, logits.shape[-1], dtype=logits.dtype)
  return optax.softmax_cross_entropy(logits, labels).mean()


OPT = optax.adam(3e-3)


@jax.jit
def step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
  updates, opt_state = OPT.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@jax.jit
def accuracy(params, x, y):
  return jnp.mean(jnp.argmax(forward(params, x), -1) == y)


def train(axis_type: AxisType) -> bool:
  """Trains on a mesh of every device whose one axis is ``axis_type``; whether the first
  sharded step equalled the single-device one."""
  devices = jax.devices()
  n = len(devices)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(axis_type,))
  batch = NamedSharding(mesh, P("data"))    # examples split over the devices
  replicated = NamedSharding(mesh, P())     # parameters and optimizer state everywhere
  print(f"{axis_type.name} mesh, {n} device(s): {devices[0].platform} "
        f"({devices[0].device_kind}); jax {jax.__version__}; implementation {IMPL}")

  digits = load_digits()
  x_all = (digits.images / 16.0).astype(np.float32)[..., None]
  y_all = digits.target.astype(np.int32)
  rng = np.random.default_rng(0)
  order = rng.permutation(len(x_all))
  test, train = order[:360], order[360:]
  bsz = ARGS.batch_per_device * n

  params = init(jax.random.key(0))
  opt_state = OPT.init(params)

  # The same first step on one device and sharded over all: equal up to the order of the
  # batch-mean's sum (the sharded one adds the devices' partial sums).
  xb, yb = x_all[train[:bsz]], y_all[train[:bsz]]
  p1, _, l1 = step(params, opt_state, xb, yb)
  ps, _, ls = step(jax.device_put(params, replicated), jax.device_put(opt_state, replicated),
                   jax.device_put(xb, batch), jax.device_put(yb, batch))
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(p1), jax.tree.leaves(ps), strict=True))
  print(f"first step: loss one device {float(l1):.6f}, sharded {float(ls):.6f}; "
        f"max parameter difference {diff:.2e}")
  ok = abs(float(l1) - float(ls)) < 1e-5 and diff < 1e-5

  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(opt_state, replicated)
  t0 = time.perf_counter()
  for i in range(ARGS.steps):
    idx = rng.choice(train, bsz, replace=False)
    params, opt_state, loss = step(params, opt_state, jax.device_put(x_all[idx], batch),
                                   jax.device_put(y_all[idx], batch))
    if (i + 1) % 50 == 0 or i + 1 == ARGS.steps:
      print(f"step {i + 1:4d}  loss {float(loss):.4f}")
  loss.block_until_ready()
  dt = time.perf_counter() - t0
  acc = float(accuracy(params, jax.device_put(x_all[test], NamedSharding(mesh, P())),
                       y_all[test]))
  print(f"{ARGS.steps} steps of {bsz} examples ({ARGS.batch_per_device} per device) in "
        f"{dt:.2f} s; test accuracy {100 * acc:.1f}% on {len(test)} held-out digits")
  print("params sharding:", jax.tree.leaves(params)[0].sharding.spec,
        "| batch sharding:", batch.spec)
  if not ok:
    print(f"MISMATCH between the sharded and the single-device step ({axis_type.name} mesh)",
          file=sys.stderr)
  return ok


def main() -> int:
  kinds = {"explicit": [AxisType.Explicit], "auto": [AxisType.Auto],
           "both": [AxisType.Explicit, AxisType.Auto]}[ARGS.mesh]
  results = [train(kind) for kind in kinds]
  return 0 if all(results) else 1


if __name__ == "__main__":
  sys.exit(main())
