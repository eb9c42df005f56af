"""Measures, on a GPU, the sites that jaxpool.optimize's default cost model decides about, to
check the model against measurements (docs/optimize.md, "Never slower"). Not a test: run it.

For each case, one jitted training step (value and gradient of a weighted sum, with respect to
the input and the convolution's weights) three ways: the plain function (XLA), optimize with
every recognised site replaced (``cost=always``), and optimize with the default model. Each
prints one JSON line: the median step time of each, the speed-up of replacing, and what the
default model decided::

  python benchmarks/optimize_cost_gpu.py [--dtype bfloat16] [--samples 20] [--calls 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpool
from jaxpool._src.optimize import cost


def conv1x1_avg(x, w):
  """DenseNet's transition: a 1x1 convolution, then a 2x2/s2 average pool."""
  y = lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return lax.reduce_window(y, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def relu_max(x, w):
  """A ResNet/DenseNet stem's pool: a ReLU then a 3x3/s2 SAME max pool (w: unused scale)."""
  return lax.reduce_window(jax.nn.relu(x * w.mean()), -jnp.inf, lax.max, (1, 3, 3, 1),
                           (1, 2, 2, 1), "SAME")


def avg_only(x, w):
  """An average pool that reads no convolution (w: unused scale)."""
  return lax.reduce_window(x * w.mean(), 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def max_only(x, w):
  return lax.reduce_window(x * w.mean(), -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def conv3_relu_max3d(x, w):
  """A 3-D U-Net's way down: a 3x3x3 convolution, a ReLU, then a 2x2x2/s2 max pool."""
  y = lax.conv_general_dilated(x, w, (1, 1, 1), "SAME",
                               dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
  return lax.reduce_window(jax.nn.relu(y), -jnp.inf, lax.max, (1, 2, 2, 2, 1), (1, 2, 2, 2, 1),
                           "VALID")


CASES = {
    "densenet_transition_56": (conv1x1_avg, (64, 56, 56, 256), (1, 1, 256, 128)),
    "densenet_transition_28": (conv1x1_avg, (64, 28, 28, 512), (1, 1, 512, 256)),
    "densenet_transition_14": (conv1x1_avg, (64, 14, 14, 1024), (1, 1, 1024, 512)),
    "stem_relu_max_112": (relu_max, (64, 112, 112, 64), (1,)),
    "avg_no_conv_56": (avg_only, (64, 56, 56, 128), (1,)),
    "small_max_8192": (max_only, (8, 8, 8, 16), (1,)),
    "small_avg_8192": (avg_only, (8, 8, 8, 16), (1,)),
    "mid_max_32768": (max_only, (8, 16, 16, 16), (1,)),
    "mid_max_262144": (max_only, (32, 16, 16, 32), (1,)),
    # The two pools of benchmarks/models_gpu.py's flax_unet3d (batch 2, 96^3, 32 features).
    "unet3d_conv_relu_max_96": (conv3_relu_max3d, (2, 96, 96, 96, 32), (3, 3, 3, 32, 32)),
    "unet3d_conv_relu_max_48": (conv3_relu_max3d, (2, 48, 48, 48, 64), (3, 3, 3, 64, 64)),
}


def median_ms(step, args, samples, calls):
  jax.block_until_ready(step(*args))
  jax.block_until_ready(step(*args))
  times = []
  for _ in range(samples):
    t = time.perf_counter()
    for _ in range(calls):
      out = step(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / calls * 1e3)
  return statistics.median(times)


def loss_of(fn):
  """The weighted sum of ``fn``'s output (cotangent ``cot``, an argument: a constant would be
  folded at compile time), accumulated in float32."""
  return lambda x, w, cot: (fn(x, w).astype(jnp.float32) * cot.astype(jnp.float32)).sum()


def step_of(fn):
  return jax.jit(jax.value_and_grad(loss_of(fn), argnums=(0, 1)))


def run_case(name, f, x, w, cot, samples, calls):
  rep = jaxpool.optimize(jax.grad(loss_of(f), argnums=(0, 1))).report(x, w, cot)
  args = (x, w, cot)
  row = {
      "case": name, "dtype": str(x.dtype), "device": jax.devices()[0].device_kind,
      "xla_ms": median_ms(step_of(f), args, samples, calls),
      "replaced_ms": median_ms(step_of(jaxpool.optimize(f, cost=cost.always)), args, samples,
                               calls),
      "default_ms": median_ms(step_of(jaxpool.optimize(f)), args, samples, calls),
      "default_model": [(d.op, d.replaced, d.cost) for d in rep.findings
                        if d.op.startswith(("reduce_window", "select_and"))],
  }
  row["speedup_replaced"] = row["xla_ms"] / row["replaced_ms"]
  row["speedup_default"] = row["xla_ms"] / row["default_ms"]
  return row


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--samples", type=int, default=20)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--cases", default=",".join(CASES))
  a = p.parse_args()
  rng = np.random.default_rng(0)
  for name in a.cases.split(","):
    f, xs, ws = CASES[name]
    x = jnp.asarray(rng.standard_normal(xs), a.dtype)
    w = jnp.asarray(rng.standard_normal(ws) * 0.1, a.dtype)
    cot = jnp.asarray(rng.standard_normal(jax.eval_shape(f, x, w).shape), a.dtype)
    print(json.dumps(run_case(name, f, x, w, cot, a.samples, a.calls)), flush=True)


if __name__ == "__main__":
  main()
