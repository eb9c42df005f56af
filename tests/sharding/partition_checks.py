"""The Pallas kernels on several devices, against one device.

Run it in its own process: by default with 8 CPU devices, the kernels in interpret mode (what
the test runs)::

  python tests/sharding/partition_checks.py [--quick] [--part spatial|rest]

or on the devices the process has, 2 or more GPUs say, the kernels compiled (every check that
compiles its program asserts that the program calls the compiled kernels)::

  python tests/sharding/partition_checks.py --devices-as-is [--quick]

(``JAXPOOL_CHECK_DEVICES=as-is`` does the same, and makes tests/sharding/test_partitioning.py
run it so: ``JAXPOOL_CHECK_DEVICES=as-is python -m pytest -q
tests/sharding/test_partitioning.py``). The meshes are
``(4, 2)`` on 8 devices (or more: the first 8), ``(2, 2)`` on 4 and ``(2, 1)`` on 2
(``device_checks.mesh_shape``). On 2 devices the checks that split two spatial dims at once,
and those of a partly manual ``shard_map``, are skipped (each needs a second mesh axis of 2
devices or more); the TPU kernels' checks run only on a CPU (the TPU interpreter) or a TPU. A
skipped check prints ``{"name": ..., "ok": true, "skipped": why}``; the summary line says the
platform, the devices and the mesh.

Each check prints one JSON line ``{"name": ..., "ok": bool, "detail": ...}``. A check runs one
kernel op with ``implementation="pallas"`` on sharded inputs and asserts:

* the result equals the same op on one device, bit for bit;
* the result is sharded along the input's sharded dims (no gathered output);
* the compiled program moves no array between devices when batch or channel dims are sharded,
  and, when spatial dims are, only collective-permutes of halo-sized slices (at most
  ``effective window + stride`` rows of a block per message), never an all-gather or
  all-to-all of the input.

The meshes: Auto axes (``jit`` with ``NamedSharding`` inputs: the compiler decides), Explicit
axes (sharding in the types), and a user's ``shard_map`` (``check_vma`` on and off, all axes or
some of them manual).

``--part spatial`` runs the Auto-mesh splits along height, width or a length (the names that
start with one of ``SPATIAL``), ``--part rest`` every other check: the two parts run in two
processes (tests/sharding/test_partitioning_spatial.py and test_partitioning.py), so that
``make test``'s two workers share them; together they are the whole run.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import device_checks  # noqa: E402  (tests/support: run as a script, it is not on the path)

device_checks.prepare(sys.argv)  # 8 CPU devices, unless --devices-as-is

import contextlib  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpool  # noqa: E402

QUICK = "--quick" in sys.argv
# --only PREFIX: the checks whose names start with PREFIX (when working on one).
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
# --part spatial / --part rest (see the module doc): the checks named SPATIAL* / all others.
PART = sys.argv[sys.argv.index("--part") + 1] if "--part" in sys.argv else ""
if PART not in ("", "spatial", "rest"):
  raise SystemExit(f"--part must be 'spatial' or 'rest', got {PART!r}")
SPATIAL = ("auto/height", "auto/1d_length", "auto/avg_exclude_pad_1d",
           "auto/channels_first/height", "auto/2x2s2_height")
RESULTS: list[dict] = []
BAD = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter")


def check(name, skip=None):
  """Runs the function as the check ``name`` (or, with ``skip``, says why not); a check of
  the other ``--part`` is left out."""
  if PART and name.startswith(SPATIAL) != (PART == "spatial"):
    return lambda fn: fn
  return device_checks.check(name, results=RESULTS, skip=skip, only=ONLY)


_ONE_DEVICE: dict = {}


def one_device(op, kw, fn, x, dy):
  """``jax.jit(fn)(x, dy)`` on one device: the reference of a check. Several groups split the
  same op on the same arrays in different ways (``x2`` with ``K3S2``: batch, channels, height,
  Explicit axes, ``shard_map``); their reference compiles once. The key holds the op, its
  arguments, the kernel backend and the arrays' bytes."""
  key = (op, repr(sorted(kw.items())), os.environ.get("JAXPOOL_PALLAS_BACKEND"),
         *((a.shape, str(a.dtype), np.asarray(a).tobytes()) for a in (x, dy)))
  if key not in _ONE_DEVICE:
    one = jax.devices()[0]
    _ONE_DEVICE[key] = jax.jit(fn)(jax.device_put(x, one), jax.device_put(dy, one))
  return _ONE_DEVICE[key]


