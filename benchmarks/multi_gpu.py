"""jaxpool on several GPUs: pooling gradients and training steps, split over the devices.

Parts (``--parts``, comma-separated):

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
* ``vgg``: an unmodified Flax VGG-16 training step (224x224, bfloat16, ``--per-gpu`` images per
  GPU) with and without ``jaxpool.optimize``: the global batch on one GPU, and split over every
  GPU on an Auto mesh, on an Explicit mesh and inside ``shard_map``, and (``fsdp``) on an Auto
  mesh with the parameters and the optimizer state split over the GPUs as well: each array
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
  step's loss and updated parameters are compared with one GPU's: ``params_vs_one_gpu``, the
  largest relative difference of an array's norm, and ``update_vs_one_gpu``, of an array's
  update (new minus initial values, as a whole). Two times a row: ``ms``, one step a sample (a
  wait after every step), and ``loop_ms``, ``--steps`` K steps a sample (10; 0: none) run as a
  training loop runs them, each step taking the parameters and optimizer state the one before
  returned, with one wait after the last, divided by K.
* ``unet``: a 3-D U-Net-style training step (Flax) on a volume split along depth over every GPU,
  with and without ``jaxpool.optimize``.

Prints a table and writes JSON with ``XLA_FLAGS`` and ``JAXPOOL_TUNE`` as they were
(``xla_flags``, ``jaxpool_tune``): to ``--out``, by default
``benchmarks/results/multi_gpu_<gpu>x<N>.json`` (``multi_gpu_h100x2.json`` on two H100s). With
``--cpu-devices N`` it runs on N forced CPU devices at toy sizes (a smoke test of the script,
not a measurement), which goes to ``build/benchmarks/`` unless ``--out`` says otherwise.

    python benchmarks/multi_gpu.py
    python benchmarks/multi_gpu.py --parts vgg --modes "one GPU,auto"
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


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parts", default="pool,vgg,unet")
  p.add_argument("--per-gpu", type=int, default=64, help="VGG images per GPU")
  p.add_argument("--variants", default="plain,optimize",
                 help="VGG variants, comma-separated, from plain, optimize, no_pool (every max "
                      "pool replaced by a strided slice: how the rest of the step scales)")
  p.add_argument("--modes", default=",".join(VGG_MODES),
                 help=f"VGG modes, comma-separated, from {', '.join(VGG_MODES)}")
  p.add_argument("--chain", type=int, default=10,
                 help="pool gradients chained in one program (chain_ms); 0: none")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--steps", type=int, default=10,
                 help="VGG steps a sample of the training-loop timer (loop_ms); 0: none")
  p.add_argument("--out", default=None,
                 help="the JSON file (default: benchmarks/results/multi_gpu_<gpu>x<N>.json)")
  p.add_argument("--cpu-devices", type=int, default=0)
  args = p.parse_args(argv)
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  unknown = [m for m in modes if m not in VGG_MODES]
  if unknown or not modes:
    p.error(f"--modes takes a comma list of {', '.join(VGG_MODES)}; got {args.modes!r}")
  args.modes = modes
  args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  if not args.variants or set(args.variants) - {"plain", "optimize", "no_pool"}:
    p.error(f"--variants takes a comma list of plain, optimize, no_pool; got {args.variants!r}")
  if args.chain < 0:
    p.error(f"--chain must be 0 (off) or a positive count; got {args.chain}")
  return args


ARGS = parse()
if ARGS.cpu_devices:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import jaxpool  # noqa: E402
from result_path import device_tag, result_path  # noqa: E402

SMOKE = bool(ARGS.cpu_devices)
N = jax.device_count()
ROWS: list[dict] = []
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


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


def mesh(kind=AxisType.Auto):
  return jax.make_mesh((N,), ("d",), axis_types=(kind,))


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
          ROWS.append(row)
          print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------- VGG


def fsdp_spec(shape) -> P:
  """An array's split in the ``fsdp`` mode: along its largest dim that the devices divide;
  whole on every device if it is small (under 64 Ki elements: biases, scales) or no dim fits."""
  dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % N == 0]
  if int(np.prod(shape, dtype=np.int64)) < 2**16 or not dims:
    return P()
  return P(*["d" if d == dims[0] else None for d in range(len(shape))])


def fsdp_shardings(m, tree):
  """:func:`fsdp_spec`'s split of every array of ``tree`` on the mesh ``m``."""
  return jax.tree.map(lambda a: NamedSharding(m, fsdp_spec(a.shape)), tree)


