"""Draws the pictures of docs/semantics.md from jaxpool's own outputs, and the heat map of
docs/large-windows.md from the windows sweep's results.

  .venv/bin/python docs/make_figures.py      # writes docs/img/{windows,padding,ties}.png and
                                             # docs/img/windows_sweep_h200.png
  .venv/bin/python docs/make_figures.py windows_sweep   # only the heat map

Every number drawn is computed here by jaxpool (nothing typed in by hand but the inputs) or
read from benchmarks/results/windows_gpu_h200.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.patches as mpatches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

import jaxpool  # noqa: E402

IMG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOWS_RESULTS = os.path.join(ROOT, "benchmarks", "results", "windows_gpu_h200.json")
SWEEP_PARTS = ("2d_float32", "2d_bfloat16", "3d_float32", "3d_bfloat16")
STRIDE_CLASSES = ("1", "2", "k // 2", "k")
MODES = (("fwd", "forward"), ("fwd_grad", "forward + gradient"))
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def grid(ax, values, *, origin=(0, 0), pad=0, title="", highlight=None, fmt="{:g}"):
  """Draws a 2-D array as labelled cells; ``pad`` grey cells around it."""
  h, w = values.shape
  oy, ox = origin
  for i in range(-pad, h + pad):
    for j in range(-pad, w + pad):
      real = 0 <= i < h and 0 <= j < w
      face = "white" if real else "#dddddd"
      if real and highlight is not None and highlight[i, j]:
        face = "#ffe08a"
      ax.add_patch(mpatches.Rectangle((ox + j, oy - i - 1), 1, 1, fc=face, ec="black", lw=0.8))
      text = fmt.format(float(values[i, j])) if real else "pad"
      ax.text(ox + j + 0.5, oy - i - 0.5, text, ha="center", va="center",
              fontsize=9 if real else 7, color="black" if real else "#777777")
  if title:
    ax.text(ox + w / 2, oy + pad + 0.4, title, ha="center", va="bottom", fontsize=10)


def finish(ax):
  ax.set_aspect("equal")
  ax.axis("off")
  ax.autoscale_view()


def windows_figure(path):
  """3x3 windows, stride 2, padding 1 over a 5x5 input: each window and its output."""
  x = jnp.arange(25.0).reshape(1, 5, 5, 1)
  y = jaxpool.max_pool(x, (3, 3), strides=(2, 2), padding=1)[0, :, :, 0]
  fig, ax = plt.subplots(figsize=(9, 4.2))
  grid(ax, np.asarray(x[0, :, :, 0]), pad=1, title="x: 5x5, padding 1")
  k = 0
  for oi in range(y.shape[0]):
    for oj in range(y.shape[1]):
      if (oi, oj) in ((0, 0), (1, 2), (2, 1)):
        r0, c0 = oi * 2 - 1, oj * 2 - 1
        ax.add_patch(mpatches.Rectangle((c0 + 0.06 * k, -r0 - 3 + 0.06 * k), 3 - 0.12 * k,
                                        3 - 0.12 * k, fill=False, ec=COLORS[k], lw=2.5))
        k += 1
  grid(ax, np.asarray(y), origin=(-0.5, 8), title="max_pool(x, (3, 3), (2, 2), 1)")
  k = 0
  for oi in range(y.shape[0]):
    for oj in range(y.shape[1]):
      if (oi, oj) in ((0, 0), (1, 2), (2, 1)):
        ax.add_patch(mpatches.Rectangle((8 + oj, -0.5 - oi - 1), 1, 1, fill=False,
                                        ec=COLORS[k], lw=2.5))
        k += 1
  ax.text(9.5, -4.6, "out = (5 + 1 + 1 - 3) // 2 + 1 = 3", ha="center", fontsize=10)
  finish(ax)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def padding_figure(path):
  """Where the windows of a 1-D pool (window 2, stride 2, 5 elements) fall for each padding."""
  x = jnp.arange(1.0, 6.0).reshape(1, 5, 1)
  cases = [("VALID", dict(padding="VALID")), ('"SAME" (extra at the end)', dict(padding="SAME")),
           ('"SAME_LOWER"', dict(padding="SAME_LOWER")), ("padding=1", dict(padding=1)),
           ("VALID, ceil_mode=True", dict(padding="VALID", ceil_mode=True)),
           ("padding=((0, 1),)", dict(padding=((0, 1),)))]
  fig, ax = plt.subplots(figsize=(9, 5.2))
  for row, (label, kw) in enumerate(cases):
    geom = jaxpool.make_geometry(x.shape, (2,), (2,), kw.get("padding"), None,
                                 kw.get("ceil_mode", False))
    y = jaxpool.max_pool(x, (2,), (2,), **kw)[0, :, 0]
    (lo, hi), extra = geom.padding[0], geom.extra[0]
    top = -row * 1.6
    for j in range(-lo, 5 + hi + extra):
      real = 0 <= j < 5
      face = "white" if real else ("#dddddd" if j < 5 + hi else "#f4d4d4")
      ax.add_patch(mpatches.Rectangle((j, top - 1), 1, 1, fc=face, ec="black", lw=0.8))
      ax.text(j + 0.5, top - 0.5, f"{j + 1}" if real else ("pad" if j < 5 + hi else "ceil"),
              ha="center", va="center", fontsize=9 if real else 7)
    for o in range(geom.out_spatial[0]):
      start = o * 2 - lo
      ax.add_patch(mpatches.Rectangle((start + 0.08, top - 1 + 0.08), 1.84, 0.84, fill=False,
                                      ec=COLORS[o % len(COLORS)], lw=2))
    ax.text(-2.6, top - 0.5, label, ha="right", va="center", fontsize=9)
    ax.text(8.2, top - 0.5, f"pads {geom.padding[0]}  ->  y = {np.asarray(y).tolist()}",
            ha="left", va="center", fontsize=9)
  ax.set_xlim(-9, 16)
  ax.text(3.5, 1.0, "x = [1, 2, 3, 4, 5], window 2, stride 2, max_pool", ha="center", fontsize=10)
  finish(ax)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def ties_figure(path):
  """Ties: the first maximum in row-major window order wins, and takes the gradient."""
  x = jnp.array([[1., 3., 3., 0.], [2., 3., 1., 3.], [0., 1., 2., 2.], [4., 0., 2., 2.]])
  x4 = x[None, :, :, None]
  y, idx = jaxpool.max_pool_with_indices(x4, (2, 2), strides=(2, 2))
  dx = jax.grad(lambda v: jnp.sum(jaxpool.max_pool(v, (2, 2), strides=(2, 2))))(x4)
  win = np.zeros((4, 4), bool)
  for f in np.asarray(idx).ravel():
    win[f // 4, f % 4] = True
  fig, ax = plt.subplots(figsize=(10, 3.6))
  grid(ax, np.asarray(x), title="x (winners shaded)", highlight=win)
  for i in range(2):
    for j in range(2):
      ax.add_patch(mpatches.Rectangle((2 * j + 0.05, -2 * i - 2 + 0.05), 1.9, 1.9, fill=False,
                                      ec=COLORS[2 * i + j], lw=2))
  grid(ax, np.asarray(y[0, :, :, 0]), origin=(-1, 5.5), title="y = max_pool")
  grid(ax, np.asarray(idx[0, :, :, 0]), origin=(-1, 8.5), title="indices", fmt="{:.0f}")
  grid(ax, np.asarray(dx[0, :, :, 0]), origin=(0, 11.5), title="grad of sum(y)", highlight=win)
  finish(ax)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def stride_classes(k: int) -> tuple[int, ...]:
  """The stride of each class of ``STRIDE_CLASSES`` for window ``k`` (at least 1)."""
  return tuple(max(1, s) for s in (1, 2, k // 2, k))


def sweep_panels(result: dict) -> list[dict]:
  """One panel per sweep part present in ``result`` (windows_gpu.py's JSON), in
  ``SWEEP_PARTS`` order: its windows (rows), and per mode the speed-ups (jaxpool over XLA:
  XLA's time over jaxpool's) and strides by stride class (columns), NaN where no cell. A cell
  whose stride falls in two classes (5x5 at stride 2: ``2`` and ``k // 2``) fills both."""
  cells = result.get("cells", [])
  panels = []
  for part in [p for p in SWEEP_PARTS if any(c["part"] == p for c in cells)]:
    mine = [c for c in cells if c["part"] == part]
    windows = sorted({c["window"][0] for c in mine})
    speedup = {m: np.full((len(windows), len(STRIDE_CLASSES)), np.nan) for m, _ in MODES}
    strides = np.zeros((len(windows), len(STRIDE_CLASSES)), int)
    for c in mine:
      k, s = c["window"][0], c["strides"][0]
      for j, s_class in enumerate(stride_classes(k)):
        if s == s_class:
          strides[windows.index(k), j] = s
          for m, _ in MODES:
            speedup[m][windows.index(k), j] = c["speedup"][m]
    panels.append({"part": part, "shape": mine[0]["shape"], "windows": windows,
                   "speedup": speedup, "strides": strides})
  return panels


def windows_sweep_figure(path, results=WINDOWS_RESULTS) -> list[str]:
  """The sweep's heat map: jaxpool over XLA per cell, forward and forward + gradient side by
  side, one row of panels per part present in ``results``; returns the parts drawn (none:
  nothing written)."""
  with open(results) as f:
    result = json.load(f)
  panels = sweep_panels(result)
  if not panels:
    return []
  norm = mcolors.LogNorm(vmin=1 / 16, vmax=16)  # (1 in the middle of the colour scale)
  cmap = plt.get_cmap("RdBu").with_extremes(bad="#eeeeee")
  fig, axes = plt.subplots(len(panels), 2, squeeze=False, layout="constrained",
                           figsize=(9.5, 0.5 + 0.4 * sum(len(p["windows"]) + 3 for p in panels)),
                           gridspec_kw={"height_ratios": [len(p["windows"]) for p in panels]})
  for row, panel in zip(axes, panels, strict=True):
    n = len(panel["shape"]) - 2
    for ax, (mode, title) in zip(row, MODES, strict=True):
      values = panel["speedup"][mode]
      image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
      for i in range(len(panel["windows"])):
        for j in range(len(STRIDE_CLASSES)):
          v = values[i, j]
          if np.isnan(v):
            continue
          slow = v < 0.95
          ax.text(j, i, f"{v:.2f}x  s{panel['strides'][i, j]}", ha="center", va="center",
                  fontsize=7.5, fontweight="bold" if slow else "normal",
                  color="white" if abs(np.log2(v)) > 2.5 else "black")
      ax.set_xticks(range(len(STRIDE_CLASSES)), [f"stride {c}" for c in STRIDE_CLASSES],
                    fontsize=8)
      ax.set_yticks(range(len(panel["windows"])),
                    ["x".join([str(k)] * n) for k in panel["windows"]], fontsize=8)
      ax.set_title(f"{panel['part']}, {title}\n{tuple(panel['shape'])}", fontsize=9)
  bar = fig.colorbar(image, ax=axes, shrink=0.8)
  bar.set_ticks([1 / 16, 1 / 4, 1, 4, 16], labels=["1/16", "1/4", "1", "4", "16"])
  bar.minorticks_off()
  bar.set_label("XLA's time / jaxpool's (above 1: jaxpool faster; bold: below 0.95)", fontsize=8)
  meta = result.get("meta", {})
  fig.suptitle(f"max_pool against lax.reduce_window, {meta.get('device', '?')}, "
               f"JAX {meta.get('jax', '?')}", fontsize=10)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)
  return [p["part"] for p in panels]


FIGURES = {"windows": windows_figure, "padding": padding_figure, "ties": ties_figure,
           "windows_sweep_h200": windows_sweep_figure}


def main(argv=None):
  """Writes the figures named in ``argv`` (``windows_sweep`` for the heat map), else all."""
  names = list(sys.argv[1:] if argv is None else argv) or list(FIGURES)
  names = ["windows_sweep_h200" if n == "windows_sweep" else n for n in names]
  unknown = [n for n in names if n not in FIGURES]
  if unknown:
    raise SystemExit(f"unknown figures {unknown}; choose from {', '.join(FIGURES)}")
  os.makedirs(IMG, exist_ok=True)
  for name in names:
    FIGURES[name](os.path.join(IMG, f"{name}.png"))
  print("wrote", ", ".join(f"docs/img/{n}.png" for n in names))


if __name__ == "__main__":
  main()