def tie_rich(seed, shape):
  """Small integers: many ties, so a wrong tie-break (or a wrong halo) would show."""
  return jnp.asarray(np.random.default_rng(seed).integers(-4, 5, shape), jnp.float32)


def assert_equal(a, b, what):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b), what
  for u, v in zip(a, b, strict=True):
    u, v = np.asarray(u), np.asarray(v)
    assert u.shape == v.shape and u.dtype == v.dtype, f"{what}: {u.shape} vs {v.shape}"
    if not np.array_equal(u.view(np.uint8), v.view(np.uint8)):
      bad = np.argwhere(u != v)
      at = bad[0].tolist() if len(bad) else "(signed zeros)"
      raise AssertionError(f"{what}: {len(bad)} elements differ, first at {at}")


def collectives(hlo: str) -> list[tuple[str, int]]:
  """``(op, elements)`` of every collective in an HLO module's text."""
  return device_checks.collectives(hlo, (*BAD, "collective-permute"))


def _names(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def halo_bound(x_shape, spec, mesh, halo_rows: dict[int, int]) -> int:
  """The most elements one halo message may hold: ``halo_rows[axis]`` rows of one device's
  block along a split spatial axis."""
  sizes = dict(mesh.shape)
  block = [d if e is None else -(-d // math.prod(sizes[a] for a in ((e,) if isinstance(e, str)
                                                                     else e)))
           for d, e in zip(x_shape, (*spec, *(None,) * (len(x_shape) - len(spec))), strict=True)]
  return max(math.prod(block) // block[ax] * rows for ax, rows in halo_rows.items())


# ----------------------------------------------------------------------------- the ops


def ops_for(kw):
  """Every kernel op, as ``fn(x, dy) -> arrays`` (``dy``: a cotangent of the output's shape,
  split like ``x``; the forward ops leave it out)."""
  imp = dict(kw, implementation="pallas")

  def grad(pool):
    return lambda v, dy: jax.vjp(lambda u: pool(u, **imp), v)[1](dy)[0]

  def from_taps(v, dy):
    _, taps = jaxpool.max_pool_with_taps(v, **imp)
    return jaxpool.max_pool_grad_from_taps(dy, taps, v.shape, **imp)

  return {
      "max": lambda v, dy: jaxpool.max_pool(v, **imp),
      "max_relu": lambda v, dy: jaxpool.max_pool(v, activation="relu", **imp),
      "max_taps": lambda v, dy: jaxpool.max_pool_with_taps(v, **imp),
      "grad_max": grad(jaxpool.max_pool),
      "grad_from_taps": from_taps,
      "min": lambda v, dy: jaxpool.min_pool(v, **imp),
      "grad_min": grad(jaxpool.min_pool),
      "avg": lambda v, dy: jaxpool.avg_pool(v, **imp),
      "grad_avg": grad(jaxpool.avg_pool),
  }


def run_case(name, mesh, x, spec, kw, *, spatial_rows=None, only=None, seed=0,
             inside=False, explicit=False, skip=None):
  """Every op of ``ops_for`` on ``x`` (and a cotangent) placed with ``spec`` under ``jit``.

  With ``inside``, ``x`` arrives replicated and is split inside ``jit``, the way sizes the
  devices do not divide arrive (equal, padded blocks); each result is padded to a size the
  devices divide and constrained to the same split, as the next layer of a network split that
  way would use it (a result of a size the devices do not divide cannot leave ``jit`` split).
  With ``explicit``, the sharded call runs under ``jax.set_mesh(mesh)``. With ``skip`` (why),
  each op's check prints a skipped line instead.
  """
  one = jax.devices()[0]
  y_shape = jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw), x).shape
  dy = tie_rich(seed + 1, y_shape)
  for op, fn in ops_for(kw).items():
    if only is not None and op not in only:
      continue

    @check(f"{name}/{op}", skip)
    def _(fn=fn, op=op):
      want = NamedSharding(mesh, spec)
      if inside:
        axis = next(i for i, e in enumerate(spec) if e is not None)
        n = math.prod(dict(mesh.shape)[a] for a in _names(spec[axis]))

        def pad(a):  # to a size the devices divide (the padded rows are zeros)
          cfg = [(0, 0)] * a.ndim
          cfg[axis] = (0, -a.shape[axis] % n)
          return jnp.pad(a, cfg)

        split = lambda a: jax.lax.with_sharding_constraint(a, want)  # noqa: E731
        run_fn = lambda v, d: jax.tree.map(lambda o: split(pad(o)), fn(split(v), split(d)))  # noqa: E731
        single = jax.jit(lambda v, d: jax.tree.map(pad, fn(v, d)))(
            jax.device_put(x, one), jax.device_put(dy, one))
        placed_as = [NamedSharding(mesh, P())] * 2
      else:
        run_fn = fn
        single = one_device(op, kw, fn, x, dy)
        placed_as = [want] * 2
      with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
        placed = [jax.device_put(a, s) for a, s in zip((x, dy), placed_as, strict=True)]
        compiled = jax.jit(run_fn).lower(*placed).compile()
        out = compiled(*placed)
      assert_equal(out, single, "sharded vs one device")
      assert_kernels_compiled(compiled)
      for leaf in jax.tree.leaves(out):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (
            f"output sharding {leaf.sharding}, input {spec}")
      comm = collectives(compiled.as_text())
      bad = [c for c in comm if c[0] in BAD and c[1] > 1]
      assert not bad, f"gathers or reductions of arrays: {bad}"
      permutes = [c[1] for c in comm if c[0] == "collective-permute"]
      if spatial_rows is None:
        assert not permutes, f"batch/channel sharding moved data: {permutes}"
      else:
        bound = halo_bound(x.shape, spec, mesh, spatial_rows)
        assert all(n <= bound for n in permutes), f"messages {permutes} above halo {bound}"
        if inside:
          # The input arrives whole: a program with no halo messages pooled that copy instead
          # of each device's block.
          assert permutes, ("a spatial split exchanged no halos (communication in the "
                            f"program: {device_checks.communication_ops(compiled.as_text())})")
      if spatial_rows is not None and not permutes:
        ops = device_checks.communication_ops(compiled.as_text())
        return f"no halo messages; communication: {ops}"
      return f"collective-permutes: {permutes}" if permutes else ""


