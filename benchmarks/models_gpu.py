"""A model zoo with and without ``jaxpool.optimize``: training-step time, memory, numerics.

Each row is one model in one precision: a training step (``jax.value_and_grad`` of the model's
loss, the model's state updates included) compiled twice in one process, as written and
through ``jaxpool.optimize``, on the same parameters and inputs. The models:

* Keras 3 applications on the JAX backend, random weights (``weights=None``), a step written
  with ``model.stateless_call``: ``keras_vgg16``, ``keras_resnet50``, ``keras_densenet121``,
  ``keras_inceptionv3``, ``keras_xception``, ``keras_mobilenetv2``, ``keras_efficientnetb0``,
  ``keras_convnexttiny``. bfloat16 is Keras's ``mixed_bfloat16`` policy (float32 variables).
* Flax linen: ``flax_resnet50`` (a standard ResNet-50 v1.5: bottleneck blocks 3-4-6-3,
  BatchNorm, a 3x3/s2 max pool after the stem, as Flax's ImageNet example),
  ``flax_unet2d`` and ``flax_unet3d`` (U-Nets: two 3x3(x3) conv + ReLU per level, 2x max pools
  down, transposed convolutions up, skip connections). bfloat16 computes in bfloat16 with
  float32 parameters (Flax's ``dtype=``).
* Equinox: ``equinox_cnn`` (examples/equinox_cnn.py: conv stem, max pools, average pool);
  bfloat16 casts the parameters and the images inside the loss.

Per row: the median step time of each (samples alternate between the two, after two warm-up
calls each; every sample blocks until the device is done; arrays are arguments, never closed
over), the speed-up, the compiled steps' memory (XLA's ``memory_analysis``: temporaries, and
arguments + outputs + temporaries), the process's peak device memory after the step without
optimize and after both (``memory_stats()["peak_bytes_in_use"]``: the second is higher only if
the optimized step needed more), what optimize replaced and left alone (its report), compile
times, and the numerics: in float32, the loss and gradient differences between the two steps
(equal up to rounding); in bfloat16, each step's distance to a float32 reference (the step
without optimize, in float32, same parameters and inputs): optimize should be no further.

Each (model, dtype) runs in a child process with a time limit (``--timeout``; ``--budget``
bounds the whole run), so a compile that autotunes for minutes costs one row, not the run;
``--autotune-level 0`` makes XLA pick convolution algorithms without measuring them (both steps
alike). The child's output goes to a log file per row (``models_gpu_logs/`` beside the JSON
file); each phase of a row (starting the backend, building the model, each compile, the first
runs, the timing, the float32 reference) prints a progress line as it starts and ends, which
the parent echoes as it comes, and the row keeps the phases' seconds (``phases_s``): a row that
runs out of time says in which phase. The kernels' launch configurations come from the shipped
tables and the disk cache, else are tuned (``--tune auto``, the default, as in a user's step):
tuning one that neither holds costs up to 10 s inside the optimized step's first compile (``--tune
cached`` never tunes), and a Keras VGG16 step has ten such kernels (the row's ``tuning`` says what
it cost). Children do not preallocate GPU memory (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless
set); the parent never starts a backend. Results accumulate in the JSON file (rows replaced by
model, dtype, batch and device), and every run writes the table (``.md``) and the speed-up
chart (``.png``, or a small ``.svg`` without matplotlib) beside it, so a zoo runs in parts::

  # on a GPU machine, from the repository root (keras wheels in ./.whl, see --wheels)
  PYTHONPATH=$PWD python3 benchmarks/models_gpu.py --models keras_vgg16,keras_densenet121 \\
      --dtypes bfloat16 --autotune-level 0 --budget 510 --timeout 200 --wheels .whl
  python3 benchmarks/models_gpu.py --merge part1.json part2.json   # parts from other runs
  python3 benchmarks/models_gpu.py --table          # the table of everything measured so far
  python3 benchmarks/models_gpu.py --plot docs/img/models_gpu.png   # speed-up bars for docs
  PYTHONPATH=$PWD python3 benchmarks/models_gpu.py --smoke   # tiny sizes on a CPU, a minute

Keras is imported only for Keras rows (with ``KERAS_BACKEND=jax``); ``--wheels DIR`` unpacks the
wheels in DIR (keras, namex, optree, ...) into DIR/_unpacked and appends it to ``sys.path``, for a
machine where nothing can be installed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxpool  # noqa: E402

sys.path.insert(0, HERE)
from result_path import device_tag, result_path  # noqa: E402


def default_out(smoke: bool) -> str:
  """``benchmarks/results/models_gpu_<gpu>.json``, the GPU named by ``nvidia-smi`` (the parent
  starts no backend); a smoke run's goes to ``build/benchmarks/``."""
  if smoke:
    return result_path(__file__, "cpu", quick=True)
  try:
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=True).stdout.splitlines()[0]
  except (OSError, subprocess.CalledProcessError, IndexError):
    raise SystemExit("models_gpu.py: nvidia-smi cannot name the GPU; give --out") from None
  return result_path(__file__, device_tag(name))

