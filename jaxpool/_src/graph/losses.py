"""Loss nodes: :class:`SoftmaxCrossEntropy`, :class:`SigmoidCrossEntropy`,
:class:`MeanSquaredError`. Each is a scalar: the mean over the batch dims."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src.graph.base import Node, Ref, input_field


@dataclass(frozen=True)
class SoftmaxCrossEntropy(Node):
  """Softmax cross-entropy loss against integer labels, averaged over the batch dims.

  ``logits``: ``(K,)`` per example; ``labels``: an integer input of shape ``()`` per example,
  each a class index in ``[0, K)``. The output is a scalar for any batch:
  ``mean(logsumexp(logits) - logits[label])``.

  A label outside ``[0, K)`` (``-1`` included: it never means the last class) is a
  ``ValueError`` naming the node when the labels are concrete (eager ``apply``/``run``, or
  labels closed over by ``jit``). Traced labels (arguments of ``jit``, ``vmap``) cannot raise:
  there the example's loss is NaN, so the mean loss and the gradients are NaN;
  ``jax.experimental.checkify`` with ``checkify.nan_checks`` or ``jax_debug_nans`` locate it.
  """

  logits: Ref = input_field()
  labels: Ref = input_field()
  _input_fields: ClassVar[tuple[str, ...]] = ("logits", "labels")

  def check_inputs(self, in_specs):
    lg, lb = in_specs
    if len(lg.shape) != 1:
      raise self._fail(f"logits {self.inputs[0]!r} must be (K,) per example; got {lg.shape}.")
    if lb.shape != () or not jnp.issubdtype(lb.dtype, jnp.integer):
      raise self._fail(f"labels {self.inputs[1]!r} must be integers of shape () per example; "
                       f"got {lb.shape} {lb.dtype}.")

  def check_labels(self, labels: Any, num_classes: int) -> None:
    """Raises ValueError if concrete ``labels`` hold a class outside ``[0, num_classes)``.

    Traced labels (under ``jit``, ``vmap``, ``eval_shape``) cannot be checked here; for them the
    forward makes the loss NaN instead (see :meth:`forward`).
    """
    try:
      values = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
      return
    bad = (values < 0) | (values >= num_classes)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      at = f" at batch index {where}" if where else ""
      raise self._fail(
          f"labels {self.inputs[1]!r} must be class indices in [0, {num_classes}) (logits "
          f"{self.inputs[0]!r} has {num_classes} classes); got {int(values[where])}{at}, "
          f"{int(bad.sum())} out of range in all.")

  def forward(self, params, xs, in_specs):
    logits, labels = xs
    num_classes = in_specs[0].shape[-1]
    self.check_labels(labels, num_classes)
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)))
    valid = (labels >= 0) & (labels < num_classes)
    safe = jnp.where(valid, labels, 0).astype(jnp.int32)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    # A traced label out of range (no error is possible under jit): that example's loss is NaN,
    # so the mean is NaN, and so are the gradients (a product, where jnp.where would pass a zero
    # gradient and hide it). -1 never wraps to the last class.
    nll = nll * jnp.where(valid, 1, jnp.nan).astype(nll.dtype)
    return jnp.mean(nll)

  def describe(self):
    return "SoftmaxCrossEntropy (mean)"


@dataclass(frozen=True)
class _Elementwise(Node):
  """A loss of two float inputs of the same per-example shape, averaged over every element (and
  so over the batch dims)."""

  _input_fields: ClassVar[tuple[str, ...]] = ("predictions", "targets")

  def check_inputs(self, in_specs):
    p, t = in_specs
    if p.shape != t.shape:
      raise self._fail(f"{self._input_fields[0]} {self.inputs[0]!r} {p.shape} and "
                       f"{self._input_fields[1]} {self.inputs[1]!r} {t.shape} must have the "
                       "same per-example shape.")
    for field_name, name, s in zip(self._input_fields, self.inputs, in_specs, strict=True):
      if not jnp.issubdtype(s.dtype, jnp.floating):
        raise self._fail(f"{field_name} {name!r} must be a float input; got {s.dtype}.",
                         TypeError)

  def forward(self, params, xs, in_specs):
    dtype = jnp.promote_types(jnp.result_type(*xs), jnp.float32)
    return jnp.mean(self.elementwise(*(x.astype(dtype) for x in xs)))

  def elementwise(self, a: jax.Array, b: jax.Array) -> jax.Array:
    raise NotImplementedError(type(self).__name__)


@dataclass(frozen=True)
class MeanSquaredError(_Elementwise):
  """Mean squared error: ``mean((predictions - targets) ** 2)`` over every element, the batch
  dims included (PyTorch's ``MSELoss()``; optax's ``squared_error`` averaged).

  ``predictions``, ``targets``: float inputs of the same per-example shape; the output is a
  scalar for any batch.
  """

  predictions: Ref = input_field()
  targets: Ref = input_field()

  def elementwise(self, a, b):
    return jnp.square(a - b)

  def describe(self):
    return "MeanSquaredError (mean)"


@dataclass(frozen=True)
class SigmoidCrossEntropy(_Elementwise):
  """Sigmoid (binary) cross-entropy against float labels in ``[0, 1]``, averaged over every
  element, the batch dims included: ``mean(-y log(sigmoid(x)) - (1 - y) log(1 - sigmoid(x)))``
  (optax's ``sigmoid_binary_cross_entropy`` averaged; PyTorch's ``BCEWithLogitsLoss()``).

  ``logits``, ``labels``: float inputs of the same per-example shape (one logit per binary
  label); the output is a scalar for any batch.
  """

  logits: Ref = input_field()
  labels: Ref = input_field()
  _input_fields: ClassVar[tuple[str, ...]] = ("logits", "labels")

  def elementwise(self, a, b):
    return -b * jax.nn.log_sigmoid(a) - (1 - b) * jax.nn.log_sigmoid(-a)

  def describe(self):
    return "SigmoidCrossEntropy (mean)"