def assert_kernels_compiled(compiled):
  """On a GPU: the program calls the compiled kernels (interpret mode is for CPUs only)."""
  if PLATFORM == "gpu":
    assert device_checks.has_compiled_kernel(compiled.as_text()), (
        "the program calls no compiled kernel (interpret mode?)")


# ----------------------------------------------------------------------------- the devices

PLATFORM = jax.default_backend()
try:
  MESH_SHAPE = device_checks.mesh_shape(jax.device_count())
except ValueError as e:
  print(json.dumps(dict(name="devices", ok=False, detail=str(e))))
  sys.exit(1)
DEVICES = jax.devices()[:math.prod(MESH_SHAPE)]
AUTO = jax.make_mesh(MESH_SHAPE, ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=DEVICES)
EXPLICIT = jax.make_mesh(MESH_SHAPE, ("a", "b"), axis_types=(AxisType.Explicit,) * 2,
                         devices=DEVICES)
# Splitting two spatial dims at once needs both mesh axes of 2 or more devices.
TWO_SPLITS = (None if MESH_SHAPE[1] > 1 else
              f"needs 4 devices: splits two spatial dims, one over each mesh axis (the mesh is "
              f"{MESH_SHAPE} on {len(DEVICES)} devices)")
# The TPU kernels run compiled on a TPU and in the TPU interpreter on a CPU; not elsewhere.
TPU_KERNELS = (None if PLATFORM in ("cpu", "tpu") else
               f"needs a CPU or a TPU: the TPU kernels run in the TPU interpreter on a CPU, "
               f"not on {PLATFORM}")
K3S2 = dict(window_shape=(3, 3), strides=(2, 2), padding=1)


# ----------------------------------------------------------------------------- Auto mesh

x2 = tie_rich(0, (8, 16, 12, 4))
# (--quick: each op in some of the batch and height groups, every op in the full run)
run_case("auto/batch", AUTO, x2, P("a"), K3S2,
         only=("max", "max_relu", "grad_from_taps", "min", "grad_min", "grad_avg") if QUICK
         else None)
run_case("auto/batch+channels", AUTO, x2, P("a", None, None, "b"), K3S2,
         only=None if not QUICK else ("max", "grad_max", "avg", "grad_avg"))
run_case("auto/height", AUTO, x2, P(None, "a"), K3S2, spatial_rows={1: 5},
         only=("max_taps", "grad_max", "grad_from_taps", "grad_min", "avg", "grad_avg") if QUICK
         else None)
