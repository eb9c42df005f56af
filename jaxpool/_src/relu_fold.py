"""The ReLU fold, one rule for :mod:`jaxpool.graph`'s pass and :func:`jaxpool.optimize`.

``max_pool(act(x))`` becomes ``act(max_pool(x))`` (a pass over the input and its gradient
fewer) for the activations in :data:`FOLDABLE`, with the same values and gradients bit for bit
(docs/optimize.md, "The ReLU rule", proves it for each). Folded only where the activation's
result has exactly one reader, that max pool, and is not an output: moving it otherwise would
compute it twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Fold:
  """How one activation folds into the max pool after it.

  Attributes:
    activation: the activation's name (``jax.nn``'s).
    fused: the ``activation=`` that :func:`jaxpool.max_pool` takes for it (one pass), or
      ``None``: it runs on the pooled values after the pool.
  """

  activation: str
  fused: str | None

  @property
  def after_pool(self) -> Callable[[jax.Array], jax.Array]:
    """The activation as a function of the pooled values (``jax.nn``'s)."""
    return getattr(jax.nn, self.activation)


FOLDABLE: dict[str, Fold] = {
    "relu": Fold("relu", fused="relu"),
    "relu6": Fold("relu6", fused=None),
}
"""The activations that commute with a max pool in values and gradients, bit for bit."""


def fold(activation: str, *, only_reader: bool, is_output: bool = False) -> Fold | str:
  """The fold of ``activation`` into the max pool that reads it, or why it is not folded.

  Args:
    activation: the activation's name.
    only_reader: whether that max pool is the only reader of the activation's result.
    is_output: whether the activation's result is also an output.
  """
  if activation not in FOLDABLE:
    return f"{activation} is not folded (only {', '.join(FOLDABLE)} commute with a max pool)"
  if is_output or not only_reader:
    return "not folded, its result has other readers"
  return FOLDABLE[activation]
