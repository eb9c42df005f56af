"""Every benchmark figure that README.md and the docs quote is read back from benchmarks/results/.

Each entry of ``FIGURES`` names a page and a function that renders, from the committed JSON, the
text the page quotes (a table row, a phrase with its numbers). The test checks that the page
holds that text (whitespace and ``**`` bold ignored), so a rerun that moves a figure fails here
until the page follows. The tables of docs/benchmarks.md's CPU and GPU sections are rendered
from the same files when the site is built (docs/hooks.py) and need no entry.

A figure that a page cites from an older commit (``c2b0d33:benchmarks/results/NAME``: a probe's
record, a superseded run) is the record of that run, fixed by the commit, and not checked here;
the pages quote current numbers from the current files only.

``test_every_figure_reads_its_file`` shows that each entry can fail: with every number in its
files scaled, none of the rendered texts is found on its page any more.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# The pages whose figures come from benchmarks (README.md and every docs page).
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

_loader: Callable[[str], dict]


@functools.cache
def _load_file(name: str) -> dict:
  with open(RESULTS / name) as f:
    return json.load(f)


_loader = _load_file


def load(name: str) -> dict:
  return _loader(name)


BOLD = re.compile(r"(?<![(*])\*\*([^*|\n]+?)\*\*")  # **1.35x**, not a footnote's (**)


def normal(text: str) -> str:
  """``text`` without bold marks, its whitespace runs as one space."""
  return re.sub(r"\s+", " ", BOLD.sub(r"\1", text))


def page_text(page: str) -> str:
  return normal((ROOT / page).read_text())


def span(values, fmt: str = "{:.2f}", sep: str = "-") -> str:
  """``"lo-hi"`` of ``values``, each formatted with ``fmt``."""
  values = list(values)
  return f"{fmt.format(min(values))}{sep}{fmt.format(max(values))}"


def ms(v: float) -> str:
  """A step time as the pages print it: 2 decimals, 1 from 100 ms."""
  return f"{v:.1f}" if v >= 100 else f"{v:.2f}"


# ------------------------------------------------------------------------ pooling_cpu.json


def cpu_row(op: str, window: int) -> dict:
  [row] = [r for r in load("pooling_cpu.json")["rows"]
           if r["op"] == op and r["window"][0] == window]
  return row


def cpu_timed_calls() -> int:
  d = load("pooling_cpu.json")
  return d.get("timed_calls", 3 * max(1, d["repeats"] // 3))


def readme_cpu_table() -> list[str]:
  mx, av = cpu_row("max", 3), cpu_row("avg", 3)
  return [
      f"| max forward (inference) | {mx['xla_fwd']:.1f} ms | {mx['jaxpool_fwd']:.1f} ms | "
      f"{mx['jaxpool_fwd'] / mx['xla_fwd']:.2f}x the time |",
      f"| max backward | {mx['xla_bwd']:.1f} ms | {mx['jaxpool_bwd']:.1f} ms | "
      f"{mx['xla_bwd'] / mx['jaxpool_bwd']:.1f}x faster |",
      f"| max forward + backward | {mx['xla_fwd_bwd']:.1f} ms | {mx['jaxpool_fwd_bwd']:.1f} ms | "
      f"{mx['xla_fwd_bwd'] / mx['jaxpool_fwd_bwd']:.1f}x faster |",
      f"| avg forward + backward | {av['xla_fwd_bwd']:.1f} ms | {av['jaxpool_fwd_bwd']:.1f} ms | "
      f"{av['xla_fwd_bwd'] / av['jaxpool_fwd_bwd']:.1f}x faster |",
      f"Each time is the median of {cpu_timed_calls()} calls.",
      f"Reverse mode keeps {load('pooling_cpu.json')['residual_bytes_per_output']:.2f} byte per "
      f"output element",
  ]


def when_cpu_table() -> list[str]:
  out = []
  for op, w, s, p in (("max", 3, 2, 1), ("max", 2, 2, 0), ("avg", 3, 2, 1), ("avg", 2, 2, 0)):
    r = cpu_row(op, w)
    out.append(f"| {op} {w}x{w} / {s} / {p} | {r['xla_fwd_bwd']:.1f} ms | "
               f"{r['jaxpool_fwd_bwd']:.1f} ms | {r['xla_fwd_bwd'] / r['jaxpool_fwd_bwd']:.1f}x |")
  rows = load("pooling_cpu.json")["rows"]
  avg2 = cpu_row("avg", 2)
  out += [f"the median of {cpu_timed_calls()} calls",
          f"({span((r['jaxpool_fwd'] / r['xla_fwd'] for r in rows), sep='x to ')}x XLA's time in "
          f"the four CPU cases)",
          f"non-overlapping windows on a CPU: "
          f"{avg2['xla_fwd_bwd'] / avg2['jaxpool_fwd_bwd']:.1f}x"]
  return out


# ----------------------------------------------------------------- pooling_gpu_<gpu>.json

KERNELS = ("pallas_fwd", "pallas_fwd_argmax", "pallas_bwd", "pallas_avg_fwd")
TORCH = "pooling_gpu_h100_torch.json"
GPU_CASES = [("128x112x112x64 3x3/s2/p1", "float32"), ("128x112x112x64 3x3/s2/p1", "bfloat16"),
             ("64x224x224x64 2x2/s2", "float32"), ("64x224x224x64 2x2/s2", "bfloat16"),
             ("128x64x112x112 NCHW 3x3/s2/p1", "float32"),
             ("16x16x56x56x64 3x3x3/s2/p1", "float32")]


def gpu_case(name: str, case: str, dtype: str) -> dict:
  [res] = [r for r in load(name)["results"] if r["case"] == case and r["dtype"] == dtype]
  return res["rows"]


def kernel_fractions(name: str, cases=None, kernels=KERNELS) -> list[float]:
  return [r["rows"][k]["of_copy"] for r in load(name)["results"] for k in kernels
          if cases is None or r["case"] in cases]


def tuning_table() -> list[str]:
  out = []
  for name, gpu in (("pooling_gpu_h200.json", "one H200"),
                    ("pooling_gpu_h100.json", "one H100 80GB HBM3")):
    fr = kernel_fractions(name)
    below = sum(f < 0.85 for f in fr)
    out.append(f"| {gpu} | {load(name)['meta']['copy_GBps']:.0f} GB/s | {below} of {len(fr)} | "
               f"{span(fr)} | `benchmarks/results/{name}` |")
  return out


def readme_gpu() -> list[str]:
  h100 = kernel_fractions("pooling_gpu_h100.json")
  h200 = kernel_fractions("pooling_gpu_h200.json")
  threed = {"16x16x56x56x64 3x3x3/s2/p1"}
  two_d = {c for c, _ in GPU_CASES} - threed
  out = [f"{span(h100)} of the copy bandwidth on an H100, {span(h200)} on an H200",
         f"the kernels (max forward with and without the argmax, max backward, average forward) "
         f"run at {span(h100)} of the copy bandwidth with the shipped table",
         f"run at {span(h200)} of its copy bandwidth: the 2-D kernels "
         f"{span(kernel_fractions('pooling_gpu_h200.json', two_d))}, the 3-D ones "
         f"{span(kernel_fractions('pooling_gpu_h200.json', threed))}"]
  d = load(TORCH)
  out.append(f"copy bandwidth measured by the same timer: {d['meta']['copy_GBps'] / 1000:.3f} "
             f"TB/s")
  for case, dtype in GPU_CASES[:2] + GPU_CASES[4:5]:
    r = gpu_case(TORCH, case, dtype)
    label = case.split(" 3x3")[0]  # the shape (and NCHW): every case here is 3x3/s2/p1
    out.append(f"| {label} {dtype} | {r['xla_bwd']['ms']:.3f} ms | "
               f"{r['pallas_bwd']['ms']:.3f} ms: "
               f"{r['xla_bwd']['ms'] / r['pallas_bwd']['ms']:.1f}x "
               f"({r['pallas_bwd']['of_copy']:.2f}) | {r['pallas_fwd_bwd']['ms']:.3f} ms | "
               f"{r['torch_fwd_bwd']['ms']:.3f} ms: "
               f"{r['torch_fwd_bwd']['ms'] / r['pallas_fwd_bwd']['ms']:.1f}x |")
  avg = [gpu_case(TORCH, c, t) for c, t in GPU_CASES]
  gains = [r["xla_avg_fwd_bwd"]["ms"] / r["pallas_avg_fwd_bwd"]["ms"] for r in avg]
  out.append(f"average pooling fwd+bwd was {span(gains, '{:.1f}')}x faster with the kernels "
             f"than with jaxpool's XLA path")
  out.append(least_gain("The 64x224x224x64 2x2/s2 float32 case gains least over XLA's backward "
                        "({bwd}x; {torch}x over cuDNN's fwd+bwd in the table above): there "
                        "jaxpool's fwd+bwd already moves its bytes at {frac} of the copy "
                        "bandwidth"))
  return out


def least_gain(template: str) -> str:
  r = gpu_case(TORCH, "64x224x224x64 2x2/s2", "float32")
  return template.format(bwd=f"{r['xla_bwd']['ms'] / r['pallas_bwd']['ms']:.1f}",
                         torch=f"{r['torch_fwd_bwd']['ms'] / r['pallas_fwd_bwd']['ms']:.1f}",
                         frac=f"{r['pallas_fwd_bwd']['of_copy']:.2f}")


def pallas_speed() -> list[str]:
  d = load(TORCH)
  labels = ["128x112x112x64 3x3/s2/p1 f32", "same, bf16", "64x224x224x64 2x2/s2 f32",
            "same, bf16", "128x64x112x112 NCHW 3x3/s2/p1 f32", "16x16x56x56x64 3x3x3/s2/p1 f32"]
  out = [f"the fraction of the copy bandwidth ({d['meta']['copy_GBps']:.0f} GB/s in that run",
         f"reach {span(kernel_fractions('pooling_gpu_h100.json'))} of the measured copy bandwidth "
         f"on an H100 and {span(kernel_fractions('pooling_gpu_h200.json'))} on an H200 with the "
         f"shipped tables"]
  for label, (case, dtype) in zip(labels, GPU_CASES, strict=True):
    r = gpu_case(TORCH, case, dtype)
    out.append(f"| {label} | {r['xla_bwd']['ms']:.3f} | {r['pallas_bwd']['ms']:.3f} "
               f"({r['pallas_bwd']['of_copy']:.2f}), "
               f"{r['xla_bwd']['ms'] / r['pallas_bwd']['ms']:.1f}x | "
               f"{r['pallas_fwd']['ms']:.3f} ({r['pallas_fwd']['of_copy']:.2f}) | "
               f"{r['pallas_fwd_bwd']['ms']:.3f}, "
               f"{r['torch_fwd_bwd']['ms'] / r['pallas_fwd_bwd']['ms']:.1f}x | "
               f"{r['torch_fwd_bwd']['ms']:.3f} | {r['xla_avg_fwd_bwd']['ms']:.3f} / "
               f"{r['pallas_avg_fwd_bwd']['ms']:.3f} |")
  rows = [gpu_case(TORCH, c, t) for c, t in GPU_CASES]

  def frac(k):
    return span(r[k]["of_copy"] for r in rows)
  out.append(f"The forward with the argmax ran at {frac('pallas_fwd_argmax')} of the copy "
             f"bandwidth, the backward at {frac('pallas_bwd')}, the average-pooling forward at "
             f"{frac('pallas_avg_fwd')} (each case's row `copy_same_bytes` in "
             f"`pooling_gpu_h100_torch.json`: a plain copy of the forward's bytes reached "
             f"{frac('copy_same_bytes')})")
  fwd = [r["pallas_fwd"]["ms"] / r["xla_fwd"]["ms"] for r in rows]
  xla = [r["xla_fwd"]["of_copy"] for r in rows]
  out.append(f"takes {span(fwd[:1] + fwd[2:])}x the time of XLA's `reduce_window` (which runs at "
             f"{span(xla[:1] + xla[2:])} of the copy bandwidth on the other cases) and is "
             f"{1 / fwd[1]:.1f}x faster in bfloat16 3x3/s2 (where `reduce_window` runs at "
             f"{xla[1]:.2f} of it)")
  out.append(least_gain("The 2x2/s2 float32 case gains least ({bwd}x over XLA's backward, "
                        "{torch}x over cuDNN's forward plus backward): its forward plus backward "
                        "already moves its bytes at {frac} of the copy bandwidth"))
  return out


def when_gpu() -> list[str]:
  rows = [gpu_case(TORCH, c, t) for c, t in GPU_CASES]
  out = []
  for (case, dtype), r in zip(GPU_CASES, rows, strict=True):
    out.append(f"| {case} | {dtype} | {r['xla_bwd']['ms']:.3f} | {r['pallas_bwd']['ms']:.3f} | "
               f"{r['xla_bwd']['ms'] / r['pallas_bwd']['ms']:.1f}x | "
               f"{r['torch_fwd_bwd']['ms']:.3f} | {r['pallas_fwd_bwd']['ms']:.3f} | "
               f"{r['torch_fwd_bwd']['ms'] / r['pallas_fwd_bwd']['ms']:.1f}x |")
  bwd = [r["xla_bwd"]["ms"] / r["pallas_bwd"]["ms"] for r in rows]
  torch = [r["torch_fwd_bwd"]["ms"] / r["pallas_fwd_bwd"]["ms"] for r in rows]
  out.append(f"Its max-pool backward took {span(bwd, '{:.1f}', 'x to ')}x less time than XLA's "
             f"`select_and_scatter`, and its forward plus backward "
             f"{span(torch, '{:.1f}', 'x to ')}x less than PyTorch's")
  fwd = [r["pallas_fwd"]["ms"] / r["xla_fwd"]["ms"] for r in rows]
  bf16 = fwd[1]
  others = fwd[:1] + fwd[2:]
  out.append(f"its forward kernel took {span(others, sep='x to ')}x XLA's time in five of the six "
             f"cases and {bf16:.2f}x in bfloat16 3x3/s2")
  first, last = rows[0], rows[5]
  out.append(f"({first['jaxpool_xla_fwd_bwd']['ms']:.3f} ms against {first['xla_bwd']['ms']:.3f} "
             f"ms for 128x112x112x64 3x3/s2/p1 float32), but not in 3-D "
             f"({last['jaxpool_xla_fwd_bwd']['ms']:.3f} ms against {last['xla_bwd']['ms']:.3f} ms "
             f"for 16x16x56x56x64 3x3x3/s2/p1)")
  out.append(least_gain("The 2x2/s2 float32 case gains least against XLA's backward ({bwd}x): "
                        "jaxpool's forward plus backward already moves that case's bytes at "
                        "{frac} of the copy bandwidth"))
  return out


# ----------------------------------------------------------------- tune_<gpu>.json


def tuning_cost() -> list[str]:
  t200, t100 = load("tune_h200.json"), load("tune_h100.json")
  return [f"tuned in {t200['seconds']:.1f} s on an H200 and {t100['seconds']:.1f} s on an H100, "
          f"at most {max(r['seconds'] for r in t200['rows']):.1f} s and "
          f"{max(r['seconds'] for r in t100['rows']):.1f} s a kernel",
          f"({len(t200['rows'])} kernels in {t200['seconds']:.1f} s on the H200 and "
          f"{t100['seconds']:.1f} s on the H100)"]


# ----------------------------------------------------------------- optimize_gpu_<gpu>.json


def optimize_step(case: str) -> tuple[dict, dict]:
  steps = load("optimize_gpu_h100.json")["steps"]
  [base] = [r for r in steps if r["case"] == case and r["variant"] == "base"]
  [opt] = [r for r in steps if r["case"] == case and r["variant"] == "optimize"]
  return base, opt


def readme_optimize() -> list[str]:
  base, opt = optimize_step("flax_vgg16_bf16_b64")
  return [f"a Flax VGG-16 bfloat16 training step ran {base['step_ms'] / opt['step_ms']:.2f}x "
          f"faster on an H100"]


def optimize_tables() -> list[str]:
  pools = load("optimize_gpu_h100.json")["pools"]

  def cell(variant, dtype):
    [r] = [r for r in pools if r["variant"] == variant and r["dtype"] == dtype]
    return r["fwd_bwd_ms"]
  out = []
  for label, variant in (("XLA: `jax.nn.relu` then `lax.reduce_window`",
                          "xla: relu -> reduce_window"),
                         ("jaxpool's pool after the ReLU (unfolded)", "jaxpool: relu -> pool"),
                         ('jaxpool, `activation="relu"`', "jaxpool: pool, activation='relu'"),
                         ("(jaxpool's pool alone, no ReLU)", "jaxpool: pool alone")):
    out.append(f"| {label} | {cell(variant, 'float32'):.3f} ms | "
               f"{cell(variant, 'bfloat16'):.3f} ms |")
  xla = "xla: relu -> reduce_window"
  opt = "jaxpool.optimize(xla)"
  out.append("| `jaxpool.optimize` of the XLA code | "
             + " | ".join(f"{cell(opt, t):.3f} ms ({cell(xla, t) / cell(opt, t):.1f}x)"
                          for t in ("float32", "bfloat16")) + " |")
  for label, case in (("Flax VGG-16, 224x224, bfloat16, batch 64", "flax_vgg16_bf16_b64"),
                      ("Flax VGG-16, 224x224, float32, batch 32", "flax_vgg16_f32_b32"),
                      ("Equinox CNN (examples/equinox_cnn.py), 128x3x112x112",
                       "equinox_cnn_f32_b128"),
                      ("Flax 3-D CNN, 8x16x112x112x3 clips", "video3d_f32_b8")):
    base, opt_ = optimize_step(case)
    out.append(f"| {label} | {base['step_ms']:.2f} ms | {opt_['step_ms']:.2f} ms | "
               f"{base['step_ms'] / opt_['step_ms']:.2f}x | {base['peak_mib']:.0f} / "
               f"{opt_['peak_mib']:.0f} MiB |")
  return out


# ----------------------------------------------------------------- global_adaptive_<gpu>.json


def global_adaptive() -> list[str]:
  rows = load("global_adaptive_h100.json")["rows"]

  def gain(r):
    return r["base_fwd_bwd"] / r["ours_fwd_bwd"]
  glob = [r for r in rows if r["base"].startswith("x.")]
  fixed = [r for r in rows if r.get("route") == "fixed"]
  bins = [r for r in rows if "128x13x13x512" in r["case"]]
  avg = [gain(r) for r in glob if r["case"].startswith("avg")]
  mx = [gain(r) for r in glob if r["case"].startswith("max")]
  return [f"global average {span(avg)}x, global max {span(mx)}x (128x7x7x2048 and 64x56x56x256, "
          f"float32 and bfloat16); adaptive pooling on evenly dividing sizes "
          f"{span(gain(r) for r in fixed)}x of the fixed-window op; on 13x13 -> 7x7, "
          f"{span((gain(r) for r in bins), '{:.1f}')}x faster than the `reduce_window` "
          f"formulation"]


# ----------------------------------------------------------------- models_gpu_<gpu>.json

MODEL_LABELS = {"Keras VGG16": "keras_vgg16", "Keras ResNet50": "keras_resnet50",
                "Keras DenseNet121": "keras_densenet121", "Keras InceptionV3": "keras_inceptionv3",
                "Keras Xception": "keras_xception", "Keras MobileNetV2": "keras_mobilenetv2",
                "Keras EfficientNetB0": "keras_efficientnetb0",
                "Keras ConvNeXtTiny (*)": "keras_convnexttiny",
                "Flax ResNet-50 (the Flax examples')": "flax_resnet50",
                "Flax ResNet-50": "flax_resnet50", "Flax 2-D U-Net": "flax_unet2d",
                "Flax 3-D U-Net (96^3) (**)": "flax_unet3d", "Equinox CNN": "equinox_cnn"}
DTYPES = {"bf16": "bfloat16", "f32": "float32"}


def models_table_rows(page: str, name: str, heading: str) -> tuple[list[str], list[str]]:
  """The rows of the models table after ``heading`` on ``page``, and those rendered from
  ``name``: every JSON row must appear, and every page row must be one of them."""
  text = (ROOT / page).read_text()
  after = text[text.index(heading):]
  table = re.search(r"\| model \| dtype, batch .*?\n\n", after, re.S).group(0)
  page_rows = []
  for line in BOLD.sub(r"\1", table).strip().splitlines()[2:]:
    label, rest = line.strip("| ").split(" | ", 1)
    assert label in MODEL_LABELS, f"{page}: a model the test does not know: {label!r}"
    page_rows.append(f"{MODEL_LABELS[label]} {rest.rstrip()}")
  rendered = []
  for r in load(name)["rows"]:
    short = {v: k for k, v in DTYPES.items()}[r["dtype"]]
    rendered.append(f"{r['model']} {short}, {r['batch']} | {ms(r['ms_without'])} ms | "
                    f"{ms(r['ms_with'])} ms | {r['speedup']:.2f}x | {r['replaced']} / "
                    f"{r['left_alone']}")
  return page_rows, rendered


def models_prose() -> list[str]:
  h100 = load("models_gpu_h100.json")["rows"]
  h200 = load("models_gpu_h200.json")["rows"]
  vgg_like = [r["speedup"] for r in h100 if r["model"] in ("keras_vgg16", "equinox_cnn")]
  xcep = [r["speedup"] for r in h100 if r["model"] == "keras_xception"]
  [vgg_bf16] = [r for r in h100 if r["model"] == "keras_vgg16" and r["dtype"] == "bfloat16"]
  return [f"Every row is at least {min(r['speedup'] for r in h100):.2f}x",
          f"Keras VGG16 and the Equinox CNN gain {span(vgg_like)}x, Xception {span(xcep)}x",
          f"{vgg_bf16['memory_without']['temp_mib']:.0f} → "
          f"{vgg_bf16['memory_with']['temp_mib']:.0f} MiB for VGG16 in bfloat16",
          f"On one H200 every row is at least {min(r['speedup'] for r in h200):.2f}x"]


# ----------------------------------------------------------------- multi_gpu_<gpu>x<n>.json


def pool_table(name: str, key: str) -> list[str]:
  rows = [r for r in load(name)["rows"] if r["part"] == "pool"]

  def get(dtype, op, impl, split):
    [r] = [r for r in rows if (r["dtype"], r["op"], r["impl"], r["split"])
           == (dtype, op, impl, split)]
    return r[key]
  out = []
  for op, word in (("max_pool", "max"), ("avg_pool", "average")):
    for dtype in ("float32", "bfloat16"):
      one = get(dtype, op, "jaxpool", "one GPU")
      cells = []
      for split in ("one GPU", "batch", "depth"):
        mine = get(dtype, op, "jaxpool", split)
        cell = f"{get(dtype, op, 'reduce_window', split):.3f} / {mine:.3f} ms"
        cells.append(cell if split == "one GPU" else f"{cell} ({one / mine:.2f}x)")
      out.append(f"| {word}, {dtype} | " + " | ".join(cells) + " |")
  return out


def vgg_table(name: str, key: str, modes: list[str], unit: str = " ms") -> list[str]:
  rows = [r for r in load(name)["rows"] if r["part"] == "vgg"]
  out = []
  for variant, label in (("plain", "plain Flax"), ("optimize", "`jaxpool.optimize`")):
    by_mode = {r["mode"]: r[key] for r in rows if r["variant"] == variant}
    one = by_mode["one GPU"]
    cells = [f"{one:.2f}{unit}"] + [f"{by_mode[m]:.2f}{unit} ({one / by_mode[m]:.2f}x)"
                                    for m in modes]
    out.append(f"| {label} | " + " | ".join(cells) + " |")
  return out


def unet(name: str, template: str) -> str:
  by = {r["variant"]: r["ms"] for r in load(name)["rows"] if r["part"] == "unet"}
  return template.format(plain=f"{by['plain']:.2f}", optimize=f"{by['optimize']:.2f}")


def sharding() -> list[str]:
  h100, h200 = "multi_gpu_h100x2.json", "multi_gpu_h200x2.json"
  return [*pool_table(h100, "chain_ms"),
          *vgg_table(h100, "loop_ms", ["auto", "fsdp", "fsdp_bf16"]),
          unet(h100, "split along depth): plain {plain} ms, `optimize` {optimize} ms"),
          *pool_table(h200, "ms"),
          *vgg_table(h200, "ms", ["auto", "explicit", "shard_map"]),
          unet(h200, "The 3-D U-Net-style step: plain {plain} ms, `optimize` {optimize} ms.")]


def first_call() -> list[str]:
  """docs/tuning.md: the first-call run and the model alone (the table hidden)."""
  fc = load("first_call_gpu_h200.json")["summary"]
  fractions = kernel_fractions("pooling_gpu_h200_table_off.json")
  over = fc["overhead_s_over_9_taps"]
  return [f"ran {sum(f < 0.85 for f in fractions)} of {len(fractions)} kernel rows below 0.85 of "
          f"the copy bandwidth ({min(fractions):.2f}-{max(fractions):.2f})",
          f"was at most {fc['max_overhead_s_up_to_9_taps']:.2f} s for windows of up to 9 taps "
          f"({fc['cases_up_to_9_taps_over_0.5_s']} of them over 0.5 s), "
          f"up to {max(over):.2f} s for larger ones",
          f"within 5% of a tuned launch in "
          f"{fc['cases'] - fc['cases_default_over_tuned_above_1.05']} of {fc['cases']} cases, and "
          f"up to {fc['max_default_over_tuned']:.2f}x slower"]


def large_windows() -> list[str]:
  """docs/large-windows.md: the SPP table's rows, the 3-D target's (same columns) and the SPPF
  step's, once measured (the JSON has no such rows before its ``3d_target`` and ``sppf`` parts
  run)."""
  rows = []
  result = load("windows_gpu_h200.json")
  for r in result["spp"] + result.get("3d_target", []):
    m, s, fl = r["ms"], r["speedup"], r["of_floor"]
    rows.append(f"| {r['dtype']} | {r['case']} | {m['jaxpool_fwd']:.3f} | {m['xla_fwd']:.3f} | "
                f"{s['fwd']:.2f}x | {m['jaxpool_fwd_grad']:.3f} | {m['xla_fwd_grad']:.3f} | "
                f"{s['fwd_grad']:.2f}x | {fl['fwd_grad']:.2f} |")
  for r in result.get("sppf", []):
    m, s = r["ms"], r["speedup"]
    rows.append(f"| {r['dtype']} | {m['jaxpool_fwd']:.3f} | {m['xla_fwd']:.3f} | {s['fwd']:.2f}x | "
                f"{m['jaxpool_fwd_grad']:.3f} | {m['xla_fwd_grad']:.3f} | {s['fwd_grad']:.2f}x |")
  cells = load("windows_gpu_h200.json")["cells"]
  slow = sorted((c for c in cells if c["speedup"]["fwd_grad"] < 0.95),
                key=lambda c: c["speedup"]["fwd_grad"])
  fwd_ok = [c for c in cells if c["speedup"]["fwd"] >= 0.95]
  lowest_fwd = min(cells, key=lambda c: c["speedup"]["fwd"])
  name = lambda c: (f"{c['dtype']} {'x'.join(map(str, c['window']))}"  # noqa: E731
                    f"/s{c['strides'][0]}")
  rows += [f"faster than XLA in {len(cells) - len(slow)} of {len(cells)} cells",
           f"slower in {len(slow)}",
           ", ".join(f"{name(c)} {c['speedup']['fwd_grad']:.2f}x" for c in slow)
           or "no cell slower than",  # (the line is a constant: not a measured figure)
           f"within 0.95x of XLA in {len(fwd_ok)} of {len(cells)} cells (lowest "
           f"{name(lowest_fwd)} {lowest_fwd['speedup']['fwd']:.2f}x)"]
  return rows


def roi() -> list[str]:
  """docs/roi.md: the measured tables' rows (roi_align, its max mode, a detection head's step,
  roi_pool)."""
  rows = []
  for c in load("roi_gpu_h200.json")["cases"]:
    r, tv = c["rows"], c["rows"]["torchvision"]
    tv_ms = f"{tv['fwd+dx_ms']:.3f}" if "fwd+dx_ms" in tv else f"(no {c['dtype']})"
    grid = "x".join(map(str, c["output_size"]))
    rows.append(f"| {c['dtype']}, {grid} | {r['jaxpool']['fwd']['ms']:.3f} | "
                f"{r['jaxpool']['fwd+dx']['ms']:.3f} | {tv_ms} | "
                f"{r['plain_jnp']['fwd+dx']['ms']:.3f} | {r['jaxpool_xla']['fwd+dx']['ms']:.3f} |")
  for c in load("roi_max_gpu_h200.json")["cases"]:
    j, x = c["rows"]["jaxpool"], c["rows"]["jaxpool_xla"]
    parts = ("fwd", "fwd+dx", "fwd+dx+dboxes")
    rows.append(f"| {c['dtype']}, {'x'.join(map(str, c['output_size']))} | "
                + " | ".join(f"{r[p]['ms']:.3f}" for r in (j, x) for p in parts) + " |")
  for c in load("detection_gpu_h200.json")["cases"]:
    steps = [c["rows"][n]["step_ms"] for n in ("jaxpool", "jaxpool_xla", "plain_jnp",
                                                "no_pooling")]
    rows.append(f"| {c['dtype']} | " + " | ".join(f"{v:.3f}" for v in steps) + " |")
  for c in load("roi_pool_gpu_h200.json")["cases"]:
    r, tv = c["rows"], c["rows"]["torchvision"]
    tv_ms = (f"{tv['fwd_ms']:.3f} | {tv['fwd+dx_ms']:.3f}" if "fwd+dx_ms" in tv
             else f"(no {c['dtype']}) | (no {c['dtype']})")
    rows.append(f"| {c['dtype']} | {r['jaxpool']['fwd']['ms']:.3f} | "
                f"{r['jaxpool']['fwd+dx']['ms']:.3f} | {tv_ms} | "
                f"{r['jaxpool_xla']['fwd+dx']['ms']:.3f} |")
  return rows


def readme_roi() -> list[str]:
  """README.md: the ROI box head's speed-ups (float32, 7x7)."""
  c = next(c for c in load("roi_gpu_h200.json")["cases"]
           if c["dtype"] == "float32" and c["output_size"] == [7, 7])
  r = c["rows"]
  ours = r["jaxpool"]["fwd+dx"]["ms"]
  return [f"{r['torchvision']['fwd+dx_ms'] / ours:.1f}x faster than torchvision's CUDA kernel "
          f"and {r['plain_jnp']['fwd+dx']['ms'] / ours:.1f}x a plain `jnp` version on an H200"]