run_case("auto/height+width", AUTO, x2, P(None, "a", "b"), K3S2, spatial_rows={1: 5, 2: 5},
         only=("max_taps", "grad_max", "grad_avg"), skip=TWO_SPLITS)
# 13 rows over axis a's 4 devices (2 on 2 or 4 devices; padded blocks), stride 3 (does not
# divide a block), ceil mode, dilation: the output is not the input over the stride.
run_case("auto/height_uneven_ceil_dilated", AUTO, tie_rich(2, (2, 13, 7, 3)), P(None, "a"),
         dict(window_shape=(2, 2), strides=(3, 1), padding=((1, 0), (0, 1)), dilation=(2, 1),
              ceil_mode=True), spatial_rows={1: 6}, inside=True,
         only=("max_taps", "grad_max", "avg", "grad_avg"))
# A window wider than a block: every device along height, 2 rows each (16 rows on 8 devices),
# a 5x1 window.
run_case("auto/height_window_wider_than_block", AUTO, tie_rich(3, (2, 2 * len(DEVICES), 5, 2)),
         P(None, ("a", "b")), dict(window_shape=(5, 1), strides=(1, 1), padding=((2, 2), (0, 0))),
         spatial_rows={1: 6}, only=("max", "grad_max", "avg", "grad_avg"))
# A window of more than 32 taps (7x6, stride 1): max and min pooling run the kernels a dim at a
# time, each stage a partitioned call of its own (the height stage exchanges the halos). (The
# full run only: the taps and average ops of such a window are not the kernels'.)
if not QUICK:
  run_case("auto/height_large_window", AUTO, tie_rich(4, (2, 16, 12, 3)), P(None, "a"),
           dict(window_shape=(7, 6), strides=(1, 1), padding="SAME"), spatial_rows={1: 8},
           only=("max", "max_relu", "grad_max", "min", "grad_min"))