KERAS_APPS = {
    "keras_vgg16": ("VGG16", 224),
    "keras_resnet50": ("ResNet50", 224),
    "keras_densenet121": ("DenseNet121", 224),
    "keras_inceptionv3": ("InceptionV3", 299),
    "keras_xception": ("Xception", 299),
    "keras_mobilenetv2": ("MobileNetV2", 224),
    "keras_efficientnetb0": ("EfficientNetB0", 224),
    "keras_convnexttiny": ("ConvNeXtTiny", 224),
}
# model -> (full config, smoke config). Batch per dtype: {"bfloat16": n, "float32": n}.
CONFIGS: dict[str, tuple[dict, dict]] = {
    **{name: (dict(size=size, batch={"bfloat16": 64, "float32": 32}),
              dict(size=75 if size == 299 else 32, batch={"bfloat16": 2, "float32": 2}))
       for name, (_, size) in KERAS_APPS.items()},
    "flax_resnet50": (dict(size=224, batch={"bfloat16": 64, "float32": 32}),
                      dict(size=32, batch={"bfloat16": 2, "float32": 2})),
    "flax_unet2d": (dict(size=256, levels=4, features=32, batch={"bfloat16": 16, "float32": 16}),
                    dict(size=16, levels=2, features=4, batch={"bfloat16": 2, "float32": 2})),
    "flax_unet3d": (dict(size=96, levels=3, features=32, batch={"bfloat16": 2, "float32": 2}),
                    dict(size=8, levels=2, features=4, batch={"bfloat16": 1, "float32": 1})),
    "equinox_cnn": (dict(size=112, width=64, batch={"bfloat16": 128, "float32": 128}),
                    dict(size=32, width=8, batch={"bfloat16": 2, "float32": 2})),
}
MODELS = list(CONFIGS)
DTYPES = ("bfloat16", "float32")
SMOKE_MODELS = ("flax_unet2d", "equinox_cnn")


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass
class Workload:
  """A pure loss ``loss(params, state, x, y) -> (value, new_state)`` and its arguments.

  ``reference`` is the same model's loss in float32 taking the same arguments (bfloat16 rows),
  for the distance of each step to float32.
  """

  loss: Callable[..., Any]
  args: tuple[Any, ...]
  reference: Callable[..., Any] | None = None