FIGURES: dict[str, Callable[[], list[str]]] = {
    "README.md": lambda: readme_cpu_table() + readme_gpu() + readme_optimize() + readme_roi(),
    "docs/when-to-use.md": lambda: when_cpu_table() + when_gpu(),
    "docs/pallas.md": pallas_speed,
    "docs/tuning.md": lambda: tuning_table() + tuning_cost() + first_call(),
    "docs/optimize.md": optimize_tables,
    "docs/benchmarks.md": lambda: global_adaptive() + models_prose(),
    "docs/sharding.md": sharding,
    "docs/large-windows.md": large_windows,
    "docs/roi.md": roi,
}
MODEL_TABLES = [("docs/benchmarks.md", "models_gpu_h100.json", "## Real models"),
                ("docs/benchmarks.md", "models_gpu_h200.json", "results/models_gpu_h200.json`):")]


def missing(page: str) -> list[str]:
  text = page_text(page)
  return [f for f in FIGURES[page]() if normal(f) not in text]


@pytest.mark.parametrize("page", sorted(FIGURES))
def test_page_quotes_the_results(page):
  gone = missing(page)
  assert not gone, (f"{page} does not say what benchmarks/results/ holds; expected (rendered "
                    f"from the JSON):\n" + "\n".join(gone))


