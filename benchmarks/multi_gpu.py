"""jaxpool on several GPUs: pooling gradients, weak scaling and training steps, split over the
devices.

Parts (``--parts``, comma-separated; default ``pool,vgg,unet``):

* ``pool``: the gradient of a 3x3x3/s2/p1 max pool and average pool on 2x128x128x128x32
  (float32 and bfloat16): one GPU, the batch split over every GPU, the depth split over every
  GPU; ``lax.reduce_window`` (``implementation="xla"``) beside jaxpool's kernels; the compiled
  program's collectives listed. Each row has two times: ``ms``, one call of a program that
  takes one gradient, and ``chain_ms``, one program that takes ``--chain`` K gradients (10; 0:
  none), divided by K. The chain is unrolled (a ``lax.fori_loop`` is an XLA while loop, whose
  trips a GPU syncs with the host); call k+1's input is call k's gradient, sharded as the
  input, each call has its own cotangent and every gradient is returned (the average pool's
  gradient does not read its input: with one cotangent XLA would merge the calls, and without
  the outputs drop all but the last). A program's launch on several devices, about as long as
  the smaller gradients, is then paid once for K gradients, as in a training step. The rows
  also give the input's and output's ``PartitionSpec`` and the chain's collectives
  (``chain_collectives``: K times one call's).
* ``weak``: weak scaling of a 3x3x3/s2/p1 max pool and average pool, forward and gradient
  (``jax.vjp``: the pooled output and the input's gradient, both returned), float32 and
  bfloat16 (``--dtypes``, ``--ops``): a block of ``--block`` (1x64x256x256x32) per device,
  split along depth over 1, 2, 4 and 8 devices (``--counts``: those the machine has) and along
  depth and height over 4 and 8 (a mesh of N/2 x 2), jaxpool's kernels
  (``implementation="pallas"``) beside ``lax.reduce_window`` (``implementation="xla"``) split
  the same way. Each row is timed as a chain (``chain_ms``: K forward-and-gradient calls in one
  program, call k+1's input call k's gradient, divided by K; K is ``--chain``, at least 1) and
  as one call (``ms``). ``equal_to_one_device``: the split's output and gradient equal, bit for
  bit, those of the whole problem (every device's block) on one device with the same
  implementation. Before each jaxpool split, its halo exchange alone (``kind: "halo"``): the
  collective-permutes that the compiled split program holds (the same shapes, dtypes and
  device pairs, read from its HLO) in a ``shard_map`` with nothing else, one exchange a call
  (``ms``) and K exchanges in a chain, each sending on what the one before received
  (``chain_ms`` divided by K): the floor of the split's communication; and each split row's
  ``during_exchange``, the kernels (custom calls) and fusions that the compiled schedule runs
  while an asynchronous halo permute is in flight (None where none is asynchronous, as on a
  CPU): zero kernels there, no overlap of the exchange with the work. On writing, each row
  gets ``efficiency``: the one-device row's ``chain_ms`` over its own (same dtype, op and
  implementation); a jaxpool row ``vs_reduce_window`` (``lax.reduce_window``'s ``chain_ms`` at
  the same split over jaxpool's) and ``halo_share`` (its halo floor's ``chain_ms`` over its
  own).
* ``vgg``: an unmodified Flax VGG-16 training step (224x224, bfloat16, ``--per-gpu`` images per
  GPU) with and without ``jaxpool.optimize``, for each device count n of ``--counts`` (each
  GPU its ``--per-gpu`` images: the global batch grows with n; a count of one runs the step on
  one GPU, the data-parallel baseline): ``one GPU``, the global batch of n GPUs on one GPU
  (where it fits; the reference of the other modes' losses), and the global batch split over
  n GPUs on an Auto mesh, on an Explicit mesh and inside ``shard_map``, and (``fsdp``) on an
  Auto mesh with the parameters and the optimizer state split over the GPUs as well: each array
  along its largest dim that the GPUs divide, gathered whole where the step starts and its
  gradient summed over the GPUs into the split (ZeRO-3-style storage: the parameters are whole
  for the whole step), so that each GPU updates only its part of the parameters; and
  (``fsdp_bf16``) the same split written inside ``shard_map`` with mixed-precision
  communication, as PyTorch's FSDP ``MixedPrecision(param_dtype=bfloat16,
  reduce_dtype=bfloat16)`` does: each GPU casts its part of the parameters to bfloat16 (the
  model computes in bfloat16: the forward is the same) before the all-gather, and the
  gradients are summed over the GPUs in bfloat16 (a split array's reduce-scattered, the
  gather's transpose; a whole one's all-reduced), each GPU updating its float32 part
  (``--modes`` takes some of ``one GPU,auto,explicit,shard_map,fsdp,fsdp_bf16``).
  ``--variants`` adds ``no_pool``: the model with every max pool replaced by a strided slice
  (the same shapes at next to no cost), which shows how the rest of the step scales. The first
  step's loss and updated parameters are compared with one GPU's on the same global batch:
  ``params_vs_one_gpu``, the largest relative difference of an array's norm, and
  ``update_vs_one_gpu``, of an array's update (new minus initial values, as a whole). Two
  times a row: ``ms``, one step a sample (a wait after every step), and ``loop_ms``,
  ``--steps`` K steps a sample (10; 0: none) run as a training loop runs them, each step taking
  the parameters and optimizer state the one before returned, with one wait after the last,
  divided by K. On writing, each row gets ``efficiency``: the one-GPU step on ``--per-gpu``
  images over the row's (``loop_ms``, else ``ms``): 1.0 is perfect data-parallel scaling.
* ``resnet50``: the same data-parallel scaling (the ``one GPU`` and ``auto`` modes of
  ``--modes``; ``plain`` and ``optimize`` of ``--variants``) for the model zoo's Flax
  ResNet-50 (``flax_resnet50`` of ``benchmarks/models_gpu.py``: bfloat16, 224x224,
  BatchNorm whose statistics span the global batch), an SGD step with momentum.
* ``unet``: a 3-D U-Net-style training step (Flax) on one ``--volume`` (256^3; ``DxHxW`` for
  another shape), with and without ``jaxpool.optimize``, on one GPU (where it fits: an error
  row where it does not) and split along depth over each count of ``--counts``; on writing,
  ``speedup`` (one GPU's ``ms`` over the row's) and ``vs_plain`` (plain Flax's ``ms`` at the
  same count over the row's).

Prints a table and writes JSON (``--out``; by default
``benchmarks/results/multi_gpu_<device>.json``, e.g. ``multi_gpu_h200x8.json``) with
``XLA_FLAGS`` and ``JAXPOOL_TUNE`` as they were (``xla_flags``, ``jaxpool_tune``; and per part
in ``runs``). Rows accumulate in that file: a row replaces the row of the same part and
configuration that an earlier run wrote, so the parts can run in separate processes. JSON is
written after every row, so a run stopped early keeps what it measured; ``--budget`` seconds
skip what is left (an error row each). ``--plot`` writes the efficiency plot (matplotlib)
beside the JSON (``.png``). With ``--cpu-devices N`` it runs on N forced CPU devices at toy
sizes, the kernels in interpret mode (a smoke test of the script, not a measurement; no JSON
unless ``--out`` is given).

    python benchmarks/multi_gpu.py                      # pool, vgg, unet
    python benchmarks/multi_gpu.py --parts weak --plot  # weak scaling over 1, 2, 4, 8 GPUs
    python benchmarks/multi_gpu.py --parts vgg,resnet50 --modes auto --variants \\
        plain,optimize,no_pool --plot                   # data parallel, 1 to 8 GPUs
    python benchmarks/multi_gpu.py --parts vgg --modes "one GPU,auto" --counts 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path


VGG_MODES = ("one GPU", "auto", "explicit", "shard_map", "fsdp", "fsdp_bf16")
PARTS = ("pool", "weak", "vgg", "resnet50", "unet")
WEAK_OPS = ("max_pool", "avg_pool")
WEAK_DTYPES = ("float32", "bfloat16")


def _dims(text: str, what: str, p) -> tuple[int, ...]:
  try:
    dims = tuple(int(v) for v in text.lower().split("x"))
  except ValueError:
    dims = ()
  if not dims or min(dims) < 1:
    p.error(f"{what} takes positive sizes joined by 'x'; got {text!r}")
  return dims


def _names(text: str, allowed, what: str, p) -> list[str]:
  names = [v.strip() for v in text.split(",") if v.strip()]
  unknown = [v for v in names if v not in allowed]
  if unknown or not names:
    p.error(f"{what} takes a comma list of {', '.join(allowed)}; got {text!r}")
  return names


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parts", default="pool,vgg,unet",
                 help=f"comma-separated, from {', '.join(PARTS)} (empty: none, e.g. to plot "
                      f"what --out holds)")
  p.add_argument("--counts", default="1,2,4,8",
                 help="device counts of the weak, vgg, resnet50 and unet parts (those above "
                      "the machine's device count are left out)")
  p.add_argument("--per-gpu", type=int, default=64,
                 help="VGG and ResNet-50 images per GPU")
  p.add_argument("--variants", default="plain,optimize",
                 help="VGG variants, comma-separated, from plain, optimize, no_pool (every max "
                      "pool replaced by a strided slice: how the rest of the step scales); "
                      "ResNet-50 takes plain and optimize")
  p.add_argument("--modes", default=",".join(VGG_MODES),
                 help=f"VGG modes, comma-separated, from {', '.join(VGG_MODES)} (ResNet-50: "
                      f"one GPU and auto)")
  p.add_argument("--chain", type=int, default=10,
                 help="pool gradients chained in one program (chain_ms); 0: none (the weak "
                      "part chains at least one)")
  p.add_argument("--block", default="",
                 help="the weak part's block per device, NxDxHxWxC (1x64x256x256x32; "
                      "1x4x8x8x4 with --cpu-devices)")
  p.add_argument("--dtypes", default=",".join(WEAK_DTYPES), help="the weak part's dtypes")
  p.add_argument("--ops", default=",".join(WEAK_OPS), help="the weak part's pools")
  p.add_argument("--volume", default="",
                 help="the U-Net's volume: D (a cube) or DxHxW (256; 32x16x16 with "
                      "--cpu-devices)")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--steps", type=int, default=10,
                 help="VGG and ResNet-50 steps a sample of the training-loop timer (loop_ms); "
                      "0: none")
  p.add_argument("--budget", type=float, default=0,
                 help="seconds for the run: what is left after them is skipped (an error row "
                      "each); 0: no limit")
  p.add_argument("--out", default="",
                 help="the JSON file (default benchmarks/results/multi_gpu_<device>.json; "
                      "none in --cpu-devices mode unless given)")
  p.add_argument("--plot", action="store_true",
                 help="write the efficiency plot (PNG, matplotlib) beside the JSON")
  p.add_argument("--cpu-devices", type=int, default=0)
  args = p.parse_args(argv)
  args.parts = [v.strip() for v in args.parts.split(",") if v.strip()]
  if set(args.parts) - set(PARTS):
    p.error(f"--parts takes a comma list of {', '.join(PARTS)}; got {args.parts!r}")
  args.modes = _names(args.modes, VGG_MODES, "--modes", p)
  args.variants = _names(args.variants, ("plain", "optimize", "no_pool"), "--variants", p)
  args.dtypes = _names(args.dtypes, WEAK_DTYPES, "--dtypes", p)
  args.ops = _names(args.ops, WEAK_OPS, "--ops", p)
  args.counts = sorted(set(_dims(args.counts.replace(",", "x"), "--counts", p)))
  smoke = bool(args.cpu_devices)
  args.block = _dims(args.block or ("1x4x8x8x4" if smoke else "1x64x256x256x32"), "--block", p)
  if len(args.block) != 5:
    p.error(f"--block takes five sizes, NxDxHxWxC; got {args.block}")
  args.volume = _dims(args.volume or ("32x16x16" if smoke else "256"), "--volume", p)
  if len(args.volume) == 1:
    args.volume *= 3
  if len(args.volume) != 3:
    p.error(f"--volume takes D or DxHxW; got {args.volume}")
  if args.chain < 0:
    p.error(f"--chain must be 0 (off) or a positive count; got {args.chain}")
  if args.per_gpu < 1:
    p.error(f"--per-gpu must be positive; got {args.per_gpu}")
  return args


ARGS = parse()
if ARGS.cpu_devices:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import jaxpool  # noqa: E402
from result_path import device_tag, result_path  # noqa: E402

SMOKE = bool(ARGS.cpu_devices)
N = jax.device_count()
# The device counts of the scaling parts: those of --counts that the machine has.
COUNTS = [n for n in ARGS.counts if n <= N]
ROWS: list[dict] = []
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")
START = time.perf_counter()


OUT = ARGS.out or ("" if SMOKE else result_path(__file__, device_tag(jax.devices()[0].device_kind,
                                                                         N)))


def timed(fn, *args, reps=ARGS.reps) -> float:
  """Median milliseconds of one call: each sample runs calls back to back for at least 5 ms
  (the wait for the first call's launch, about 0.1 ms, would otherwise count against a short
  op), after two warm-up calls."""
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  inner = max(1, int(5e-3 / max(time.perf_counter() - t0, 1e-6)))
  samples = []
  for _ in range(3 if SMOKE else reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  return 1e3 * statistics.median(samples)


def timed_loop(step, state, batch, steps: int, reps=ARGS.reps) -> float:
  """Median milliseconds of one training step as a training loop runs it: ``steps`` steps a
  sample, each taking the state (parameters, optimizer state) the one before returned, with no
  wait between them (JAX dispatches the next step while the GPUs run this one), then one wait
  for the last. :func:`timed` waits after every step of this size instead, so its samples also
  hold the dispatch of each step."""
  def run(state):
    for _ in range(steps):
      *state, value = step(*state, *batch)
    return tuple(state), value
  for _ in range(2):
    state, value = run(state)
    jax.block_until_ready(value)
  samples = []
  for _ in range(3 if SMOKE else reps):
    t0 = time.perf_counter()
    state, value = run(state)
    jax.block_until_ready((state, value))
    samples.append((time.perf_counter() - t0) / steps)
  return 1e3 * statistics.median(samples)


def collectives(compiled) -> dict[str, int]:
  """How many collectives of each kind, and the largest array any of them moves (a combined
  collective's result is a tuple of arrays, an asynchronous ``-start``'s a tuple of them)."""
  out: dict[str, int] = {}
  op = re.compile(r" (" + "|".join(COLLECTIVES) + r")(-start)?\(")
  for line in compiled.as_text().splitlines():
    m = op.search(line)
    eq = line.find(" = ")
    if m is None or eq < 0 or eq > m.start():
      continue
    shapes = re.findall(r"\w+\[([\d,]*)\]", line[eq:m.start()])
    if not shapes:
      continue
    n = max(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in shapes)
    out[m.group(1)] = out.get(m.group(1), 0) + 1
    out[m.group(1) + " max elems"] = max(out.get(m.group(1) + " max elems", 0), n)
  return out


def mesh(kind=AxisType.Auto, n: int | None = None):
  """A mesh of one axis ``"d"`` over the first ``n`` devices (all of them by default)."""
  n = n or N
  return jax.make_mesh((n,), ("d",), axis_types=(kind,), devices=jax.devices()[:n])


# ----------------------------------------------------------------------------- pool


def pool_part():
  shape = (2, 16, 16, 16, 4) if SMOKE else (2, 128, 128, 128, 32)
  kw = dict(window_shape=(3, 3, 3), strides=(2, 2, 2), padding=1)
  rng = np.random.default_rng(0)
  m = mesh()
  k = ARGS.chain
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    y_shape = jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw), x).shape
    dy = jnp.asarray(rng.standard_normal(y_shape), dtype)
    # The chain's cotangents, one a call: the average pool's gradient does not read its input,
    # so XLA would merge K calls on one dy into one.
    dys = [dy] + [jnp.asarray(rng.standard_normal(y_shape), dtype) for _ in range(k - 1)]
    for op in ("max_pool", "avg_pool"):
      for impl in ("xla", None):
        pool = getattr(jaxpool, op)

        def grad(v, d, pool=pool, impl=impl):
          return jax.vjp(lambda u: pool(u, **kw, implementation=impl), v)[1](d)[0]

        def chain(v, *ds, grad=grad):
          # Unrolled on purpose: a lax.fori_loop is an XLA while loop, whose trips a GPU
          # syncs with the host. Each call's input is the previous call's gradient; every
          # gradient is returned (the average pool's do not feed the next call, and XLA would
          # drop all but the last).
          dxs = []
          for d in ds:
            v = grad(v, d)
            dxs.append(v)
          return tuple(dxs)

        fn, chain_fn = jax.jit(grad), jax.jit(chain)
        ref = chain_ref = None
        for split, spec in (("one GPU", None), ("batch", P("d")), ("depth", P(None, "d"))):
          if spec is None:
            put = functools.partial(jax.device_put, device=jax.devices()[0])
          else:
            put = functools.partial(jax.device_put, device=NamedSharding(m, spec))
          args = [put(a) for a in (x, dy)]
          compiled = fn.lower(*args).compile()
          out = compiled(*args)
          if ref is None:
            ref = np.asarray(out.astype(jnp.float32))
          same = bool(np.array_equal(np.asarray(out.astype(jnp.float32)), ref))
          row = dict(part="pool", dtype=jnp.dtype(dtype).name, op=op,
                     impl="jaxpool" if impl is None else "reduce_window", split=split,
                     devices=1 if spec is None else N, ms=timed(compiled, *args),
                     equal_to_one_gpu=same,
                     in_spec=str(getattr(args[0].sharding, "spec", "")),
                     out_spec=str(getattr(out.sharding, "spec", "")),
                     collectives=collectives(compiled))
          if k:
            chain_args = [args[0]] + [put(d) for d in dys]
            chain_compiled = chain_fn.lower(*chain_args).compile()
            chain_out = chain_compiled(*chain_args)[-1]
            if chain_ref is None:
              chain_ref = np.asarray(chain_out.astype(jnp.float32))
            row.update(
              chain=k, chain_ms=timed(chain_compiled, *chain_args) / k,
              chain_equal_to_one_gpu=bool(np.array_equal(
                np.asarray(chain_out.astype(jnp.float32)), chain_ref)),
              chain_out_spec=str(getattr(chain_out.sharding, "spec", "")),
              chain_collectives=collectives(chain_compiled))
          record(row)


# ----------------------------------------------------------------------------- weak scaling

HLO_DTYPES = {"pred": np.bool_, "s8": np.int8, "u8": np.uint8, "s16": np.int16,
              "u16": np.uint16, "s32": np.int32, "u32": np.uint32, "s64": np.int64,
              "u64": np.uint64, "f16": np.float16, "bf16": jnp.bfloat16, "f32": np.float32,
              "f64": np.float64}


def permutes(compiled) -> list[tuple[str, tuple[int, ...], tuple[tuple[int, int], ...]]]:
  """The collective-permutes of a compiled program: each one's dtype (HLO's name), the shape
  of the piece each device sends, and its (source, target) device pairs."""
  out = []
  op = re.compile(r" collective-permute(-start)?\(")
  for line in compiled.as_text().splitlines():
    m = op.search(line)
    eq = line.find(" = ")
    if m is None or eq < 0 or eq > m.start():
      continue
    # (an asynchronous -start's result is a tuple whose first array is the piece sent)
    piece = re.search(r"(\w+)\[([\d,]*)\]", line[eq:m.start()])
    pairs = re.search(r"source_target_pairs=\{([{}\d,]*)\}", line)
    if piece is None or pairs is None:
      continue
    shape = tuple(int(d) for d in piece.group(2).split(",") if d)
    out.append((piece.group(1), shape,
                tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}",
                                                              pairs.group(1)))))
  return out


def in_flight(compiled) -> dict[str, int] | None:
  """What the compiled program's schedule runs while a halo is in flight: the custom calls
  (the kernels) and fusions between an asynchronous collective-permute's ``-start`` and its
  ``-done`` in the entry computation; None where no permute is asynchronous (XLA:CPU's are
  not). Zero custom calls there: the exchange does not overlap the kernels."""
  text = compiled.as_text()
  entry = text[text.find("\nENTRY"):] if "\nENTRY" in text else ""
  started: set[str] = set()
  counts = {"custom-call": 0, "fusion": 0}
  seen = False
  for line in entry.splitlines()[1:]:
    if line.startswith("}"):
      break
    name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    if " collective-permute-start(" in line and name:
      started.add(name.group(1))
      seen = True
    elif " collective-permute-done(" in line:
      done = re.search(r"collective-permute-done\(%?([\w.\-]+)", line)
      started.discard(done.group(1) if done else "")
    elif started:
      for op in counts:
        if f" {op}(" in line:
          counts[op] += 1
  return counts if seen else None


def halo_floor(m, exchanged, k: int):
  """The collective-permutes ``exchanged`` (:func:`permutes` of a split program on the mesh
  ``m``) with nothing else: a program of one exchange, and one of ``k`` exchanges in a chain,
  each sending on the pieces the one before received; and their arguments (each device's
  pieces, zeros)."""
  axes = tuple(m.axis_names)
  spec = P(axes)

  def chained(times):
    def exchange(*pieces):
      for _ in range(times):
        pieces = tuple(lax.ppermute(piece, axes, pairs)
                       for piece, (_, _, pairs) in zip(pieces, exchanged, strict=False))
      return pieces
    specs = (spec,) * len(exchanged)
    return jax.jit(jax.shard_map(exchange, mesh=m, in_specs=specs, out_specs=specs))

  args = [jax.device_put(np.zeros((m.size * shape[0], *shape[1:]), HLO_DTYPES[dtype]),
                         NamedSharding(m, spec))
          for dtype, shape, _ in exchanged]
  return chained(1), chained(k), args


@jax.jit
def same_bits(a, b):
  """Whether ``a`` and ``b`` hold the same bits (signed zeros and NaNs told apart)."""
  kind = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
  return jnp.array_equal(lax.bitcast_convert_type(a, kind), lax.bitcast_convert_type(b, kind))


def weak_layouts() -> list[tuple[str, int, tuple[int, ...]]]:
  """(split, devices, mesh shape) of each weak-scaling run: depth over every count, depth x
  height (a mesh of n/2 x 2) over the even counts from 4."""
  return ([("depth", n, (n,)) for n in COUNTS]
          + [("depth x height", n, (n // 2, 2)) for n in COUNTS if n >= 4 and n % 2 == 0])


def out_of_time() -> bool:
  return bool(ARGS.budget) and time.perf_counter() - START > ARGS.budget


def weak_part():
  kw = dict(window_shape=(3, 3, 3), strides=(2, 2, 2), padding=1)
  block = ARGS.block
  k = max(ARGS.chain, 1)
  dev0 = jax.devices()[0]
  for dtype_name in ARGS.dtypes:
    dtype = jnp.dtype(dtype_name)
    for split, n, mesh_shape in weak_layouts():
      shape = list(block)
      for dim, ways in zip((1, 2), mesh_shape, strict=False):
        shape[dim] *= ways
      shape = tuple(shape)
      base = dict(part="weak", dtype=dtype_name, split=split, devices=n,
                  mesh=list(mesh_shape), block=list(block), global_shape=list(shape), chain=k)
      if out_of_time():
        for op in ARGS.ops:
          for impl in ("jaxpool", "reduce_window"):
            record(dict(base, kind="pool", op=op, impl=impl, error="skipped: --budget spent"))
        continue
      # The whole problem on the first device (the reference), drawn there at random: each
      # call's input and its own cotangent (the average pool's gradient does not read its
      # input, so K calls on one cotangent would merge into one).
      y_shape = jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw),
                               jax.ShapeDtypeStruct(shape, dtype)).shape
      keys = jax.random.split(jax.random.key(n), k + 1)
      draw = jax.jit(jax.random.normal, static_argnums=(1, 2))
      x = draw(keys[0], shape, dtype)
      dys = [draw(key, y_shape, dtype) for key in keys[1:]]
      if n == 1:
        m, put = None, functools.partial(jax.device_put, device=dev0)
      else:
        axes = ("d", "h")[:len(mesh_shape)]
        m = jax.make_mesh(mesh_shape, axes, axis_types=(AxisType.Auto,) * len(axes),
                          devices=jax.devices()[:n])
        spec = P(None, *axes)
        put = functools.partial(jax.device_put, device=NamedSharding(m, spec))
      args = [put(x)] + [put(d) for d in dys]
      for op in ARGS.ops:
        pool = getattr(jaxpool, op)
        for impl, impl_name in (("pallas", "jaxpool"), ("xla", "reduce_window")):
          row = dict(base, kind="pool", op=op, impl=impl_name)
          try:
            weak_run(row, pool, kw, impl, x, dys, args, m, k, dev0)
          except Exception as e:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            record(row)
      del x, dys, args


def weak_run(row, pool, kw, impl, x, dys, args, m, k, dev0):
  """One weak-scaling row (and, before a jaxpool split, its halo floor's row)."""
  def fwd_grad(v, d):
    y, vjp = jax.vjp(lambda u: pool(u, **kw, implementation=impl), v)
    return y, vjp(d)[0]

  def chain(v, *ds):
    # Unrolled (see the pool part): call k+1's input is call k's gradient; every output and
    # gradient is returned.
    outs = []
    for d in ds:
      y, v = fwd_grad(v, d)
      outs += [y, v]
    return tuple(outs)

  single = jax.jit(fwd_grad).lower(args[0], args[1]).compile()
  if m is not None and row["impl"] == "jaxpool":
    exchanged = permutes(single)
    one, many, pieces = halo_floor(m, exchanged, row["chain"])
    one = one.lower(*pieces).compile()
    many = one if row["chain"] == 1 else many.lower(*pieces).compile()
    nbytes = sum(int(np.prod(s)) * jnp.dtype(HLO_DTYPES[d]).itemsize for d, s, _ in exchanged)
    record(dict(row, kind="halo", impl="ppermute", permutes=len(exchanged),
                pieces=[f"{d}{list(s)}" for d, s, _ in exchanged], halo_bytes=nbytes,
                ms=timed(one, *pieces), chain_ms=timed(many, *pieces) / row["chain"],
                collectives=collectives(many)))
  out = single(args[0], args[1])
  out_spec = str(getattr(out[1].sharding, "spec", ""))
  if m is None:
    same = None  # (this is the one device)
  else:  # the whole problem on one device, the same implementation
    try:
      ref = jax.jit(fwd_grad)(x, dys[0])
      same = all(bool(same_bits(jax.device_put(o, dev0), r)) for o, r in zip(out, ref, strict=True))
      del ref
    except Exception as e:  # noqa: BLE001 - e.g. the whole problem does not fit one device
      same = None
      row["reference_error"] = f"{type(e).__name__}: {e}"[:300]
  del out
  # (a chain of one call is the single call)
  chained = single if row["chain"] == 1 else jax.jit(chain).lower(*args).compile()
  row.update(ms=timed(single, args[0], args[1]),
             chain_ms=timed(chained, *args) / row["chain"],
             equal_to_one_device=same, out_spec=out_spec,
             collectives=collectives(single), chain_collectives=collectives(chained),
             during_exchange=in_flight(single))
  record(row)


# ----------------------------------------------------------------------------- VGG


def fsdp_spec(shape, n: int) -> P:
  """An array's split over ``n`` devices in the ``fsdp`` mode: along its largest dim that the
  devices divide; whole on every device if it is small (under 64 Ki elements: biases, scales)
  or no dim fits."""
  dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % n == 0]
  if int(np.prod(shape, dtype=np.int64)) < 2**16 or not dims:
    return P()
  return P(*["d" if d == dims[0] else None for d in range(len(shape))])