def _xent(logits, labels):
  """Mean softmax cross-entropy in float32, over every position (images or voxels)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _inputs(shape, classes, label_shape, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  y = jnp.asarray(rng.integers(0, classes, label_shape), jnp.int32)
  return x, y


def keras_workload(name: str, dtype: str, cfg: dict, batch: int) -> Workload:
  os.environ.setdefault("KERAS_BACKEND", "jax")
  import keras
  if keras.backend.backend() != "jax":
    raise RuntimeError(f"Keras runs on {keras.backend.backend()!r}; set KERAS_BACKEND=jax")
  app, size = getattr(keras.applications, KERAS_APPS[name][0]), cfg["size"]

  def build(policy):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    try:
      return app(weights=None, input_shape=(size, size, 3), classes=1000,
                 classifier_activation=None)
    finally:
      keras.config.set_dtype_policy("float32")

  def make_loss(model):
    def loss(trainable, non_trainable, x, y):
      logits, new_state = model.stateless_call(trainable, non_trainable, x, training=True)
      return _xent(logits, y), new_state
    return loss

  model = build("mixed_bfloat16" if dtype == "bfloat16" else "float32")
  params = [v.value for v in model.trainable_variables]
  state = [v.value for v in model.non_trainable_variables]
  x, y = _inputs((batch, size, size, 3), 1000, (batch,))
  ref = make_loss(build("float32")) if dtype == "bfloat16" else None
  return Workload(make_loss(model), (params, state, x, y), ref)


def flax_models():
  """The Flax linen models (imported here: a Keras-only run needs no Flax)."""
  import flax.linen as nn

  class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1, 3x3 (strided), 1x1 (4x wider), a projected shortcut."""

    features: int
    strides: int
    dtype: Any

    @nn.compact
    def __call__(self, x, train: bool):
      conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
      norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                               epsilon=1e-5, dtype=self.dtype)
      h = nn.relu(norm()(conv(self.features, (1, 1))(x)))
      h = conv(self.features, (3, 3), (self.strides, self.strides), padding=((1, 1), (1, 1)))(h)
      h = nn.relu(norm()(h))
      h = norm(scale_init=nn.initializers.zeros_init())(conv(4 * self.features, (1, 1))(h))
      if x.shape != h.shape:
        x = norm()(conv(4 * self.features, (1, 1), (self.strides, self.strides))(x))
      return nn.relu(x + h)

  class ResNet50(nn.Module):
    classes: int
    dtype: Any

    @nn.compact
    def __call__(self, x, train: bool = True):
      x = x.astype(self.dtype)
      x = nn.Conv(64, (7, 7), (2, 2), padding=((3, 3), (3, 3)), use_bias=False,
                  dtype=self.dtype)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                               dtype=self.dtype)(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
      for stage, blocks in enumerate((3, 4, 6, 3)):
        for block in range(blocks):
          x = Bottleneck(64 * 2**stage, 2 if stage and not block else 1, self.dtype)(x, train)
      x = jnp.mean(x, axis=(1, 2))
      return nn.Dense(self.classes, dtype=self.dtype)(x)

  class UNet(nn.Module):
    """A U-Net over ``ndim`` spatial dims, channels last."""

    ndim: int
    levels: int
    features: int
    classes: int
    dtype: Any

    def _block(self, x, features):
      for _ in range(2):
        x = nn.relu(nn.Conv(features, (3,) * self.ndim, padding="SAME", dtype=self.dtype)(x))
      return x

    @nn.compact
    def __call__(self, x, train: bool = True):
      del train
      x = x.astype(self.dtype)
      skips = []
      for level in range(self.levels):
        x = self._block(x, self.features * 2**level)
        if level < self.levels - 1:
          skips.append(x)
          x = nn.max_pool(x, (2,) * self.ndim, strides=(2,) * self.ndim)
      for level in reversed(range(self.levels - 1)):
        f = self.features * 2**level
        x = nn.ConvTranspose(f, (2,) * self.ndim, strides=(2,) * self.ndim,
                             dtype=self.dtype)(x)
        x = self._block(jnp.concatenate([x, skips[level]], axis=-1), f)
      return nn.Conv(self.classes, (1,) * self.ndim, dtype=self.dtype)(x)

  return ResNet50, UNet


def flax_workload(name: str, dtype: str, cfg: dict, batch: int) -> Workload:
  ResNet50, UNet = flax_models()
  size = cfg["size"]

  def module(dt):
    if name == "flax_resnet50":
      return ResNet50(1000, dt)
    return UNet(3 if name == "flax_unet3d" else 2, cfg["levels"], cfg["features"], 4, dt)

  if name == "flax_resnet50":
    x, y = _inputs((batch, size, size, 3), 1000, (batch,))
  else:
    nd = 3 if name == "flax_unet3d" else 2
    x, y = _inputs((batch, *(size,) * nd, 1), 4, (batch, *(size,) * nd))
  model = module(jnp.dtype(dtype))
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), x)
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}

  def make_loss(m):
    def loss(params, state, x, y):
      if state:
        logits, new_state = m.apply({"params": params, **state}, x, train=True,
                                    mutable=list(state))
      else:
        logits, new_state = m.apply({"params": params}, x, train=True), state
      return _xent(logits, y), new_state
    return loss

  ref = make_loss(module(jnp.float32)) if dtype == "bfloat16" else None
  return Workload(make_loss(model), (params, state, x, y), ref)