@pytest.mark.parametrize("page, name, heading", MODEL_TABLES)
def test_models_tables_are_the_results(page, name, heading):
  page_rows, rendered = models_table_rows(page, name, heading)
  assert sorted(page_rows) == sorted(rendered), (
      f"{page}'s table after {heading!r} is not {name}'s rows:\n"
      f"only on the page: {sorted(set(page_rows) - set(rendered))}\n"
      f"only in the JSON: {sorted(set(rendered) - set(page_rows))}")


CITED = re.compile(r"benchmarks/results/([\w.-]+\.jsonl?)")


@pytest.mark.parametrize("page", PAGES)
def test_cited_results_exist(page):
  """A page cites only files that benchmarks/results/ holds (older runs by their commit)."""
  text = (ROOT / page).read_text()
  cited = {m.group(1) for m in CITED.finditer(text)}
  # A citation of an older commit's file reads c2b0d33:benchmarks/results/NAME.
  old = {m.group(1) for m in re.finditer(r"[0-9a-f]{7,40}:" + CITED.pattern, text)}
  # ``pooling_gpu_<gpu>.json`` and the like name a pattern, not a file.
  absent = sorted(n for n in cited - old if not (RESULTS / n).exists() and "<" not in n)
  assert not absent, f"{page} cites files that benchmarks/results/ no longer holds: {absent}"


