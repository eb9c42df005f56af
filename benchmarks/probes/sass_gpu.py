"""The SASS instructions a GPU kernel executes, by opcode (Nsight Compute's source page).

``run`` compiles and runs the max-pool backward of 128x112x112x64 3x3/s2/p1 once (``--dtype``,
default bfloat16; the launch jaxpool picks on this GPU, ``JAXPOOL_TUNE`` as usual;
``--plain``: the 16-bit selects one lane at a time, ``triton.PACKED_SELECT`` off), for Nsight
Compute to profile; ``count`` reads the source page that Nsight Compute printed and prints the
opcodes by how many warp instructions executed them (and how many lines of SASS each has)::

  ncu --clock-control none -k regex:jaxpool_max_pool_bwd -c 1 --section SourceCounters \\
      --page source --print-source sass --csv \\
      python3 benchmarks/probes/sass_gpu.py run > sass.csv
  python3 benchmarks/probes/sass_gpu.py count sass.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import sys


def run(dtype: str, plain: bool) -> None:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
      __file__)))))
  import jax
  import jax.numpy as jnp

  from jaxpool._src import windows
  from jaxpool._src.pallas import triton as pk
  from jaxpool._src.pallas import tuning
  pk.PACKED_SELECT = not plain
  shape = (128, 112, 112, 64)
  geom = windows.make_geometry(shape, (3, 3), (2, 2), 1, data_format="channels_last")
  dt = jnp.dtype(dtype)
  launch = pk.launch_for("max_bwd", shape, dt, geom, interpret=False)
  ops = (jnp.zeros(1, windows.taps_dtype(geom.num_taps)), jnp.zeros(1, dt))
  packed = pk._packed_select("max", ops, geom.lift(3), launch[0] * launch[1], launch[2], False)
  print(f"{jax.devices()[0].device_kind}: launch {tuning.launch_name(launch)}, packed select "
        f"{packed}", file=sys.stderr)
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dt)
  idx = jax.jit(lambda a: pk.max_forward_taps(a, geom, interpret=False)[1])(x)
  dy = jnp.ones(geom.output_shape(shape), dt)
  jax.block_until_ready(jax.jit(
      lambda i, g: pk.max_backward(i, g, shape, geom, interpret=False))(idx, dy))


def count(path: str) -> None:
  with open(path) as f:
    rows = list(csv.reader(ln for ln in f if ln.startswith('"')))
  head = next(i for i, r in enumerate(rows) if "Source" in r)
  src = rows[head].index("Source")
  exe = next((i for i, c in enumerate(rows[head]) if c.startswith("Instructions Executed")),
             None)
  lines: collections.Counter = collections.Counter()
  executed: collections.Counter = collections.Counter()
  for r in rows[head + 1:]:
    m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", r[src]) if len(r) > src else None
    if m:
      lines[m.group(1)] += 1
      if exe is not None and r[exe].replace(",", "").strip():
        executed[m.group(1)] += int(float(r[exe].replace(",", "")))
  total = sum(executed.values())
  print(f"{sum(lines.values())} SASS lines; {total} warp instructions executed")
  for op, n in (executed if total else lines).most_common(45):
    print(f"  {op:24s} {n:12d} {100 * n / max(total, 1):5.1f}%  ({lines[op]} lines)")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--dtype", default="bfloat16")
  r.add_argument("--plain", action="store_true")
  c = sub.add_parser("count")
  c.add_argument("csv")
  args = ap.parse_args()
  if args.cmd == "run":
    run(args.dtype, args.plain)
  else:
    count(args.csv)


if __name__ == "__main__":
  main()