def equinox_workload(name: str, dtype: str, cfg: dict, batch: int) -> Workload:
  import equinox as eqx
  import equinox_cnn
  model = equinox_cnn.CNN(cfg["size"], cfg["width"], 10, jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  x, y = _inputs((batch, 3, cfg["size"], cfg["size"]), 10, (batch,))

  def make_loss(dt):
    def loss(params, state, x, y):
      p = jax.tree.map(lambda a: a.astype(dt), params)
      logits = jax.vmap(eqx.combine(p, static))(x.astype(dt))
      return _xent(logits, y), state
    return loss

  ref = make_loss(jnp.float32) if dtype == "bfloat16" else None
  return Workload(make_loss(jnp.dtype(dtype)), (params, {}, x, y), ref)


def workload(name: str, dtype: str, cfg: dict, batch: int) -> Workload:
  if name.startswith("keras_"):
    return keras_workload(name, dtype, cfg, batch)
  if name.startswith("flax_"):
    return flax_workload(name, dtype, cfg, batch)
  return equinox_workload(name, dtype, cfg, batch)


# ----------------------------------------------------------------------------- measuring


def compile_step(loss, args):
  """``jit(value_and_grad(loss))`` compiled for ``args``: (compiled, seconds, memory)."""
  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  seconds = time.perf_counter() - t0
  mem = None
  try:
    ma = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 (not every backend has it)
    ma = None
  if ma is not None:
    temp = int(ma.temp_size_in_bytes)
    total = (int(ma.argument_size_in_bytes) + int(ma.output_size_in_bytes) + temp
             - int(ma.alias_size_in_bytes))
    mem = dict(temp_mib=temp / 2**20, total_mib=total / 2**20)
  return compiled, seconds, mem


def time_pair(fa, fb, args, reps: int) -> tuple[float, float]:
  """Median milliseconds of ``fa(*args)`` and ``fb(*args)``; the samples alternate."""
  for f in (fa, fb):
    for _ in range(2):
      jax.block_until_ready(f(*args))
  ta: list[float] = []
  tb: list[float] = []
  for i in range(reps):
    pairs = [(fa, ta), (fb, tb)]
    for f, samples in (pairs if i % 2 == 0 else pairs[::-1]):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      samples.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


@jax.jit
def _distance(a, b):
  """Max |a - b|, max |b|, ||a - b|| and ||b|| over two pytrees of one structure (float32)."""
  la = [v.astype(jnp.float32) for v in jax.tree.leaves(a)]
  lb = [v.astype(jnp.float32) for v in jax.tree.leaves(b)]
  stack = lambda vs: jnp.stack([jnp.float32(0), *vs])
  return (jnp.max(stack([jnp.max(jnp.abs(u - v)) for u, v in zip(la, lb, strict=True)])),
          jnp.max(stack([jnp.max(jnp.abs(v)) for v in lb])),
          jnp.sqrt(jnp.sum(stack([jnp.sum((u - v) ** 2) for u, v in zip(la, lb, strict=True)]))),
          jnp.sqrt(jnp.sum(stack([jnp.sum(v**2) for v in lb]))))


def compare(out, ref) -> dict:
  """Loss and gradient differences of a step's output ``((loss, state), grads)`` to ``ref``."""
  (loss, _), grads = out
  (ref_loss, _), ref_grads = ref
  max_diff, max_ref, l2_diff, l2_ref = (float(v) for v in _distance(grads, ref_grads))
  return dict(loss=float(loss), loss_abs_diff=abs(float(loss) - float(ref_loss)),
              grad_max_abs_diff=max_diff, grad_max_abs=max_ref,
              grad_rel_l2=l2_diff / l2_ref if l2_ref else 0.0)


def peak_mib() -> float | None:
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 2**20


class Phases:
  """Times the phases of a row and prints a progress line as each starts and ends (stderr,
  flushed): a row that runs past its time limit shows in its log where it stopped."""

  def __init__(self, label: str):
    self.label = label
    self.start = time.perf_counter()
    self.seconds: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, name: str):
    t0 = time.perf_counter()
    _progress(f"{self.label}: {name} ... (at {t0 - self.start:.1f} s)")
    try:
      yield
    finally:
      self.seconds[name] = time.perf_counter() - t0
      _progress(f"{self.label}: {name} done in {self.seconds[name]:.1f} s")