def test_pages_citing_results_have_their_figures_checked():
  """A page that names a result file is in FIGURES (or is rendered, benchmarks.md's tables)."""
  citing = [p for p in PAGES if CITED.search((ROOT / p).read_text())]
  unchecked = [p for p in citing if p not in FIGURES and p not in ("docs/architecture.md",)]
  assert not unchecked, f"pages quote benchmark results with no entry in FIGURES: {unchecked}"


def _moved(value, path: str = ""):
  """Every float of a JSON value times a factor from 1.2 to 1.68 that depends on where it is
  (so that ratios move too); names, shapes and counts unchanged."""
  if isinstance(value, float):
    return value * (1.2 + 0.03 * (zlib.crc32(path.encode()) % 17))
  if isinstance(value, list):
    return [_moved(v, f"{path}/{i}") for i, v in enumerate(value)]
  if isinstance(value, dict):
    return {k: _moved(v, f"{path}/{k}") for k, v in value.items()}
  return value


@pytest.mark.parametrize("page", sorted(FIGURES))
def test_every_figure_reads_its_file(page, monkeypatch):
  """The check can fail: rendered from files whose measurements moved, no figure with a
  measured (decimal) number is found on its page any more."""
  before = FIGURES[page]()
  monkeypatch.setattr(sys.modules[__name__], "_loader",
                      lambda name: _moved(copy.deepcopy(_load_file(name))))
  after = FIGURES[page]()
  text = page_text(page)
  still = [f for f, g in zip(before, after, strict=True)
           if re.search(r"\d\.\d", f) and normal(g) in text]
  assert not still, f"{page}: these figures do not follow their files: {still}"


def test_models_tables_read_their_file(monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "_loader",
                      lambda name: _moved(copy.deepcopy(_load_file(name))))
  for page, name, heading in MODEL_TABLES:
    page_rows, rendered = models_table_rows(page, name, heading)
    assert not set(page_rows) & set(rendered), (page, name)