def few_outputs_case():
  """Fewer output rows than devices along the split dim, the input the output times the
  stride: one row over every device of axis a, and half as many rows as devices. (Shardy
  refused the rule's compound factor of size 1; for the second, it gives each output row part
  of a mesh axis, which a PartitionSpec cannot say: the kernel then takes the rows whole.)"""
  n = MESH_SHAPE[0]
  for rows, stride in ((2 * n, 2 * n), (n, 2)):

    @check(f"auto/height_few_outputs/{rows}_rows_stride_{stride}")
    def _(rows=rows, stride=stride):
      kw = dict(window_shape=(2, 3), strides=(stride, 1), padding=((0, 0), (1, 1)),
                implementation="pallas")
      x = tie_rich(15, (2, rows, 5, 3))
      dy = tie_rich(16, (2, rows // stride, 5, 3))
      fwd = jax.jit(lambda v: jaxpool.max_pool(v, **kw))
      grad = jax.jit(lambda v, d: jax.vjp(lambda u: jaxpool.max_pool(u, **kw), v)[1](d)[0])
      xs = jax.device_put(x, NamedSharding(AUTO, P(None, "a")))
      dys = jax.device_put(dy, NamedSharding(AUTO, P()))
      one = jax.devices()[0]
      x1, dy1 = jax.device_put(x, one), jax.device_put(dy, one)
      assert_equal(fwd(xs), fwd(x1), "value, sharded vs one device")
      assert_equal(grad(xs, dys), grad(x1, dy1), "gradient, sharded vs one device")


few_outputs_case()


@check("auto/height_few_outputs/uneven_batch_chain")
def _():
  # Two pools in a row, batch (3, which axis b does not divide) and height split: the second
  # pool has fewer output rows than devices, and its sharding cannot be said over the mesh;
  # its spatial rows are taken whole while the uneven batch split is kept.
  pool1 = dict(window_shape=(2, 3), strides=(2, 1), padding=((0, 0), (1, 1)),
               implementation="pallas")
  pool2 = dict(window_shape=(2, 1), strides=(2, 1), padding=0, implementation="pallas")

  def pool(v):
    return jaxpool.max_pool(jaxpool.max_pool(v, **pool1), **pool2)

  x = tie_rich(17, (3, 3 * MESH_SHAPE[0], 5, 3))
  dy = tie_rich(18, jax.eval_shape(pool, x).shape)
  split = lambda v: jax.lax.with_sharding_constraint(v, NamedSharding(AUTO, P("b", "a")))  # noqa: E731
  fwd = jax.jit(lambda v: pool(split(v)))
  grad = jax.jit(lambda v, d: jax.vjp(pool, split(v))[1](d)[0])
  one = jax.devices()[0]
  x1, dy1 = jax.device_put(x, one), jax.device_put(dy, one)
  assert_equal(fwd(x), jax.jit(pool)(x1), "value, sharded vs one device")
  assert_equal(grad(x, dy), jax.jit(lambda v, d: jax.vjp(pool, v)[1](d)[0])(x1, dy1),
               "gradient, sharded vs one device")
run_case("auto/1d_length", AUTO, tie_rich(4, (3, 32, 2)), P(None, "a"),
         dict(window_shape=(3,), strides=(2,), padding=1), spatial_rows={1: 5},
         only=("max_taps", "grad_max", "grad_avg"))


def avg_edges_case():
  """Average pooling where an interior window of the whole problem is an edge window of a
  device's part (or the other way round): each window's average must not depend on which code
  path of the kernel computed it. One channel, so nothing broadcasts the divisor: XLA's CPU
  backend divides by a constant as a multiply by its reciprocal, by a computed count as a
  true division, and the two differ in the last bit (the kernels once divided an interior
  window by a constant and an edge window by its count)."""
  kw = dict(window_shape=(3,), strides=(1,), padding=6, dilation=(3,), count_include_pad=False,
            implementation="pallas")
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, 10, 1)), jnp.float32)  # (not small integers: exact)
  dy = jnp.asarray(rng.normal(size=(1, 16, 1)), jnp.float32)
  spec = NamedSharding(AUTO, P(None, ("a", "b")))  # 8 devices along the length
  split = lambda a: jax.lax.with_sharding_constraint(a, spec)  # noqa: E731
  pad = lambda a: jnp.pad(a, ((0, 0), (0, -a.shape[1] % 8), (0, 0)))  # noqa: E731
  fns = {"avg": lambda v, d: jaxpool.avg_pool(v, **kw),
         "grad_avg": lambda v, d: jax.vjp(lambda u: jaxpool.avg_pool(u, **kw), v)[1](d)[0]}
  for op, fn in fns.items():

    @check(f"auto/avg_exclude_pad_1d/{op}")
    def _(fn=fn):
      one = jax.devices()[0]
      single = jax.jit(lambda v, d: pad(fn(v, d)))(jax.device_put(x, one), jax.device_put(dy, one))
      whole = NamedSharding(AUTO, P())
      placed = [jax.device_put(a, whole) for a in (x, dy)]
      compiled = jax.jit(lambda v, d: split(pad(fn(split(v), split(d))))).lower(*placed).compile()
      assert [c for c in collectives(compiled.as_text()) if c[0] == "collective-permute"], (
          "a spatial split exchanged no halos (communication in the program: "
          f"{device_checks.communication_ops(compiled.as_text())})")
      assert_equal(compiled(*placed), single, "sharded vs one device")


avg_edges_case()
# (--quick leaves out max and grad_max: explicit/depth_one_program/grad_max runs the same
# per-device program (halo.per_device, this window, stride and padding, a depth split whose
# block the stride divides) under shard_map, and the two ops here the Auto rule on 5-D operands.)
run_case("auto/3d_depth", AUTO, tie_rich(5, (2, 8, 6, 6, 2)), P(None, "a"),
         dict(window_shape=(3, 3, 3), strides=(2, 2, 2), padding=1), spatial_rows={1: 5},
         only=("avg", "grad_avg") if QUICK else ("max", "grad_max", "avg", "grad_avg"))
run_case("auto/channels_first/height", AUTO, tie_rich(6, (4, 3, 16, 9)), P(None, None, "a"),
         dict(K3S2, data_format="channels_first"), spatial_rows={2: 5},
         only=("max_taps", "grad_max", "grad_avg"))
