"""Train a small CNN, built with jaxpool.graph, on scikit-learn's handwritten digits.

The network is a graph of nodes (convolutions, batch normalization, max pooling, dense layers,
dropout, a softmax cross-entropy loss); each training step runs its *training graph* in training
mode: the forward nodes, the gradient-state nodes that keep the max-pool argmax, the weights, the
batch statistics and the dropout masks, and one gradient node per forward node, as MPS's
``trainingGraph`` builds; ``train.make_step`` applies optax's Adam to the gradients and returns
the updated running statistics. The trained parameters and statistics are saved with
``jg.save_params`` and read back for the final test.

    .venv/bin/python examples/train_digits.py              # full run, ~98% test accuracy
    .venv/bin/python examples/train_digits.py --steps 20   # a short run (CI)

The data set is the 1,797 8x8 digit images that scikit-learn ships (no download). The plot of
loss and accuracy per epoch goes to ``examples/out/train_digits.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # CPU by default; set JAX_PLATFORMS to override

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from jaxpool import graph as jg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def build_network() -> tuple[jg.Node, jg.Node]:
  """The CNN as nodes: returns ``(logits, loss)``."""
  image = jg.Input("image", shape=(8, 8, 1))
  label = jg.Input("label", shape=(), dtype=jnp.int32)
  # (no conv bias: the batch norm after it has one)
  x = jg.Conv("conv1", image, features=32, window=(3, 3), padding="SAME", use_bias=False)
  x = jg.ReLU("relu1", jg.BatchNorm("bn1", x))
  x = jg.MaxPool("pool1", x, window=(2, 2))                                  # 4x4x32
  x = jg.Conv("conv2", x, features=64, window=(3, 3), padding="SAME", use_bias=False)
  x = jg.ReLU("relu2", jg.BatchNorm("bn2", x))
  x = jg.MaxPool("pool2", x, window=(2, 2))                                  # 2x2x64
  x = jg.ReLU("relu3", jg.Dense("fc1", x, features=128))                     # flattens
  x = jg.Dropout("drop", x, rate=0.3)
  logits = jg.Dense("logits", x, features=10)
  loss = jg.SoftmaxCrossEntropy("loss", logits, label)
  return logits, loss


def load_data(seed: int):
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
  y = digits.target.astype(np.int32)
  return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def save_plot(history: dict[str, list[float]], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  epochs = np.arange(1, len(history["loss"]) + 1)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  ax1.plot(epochs, history["loss"], marker="o", ms=3, label="train loss")
  ax1.plot(epochs, history["test_loss"], marker="o", ms=3, label="test loss")
  ax1.set_xlabel("epoch")
  ax1.set_ylabel("softmax cross-entropy")
  ax1.set_yscale("log")
  ax1.legend()
  ax1.grid(alpha=0.3)
  ax2.plot(epochs, 100 * np.asarray(history["train_acc"]), marker="o", ms=3, label="train")
  ax2.plot(epochs, 100 * np.asarray(history["test_acc"]), marker="o", ms=3, label="test")
  ax2.axhline(97, color="grey", ls="--", lw=1, label="97%")
  ax2.set_xlabel("epoch")
  ax2.set_ylabel("accuracy (%)")
  ax2.set_ylim(min(90.0, 100 * min(history["test_acc"]) - 1), 100.5)
  ax2.legend(loc="lower right")
  ax2.grid(alpha=0.3)
  for ax in (ax1, ax2):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  fig.suptitle("jaxpool.graph CNN on scikit-learn digits (training graph + optax adam)")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--epochs", type=int, default=20, help="passes over the training set")
  p.add_argument("--steps", type=int, default=None,
                 help="stop after this many steps in all (a short run, e.g. for CI)")
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--lr", type=float, default=2e-3, help="adam learning rate (cosine decay)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=os.path.join(HERE, "out"), help="folder for the plot")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--quiet", action="store_true", help="no graph summaries")
  args = p.parse_args(argv)
  t0 = time.perf_counter()

  x_train, x_test, y_train, y_test = load_data(args.seed)
  logits_node, loss_node = build_network()
  model = jg.Graph(logits_node)                # inference: image -> logits
  train = jg.training_graph(loss_node)         # forward + gradient-state + gradient nodes
  if not args.quiet:
    print(model.summary())
    print()
    print(train.summary())
    print()

  params = model.init(jax.random.key(args.seed))
  state = model.init_state()                   # the batch norms' running statistics
  keys = jax.random.key(args.seed + 1)         # dropout: jax.random.fold_in(keys, step)
  steps_per_epoch = len(x_train) // args.batch_size
  total = steps_per_epoch * args.epochs
  if args.steps is not None:
    total = min(total, args.steps)
  schedule = optax.cosine_decay_schedule(args.lr, max(total, 1), alpha=0.05)
  opt = optax.adam(schedule)
  opt_state = opt.init(params)

  # The training graph's gradients are jax.value_and_grad's of the training-mode forward: check
  # once, on the first batch.
  xb, yb = jnp.asarray(x_train[:args.batch_size]), jnp.asarray(y_train[:args.batch_size])
  loss_a, grads_a, _ = jax.jit(train.run)(params, state=state, key=keys, image=xb, label=yb)
  forward_loss = jg.Graph(loss_node)
  (loss_b, _), grads_b = jax.jit(jax.value_and_grad(
      lambda p: forward_loss.apply(p, state=state, key=keys, training=True, image=xb, label=yb),
      has_aux=True))(params)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True))
  print(f"training graph vs jax.value_and_grad on one batch: loss {float(loss_a):.6f} vs "
        f"{float(loss_b):.6f}, max |grad difference| = {diff:.3g}")

  # The training graph does backprop, optax's Adam the update: (params, opt_state, state, loss).
  train_step = jax.jit(train.make_step(opt))

  @jax.jit
  def evaluate(params, state, x, y):
    logits, _ = model.apply(params, state=state, image=x)   # inference mode
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)

  history: dict[str, list[float]] = {"loss": [], "test_loss": [], "train_acc": [], "test_acc": []}
  rng = np.random.default_rng(args.seed)
  step = 0
  epochs = -(-total // steps_per_epoch) if total else 0
  bar = tqdm(total=total, desc="training", unit="step", disable=args.no_progress,
             file=sys.stdout, dynamic_ncols=True)
  for epoch in range(epochs):
    perm = rng.permutation(len(x_train))
    losses = []
    for k in range(steps_per_epoch):
      if step >= total:
        break
      idx = perm[k * args.batch_size:(k + 1) * args.batch_size]
      params, opt_state, state, loss = train_step(
          params, opt_state, state=state, key=jax.random.fold_in(keys, step),
          image=x_train[idx], label=y_train[idx])
      losses.append(loss)
      step += 1
      bar.update(1)
    _, train_acc = evaluate(params, state, x_train, y_train)
    test_loss, test_acc = evaluate(params, state, x_test, y_test)
    history["loss"].append(float(np.mean(jax.device_get(losses))))
    history["test_loss"].append(float(test_loss))
    history["train_acc"].append(float(train_acc))
    history["test_acc"].append(float(test_acc))
    bar.set_postfix(epoch=epoch + 1, loss=f"{history['loss'][-1]:.4f}",
                    test_acc=f"{100 * float(test_acc):.2f}%")
  bar.close()

  # Save the parameters and the running statistics, and test what is read back.
  os.makedirs(args.out, exist_ok=True)
  saved = [jg.save_params(os.path.join(args.out, f"digits_{what}.npz"), tree)
           for what, tree in (("params", params), ("state", state))]
  params, state = (jg.load_params(f) for f in saved)
  _, train_acc = evaluate(params, state, x_train, y_train)
  _, test_acc = evaluate(params, state, x_test, y_test)
  train_acc, test_acc = float(train_acc), float(test_acc)
  correct = int(round(test_acc * len(y_test)))
  elapsed = time.perf_counter() - t0
  print(f"\nSaved and reloaded {', '.join(saved)}")
  print(f"Final train accuracy: {100 * train_acc:.2f}%")
  print(f"Final test accuracy: {100 * test_acc:.2f}% ({correct}/{len(y_test)} digits), "
        f"{step} steps, {len(history['loss'])} epochs, {elapsed:.1f} s")
  plot = None
  if not args.no_plot and history["loss"]:
    plot = os.path.join(args.out, "train_digits.png")
    save_plot(history, plot)
    print(f"Plot of loss and accuracy per epoch: {plot}")
  return {"test_accuracy": test_acc, "train_accuracy": train_acc, "history": history,
          "steps": step, "plot": plot, "seconds": elapsed, "grad_check_max_diff": diff,
          "saved": saved}


if __name__ == "__main__":
  main()