def _progress(line: str) -> None:
  print(f"[models_gpu {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def tuning_summary(records) -> dict[str, Any]:
  """What the kernels' launch configurations cost this process (``jaxpool.tune``'s records):
  lookups by source (``table``, ``cache``, ``tuned``, ``heuristic``, ...) and the seconds spent
  tuning, which fall inside the first compile of the optimized step."""
  sources: dict[str, int] = {}
  for r in records:
    sources[r.source] = sources.get(r.source, 0) + 1
  return dict(mode=os.environ.get("JAXPOOL_TUNE", "") or "model", lookups=sources,
              tuned_keys=sorted({r.key for r in records if r.source == "tuned"}),
              seconds=sum(r.seconds for r in records))


def run_row(name: str, dtype: str, smoke: bool, reps: int, batch: int | None,
            reference: bool) -> dict:
  """One (model, dtype) row, measured in this process.

  The step without optimize is compiled and run before anything else, so the peak device
  memory then is its own; the peak after both steps is higher only where the optimized step
  needed more. Each phase is timed (``phases_s``) and announced on stderr as it starts.
  """
  from jaxpool._src.pallas.tuning import tuner as tuning
  cfg = CONFIGS[name][1 if smoke else 0]
  batch = batch or cfg["batch"][dtype]
  phase = Phases(f"{name} {dtype} batch {batch}")
  with phase("start the backend"):
    device = jax.devices()[0].device_kind
  row: dict[str, Any] = dict(model=name, dtype=dtype, batch=batch,
                             config={k: v for k, v in cfg.items() if k != "batch"},
                             device=device, smoke=smoke)
  tuned_before = len(tuning.report())
  with phase("build the model"):
    work = workload(name, dtype, cfg, batch)
  with phase("compile without optimize"):
    base, row["compile_s_without"], row["memory_without"] = compile_step(work.loss, work.args)
  with phase("first run without optimize"):
    out_base = jax.block_until_ready(base(*work.args))
  row["peak_mib_after_without"] = peak_mib()
  optimized = jaxpool.optimize(work.loss)
  with phase("optimize: trace and plan"):
    report = optimized.report(*work.args)
  row["replaced"], row["left_alone"] = len(report.replaced), len(report.left_alone)
  row["replaced_ops"] = _count(f.op for f in report.replaced)
  row["left_alone_why"] = _count(f"{f.op}: {f.detail}" for f in report.left_alone)
  with phase("compile with optimize (kernel launch configurations included)"):
    opt, row["compile_s_with"], row["memory_with"] = compile_step(optimized, work.args)
  row["tuning"] = tuning_summary(tuning.report()[tuned_before:])
  with phase("first run with optimize"):
    out_opt = jax.block_until_ready(opt(*work.args))
  if dtype == "float32":
    row["f32_with_vs_without"] = compare(out_opt, out_base)
  row["loss_without"] = float(out_base[0][0])
  row["loss_with"] = float(out_opt[0][0])
  del out_base, out_opt
  with phase(f"time both steps ({reps} samples each)"):
    row["ms_without"], row["ms_with"] = time_pair(base, opt, work.args, reps)
  row["speedup"] = row["ms_without"] / row["ms_with"]
  row["peak_mib_after_both"] = peak_mib()
  if dtype == "bfloat16" and reference and work.reference is not None:
    with phase("compile and run the float32 reference"):
      ref, row["compile_s_reference"], _ = compile_step(work.reference, work.args)
      out_ref = ref(*work.args)
      row["bf16_without_vs_f32"] = compare(base(*work.args), out_ref)
      row["bf16_with_vs_f32"] = compare(opt(*work.args), out_ref)
  row["phases_s"] = phase.seconds
  return row


def _count(items) -> dict[str, int]:
  out: dict[str, int] = {}
  for item in items:
    out[item] = out.get(item, 0) + 1
  return out


# ----------------------------------------------------------------------------- driver


def unpack_wheels(folder: str) -> str:
  """Unpacks every ``*.whl`` in ``folder`` into ``folder/_unpacked``; returns that path."""
  target = os.path.join(folder, "_unpacked")
  os.makedirs(target, exist_ok=True)
  for wheel in sorted(os.listdir(folder)):
    if wheel.endswith(".whl"):
      stamp = os.path.join(target, f".{wheel}.done")
      if not os.path.exists(stamp):
        with zipfile.ZipFile(os.path.join(folder, wheel)) as z:
          z.extractall(target)
        open(stamp, "w").close()
  return target


def child_env(args) -> dict[str, str]:
  """The children's environment: Keras on JAX, unbuffered output, XLA's autotuning level, the
  kernels' tuning mode, and no preallocation of GPU memory (a row's peak is read from the
  allocator's statistics, which preallocation does not change; without it a second process on
  the GPU, or a leftover one, cannot starve the row of memory)."""
  env = dict(os.environ, KERAS_BACKEND="jax", PYTHONUNBUFFERED="1")
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  flags = env.get("XLA_FLAGS", "")
  if args.autotune_level is not None:
    flags += f" --xla_gpu_autotune_level={args.autotune_level}"
  env["XLA_FLAGS"] = flags.strip()
  if args.tune is not None:
    env["JAXPOOL_TUNE"] = args.tune
  paths = [ROOT, env.get("PYTHONPATH", "")]
  if args.wheels:
    paths.append(unpack_wheels(args.wheels))   # after the machine's own packages
  env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
  return env


def log_path(out: str, name: str, dtype: str, smoke: bool) -> str:
  """A row's log file: in a ``models_gpu_logs`` folder beside the JSON file."""
  folder = os.path.join(os.path.dirname(os.path.abspath(out)), "models_gpu_logs")
  return os.path.join(folder, f"{name}-{dtype}{'-smoke' if smoke else ''}.log")


def run_child(name: str, dtype: str, args, timeout: float | None = None) -> dict:
  """Measures one row in a child process, within ``timeout`` seconds (``--timeout``).

  The child's output goes to its log file (never to a pipe that nobody reads while it runs),
  and its row to a JSON file beside it. While it runs, its progress lines are echoed here as
  they appear; a child past its limit is killed with its process group, and its row says in
  which phase it was.
  """
  timeout = args.timeout if timeout is None else timeout
  log = log_path(args.out, name, dtype, args.smoke)
  os.makedirs(os.path.dirname(log), exist_ok=True)
  result = log[:-len(".log")] + ".json"
  if os.path.exists(result):
    os.remove(result)
  cmd = [sys.executable, "-u", os.path.abspath(__file__), "--child", name, "--dtypes", dtype,
         "--reps", str(args.reps), "--result", result] + (["--smoke"] if args.smoke else [])
  cmd += (["--batch", str(args.batch)] if args.batch else [])
  cmd += ([] if args.reference else ["--no-reference"])
  cmd += (["--cache-dir", args.cache_dir] if args.cache_dir else [])
  t0 = time.perf_counter()
  with open(log, "w") as f, open(log) as reader:
    f.write(f"$ {' '.join(cmd)}\n")
    f.flush()
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(args),
                            start_new_session=True)
    timed_out = False
    while True:
      try:
        proc.wait(timeout=1.0)
        done = True
      except subprocess.TimeoutExpired:
        done = False
      for line in reader.readlines():
        if line.startswith("[models_gpu"):
          print(f"    {line.rstrip()}", flush=True)
      if done:
        break
      if time.perf_counter() - t0 > timeout:
        timed_out = True
        _kill(proc)
        break
  wall = time.perf_counter() - t0
  with open(log) as f:
    text = f.read()
  phases = [ln for ln in text.splitlines() if ln.startswith("[models_gpu")]
  common = dict(model=name, dtype=dtype, device=_device_kind(), smoke=args.smoke, log=log,
                batch=args.batch or CONFIGS[name][1 if args.smoke else 0]["batch"][dtype],
                wall_s=wall, last_phase=phases[-1] if phases else None)
  if timed_out:
    return dict(common, error=f"timed out after {timeout:.0f} s",
                tail=text[-1500:])
  if proc.returncode != 0 or not os.path.exists(result):
    return dict(common, error=f"exit {proc.returncode}", tail=text[-3000:])
  with open(result) as f:
    row = json.load(f)
  os.remove(result)                # (the row goes into --out; the log stays)
  row.update(log=log, wall_s=wall)
  _SEEN_DEVICE[0] = row["device"]
  return row


