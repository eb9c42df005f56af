"""Max pooling's differentiation rule, written once and specialised per backend.

A backend gives three functions (:class:`MaxPoolOps`): the forward without taps, the forward
that also returns each window's winning tap, and the gather ``t -> t[taps]`` that maps a
tangent through the winners (linear in ``t``). Max pooling is then one ``custom_jvp``: its
primal is the plain forward (the inference path keeps nothing), and its JVP runs the forward
with taps and the gather. Reverse mode transposes the gather: the XLA backend's gather is made
of slices and selects, which JAX transposes into a deterministic scatter-add; the Pallas
backend's gather is a primitive whose transpose is its backward kernel. Nothing here is a
``custom_vjp``, so forward mode (``jvp``, ``jacfwd``) and second order work on every backend.

With ``activation="relu"`` the op is ``relu(max_pool(x))``, fused: a window whose maximum is not
positive (or is NaN) outputs ``max(y, 0)`` and gets tap ``-1``, so its gradient is zero with no
separate pass, the same values and gradients as ``jax.nn.relu`` after the pool.

Min pooling is the same rule on mirrored functions (:func:`mirrored`): the forwards run on
``reverse_order(x)`` (an exact order-reversing map) and map their outputs back; the gather is
unchanged, so the tangent path has no negation (no ``-0.0`` where no cotangent arrives).

A backend's operand may be a pytree: the XLA backend's masked max pool takes ``(x, mask)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src.dtypes import reverse_order
from jaxpool._src.windows import Geometry

ACTIVATIONS = (None, "relu")

# The gathers' setting under which a tap of -1 may mark any window, one with real elements too
# (as the forward's activation or a mask makes them); their transposes send nothing there.
ANY_EMPTY = "relu"


@dataclasses.dataclass(frozen=True)
class MaxPoolOps:
  """One backend's max pooling (hashable: a static argument of the rule).

  Attributes:
    forward: ``(x, geom, activation) -> y``.
    forward_with_taps: ``(x, geom, activation) -> (y, taps)``; ``taps`` is the row-major
      offset of each window's winner within the window (``windows.taps_dtype``), ``-1`` for a
      window with no real element (or, with an activation, no positive maximum).
    gather: ``(t, taps, geom, activation) -> t at each window's winner``, zero where
      ``taps < 0``; linear in ``t``.
  """

  forward: Callable
  forward_with_taps: Callable
  gather: Callable


def apply_activation(y: Any, taps: Any, activation: str | None):
  """``(relu(y), taps or -1 where y is not positive)`` for ``"relu"``; unchanged for None."""
  if activation is None:
    return y, taps
  # jax.nn.relu's value: NaN stays NaN, -0.0 becomes 0.0. (A select, not a max: Triton's max
  # drops a NaN operand.)
  out = jnp.where((y > 0) | (y != y), y, jnp.zeros_like(y))
  if taps is None:
    return out, None
  return out, jnp.where(y > 0, taps, jnp.asarray(-1, taps.dtype))


def _reverse_operand(x: Any) -> Any:
  """``reverse_order`` of ``x``, or of the ``x`` of an ``(x, mask)`` operand."""
  if isinstance(x, tuple):
    return (reverse_order(x[0]), *x[1:])
  return reverse_order(x)


@functools.cache
def mirrored(ops: MaxPoolOps) -> MaxPoolOps:
  """``ops`` as a min pool (no activation): the forwards on ``reverse_order(x)``, outputs
  mapped back, the taps (the min's winners: first minimum on ties, first NaN, ``-0.0`` over
  ``+0.0``) and the gather as they are. One object per ``ops`` (a static argument)."""

  def forward(x, geom, activation):
    assert activation is None, activation  # internal: min_pool has no activation
    return reverse_order(ops.forward(_reverse_operand(x), geom, None))

  def forward_with_taps(x, geom, activation):
    assert activation is None, activation
    y, taps = ops.forward_with_taps(_reverse_operand(x), geom, None)
    return reverse_order(y), taps

  return MaxPoolOps(forward=forward, forward_with_taps=forward_with_taps, gather=ops.gather)


def _explicit_sharding(a: jax.Array):
  """``a``'s sharding when it is in its type (Explicit mesh axes), else None: an array of the
  input's shape made from ``a`` keeps that split (the same dims, in either layout)."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    return None
  return sharding


def grad_from_taps(dy: jax.Array, taps: jax.Array, geom: Geometry,
                   ops: MaxPoolOps) -> jax.Array:
  """``dx``: each window's ``dy`` added at its winning tap (``-1`` sends nothing), the transpose
  of ``ops.gather``, which is what reverse mode through :func:`max_pool` runs (XLA's fused
  scatter-add, or the Pallas backward kernel). Linear in ``dy``, made of primitives that JAX
  differentiates, batches and transposes."""
  # The primal example comes from dy (full_like) so that it carries dy's varying axes inside
  # shard_map, as avg_pool_grad's does.
  zeros = jax.lax.full_like(dy, 0, shape=geom.input_shape(dy.shape),
                            sharding=_explicit_sharding(dy))
  _, vjp = jax.vjp(lambda t: ops.gather(t, taps, geom, ANY_EMPTY), zeros)
  return vjp(dy)[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def max_pool(x: jax.Array, geom: Geometry, activation: str | None,
             ops: MaxPoolOps) -> jax.Array:
  """Max pooling (then the activation) through ``ops``."""
  return ops.forward(x, geom, activation)


@max_pool.defjvp
def _max_pool_jvp(geom, activation, ops, primals, tangents):
  (x,), (t,) = primals, tangents
  # The differentiable op, not ops.forward_with_taps: a JVP of this rule (second order)
  # differentiates it again through the same rule.
  y, taps = max_pool_with_taps(x, geom, activation, ops)
  return y, ops.gather(t, taps, geom, activation)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def max_pool_with_taps(x: jax.Array, geom: Geometry, activation: str | None,
                       ops: MaxPoolOps) -> tuple[jax.Array, jax.Array]:
  """``(y, taps)`` through ``ops``; ``y`` is differentiable, ``taps`` is not."""
  return ops.forward_with_taps(x, geom, activation)


@max_pool_with_taps.defjvp
def _max_pool_with_taps_jvp(geom, activation, ops, primals, tangents):
  (x,), (t,) = primals, tangents
  y, taps = max_pool_with_taps(x, geom, activation, ops)
  return (y, taps), (ops.gather(t, taps, geom, activation),
                     np.zeros(taps.shape, jax.dtypes.float0))