if not QUICK:
  run_case("auto/channels_first/batch+channels", AUTO, tie_rich(7, (8, 4, 9, 9)), P("a", "b"),
           dict(K3S2, data_format="channels_first"), only=("max", "grad_max", "avg", "grad_avg"))
  run_case("auto/height_same_stride1", AUTO, x2, P(None, "a"),
           dict(window_shape=(3, 3), strides=(1, 1), padding=1), spatial_rows={1: 4})
  run_case("auto/3d_depth+height", AUTO, tie_rich(8, (2, 8, 8, 5, 2)), P(None, "a", "b"),
           dict(window_shape=(3, 3, 3), strides=(2, 2, 2), padding=1),
           spatial_rows={1: 5, 2: 5}, skip=TWO_SPLITS)
  run_case("auto/2x2s2_height", AUTO, tie_rich(9, (2, 16, 8, 3)), P(None, "a"),
           dict(window_shape=(2, 2), strides=(2, 2)), spatial_rows={1: 3})

# ----------------------------------------------------------------------------- Explicit mesh

run_case("explicit/batch+channels", EXPLICIT, x2, P("a", None, None, "b"), K3S2, explicit=True,
         only=("max_taps", "grad_max", "grad_min", "grad_avg") if QUICK else
         ("max", "max_taps", "grad_max", "grad_from_taps", "avg", "grad_avg", "grad_min"))
run_case("explicit/height", EXPLICIT, x2, P(None, "a"), K3S2, spatial_rows={1: 5},
         explicit=True, only=("max", "grad_max", "grad_from_taps", "grad_avg") if QUICK else
         ("max", "max_taps", "grad_max", "grad_from_taps", "avg", "grad_avg"))


class _CountSwitches:
  """Counts the ``lax.switch`` calls of jaxpool's partition code (``halo.py`` and
  ``halo_inplace.py``: a switch over the devices' positions compiles to a conditional) while it
  is in a ``with`` block. The kernels' own ``pl.when`` (conditionals in interpret mode) are not
  switches, so they do not count."""

  def __init__(self):
    from jaxpool._src.pallas.sharding import halo
    from jaxpool._src.pallas.sharding import halo_inplace
    self.modules, self.n = (halo, halo_inplace), 0

  def __getattr__(self, name):
    return getattr(jax.lax, name)

  def switch(self, *args, **kwargs):
    self.n += 1
    return jax.lax.switch(*args, **kwargs)

  def __enter__(self):
    for m in self.modules:
      m.lax = self
    return self

  def __exit__(self, *exc):
    for m in self.modules:
      m.lax = jax.lax


