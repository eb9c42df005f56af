"""Where a benchmark script saves its result.

A run of ``benchmarks/<stem>.py`` on a device of kind K saves
``benchmarks/results/<stem>_<k>.json``, where ``k`` names the device kind in short
(``h200``, ``h100``, ``h100x2`` for two of them; nothing for a CPU script on the CPU:
``pooling_cpu.json``). The file holds the current run of that script on that kind; a rerun
overwrites it (git keeps the earlier ones). Smoke runs (``--quick``) go to the git-ignored
``build/benchmarks/`` instead.
"""

from __future__ import annotations

import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SCRATCH = os.path.join(os.path.dirname(HERE), "build", "benchmarks")


def device_tag(kind: str, count: int = 1) -> str:
  """A device kind in short: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"NVIDIA H200"`` with
  ``count=2`` -> ``"h200x2"``, ``"cpu"`` -> ``"cpu"``, ``"TPU v5 lite"`` -> ``"tpuv5"``."""
  words = re.sub(r"^(nvidia|amd|tesla)\s+", "", kind.strip().lower()).split()
  if not words:
    raise ValueError(f"kind must name a device; got {kind!r}")
  head = words[0] + (words[1] if words[0] == "tpu" and len(words) > 1 else "")
  tag = re.sub(r"[^a-z0-9]", "", re.split(r"[-_]", head)[0]) or "device"
  return f"{tag}x{count}" if count > 1 else tag


def result_path(script: str, tag: str, *, quick: bool = False) -> str:
  """``benchmarks/results/<stem>_<tag>.json`` for the script ``script`` (its ``__file__``), or
  ``build/benchmarks/<stem>_<tag>_quick.json`` for a smoke run; the tag is left out where the
  stem already ends with it (``pooling_cpu`` on the CPU)."""
  stem = os.path.splitext(os.path.basename(script))[0]
  name = stem if stem.endswith("_" + tag) else f"{stem}_{tag}"
  return (os.path.join(SCRATCH, name + "_quick.json") if quick
          else os.path.join(RESULTS, name + ".json"))
