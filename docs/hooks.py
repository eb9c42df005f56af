"""mkdocs hook: renders the benchmark tables of docs/benchmarks.md from the committed JSON.

``<!-- table:NAME -->`` becomes the table of ``benchmarks/results/NAME.json``: ``pooling_cpu``
(benchmarks/pooling_cpu.py) or a ``pooling_gpu_<gpu>`` (benchmarks/pooling_gpu.py), so the page
always shows the numbers in the repository.
``<!-- include:NAME -->`` becomes the text of the file NAME at the repository root (the changelog
page shows CHANGELOG.md).
"""

from __future__ import annotations

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
  path = os.path.join(ROOT, "benchmarks", "results", name)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _fmt(v):
  return "" if v is None else f"{v:.2f}"


def cpu_table(name: str = "pooling_cpu") -> str:
  d = _load(name + ".json")
  if d is None:
    return f"*(benchmarks/results/{name}.json is not there yet: run benchmarks/pooling_cpu.py.)*"
  head = ("| op | shape | dtype | window / stride / padding | XLA fwd | jaxpool fwd | XLA bwd | "
          "jaxpool bwd | XLA fwd+bwd | jaxpool fwd+bwd | bwd speed-up | same result |\n"
          "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|:-:|\n")
  rows = []
  for r in d["rows"]:
    pad = ",".join(f"{lo}/{hi}" for lo, hi in r["padding"])
    rows.append(
        f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['dtype']} | "
        f"{'x'.join(map(str, r['window']))} / {'x'.join(map(str, r['strides']))} / {pad} | "
        f"{_fmt(r['xla_fwd'])} | {_fmt(r['jaxpool_fwd'])} | {_fmt(r['xla_bwd'])} | "
        f"{_fmt(r['jaxpool_bwd'])} | {_fmt(r['xla_fwd_bwd'])} | {_fmt(r['jaxpool_fwd_bwd'])} | "
        f"{r['xla_bwd'] / r['jaxpool_bwd']:.1f}x | {'yes' if r.get('same_result') else 'no'} |")
  # benchmarks/pooling_cpu.py's timeit_all: 3 rounds of repeats // 3 timed calls per contender
  # (files written before it saved "timed_calls").
  calls = d.get("timed_calls", 3 * max(1, int(d.get("repeats", 3)) // 3))
  meta = (f"\n\nTimes in ms, each the median of {calls} timed calls "
          f"(benchmarks/pooling_cpu.py); jax {d.get('jax')}, {d.get('cores')} CPU cores. "
          f"Max-pool residual: "
          f"{d.get('residual_bytes_per_output')} byte per output element "
          f"({', '.join(d.get('residuals', []))}).")
  return head + "\n".join(rows) + meta


GPU_COLUMNS = [("xla_fwd", "XLA fwd"), ("pallas_fwd", "Pallas fwd"), ("xla_bwd", "XLA bwd"),
               ("pallas_bwd", "Pallas bwd"), ("jaxpool_xla_fwd_bwd", "jaxpool XLA fwd+bwd"),
               ("pallas_fwd_bwd", "Pallas fwd+bwd"), ("torch_fwd_bwd", "PyTorch fwd+bwd")]


def gpu_table(name: str) -> str:
  d = _load(name + ".json")
  if d is None:
    return f"*(benchmarks/results/{name}.json is not there yet.)*"
  # PyTorch's column where the run timed it (pooling_gpu.py --no-torch leaves it out).
  columns = [(k, c) for k, c in GPU_COLUMNS
             if any(r["rows"].get(k, {}).get("ms") is not None for r in d["results"])]
  head = ("| case | dtype | " + " | ".join(c for _, c in columns) + " |\n|---|---|"
          + "--:|" * len(columns) + "\n")
  rows = []
  for r in d["results"]:
    cells = [_fmt(r["rows"].get(k, {}).get("ms")) for k, _ in columns]
    rows.append(f"| {r['case']} | {r['dtype']} | " + " | ".join(cells) + " |")
  m = d.get("meta", {})
  meta = (f"\n\nTimes in ms on {m.get('device')}, jax {m.get('jax')}, {m.get('timer')}"
          + (f"; PyTorch {m['torch']}" if m.get("torch") else "") + ".")
  return head + "\n".join(rows) + meta


def include(markdown: str) -> str:
  """Replaces each ``<!-- include:NAME -->`` with the file NAME of the repository root."""
  for name in re.findall(r"<!-- include:([\w.-]+) -->", markdown):
    with open(os.path.join(ROOT, name)) as f:
      markdown = markdown.replace(f"<!-- include:{name} -->", f.read())
  return markdown


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001  (mkdocs hook signature)
  markdown = include(markdown)
  for name in re.findall(r"<!-- table:([\w-]+) -->", markdown):
    if name.startswith("pooling_cpu"):
      table = cpu_table(name)
    elif name.startswith("pooling_gpu_"):
      table = gpu_table(name)
    else:
      raise ValueError(f"docs/hooks.py renders no table of benchmarks/results/{name}.json")
    markdown = markdown.replace(f"<!-- table:{name} -->", table)
  return markdown