def depth_one_program_case():
  """A depth split whose block size the stride divides: every device runs the same kernel
  calls, with no switch over the devices' positions (on a GPU a conditional's branch index goes
  back to the host: on 2 H200s such a split gradient took longer than one GPU's whole
  problem). The max pool's gradient, and the average pool's where a padding row counts like
  a data row (``count_include_pad``, or a fixed divisor); without ``count_include_pad`` a
  device's neighbour rows cannot stand as padding, and the devices take their own branches."""
  n = MESH_SHAPE[0]
  x = tie_rich(13, (2, 4 * n, 6, 6, 2))
  base = dict(window_shape=(3, 3, 3), strides=(2, 2, 2), padding=1, implementation="pallas")
  cases = {"grad_max": (jaxpool.max_pool, {}, 0),
           "grad_avg": (jaxpool.avg_pool, {}, 0),
           "grad_avg_divisor": (jaxpool.avg_pool, dict(divisor_override=5), 0),
           "grad_avg_exclude_pad": (jaxpool.avg_pool, dict(count_include_pad=False), None)}
  for op, (pool, extra, want) in cases.items():
    if QUICK and op not in ("grad_max", "grad_avg"):
      continue

    @check(f"explicit/depth_one_program/{op}")
    def _(pool=pool, extra=extra, want=want):
      kw = dict(base, **extra)
      dy = tie_rich(14, jax.eval_shape(lambda v: pool(v, **kw), x).shape)
      sharding = NamedSharding(EXPLICIT, P(None, "a"))
      grad = jax.jit(lambda v, d: jax.vjp(lambda u: pool(u, **kw), v)[1](d)[0])
      placed = [jax.device_put(a, sharding) for a in (x, dy)]
      with _CountSwitches() as switches:
        grad.lower(*placed).compile()
      assert want is None or switches.n == want, f"{switches.n} switches over the devices"
      one = jax.devices()[0]
      assert_equal(grad(*placed), grad(jax.device_put(x, one), jax.device_put(dy, one)),
                   "sharded vs one device")

  if QUICK:  # (grad_max above splits the same gradient)
    return

  @check("explicit/depth_one_program/grad_max_in_place")
  def _():
    # The max pool's gradient runs on each device's own cotangent rows as they are: the rows
    # that a neighbour's windows also reach are recomputed from small pieces, and no array of
    # a device's cotangent block with its halo is assembled (a copy of the block per operand).
    xs = tie_rich(15, (1, 8 * n, 4, 4, 1))
    kw = dict(base)
    dy = tie_rich(16, jax.eval_shape(lambda v: jaxpool.max_pool(v, **kw), xs).shape)
    block = dy.shape[1] // n
    sharding = NamedSharding(EXPLICIT, P(None, "a"))
    grad = jax.jit(lambda v, d: jax.vjp(lambda u: jaxpool.max_pool(u, **kw), v)[1](d)[0])
    placed = [jax.device_put(a, sharding) for a in (xs, dy)]
    text = grad.lower(*placed).compile().as_text()
    # The gradient's concatenates (the transpose's), in whatever rank the compiler left them:
    # the pieces are joined through 2-D views (halo.join), and XLA may or may not fold them
    # back. Each one's rows along the split dim: its elements over a cotangent row's.
    row = dy.shape[0] * math.prod(dy.shape[2:])
    sizes = [math.prod(int(d) for d in m.group(1).split(",")) for m in re.finditer(
        r"= (?:f32|s8)\[([\d,]+)\][^=\n]* concatenate\([^\n]*op_name=\"[^\"]*transpose\(",
        text)]
    rows = [size // row for size in sizes]
    assert rows and all(size % row == 0 for size in sizes), (
        f"no concatenate of whole cotangent rows in the gradient (sizes {sizes}, a row {row})")
    assert max(rows) <= block, (
        f"a concatenate of {max(rows)} rows along the split dim (a device holds {block})")
    one = jax.devices()[0]
    assert_equal(grad(*placed), grad(jax.device_put(xs, one), jax.device_put(dy, one)),
                 "sharded vs one device")


depth_one_program_case()


# ----------------------------------------------------------------------------- shard_map


def shard_map_case(name, *, check_vma, axis_names=None, spec=None, only=None, skip=None,
                   mesh=None):
  spec = P("a") if spec is None else spec
  mesh = AUTO if mesh is None else mesh
  y_shape = jax.eval_shape(lambda v: jaxpool.max_pool(v, **K3S2), x2).shape
  dy = tie_rich(1, y_shape)
  for op, fn in ops_for(K3S2).items():
    if only is not None and op not in only:
      continue

    @check(f"shard_map/{name}/{op}", skip)
    def _(fn=fn, op=op):
      single = one_device(op, K3S2, fn, x2, dy)
      kwargs = {} if axis_names is None else dict(axis_names=axis_names)
      out_specs = jax.tree.map(lambda _: spec, single)
      mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=out_specs,
                                     check_vma=check_vma, **kwargs))
      placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x2, dy)]
      assert_equal(mapped(*placed), single, "shard_map vs one device")


shard_map_case("check_vma", check_vma=True,
               only=("max", "max_taps", "grad_max", "avg", "grad_avg") if QUICK else None)
shard_map_case("no_check_vma", check_vma=False, only=("max", "max_taps", "grad_max", "avg"))
shard_map_case("partly_manual", check_vma=True, axis_names=frozenset({"a"}),
               spec=P("a"), only=("max", "max_taps", "grad_max", "avg", "grad_avg"))
# The axis left to the compiler has one device (JAX 0.10-0.11 cannot read the shardings
# custom_partitioning gets there: AssertionError in op_shardings.get_num_ways_dim_sharded; the
# kernels run as in a fully manual shard_map instead). On 2 devices the case above is this one.
shard_map_case("partly_manual_one_device_axis", check_vma=True, axis_names=frozenset({"a"}),
               mesh=jax.make_mesh((MESH_SHAPE[0], 1), ("a", "b"), axis_types=(AxisType.Auto,) * 2,
                                  devices=DEVICES[:MESH_SHAPE[0]]),
               only=("max", "grad_max", "avg", "grad_avg"))


