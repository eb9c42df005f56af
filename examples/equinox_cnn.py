"""Train an unmodified Equinox CNN with and without ``jaxpool.optimize``.

The model is plain Equinox (``eqx.nn.Conv2d``, ``jax.nn.relu``, ``eqx.nn.MaxPool2d``,
``eqx.nn.AvgPool2d``), written per example and ``vmap``-ed over the batch. The loss is wrapped in
``jaxpool.optimize``; Equinox's filtered transformations and optimize both treat the model's
non-array fields (its activation functions, static config) as static. Both versions train from
the same model on the same batches; the script prints step times, losses and the report.

    .venv/bin/python examples/equinox_cnn.py --quick            # 32x32 images on a CPU
    .venv/bin/python examples/equinox_cnn.py --size 112 --batch 128 --width 64   # a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpool  # noqa: E402


class CNN(eqx.Module):
  """A ResNet-style stem and two conv stages, for one ``(3, H, W)`` image.

  conv 7x7/2 + ReLU, max pool 3x3/s2/p1, [conv3x3 + ReLU, max pool 2x2] x 2, global average
  pool, linear.
  """

  stem: eqx.nn.Conv2d
  convs: list
  pool: eqx.nn.MaxPool2d
  pool2: eqx.nn.MaxPool2d
  head: eqx.nn.Linear
  size: int = eqx.field(static=True)

  def __init__(self, size: int, width: int, classes: int, key):
    keys = jax.random.split(key, 4)
    self.stem = eqx.nn.Conv2d(3, width, 7, stride=2, padding=3, key=keys[0])
    self.convs = [eqx.nn.Conv2d(width, width, 3, padding=1, key=k) for k in keys[1:3]]
    self.pool = eqx.nn.MaxPool2d(3, 2, padding=1)
    self.pool2 = eqx.nn.MaxPool2d(2, 2)
    self.head = eqx.nn.Linear(width, classes, key=keys[3])
    self.size = size // 16  # spatial size before the global average pool

  def __call__(self, x):
    x = self.pool(jax.nn.relu(self.stem(x)))
    for conv in self.convs:
      x = self.pool2(jax.nn.relu(conv(x)))
    x = eqx.nn.AvgPool2d(self.size, 1)(x)  # global average pool: (width, 1, 1)
    return self.head(x.reshape(-1))


def loss_fn(model, images, labels):
  logits = jax.vmap(model)(images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_step(loss, optimizer):
  @eqx.filter_jit
  def step(model, opt_state, images, labels):
    value, grads = eqx.filter_value_and_grad(loss)(model, images, labels)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value
  return step


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=64)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--quick", action="store_true", help="8 steps of 8 32x32 images")
  parser.add_argument("--implementation", default=None, choices=("xla", "pallas"))
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.batch, args.size, args.width = 8, 8, 32, 16
  if args.size % 16:
    parser.error(f"--size must be a multiple of 16; got {args.size}.")
  model = CNN(args.size, args.width, 10, jax.random.key(0))
  optimized = jaxpool.optimize(loss_fn, implementation=args.implementation)
  rng = np.random.default_rng(0)
  data = [(jnp.asarray(rng.standard_normal((args.batch, 3, args.size, args.size)), jnp.float32),
           jnp.asarray(rng.integers(0, 10, args.batch), jnp.int32)) for _ in range(2)]
  print(f"Equinox CNN: {args.batch}x3x{args.size}x{args.size}, width {args.width}, on "
        f"{jax.devices()[0].device_kind}")
  print(optimized.report(model, *data[0]))

  optimizer = optax.sgd(0.01, momentum=0.9)
  results = {}
  for name, loss in (("equinox", loss_fn), ("jaxpool.optimize", optimized)):
    step = make_step(loss, optimizer)
    m, opt_state = model, optimizer.init(eqx.filter(model, eqx.is_array))
    losses, times = [], []
    for i in range(args.steps):
      t0 = time.perf_counter()
      m, opt_state, value = step(m, opt_state, *data[i % 2])
      losses.append(float(jax.block_until_ready(value)))
      times.append(time.perf_counter() - t0)
    results[name] = dict(losses=losses, step_ms=1e3 * statistics.median(times[2:] or times),
                         first_step_s=times[0])
  print(f"\n{'':18s} {'step (median)':>14s} {'first step':>11s}   losses")
  for name, r in results.items():
    shown = " ".join(f"{v:.4f}" for v in r["losses"][:4]) + " ... " + f"{r['losses'][-1]:.4f}"
    print(f"{name:18s} {r['step_ms']:11.1f} ms {r['first_step_s']:9.2f} s   {shown}")
  a, b = results["equinox"]["losses"], results["jaxpool.optimize"]["losses"]
  diff = max(abs(u - v) for u, v in zip(a, b, strict=True))
  speedup = results["equinox"]["step_ms"] / results["jaxpool.optimize"]["step_ms"]
  print(f"\nlargest loss difference over {len(a)} steps: {diff:.3g} (speed-up {speedup:.2f}x)")
  return results


if __name__ == "__main__":
  main()