def fsdp_shardings(m, tree):
  """:func:`fsdp_spec`'s split of every array of ``tree`` on the mesh ``m``."""
  return jax.tree.map(lambda a: NamedSharding(m, fsdp_spec(a.shape, m.size)), tree)


def dp_counts() -> list[tuple[int, list[str]]]:
  """Each device count of the data-parallel parts with its modes: one device alone (the
  baseline) on a count of one, else the modes of ``--modes``."""
  return [(n, ["one GPU"] if n == 1 else [m for m in VGG_MODES if m in ARGS.modes])
          for n in COUNTS]


def vgg_part():
  import flax_vgg
  import optax
  per = 2 if SMOKE else ARGS.per_gpu
  model, all_images, all_labels, params = flax_vgg.benchmark_setup(per * max(COUNTS),
                                                                   small=SMOKE)
  optimizer = optax.sgd(0.01, momentum=0.9)
  opt_state = optimizer.init(params)

  def loss_fn(apply):
    def loss(p, x, y):
      logits = apply(p, x).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss

  def make_step(apply, pmean_axis=None, whole=None, split=None):
    """The training step; with ``whole`` (a sharding) and ``split`` (a tree of them) the
    parameters come in split, are gathered to ``whole`` for the model, and the gradients are
    split back."""
    loss = loss_fn(apply)

    def step(p, s, x, y):
      full = p if whole is None else jax.lax.with_sharding_constraint(p, whole)
      value, grads = jax.value_and_grad(loss)(full, x, y)
      if split is not None:
        grads = jax.lax.with_sharding_constraint(grads, split)
      if pmean_axis is not None:
        value, grads = jax.lax.pmean((value, grads), pmean_axis)
      updates, s = optimizer.update(grads, s, p)
      return optax.apply_updates(p, updates), s, value
    return step

  def fsdp_bf16_step(apply, split_dims, n):
    """The step on one GPU's part (inside ``shard_map`` over ``n`` GPUs): ``split_dims``
    gives each parameter's split dim (None: whole on every GPU)."""
    loss = loss_fn(apply)

    def gather(a, dim):
      a = a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a
      return a if dim is None else jax.lax.all_gather(a, "d", axis=dim, tiled=True)

    def step(p, s, x, y):
      def local(q):
        leaves, tree = jax.tree.flatten(q)
        return loss(tree.unflatten([gather(a, d)
                                    for a, d in zip(leaves, split_dims, strict=True)]), x, y)
      value, grads = jax.value_and_grad(local)(p)
      # Each gradient is now the sum over the GPUs of theirs (a split parameter's by the
      # all-gather's transpose, a reduce-scatter; a whole one's by shard_map's: its gradient is
      # summed where it is used unsplit); the loss is each GPU's mean over its images.
      grads = jax.tree.map(lambda g: g / n, grads)
      updates, s = optimizer.update(grads, s, p)
      return optax.apply_updates(p, updates), s, jax.lax.pmean(value, "d")
    return step

  import flax.linen as nn
  max_pool = nn.max_pool
  before = [np.asarray(a, np.float32) for a in jax.tree.leaves(params)]

  def update_gap(new, ref):
    """The largest relative difference of one array's update from one GPU's update."""
    return float(max(np.linalg.norm(n - r) / max(float(np.linalg.norm(r - b)), 1e-30)
                     for n, r, b in zip(new, ref, before, strict=True)))

  try:
    for variant in ARGS.variants:
      apply = jaxpool.optimize(model.apply) if variant == "optimize" else model.apply
      # (the model calls nn.max_pool as each step is traced, within this variant's loop)
      nn.max_pool = flax_vgg.strided_slice_pool if variant == "no_pool" else max_pool
      for n, modes in dp_counts():
        images, labels = all_images[:per * n], all_labels[:per * n]
        ref_loss = ref_norms = ref_new = None
        for mode in modes:
          step = make_step(apply, "d" if mode == "shard_map" else None)
          counts = None
          devices = 1 if mode == "one GPU" else n
          what = dict(part="vgg", variant=variant, mode=mode, devices=devices,
                      global_batch=per * n, per_gpu=per)
          if out_of_time():
            record(dict(what, error="skipped: --budget spent"))
            continue
          try:
            t0 = time.perf_counter()  # (first_step_s: compile and first step, in every mode)
            if mode in ("fsdp", "fsdp_bf16"):
              m = mesh(n=n)
              args = (jax.device_put(params, fsdp_shardings(m, params)),
                      jax.device_put(opt_state, fsdp_shardings(m, opt_state)),
                      jax.device_put(images, NamedSharding(m, P("d"))),
                      jax.device_put(labels, NamedSharding(m, P("d"))))
              if mode == "fsdp":
                fn = jax.jit(make_step(apply, whole=NamedSharding(m, P()),
                                       split=fsdp_shardings(m, params)))
              else:
                specs = jax.tree.map(lambda a, n=n: fsdp_spec(a.shape, n), params)
                state_specs = jax.tree.map(lambda a, n=n: fsdp_spec(a.shape, n),
                                           opt_state)
                dims = [next((i for i, e in enumerate(sp) if e == "d"), None)
                        for sp in jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P))]
                fn = jax.jit(jax.shard_map(fsdp_bf16_step(apply, dims, n), mesh=m,
                                           in_specs=(specs, state_specs, P("d"), P("d")),
                                           out_specs=(specs, state_specs, P())))
              fn = fn.lower(*args).compile()
              counts = collectives(fn)
            elif mode == "one GPU":
              one = jax.devices()[0]
              args = jax.device_put((params, opt_state, images, labels), one)
              fn = jax.jit(step)
            elif mode in ("auto", "explicit"):
              m = mesh(AxisType.Auto if mode == "auto" else AxisType.Explicit, n=n)
              rep, data = NamedSharding(m, P()), NamedSharding(m, P("d"))
              args = (jax.device_put(params, rep), jax.device_put(opt_state, rep),
                      jax.device_put(images, data), jax.device_put(labels, data))
              fn = jax.jit(step)
              if mode == "explicit":
                with jax.set_mesh(m):
                  compiled = fn.lower(*args).compile()
              else:
                compiled = None
              fn = compiled or fn
            else:
              m = mesh(n=n)
              rep, data = NamedSharding(m, P()), NamedSharding(m, P("d"))
              args = (jax.device_put(params, rep), jax.device_put(opt_state, rep),
                      jax.device_put(images, data), jax.device_put(labels, data))
              fn = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(), P(), P("d"), P("d")),
                                         out_specs=(P(), P(), P())))
            out = jax.block_until_ready(fn(*args))
            first_s = time.perf_counter() - t0
            loss = float(out[2])
            new = [np.asarray(a.astype(jnp.float32)) for a in jax.tree.leaves(out[0])]
            norms = np.asarray([float(np.linalg.norm(a)) for a in new])
            del out
            if mode == "one GPU":
              ref_loss, ref_norms, ref_new = loss, norms, new
            ms = timed(lambda fn=fn, args=args: fn(*args)[2])
            loop_ms = (timed_loop(fn, args[:2], args[2:], ARGS.steps,
                                  reps=max(ARGS.reps // 4, 3)) if ARGS.steps else None)
            row = dict(what, ms=ms, loop_ms=loop_ms, loop_steps=ARGS.steps,
                       first_step_s=first_s, loss=loss,
                       loss_vs_one_gpu=None if ref_loss is None else abs(loss - ref_loss),
                       params_vs_one_gpu=None if ref_loss is None else float(
                         np.max(np.abs(norms - ref_norms) / np.maximum(ref_norms, 1e-30))),
                       update_vs_one_gpu=None if ref_new is None else update_gap(new, ref_new))
            if counts is not None:
              row["collectives"] = counts
          except Exception as e:  # noqa: BLE001 - reported in the table
            row = dict(what, error=f"{type(e).__name__}: {e}"[:300])
          record(row)
  finally:
    nn.max_pool = max_pool


# ----------------------------------------------------------------------------- ResNet-50


def resnet50_part():
  import models_gpu
  import optax
  per = 2 if SMOKE else ARGS.per_gpu
  cfg = models_gpu.CONFIGS["flax_resnet50"][1 if SMOKE else 0]
  work = models_gpu.flax_workload("flax_resnet50", "bfloat16", cfg, per * max(COUNTS))
  params, state, all_images, all_labels = work.args
  optimizer = optax.sgd(0.01, momentum=0.9)
  opt_state = optimizer.init(params)

  def make_step(loss):
    def step(p, s, o, x, y):
      (value, s), grads = jax.value_and_grad(loss, has_aux=True)(p, s, x, y)
      updates, o = optimizer.update(grads, o, p)
      return optax.apply_updates(p, updates), s, o, value
    return jax.jit(step)

  for variant in [v for v in ARGS.variants if v in ("plain", "optimize")]:
    step = make_step(jaxpool.optimize(work.loss) if variant == "optimize" else work.loss)
    for n, modes in dp_counts():
      images, labels = all_images[:per * n], all_labels[:per * n]
      ref_loss = None
      for mode in [m for m in modes if m in ("one GPU", "auto")]:
        devices = 1 if mode == "one GPU" else n
        what = dict(part="resnet50", model="flax_resnet50", dtype="bfloat16", variant=variant,
                    mode=mode, devices=devices, global_batch=per * n, per_gpu=per,
                    image_size=cfg["size"])
        if out_of_time():
          record(dict(what, error="skipped: --budget spent"))
          continue
        try:
          t0 = time.perf_counter()
          if mode == "one GPU":
            args = jax.device_put((params, state, opt_state, images, labels), jax.devices()[0])
          else:
            m = mesh(n=n)
            rep, data = NamedSharding(m, P()), NamedSharding(m, P("d"))
            args = (*jax.device_put((params, state, opt_state), rep),
                    jax.device_put(images, data), jax.device_put(labels, data))
          compiled = step.lower(*args).compile()
          loss = float(jax.block_until_ready(compiled(*args))[3])
          first_s = time.perf_counter() - t0
          if mode == "one GPU":
            ref_loss = loss
          row = dict(what, ms=timed(lambda c=compiled, a=args: c(*a)[3]),
                     loop_ms=(timed_loop(compiled, args[:3], args[3:], ARGS.steps,
                                         reps=max(ARGS.reps // 4, 3)) if ARGS.steps else None),
                     loop_steps=ARGS.steps, first_step_s=first_s, loss=loss,
                     loss_vs_one_gpu=None if ref_loss is None else abs(loss - ref_loss),
                     collectives=collectives(compiled))
          del args
        except Exception as e:  # noqa: BLE001 - reported in the table
          row = dict(what, error=f"{type(e).__name__}: {e}"[:300])
        record(row)


# ----------------------------------------------------------------------------- U-Net


def unet_part():
  import flax.linen as nn
  import optax

  class UNet3D(nn.Module):
    width: int = 8 if SMOKE else 16

    @nn.compact
    def __call__(self, x):
      w = self.width
      a = nn.relu(nn.Conv(w, (3, 3, 3), dtype=jnp.bfloat16)(x))
      b = nn.max_pool(a, (2, 2, 2), (2, 2, 2))
      b = nn.relu(nn.Conv(2 * w, (3, 3, 3), dtype=jnp.bfloat16)(b))
      c = nn.max_pool(b, (2, 2, 2), (2, 2, 2))
      c = nn.relu(nn.Conv(4 * w, (3, 3, 3), dtype=jnp.bfloat16)(c))
      u = jax.image.resize(c, b.shape[:-1] + (c.shape[-1],), "nearest")
      b = nn.relu(nn.Conv(2 * w, (3, 3, 3), dtype=jnp.bfloat16)(jnp.concatenate([b, u], -1)))
      u = jax.image.resize(b, a.shape[:-1] + (b.shape[-1],), "nearest")
      a = nn.relu(nn.Conv(w, (3, 3, 3), dtype=jnp.bfloat16)(jnp.concatenate([a, u], -1)))
      return nn.Conv(2, (1, 1, 1), dtype=jnp.bfloat16)(a)

  volume = ARGS.volume
  model = UNet3D()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, *volume, 1)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 2, (1, *volume)), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), x[:, :4, :4, :4])

  def loss(p, apply, v, t):
    logits = apply(p, v).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

  for variant in ("plain", "optimize"):
    apply = model.apply if variant == "plain" else jaxpool.optimize(model.apply)
    fn = jax.jit(lambda p, v, t, apply=apply: jax.value_and_grad(loss)(p, apply, v, t))
    one_loss = None
    for n in COUNTS:
      what = dict(part="unet", variant=variant, devices=n, volume=list(volume),
                  split="one GPU" if n == 1 else "depth")
      if out_of_time():
        record(dict(what, error="skipped: --budget spent"))
        continue
      try:
        if volume[0] % (4 * n):
          raise ValueError(f"the volume's depth {volume[0]} does not split into {n} blocks "
                           f"that two 2x2x2 pools divide")
        if n == 1:
          args = jax.device_put((params, x, y), jax.devices()[0])
        else:
          m = mesh(n=n)
          rep, depth = NamedSharding(m, P()), NamedSharding(m, P(None, "d"))
          args = (jax.device_put(params, rep), jax.device_put(x, depth),
                  jax.device_put(y, depth))
        compiled = fn.lower(*args).compile()
        value = float(compiled(*args)[0])
        if n == 1:
          one_loss = value
        row = dict(what, ms=timed(compiled, *args), loss=value,
                   loss_vs_one_gpu=None if one_loss is None else abs(value - one_loss),
                   collectives=collectives(compiled))
        del args
      except Exception as e:  # noqa: BLE001 - e.g. out of memory on one GPU
        row = dict(what, error=f"{type(e).__name__}: {e}"[:300])
      record(row)


# ----------------------------------------------------------------------------- results

KEY = ("part", "kind", "model", "dtype", "op", "impl", "split", "devices", "mesh", "block",
       "variant", "mode", "global_batch", "volume")


def row_key(r: dict) -> str:
  """A row's identity: a later run's row of the same key replaces it in the JSON file."""
  return json.dumps([r.get(k) for k in KEY])


def record(row: dict) -> None:
  ROWS.append(row)
  print(json.dumps(row), flush=True)
  if OUT:
    save(OUT)


def _ratio(a: dict, b: dict) -> float:
  """``a``'s step time over ``b``'s: ``loop_ms`` where both have it, else ``ms``."""
  field = "loop_ms" if a.get("loop_ms") and b.get("loop_ms") else "ms"
  return a[field] / b[field]


def derive(rows: list[dict]) -> None:
  """Adds each row's efficiency and comparisons (from whatever rows the file holds)."""
  def find(**match):
    for r in rows:
      if all(r.get(f) == v for f, v in match.items()) and "error" not in r:
        return r
    return None

  for r in rows:
    if "error" in r:
      continue
    if r["part"] == "weak" and r.get("kind") == "pool":
      one = find(part="weak", kind="pool", dtype=r["dtype"], op=r["op"], impl=r["impl"],
                 devices=1, block=r.get("block"))
      if one is not None and r.get("chain_ms"):
        r["efficiency"] = one["chain_ms"] / r["chain_ms"]
      if r["impl"] == "jaxpool" and r.get("chain_ms"):
        same = dict(part="weak", dtype=r["dtype"], op=r["op"], split=r["split"],
                    devices=r["devices"], block=r.get("block"))
        xla = find(kind="pool", impl="reduce_window", **same)
        halo = find(kind="halo", **same)
        if xla is not None:
          r["vs_reduce_window"] = xla["chain_ms"] / r["chain_ms"]
        if halo is not None:
          r["halo_share"] = halo["chain_ms"] / r["chain_ms"]
    elif r["part"] in ("vgg", "resnet50") and r.get("per_gpu"):
      base = dict(part=r["part"], variant=r["variant"], mode="one GPU", devices=1)
      one = find(global_batch=r["per_gpu"], **base)  # one GPU, its own images
      whole = find(global_batch=r["global_batch"], **base)  # one GPU, every GPU's images
      if one is not None and (r["mode"] != "one GPU" or r["global_batch"] == r["per_gpu"]):
        r["efficiency"] = _ratio(one, r)
      if whole is not None and r["mode"] != "one GPU":
        r["speedup_vs_one_gpu"] = _ratio(whole, r)
    elif r["part"] == "unet" and "volume" in r:
      one = find(part="unet", variant=r["variant"], devices=1, volume=r["volume"])
      plain = find(part="unet", variant="plain", devices=r["devices"], volume=r["volume"])
      if one is not None:
        r["speedup"] = one["ms"] / r["ms"]
      if plain is not None:
        r["vs_plain"] = plain["ms"] / r["ms"]


def save(path: str) -> None:
  """Writes this run's rows into ``path``, keeping the rows of other configurations that an
  earlier run wrote there."""
  old: dict = {}
  if os.path.exists(path):
    old = json.loads(Path(path).read_text())
  mine = {row_key(r) for r in ROWS}
  rows = [r for r in old.get("rows", []) if row_key(r) not in mine] + ROWS
  derive(rows)
  flags, tune = os.environ.get("XLA_FLAGS", ""), os.environ.get("JAXPOOL_TUNE", "")
  runs = dict(old.get("runs", {}))
  for part in ARGS.parts:
    runs[part] = dict(jax=jax.__version__, devices=N, xla_flags=flags, jaxpool_tune=tune,
                      argv=sys.argv[1:], date=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                             time.gmtime()))
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(path + ".tmp")
  tmp.write_text(json.dumps(dict(
    device=jax.devices()[0].device_kind, devices=N, jax=jax.__version__,
    xla_flags=flags, jaxpool_tune=tune, chain=ARGS.chain, runs=runs, rows=rows), indent=1))
  os.replace(tmp, path)


# ----------------------------------------------------------------------------- output


def _f(v, spec=".3f") -> str:
  return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
  lines = [f"devices: {N} x {jax.devices()[0].device_kind}, jax {jax.__version__}",
           f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')!r}",
           f"JAXPOOL_TUNE: {os.environ.get('JAXPOOL_TUNE', '')!r}"]
  if any(r["part"] == "pool" and "chain_ms" in r for r in rows):
    lines.append(f"pool: ms = one call; chain = per gradient in one program of {ARGS.chain} "
                 f"chained gradients")
  if any(r["part"] == "weak" for r in rows):
    lines.append("weak: chain_ms = one forward and gradient in a chain of them; eff = one "
                 "device's chain_ms over this one's; xla/x = reduce_window's over jaxpool's; "
                 "halo = the halo floor's share")
  for r in rows:
    if "error" in r:
      what = " ".join(str(r.get(k, "")) for k in ("dtype", "op", "impl", "split", "variant",
                                                  "mode", "devices") if k in r)
      lines.append(f"{r['part']:8} {what}: {r['error']}")
    elif r["part"] == "pool":
      chain = ""
      if "chain_ms" in r:
        counts = {c: n for c, n in r["chain_collectives"].items() if not c.endswith("elems")}
        chain = (f" chain {r['chain_ms']:8.3f} ms equal={r['chain_equal_to_one_gpu']} "
                 f"out {r['chain_out_spec']} {counts}")
      lines.append(f"pool     {r['dtype']:8} {r['op']:8} {r['impl']:13} {r['split']:8} "
                   f"{r['ms']:8.3f} ms  equal={r['equal_to_one_gpu']} out {r['out_spec']} "
                   f"{r['collectives']}{chain}")
    elif r["part"] == "weak" and r["kind"] == "halo":
      lines.append(f"weak     {r['dtype']:8} {r['op']:8} {'halo alone':13} {r['split']:14} "
                   f"x{r['devices']} chain {r['chain_ms']:8.3f} ms  one {r['ms']:8.3f} ms  "
                   f"{r['permutes']} permutes, {r['halo_bytes'] / 2**20:.2f} MiB")
    elif r["part"] == "weak":
      equal = "ref" if r["devices"] == 1 else r["equal_to_one_device"]
      lines.append(f"weak     {r['dtype']:8} {r['op']:8} {r['impl']:13} {r['split']:14} "
                   f"x{r['devices']} chain {r['chain_ms']:8.3f} ms  one {r['ms']:8.3f} ms  "
                   f"eff {_f(r.get('efficiency'), '.2f')}  "
                   f"xla/x {_f(r.get('vs_reduce_window'), '.1f')}  "
                   f"halo {_f(r.get('halo_share'), '.2f')}  equal={equal}")
    elif r["part"] in ("vgg", "resnet50"):
      d = r.get("loss_vs_one_gpu")
      loop = "" if r.get("loop_ms") is None else f" loop {r['loop_ms']:8.2f} ms"
      params = ("" if r.get("params_vs_one_gpu") is None else
                f", params {r['params_vs_one_gpu']:.1e}, update "
                f"{r.get('update_vs_one_gpu') or 0:.1e}")
      lines.append(f"{r['part']:8} {r['variant']:8} {r['mode']:9} x{r['devices']} "
                   f"batch {r.get('global_batch', '?'):>4} {r['ms']:8.2f} ms{loop}  "
                   f"eff {_f(r.get('efficiency'), '.2f')}  loss {r['loss']:.5f} "
                   f"(|d| vs 1 GPU {'n/a' if d is None else f'{d:.1e}'}{params})"
                   + (f" {r['collectives']}" if r["part"] == "vgg" and "collectives" in r
                      else ""))
    else:
      lines.append(f"unet     {r['variant']:8} {r.get('split', 'depth'):7} x{r['devices']} "
                   f"{'x'.join(map(str, r.get('volume', [])))} {r['ms']:8.2f} ms  "
                   f"speed-up {_f(r.get('speedup'), '.2f')}  vs plain "
                   f"{_f(r.get('vs_plain'), '.2f')}  {r['collectives']}")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str | None:
  """The efficiency plot of ``rows`` (weak scaling, data parallel, the U-Net's speed-up) as a
  PNG at ``path``; None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("--plot: matplotlib is not installed; no plot written", flush=True)
    return None
  panels = []
  weak = [r for r in rows if r["part"] == "weak" and r.get("kind") == "pool"
          and r.get("efficiency")]
  for split in ("depth", "depth x height"):
    lines: dict[str, list] = {}
    for r in weak:
      if r["split"] == split or r["devices"] == 1:
        lines.setdefault(f"{r['op']} {r['dtype']} {r['impl']}", []).append(
          (r["devices"], r["efficiency"]))
    if any(n > 1 for pts in lines.values() for n, _ in pts):
      panels.append((f"weak scaling, split along {split}", "efficiency", lines))
  dp = [r for r in rows if r["part"] in ("vgg", "resnet50") and r.get("efficiency")
        and r["mode"] in ("auto", "one GPU")]
  lines = {}
  for r in dp:
    lines.setdefault(f"{r['part']} {r['variant']}", []).append((r["devices"], r["efficiency"]))
  if lines:
    panels.append(("data parallel (Auto mesh)", "efficiency", lines))
  unet = [r for r in rows if r["part"] == "unet" and r.get("speedup")]
  lines = {}
  for r in unet:
    lines.setdefault(f"U-Net {r['variant']}", []).append((r["devices"], r["speedup"]))
  if lines:
    panels.append(("3-D U-Net step, one volume split along depth", "speed-up over one GPU",
                   lines))
  if not panels:
    print("--plot: no rows with an efficiency to plot", flush=True)
    return None
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
  for ax, (title, ylabel, lines) in zip(axes[0], panels, strict=True):
    for label, pts in sorted(lines.items()):
      pts = sorted(set(pts))
      ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({n for pts in lines.values() for n, _ in pts})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("devices")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  most = max(r.get("devices", 1) for r in rows)
  fig.suptitle(f"benchmarks/multi_gpu.py: {jax.devices()[0].device_kind}, up to {most} devices",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


if __name__ == "__main__":
  parts = {"pool": pool_part, "weak": weak_part, "vgg": vgg_part, "resnet50": resnet50_part,
           "unet": unet_part}
  for name in ARGS.parts:
    parts[name]()
  derive(ROWS)
  print(table(ROWS))
  if OUT:
    save(OUT)  # (also with no part run: the derived fields of what the file holds)
    print(f"wrote {OUT}", flush=True)
    if ARGS.plot:
      png = plot(json.loads(Path(OUT).read_text())["rows"], str(Path(OUT).with_suffix(".png")))
      if png:
        print(f"wrote {png}", flush=True)
  elif ARGS.plot:
    print("--plot needs a JSON file (--out)", flush=True)
