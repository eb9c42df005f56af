"""The SASS instructions a GPU kernel executes, by opcode (Nsight Compute's source page).

``run`` compiles and runs one kernel once, for Nsight Compute to profile: ``--op`` (default
``max_bwd``) on ``--case``, one of ``launches_gpu.py``'s (default ``2d_bf16``, 128x112x112x64
3x3/s2/p1 bfloat16), with ``--launch bw,bl,w[,rd,rh]`` or the launch jaxpool picks on this GPU
(``JAXPOOL_TUNE=cached``: the shipped table's; ``off``: the heuristic's, as in
``launches_gpu.py``; unset: the table's, else the launch model's; ``--plain``: the 16-bit max
backward's selects one lane at a time, the ``packed_select`` setting off). ``count`` reads
the source page that Nsight Compute printed and prints the opcodes by how many warp
instructions executed them (and how many lines of SASS each has)::

  ncu --clock-control none -k regex:jaxpool -c 1 --section SourceCounters \\
      --page source --print-source sass --csv \\
      python3 benchmarks/sass_gpu.py run --case 2d_nchw --op max_bwd > sass.csv
  python3 benchmarks/sass_gpu.py count sass.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import sys


def run(case: str, op: str, launch_text: str, plain: bool) -> None:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax

  import launches_gpu as lg
  from jaxpool._src import windows
  from jaxpool._src.pallas.triton import ops as pk
  from jaxpool._src.pallas.tuning import tuner as tuning
  from jaxpool._src import settings
  settings.overrides["packed_select"] = not plain  # (this whole process)
  shape, window, strides, padding, fmt, dtype = lg.CASES[case]
  geom = windows.make_geometry(shape, window, strides, padding, data_format=fmt)
  launch = (tuple(int(v) for v in launch_text.split(",")) if launch_text else
            pk.launch_for(op, shape, dtype, geom, interpret=False, include_pad=True))
  print(f"{jax.devices()[0].device_kind}: {case} {op} launch {tuning.launch_name(launch)}, "
        f"packed select {settings.get('packed_select')}", file=sys.stderr)
  ops = lg._operands(op, shape, geom, dtype)
  jax.block_until_ready(jax.jit(lambda *a: lg._call(op, geom, shape, launch, *a))(*ops))


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
  r.add_argument("--case", default="2d_bf16", help="a case of launches_gpu.py")
  r.add_argument("--op", default="max_bwd", help="max_fwd, argmax_fwd, avg_fwd, max_bwd, avg_bwd")
  r.add_argument("--launch", default="", help="bw,bl,w[,rd,rh] (default: jaxpool's choice)")
  r.add_argument("--plain", action="store_true")
  c = sub.add_parser("count")
  c.add_argument("csv")
  args = ap.parse_args()
  if args.cmd == "run":
    run(args.case, args.op, args.launch, args.plain)
  else:
    count(args.csv)


if __name__ == "__main__":
  main()
