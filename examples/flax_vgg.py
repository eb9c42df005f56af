"""Train an unmodified Flax linen VGG with and without ``jaxpool.optimize``.

The model below is plain Flax (``nn.Conv``, ``nn.relu``, ``nn.max_pool``): nothing in it knows
about jaxpool. ``jaxpool.optimize(model.apply)`` runs the same model with jaxpool's max pools (each
ReLU before a pool folded after it); both versions train from the same parameters on the same
batches, and the script prints the step times, the losses and what optimize replaced.

    .venv/bin/python examples/flax_vgg.py --quick            # a small VGG on 32x32 images, CPU
    .venv/bin/python examples/flax_vgg.py --vgg16 --batch 64 --dtype bfloat16 --steps 20  # GPU

The data are two fixed batches of random images with random labels (no download): the loss falls
as the network memorises them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpool  # noqa: E402

# Channels per conv layer, "M" a 2x2/s2 max pool: VGG-16 (configuration D) and a small one.
VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
SMALL = (16, 16, "M", 32, 32, "M", 64, 64, "M")


class VGG(nn.Module):
  """VGG: conv3x3 + ReLU stacks, 2x2 max pools, two hidden dense layers, a classifier."""

  layers: Sequence[Any] = VGG16
  hidden: int = 4096
  classes: int = 1000
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):  # x: (batch, H, W, 3)
    x = x.astype(self.dtype)
    for v in self.layers:
      if v == "M":
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
      else:
        x = nn.relu(nn.Conv(v, (3, 3), padding="SAME", dtype=self.dtype)(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype)(x))
    x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype)(x))
    return nn.Dense(self.classes, dtype=self.dtype)(x).astype(jnp.float32)


def make_model(args) -> tuple[VGG, int]:
  """The model and its image size from the command line."""
  dtype = jnp.dtype(args.dtype)
  if args.vgg16:
    return VGG(VGG16, 4096, 1000, dtype), args.size or 224
  return VGG(SMALL, 128, 10, dtype), args.size or 32


def benchmark_setup(batch: int, small: bool = False):
  """The multi-GPU benchmarks' problem: a bfloat16 VGG-16 on 224x224 images (``small``: the
  small VGG on 32x32), a batch of random images and labels (seed 0) and its initial parameters.
  Returns ``(model, images, labels, params)``."""
  model = VGG(SMALL, 128, 10, jnp.bfloat16) if small else VGG(VGG16, 4096, 1000, jnp.bfloat16)
  size = 32 if small else 224
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, model.classes, batch), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), images[:1])
  return model, images, labels, params


def strided_slice_pool(x, window_shape, strides=None, padding="VALID"):
  """A stand-in for ``nn.max_pool`` that keeps every ``strides``-th element: the pool's output
  shape for non-overlapping windows on sizes the stride divides (this model's), at next to no
  cost; ``padding`` is ignored. A step with it in place
  of the pools bounds what any pooling can gain there, and shows how the rest of the step
  scales."""
  del padding
  steps = strides or window_shape
  return x[(slice(None),) * (x.ndim - len(steps) - 1)
           + tuple(slice(None, None, s) for s in steps) + (slice(None),)]


def make_step(apply, optimizer):
  """A jitted SGD step of ``apply`` (a Flax ``model.apply`` or its optimized version)."""
  def loss_fn(params, images, labels):
    logits = apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @jax.jit
  def step(params, opt_state, images, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def batches(args, size: int, classes: int, count: int):
  """``count`` steps over two fixed batches of random images and labels."""
  rng = np.random.default_rng(0)
  fixed = [(jnp.asarray(rng.standard_normal((args.batch, size, size, 3)), jnp.float32),
            jnp.asarray(rng.integers(0, classes, args.batch), jnp.int32)) for _ in range(2)]
  for i in range(count):
    yield fixed[i % 2]


def train(step, params, opt_state, data) -> tuple[list[float], list[float]]:
  """Runs ``step`` over ``data``; returns the losses and the step times (seconds)."""
  losses, times = [], []
  for images, labels in data:
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, images, labels)
    loss = float(jax.block_until_ready(loss))
    times.append(time.perf_counter() - t0)
    losses.append(loss)
  return losses, times


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vgg16", action="store_true", help="full VGG-16 (224x224, 1000 classes)")
  parser.add_argument("--size", type=int, default=0, help="image size (default 32, 224 for VGG-16)")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--quick", action="store_true", help="a short CPU run: 8 steps of 8 images")
  parser.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                      help="jaxpool's implementation= (default: the kernels on a GPU)")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.batch = 8, 8
  model, size = make_model(args)
  optimized_apply = jaxpool.optimize(model.apply, implementation=args.implementation)
  example = jnp.zeros((args.batch, size, size, 3))
  params = jax.jit(model.init)(jax.random.key(0), example)
  count = sum(p.size for p in jax.tree.leaves(params))
  print(f"VGG ({'VGG-16' if args.vgg16 else 'small'}): {count / 1e6:.2f}M parameters, "
        f"{args.batch}x{size}x{size}x3 {args.dtype} on {jax.devices()[0].device_kind}")
  print(optimized_apply.report(params, example))

  optimizer = optax.sgd(0.01, momentum=0.9)
  results = {}
  for name, apply in (("flax", model.apply), ("jaxpool.optimize", optimized_apply)):
    step = make_step(apply, optimizer)
    data = batches(args, size, model.classes, args.steps)
    losses, times = train(step, params, optimizer.init(params), data)
    results[name] = dict(losses=losses, step_ms=1e3 * statistics.median(times[2:] or times),
                         first_step_s=times[0])
  print(f"\n{'':18s} {'step (median)':>14s} {'first step':>11s}   losses")
  for name, r in results.items():
    shown = " ".join(f"{v:.4f}" for v in r["losses"][:4]) + " ... " + f"{r['losses'][-1]:.4f}"
    print(f"{name:18s} {r['step_ms']:11.1f} ms {r['first_step_s']:9.2f} s   {shown}")
  a, b = results["flax"]["losses"], results["jaxpool.optimize"]["losses"]
  diff = max(abs(u - v) for u, v in zip(a, b, strict=True))
  print(f"\nlargest loss difference over {len(a)} steps: {diff:.3g} "
        f"(speed-up {results['flax']['step_ms'] / results['jaxpool.optimize']['step_ms']:.2f}x)")
  return results


if __name__ == "__main__":
  main()