def vgg_part():
  import flax_vgg
  import optax
  per = 2 if SMOKE else ARGS.per_gpu
  model, images, labels, params = flax_vgg.benchmark_setup(per * N, small=SMOKE)
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

  def fsdp_bf16_step(apply, split_dims):
    """The step on one GPU's part (inside ``shard_map``): ``split_dims`` gives each parameter's
    split dim (None: whole on every GPU)."""
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
      grads = jax.tree.map(lambda g: g / N, grads)
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
      ref_loss = ref_norms = ref_new = None
      for mode in [m for m in VGG_MODES if m in ARGS.modes]:
        step = make_step(apply, "d" if mode == "shard_map" else None)
        counts = None
        try:
          t0 = time.perf_counter()  # (first_step_s: compile and first step, in every mode)
          if mode in ("fsdp", "fsdp_bf16"):
            m = mesh()
            args = (jax.device_put(params, fsdp_shardings(m, params)),
                    jax.device_put(opt_state, fsdp_shardings(m, opt_state)),
                    jax.device_put(images, NamedSharding(m, P("d"))),
                    jax.device_put(labels, NamedSharding(m, P("d"))))
            if mode == "fsdp":
              fn = jax.jit(make_step(apply, whole=NamedSharding(m, P()),
                                     split=fsdp_shardings(m, params)))
            else:
              specs = jax.tree.map(lambda a: fsdp_spec(a.shape), params)
              state_specs = jax.tree.map(lambda a: fsdp_spec(a.shape), opt_state)
              dims = [next((i for i, e in enumerate(sp) if e == "d"), None)
                      for sp in jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, P))]
              fn = jax.jit(jax.shard_map(fsdp_bf16_step(apply, dims), mesh=m,
                                         in_specs=(specs, state_specs, P("d"), P("d")),
                                         out_specs=(specs, state_specs, P())))
            fn = fn.lower(*args).compile()
            counts = collectives(fn)
          elif mode == "one GPU":
            one = jax.devices()[0]
            args = jax.device_put((params, opt_state, images, labels), one)
            fn = jax.jit(step)
          elif mode in ("auto", "explicit"):
            m = mesh(AxisType.Auto if mode == "auto" else AxisType.Explicit)
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
            m = mesh()
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
          if mode == "one GPU":
            ref_loss, ref_norms, ref_new = loss, norms, new
          ms = timed(lambda fn=fn, args=args: fn(*args)[2])
          loop_ms = (timed_loop(fn, args[:2], args[2:], ARGS.steps, reps=max(ARGS.reps // 4, 3))
                     if ARGS.steps else None)
          row = dict(part="vgg", variant=variant, mode=mode, devices=1 if mode == "one GPU" else N,
                     global_batch=per * N, ms=ms, loop_ms=loop_ms, loop_steps=ARGS.steps,
                     first_step_s=first_s, loss=loss,
                     loss_vs_one_gpu=None if ref_loss is None else abs(loss - ref_loss),
                     params_vs_one_gpu=None if ref_loss is None else float(
                       np.max(np.abs(norms - ref_norms) / np.maximum(ref_norms, 1e-30))),
                     update_vs_one_gpu=None if ref_new is None else update_gap(new, ref_new))
          if counts is not None:
            row["collectives"] = counts
        except Exception as e:  # noqa: BLE001 - reported in the table
          row = dict(part="vgg", variant=variant, mode=mode, error=f"{type(e).__name__}: {e}"[:300])
        ROWS.append(row)
        print(json.dumps(row), flush=True)
  finally:
    nn.max_pool = max_pool


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

  side = 16 if SMOKE else 128
  model = UNet3D()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, side * N, side, side, 1)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 2, (1, side * N, side, side)), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), x[:, :side])

  def loss(p, apply, v, t):
    logits = apply(p, v).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

  m = mesh()
  rep, depth = NamedSharding(m, P()), NamedSharding(m, P(None, "d"))
  args = (jax.device_put(params, rep), jax.device_put(x, depth), jax.device_put(y, depth))
  for variant in ("plain", "optimize"):
    apply = model.apply if variant == "plain" else jaxpool.optimize(model.apply)
    fn = jax.jit(lambda p, v, t, apply=apply: jax.value_and_grad(loss)(p, apply, v, t))
    try:
      compiled = fn.lower(*args).compile()
      value = float(compiled(*args)[0])
      row = dict(part="unet", variant=variant, devices=N, volume=list(x.shape[1:4]),
                 split="depth", ms=timed(compiled, *args), loss=value,
                 collectives=collectives(compiled))
    except Exception as e:  # noqa: BLE001
      row = dict(part="unet", variant=variant, error=f"{type(e).__name__}: {e}"[:300])
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def table() -> str:
  lines = [f"devices: {N} x {jax.devices()[0].device_kind}, jax {jax.__version__}",
           f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')!r}",
           f"JAXPOOL_TUNE: {os.environ.get('JAXPOOL_TUNE', '')!r}"]
  if any(r["part"] == "pool" and "chain_ms" in r for r in ROWS):
    lines.append(f"pool: ms = one call; chain = per gradient in one program of {ARGS.chain} "
                 f"chained gradients")
  for r in ROWS:
    if "error" in r:
      lines.append(f"{r['part']:5} {r.get('variant', '')} {r.get('mode', '')}: {r['error']}")
    elif r["part"] == "pool":
      chain = ""
      if "chain_ms" in r:
        counts = {c: n for c, n in r["chain_collectives"].items() if not c.endswith("elems")}
        chain = (f" chain {r['chain_ms']:8.3f} ms equal={r['chain_equal_to_one_gpu']} "
                 f"out {r['chain_out_spec']} {counts}")
      lines.append(f"pool  {r['dtype']:8} {r['op']:8} {r['impl']:13} {r['split']:8} "
                   f"{r['ms']:8.3f} ms  equal={r['equal_to_one_gpu']} out {r['out_spec']} "
                   f"{r['collectives']}{chain}")
    elif r["part"] == "vgg":
      d = r["loss_vs_one_gpu"]
      loop = "" if r.get("loop_ms") is None else f" loop {r['loop_ms']:8.2f} ms"
      lines.append(f"vgg   {r['variant']:8} {r['mode']:9} x{r['devices']} {r['ms']:8.2f} ms"
                   f"{loop}  loss {r['loss']:.5f} "
                   f"(|d| vs 1 GPU {'n/a' if d is None else f'{d:.1e}'}"
                   + (f", params {r['params_vs_one_gpu']:.1e}"
                      f", update {r.get('update_vs_one_gpu') or 0:.1e})"
                      if r.get("params_vs_one_gpu") is not None else ")")
                   + (f" {r['collectives']}" if "collectives" in r else ""))
    else:
      lines.append(f"unet  {r['variant']:8} depth x{r['devices']} {r['ms']:8.2f} ms  "
                   f"{r['collectives']}")
  return "\n".join(lines)


if __name__ == "__main__":
  parts = ARGS.parts.split(",")
  for name in parts:
    {"pool": pool_part, "vgg": vgg_part, "unet": unet_part}[name]()
  print(table())
  if ARGS.out is None:
    ARGS.out = result_path(__file__, device_tag(jax.devices()[0].device_kind, N),
                           quick=bool(ARGS.cpu_devices))
  if ARGS.out:
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(json.dumps(dict(
      device=jax.devices()[0].device_kind, devices=N, jax=jax.__version__,
      xla_flags=os.environ.get("XLA_FLAGS", ""), jaxpool_tune=os.environ.get("JAXPOOL_TUNE", ""),
      chain=ARGS.chain, rows=ROWS), indent=1))