def _kill(proc: subprocess.Popen) -> None:
  """Ends a child and everything it started (its own process group)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


_SEEN_DEVICE = ["unknown"]


def _device_kind() -> str:
  """The device of the last child that reported one: the parent never starts a backend itself
  (on a GPU it would hold memory that the children need)."""
  return _SEEN_DEVICE[0]


def _key(row) -> tuple:
  return (row.get("device"), row["model"], row["dtype"], row.get("batch"), row.get("smoke"))


def merge(path: str, rows: list[dict], meta: dict) -> None:
  """Writes ``rows`` into the JSON at ``path``, replacing rows of the same key."""
  old: dict = {}
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  new_keys = {_key(r) for r in rows}
  kept = [r for r in old.get("rows", []) if _key(r) not in new_keys]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dict(meta, rows=kept + rows), f, indent=1)


def _fmt(v, spec=".2f", none="-"):
  return none if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
  out = ["| model | dtype | batch | without ms | with ms | speed-up | replaced / left alone | "
         "temp MiB without / with | peak MiB without / both | float32: loss, grad diff "
         "(max abs / rel L2) | bfloat16: grad rel L2 to float32, without / with | compile s "
         "without / with |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r.get("device", ""), r["model"], r["dtype"])):
    if "error" in r:
      where = (r.get("last_phase") or "").split("] ", 1)[-1]
      out.append(f"| {r['model']} | {r['dtype']} | {r.get('batch', '')} | {r['error']}"
                 f"{f' (last: {where})' if where else ''} | | | | | | | | |")
      continue
    mw, mo = r.get("memory_without") or {}, r.get("memory_with") or {}
    f32 = r.get("f32_with_vs_without")
    f32s = (f"{f32['loss_abs_diff']:.1e}, {f32['grad_max_abs_diff']:.1e} / "
            f"{f32['grad_rel_l2']:.1e}" if f32 else "")
    b0, b1 = r.get("bf16_without_vs_f32"), r.get("bf16_with_vs_f32")
    bfs = f"{b0['grad_rel_l2']:.2e} / {b1['grad_rel_l2']:.2e}" if b0 and b1 else ""
    out.append(
        f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['ms_without']:.2f} | "
        f"{r['ms_with']:.2f} | {r['speedup']:.2f}x | {r['replaced']} / {r['left_alone']} | "
        f"{_fmt(mw.get('temp_mib'), '.0f')} / {_fmt(mo.get('temp_mib'), '.0f')} | "
        f"{_fmt(r.get('peak_mib_after_without'), '.0f')} / "
        f"{_fmt(r.get('peak_mib_after_both'), '.0f')} | {f32s} | {bfs} | "
        f"{r['compile_s_without']:.0f} / {r['compile_s_with']:.0f} |")
  return "\n".join(out)


def _plot_rows(rows: list[dict]) -> list[dict]:
  """The measured rows to plot: GPU rows, or smoke rows when there are no others."""
  done = [r for r in rows if "speedup" in r]
  real = [r for r in done if not r.get("smoke")]
  return real or done


def _labels(rows: list[dict]) -> tuple[list[str], list[tuple[str, str]]]:
  devices = sorted({r["device"] for r in rows})
  labels = sorted({(r["model"], r["dtype"]) for r in rows})
  return devices, labels


def _label(model: str, dtype: str) -> str:
  return f"{model} ({'bf16' if dtype == 'bfloat16' else 'f32'})"


def plot(rows: list[dict], path: str) -> str:
  """Horizontal bars of the speed-up per (model, dtype), one colour per device.

  A PNG with matplotlib where it is installed and ``path`` does not end in ``.svg``; else an
  SVG written here (``path`` with its suffix made ``.svg``). Returns the path written.
  """
  done = _plot_rows(rows)
  if not done:
    raise SystemExit("no measured rows to plot")
  try:
    import matplotlib
  except ImportError:
    matplotlib = None
  if matplotlib is None or path.endswith(".svg"):
    path = os.path.splitext(path)[0] + ".svg"
    svg = plot_svg(done)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
      f.write(svg)
    print(f"wrote {path}")
    return path
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  devices, labels = _labels(done)
  fig, ax = plt.subplots(figsize=(7, 0.35 * len(labels) * len(devices) + 1.2))
  height = 0.8 / len(devices)
  for i, dev in enumerate(devices):
    by = {(r["model"], r["dtype"]): r["speedup"] for r in done if r["device"] == dev}
    ys = [j + i * height for j in range(len(labels))]
    ax.barh(ys, [by.get(lab, 0) for lab in labels], height=height, label=dev)
  ax.axvline(1.0, color="black", linewidth=0.8)
  ax.set_yticks([j + 0.4 - height / 2 for j in range(len(labels))])
  ax.set_yticklabels([_label(m, d) for m, d in labels])
  ax.invert_yaxis()
  ax.set_xlabel("training-step speed-up with jaxpool.optimize (without / with)")
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")
  return path


def plot_svg(rows: list[dict]) -> str:
  """The speed-up chart as a small hand-written SVG (no plotting library needed)."""
  from xml.sax.saxutils import escape
  devices, labels = _labels(rows)
  colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
  bar, gap, left, width, top = 14, 8, 190, 360, 10
  top_speed = max(1.5, max(r["speedup"] for r in rows) * 1.1)
  x = lambda v: left + width * v / top_speed
  band = bar * len(devices) + gap
  height = top + band * len(labels) + 50
  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
         f'height="{height}" font-family="sans-serif" font-size="11">']
  for j, (model, dtype) in enumerate(labels):
    y0 = top + j * band
    out.append(f'<text x="{left - 6}" y="{y0 + band / 2}" text-anchor="end">'
               f'{escape(_label(model, dtype))}</text>')
    for i, dev in enumerate(devices):
      hit = [r["speedup"] for r in rows if r["device"] == dev and (r["model"], r["dtype"])
             == (model, dtype)]
      if hit:
        y = y0 + i * bar
        out.append(f'<rect x="{left}" y="{y}" width="{x(hit[0]) - left:.1f}" '
                   f'height="{bar - 2}" fill="{colours[i % len(colours)]}"/>')
        out.append(f'<text x="{x(hit[0]) + 3:.1f}" y="{y + bar - 4}">{hit[0]:.2f}x</text>')
  axis_y = top + band * len(labels)
  out.append(f'<line x1="{x(1.0):.1f}" y1="{top - 4}" x2="{x(1.0):.1f}" y2="{axis_y}" '
             f'stroke="black"/>')
  out.append(f'<text x="{x(1.0):.1f}" y="{axis_y + 14}" text-anchor="middle">1.0</text>')
  out.append(f'<text x="{left}" y="{axis_y + 30}">training-step speed-up with '
             f'jaxpool.optimize (without / with)</text>')
  for i, dev in enumerate(devices):
    out.append(f'<rect x="{left + 130 * i}" y="{axis_y + 36}" width="10" height="10" '
               f'fill="{colours[i % len(colours)]}"/><text x="{left + 130 * i + 14}" '
               f'y="{axis_y + 45}">{escape(dev)}</text>')
  out.append("</svg>")
  return "\n".join(out) + "\n"


def write_outputs(path: str) -> list[str]:
  """The table (Markdown) and the chart of every row in the JSON at ``path``, beside it:
  ``X.json`` gives ``X.md`` and ``X.png`` (``X.svg`` without matplotlib)."""
  with open(path) as f:
    rows = json.load(f)["rows"]
  stem = os.path.splitext(path)[0]
  with open(stem + ".md", "w") as f:
    f.write(table(rows) + "\n")
  written = [path, stem + ".md"]
  if _plot_rows(rows):
    written.append(plot(rows, stem + ".png"))
  return written


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=None,
                      help=f"comma-separated, from: {', '.join(MODELS)} (default: all; with "
                           f"--smoke: {', '.join(SMOKE_MODELS)})")
  parser.add_argument("--dtypes", default=",".join(DTYPES), help="bfloat16,float32")
  parser.add_argument("--reps", type=int, default=None, help="timed samples of each step")
  parser.add_argument("--batch", type=int, default=None, help="override every row's batch")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU check")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per (model, dtype)")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds for the whole run: a row gets at most what is left, and "
                           "no row starts with less than a minute left (it is reported as "
                           "skipped)")
  parser.add_argument("--tune", default="model", choices=("model", "auto", "cached", "off"),
                      help="JAXPOOL_TUNE for the rows: 'model' (default, what a user gets) "
                           "never tunes (the table, else the launch model); 'auto' "
                           "tunes a kernel that neither the shipped table nor the disk cache "
                           "holds, inside the optimized step's first compile (at most "
                           "JAXPOOL_TUNE_BUDGET_S, 10 s, a kernel); 'cached' never tunes")
  parser.add_argument("--autotune-level", type=int, default=None,
                      help="XLA's --xla_gpu_autotune_level for the children (0: no "
                           "measuring of convolution algorithms, fast compiles)")
  parser.add_argument("--no-reference", dest="reference", action="store_false",
                      help="skip the float32 reference of bfloat16 rows (one compile fewer)")
  parser.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache")
  parser.add_argument("--wheels", default=None,
                      help="a folder of wheels (keras, namex, optree, ...) to unpack and use")
  parser.add_argument("--inline", action="store_true",
                      help="measure in this process, no children and no time limit")
  parser.add_argument("--out", default=None,
                      help="the JSON file (rows accumulate; default: "
                           "benchmarks/results/models_gpu_<gpu>.json)")
  parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                      help="merge the rows of these result files into --out and exit")
  parser.add_argument("--table", action="store_true", help="print the JSON's table and exit")
  parser.add_argument("--plot", default=None, help="write a speed-up chart (PNG) and exit")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  path = args.out = args.out or default_out(args.smoke)
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
  if args.merge:
    for part in args.merge:
      with open(part) as f:
        data = json.load(f)
      merge(path, data.pop("rows"), data)
    print(f"merged {len(args.merge)} file(s) into {path}")
    return 0
  if args.table or args.plot:
    with open(path) as f:
      rows = json.load(f)["rows"]
    if args.plot:
      plot(rows, args.plot)
    else:
      print(table(rows))
    return 0
  start = time.perf_counter()
  args.reps = args.reps or (3 if args.smoke else 20)
  dtypes = [d for d in args.dtypes.split(",") if d]
  models = args.models.split(",") if args.models else list(SMOKE_MODELS if args.smoke
                                                            else MODELS)
  for m in models:
    if m not in CONFIGS:
      parser.error(f"--models: unknown model {m!r}; known: {', '.join(MODELS)}")
  for d in dtypes:
    if d not in DTYPES:
      parser.error(f"--dtypes: unknown dtype {d!r}; known: {', '.join(DTYPES)}")
  if args.child:
    row = run_row(args.child, dtypes[0], args.smoke, args.reps, args.batch, args.reference)
    if args.result:
      with open(args.result + ".tmp", "w") as f:
        json.dump(row, f)
      os.replace(args.result + ".tmp", args.result)
    print(json.dumps(row), flush=True)
    return 0
  if args.inline and args.wheels:
    sys.path.append(unpack_wheels(args.wheels))
  if args.inline:
    _SEEN_DEVICE[0] = jax.devices()[0].device_kind
  meta = dict(jax=jax.__version__, jaxpool=jaxpool.__version__,
              python=platform.python_version(), xla_flags=child_env(args)["XLA_FLAGS"],
              autotune_level=args.autotune_level, jaxpool_tune=args.tune)
  print(f"models_gpu, JAX {jax.__version__}{' (smoke)' if args.smoke else ''}"
        f"{' (in this process)' if args.inline else ' (a child process per row)'}: "
        f"{', '.join(models)} x {', '.join(dtypes)}", flush=True)
  rows = []
  for m in models:
    for d in dtypes:
      left = None if args.budget is None else args.budget - (time.perf_counter() - start)
      print(f"  {m} {d}: starting{'' if left is None else f' ({left:.0f} s of the budget left)'}",
            flush=True)
      if left is not None and left < 60:
        rows.append(dict(model=m, dtype=d, device=_device_kind(), smoke=args.smoke,
                         error=f"skipped: {left:.0f} s of --budget left"))
        print(f"  {m:22s} {d:9s} skipped: {left:.0f} s of --budget left", flush=True)
        continue
      if args.inline:
        os.environ.setdefault("KERAS_BACKEND", "jax")
        row = run_row(m, d, args.smoke, args.reps, args.batch, args.reference)
      else:
        row = run_child(m, d, args, timeout=args.timeout if left is None
                        else min(args.timeout, left - 10))
      rows.append(row)
      merge(path, [row], meta)      # after every row: a killed run keeps what it measured
      if "error" in row:
        print(f"  {m:22s} {d:9s} FAILED: {row['error']}; last: {row.get('last_phase')}; "
              f"log: {row.get('log')}\n{row.get('tail', '')}", flush=True)
      else:
        print(f"  {m:22s} {d:9s} without {row['ms_without']:9.2f} ms  with "
              f"{row['ms_with']:9.2f} ms  {row['speedup']:.2f}x  replaced {row['replaced']}"
              f"  left alone {row['left_alone']}", flush=True)
  print("\n" + table(rows), flush=True)
  if os.path.exists(path):
    print(f"\nwrote {', '.join(write_outputs(path))}", flush=True)
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