@check("shard_map/partly_manual_mesh_context/max")
def _():
  # A partly manual shard_map under the older `with mesh:` context, the height split over the
  # axis left to the compiler inside: the kernel's shardings there hold the manual axis'
  # subgroups, which JAX cannot read as a PartitionSpec (the block is gathered instead).
  kw = dict(K3S2, implementation="pallas")

  def inner(v):
    return jaxpool.max_pool(jax.lax.with_sharding_constraint(v, P(None, "b")), **kw)

  f = jax.jit(jax.shard_map(inner, mesh=AUTO, in_specs=P("a"), out_specs=P("a"),
                            axis_names=frozenset({"a"}), check_vma=False))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with AUTO:
      out = f(jax.device_put(x2, NamedSharding(AUTO, P("a"))))
  one = jax.devices()[0]
  assert_equal(out, jax.jit(lambda v: jaxpool.max_pool(v, **kw))(jax.device_put(x2, one)),
               "shard_map vs one device")


@check("shard_map/check_vma/grads")
def _():
  dy = tie_rich(1, (8, 8, 6, 4))

  def grad(v, d):
    return jax.grad(lambda u: jnp.sum(jaxpool.max_pool(u, **K3S2, implementation="pallas") * d)
                    + jnp.sum(jaxpool.avg_pool(u, **K3S2, implementation="pallas") * d))(v)

  one = jax.devices()[0]
  want = jax.jit(grad)(jax.device_put(x2, one), jax.device_put(dy, one))
  # Each block's gradient is its part of the whole: dy's block goes with it.
  mapped = jax.shard_map(grad, mesh=AUTO, in_specs=(P("a"), P("a")), out_specs=P("a"))
  placed = [jax.device_put(a, NamedSharding(AUTO, P("a"))) for a in (x2, dy)]
  assert_equal(jax.jit(mapped)(*placed), want, "shard_map grad vs one device")


@check("auto/vmap_grad")
def _():
  xb = tie_rich(11, (4, 2, 10, 10, 3))

  def per_example(v):
    return jax.grad(lambda u: jnp.sum(jaxpool.max_pool(u, **K3S2, implementation="pallas")
                                      ** 2))(v)

  fn = jax.vmap(per_example)
  want = jax.jit(fn)(jax.device_put(xb, jax.devices()[0]))
  placed = jax.device_put(xb, NamedSharding(AUTO, P("a")))
  compiled = jax.jit(fn).lower(placed).compile()
  out = compiled(placed)
  assert_equal(out, want, "vmap(grad) sharded vs one device")
  assert_kernels_compiled(compiled)
  assert out.sharding.is_equivalent_to(NamedSharding(AUTO, P("a")), out.ndim), out.sharding
  assert not [c for c in collectives(compiled.as_text()) if c[1] > 1]


# The TPU (Mosaic) kernels, in the TPU interpreter: the same rule wraps them.
os.environ["JAXPOOL_PALLAS_BACKEND"] = "tpu"
run_case("tpu/batch", AUTO, x2, P("a"), K3S2, only=("max_taps", "grad_max", "avg", "grad_avg"),
         skip=TPU_KERNELS)
run_case("tpu/height", AUTO, x2, P(None, "a"), K3S2, spatial_rows={1: 5},
         only=("max_taps", "grad_max", "avg", "grad_avg"), skip=TPU_KERNELS)
del os.environ["JAXPOOL_PALLAS_BACKEND"]


@check("export/sharded")
def _():
  # jax.export serialises the XLA ops in place of the kernels (a Pallas kernel, and the
  # partitioning callback, are no stable part of an exported program): the exported sharded
  # gradient runs and equals the kernels'.
  from jax import export
  spec = NamedSharding(AUTO, P("a"))
  dy = tie_rich(12, (8, 8, 6, 4))

  def grad(v, d):
    return jax.vjp(lambda u: jaxpool.max_pool(u, **K3S2, implementation="pallas"), v)[1](d)[0]

  placed = [jax.device_put(a, spec) for a in (x2, dy)]
  exported = export.export(jax.jit(grad))(*placed)
  text = exported.mlir_module()
  assert "CustomSPMDPartitioning" not in text and "triton" not in text.lower()
  assert_equal(exported.call(*placed), jax.jit(grad)(*placed), "exported vs kernels")


print(json.dumps(dict(
    name="summary", ok=all(r["ok"] for r in RESULTS),
    detail=(f"{sum(r['ok'] and not r.get('skipped') for r in RESULTS)} of {len(RESULTS)} passed, "
            f"{sum(bool(r.get('skipped')) for r in RESULTS)} skipped; {len(DEVICES)} of "
            f"{jax.device_count()} {PLATFORM} devices, mesh {MESH_SHAPE}"),
    platform=PLATFORM, devices=jax.device_count(), devices_used=len(DEVICES), mesh=MESH_SHAPE)))
