"""The report of jaxpool.optimize points at the user's code: each site's layer (Flax's module
path, Keras's layer name, Equinox's layer class, from JAX's name stack) and the first frame of
the user's own code (not JAX's, jaxpool's, Flax's, Keras's or Equinox's)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxpool
from jaxpool._src.optimize import cost

nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")

HERE = os.path.abspath(__file__)
POOLS = ("reduce_window_max", "reduce_window_sum", "select_and_scatter_add")


def sites(report):
  return [d for d in report.findings if d.op in POOLS]


def line_of(text: str) -> int:
  """The line of this file that holds ``text``."""
  with open(HERE) as f:
    for n, line in enumerate(f, 1):
      if text in line and "line_of(" not in line:
        return n
  raise AssertionError(text)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.max_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), (2, 2))  # the block's pool


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.remat(Block)(name="block1")(x)
    return nn.avg_pool(x, (2, 2), (2, 2))  # the net's pool


def test_flax_layers_and_lines():
  x = jnp.ones((1, 8, 8, 3))
  model = Net()
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  loss = lambda p, x: model.apply(p, x).sum()
  rep = jaxpool.optimize(jax.grad(loss), cost=cost.always).report(params, x)
  found = {(d.op, d.layer, d.source.split(" (")[0]) for d in sites(rep)}
  block = f"{HERE}:{line_of('# the block' + chr(39) + 's pool')}"
  net = f"{HERE}:{line_of('# the net' + chr(39) + 's pool')}"
  assert found == {("reduce_window_max", "Net/block1", block),
                   ("select_and_scatter_add", "Net/block1", block),
                   ("reduce_window_sum", "Net", net)}, str(rep)
  assert "[layer Net/block1; " in rep.long()  # the long form; the table shows it briefly:
  assert "Net/block1," in str(rep)


def test_equinox_layer_and_line():
  pool = eqx.nn.MaxPool2d(2, 2)
  loss = lambda x: jax.vmap(pool)(x).sum()  # the equinox call
  rep = jaxpool.optimize(jax.grad(loss), cost=cost.always).report(jnp.ones((2, 3, 8, 8)))
  where = f"{HERE}:{line_of('# the equinox call')}"
  assert {(d.layer, d.source.split(" (")[0]) for d in sites(rep)} == {
      ("eqx.nn.MaxPool2d/eqx.nn.Pool", where)}, str(rep)


def test_keras_layer_and_line():
  if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("Keras runs another backend in this process")
  model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="c1"),
                            keras.layers.MaxPooling2D(2, name="pool1")])
  tv = [v.value for v in model.trainable_variables]
  loss = lambda tv, x: model.stateless_call(tv, [], x)[0].sum()  # the keras call
  rep = jaxpool.optimize(jax.grad(loss), cost=cost.always).report(tv, jnp.ones((1, 8, 8, 3)))
  where = f"{HERE}:{line_of('# the keras call')}"
  assert {(d.layer, d.source.split(" (")[0]) for d in sites(rep)} == {("pool1", where)}, str(rep)


def test_library_frames_are_skipped():
  """A site made inside a library's function names the user's call of it, not the library."""
  rep = jaxpool.optimize(lambda x: nn.avg_pool(x, (2, 2))).report(jnp.ones((1, 4, 4, 1)))
  assert sites(rep)[0].source.startswith(f"{HERE}:"), str(rep)


def test_the_report_is_a_table_in_the_users_words():
  """Issue 49: report lines ran 200-400 characters and named JAX's primitives. ``str(report)``
  is an aligned table of at most 100 columns whose what/where/why name only what the user
  wrote; ``report.long()`` keeps a line a site with the primitive and the full source path."""
  def f(x):
    r = jax.nn.relu(x)
    y = nn.max_pool(r, (2, 2), (2, 2)) + nn.max_pool(jax.nn.relu(x * 2), (2, 2), (2, 2))
    s = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return nn.avg_pool(y, (2, 2), (2, 2)).sum() + r.sum() + s.sum()

  x = jnp.ones((1, 8, 8, 3))
  rep = jaxpool.optimize(jax.grad(f), cost=cost.always).report(x)
  text = str(rep)
  lines = text.splitlines()
  assert lines[0].startswith("jaxpool.optimize(f): ") and len(lines) > len(rep.findings)
  assert max(len(line) for line in lines) <= 100, text
  for word in ("custom_jvp_call", "reduce_window", "select_and_scatter_add", "select_prim",
               "transpose of", HERE):
    assert word not in text, (word, text)
  # One row a site, starting with its status, what and where (the file and line, briefly).
  rows = [line for line in lines[2:] if not line.startswith(" " * 4)]
  assert len(rows) == len(rep.findings), text
  for row, finding in zip(rows, rep.findings, strict=True):
    assert row.split()[0] in ("replaced", "left"), row
    line = finding.source.split(" (")[0].rsplit(":", 1)[1]
    assert finding.what in row and f"test_optimize_report.py:{line}" in row, (row, finding)
  whats = [d.what for d in rep.findings]
  assert {"jax.nn.relu", "max pool", "max pool gradient", "average pool", "window sum",
          "average pool gradient"} <= set(whats), whats
  assert "has other readers" in " ".join(text.split())
  long = rep.long().splitlines()
  assert len(long) == len(rep.findings) + 1
  assert all(f"{HERE}:" in ln for ln in long[1:]), rep.long()
  assert any("custom_jvp_call(relu) (jax.nn.relu)" in ln for ln in long), rep.long()
