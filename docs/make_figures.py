"""Draws the pictures of docs/semantics.md from jaxpool's own outputs.

  .venv/bin/python docs/make_figures.py      # writes docs/img/{windows,padding,ties}.png

Every number drawn is computed here by jaxpool (nothing typed in by hand but the inputs).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.patches as mpatches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

import jaxpool  # noqa: E402

IMG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")
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


def main():
  os.makedirs(IMG, exist_ok=True)
  windows_figure(os.path.join(IMG, "windows.png"))
  padding_figure(os.path.join(IMG, "padding.png"))
  ties_figure(os.path.join(IMG, "ties.png"))
  print("wrote", ", ".join(os.path.join("docs/img", f) for f in
                           ("windows.png", "padding.png", "ties.png")))


if __name__ == "__main__":
  main()
