"""Linear maps whose transpose jaxpool writes itself: a pair of jaxpool primitives per map.

Reverse mode through a Pallas op needs a linear map whose transpose JAX cannot derive (a
kernel); on a CPU, the XLA path's max-pool gradient has a faster transpose than the one JAX
derives (``xla.scatter_to_taps``). ``jax.custom_derivatives.linear_call`` expresses such a map,
but JAX has no batching rule for it, and adding one would change JAX's tables for every program
in the process. So each map here is a pair of jaxpool's own primitives, ``forward`` and
``transpose``, each the other's transpose, with the rules JAX needs for exactly these two
primitives:

- evaluation and lowering: the given implementation (a kernel, or XLA ops);
- JVP: linear in the last operand (the tangent goes through the same map);
- transpose: the other primitive of the pair;
- batching: every mapped axis moves to the front, where the implementations treat it as one more
  batch dim (pooling never mixes batch elements).

The leading operands are residuals (the taps), never differentiated; the last is linear.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir


class LinearPair:
  """``forward(*res, t)`` and ``transpose(*res, ct)``, linear in their last operand.

  Args:
    name: the primitives are ``jaxpool_{name}`` and ``jaxpool_{name}_transpose``.
    forward, transpose: ``fn(*res, lin, **params) -> array``: the implementations.
    forward_shape, transpose_shape: ``fn(*res_shapes, lin_shape, **params) -> shape``.
    transpose_on: ``{platform: fn}``: the transpose lowered with ``fn`` on that platform
      (``"cpu"``, ``"cuda"``, ...) and with ``transpose`` elsewhere.
  """

  def __init__(self, name: str, forward: Callable[..., jax.Array],
               transpose: Callable[..., jax.Array],
               forward_shape: Callable[..., tuple[int, ...]],
               transpose_shape: Callable[..., tuple[int, ...]],
               transpose_on: dict[str, Callable[..., jax.Array]] | None = None):
    self.forward_p = _primitive(f"jaxpool_{name}", forward, forward_shape)
    self.transpose_p = _primitive(f"jaxpool_{name}_transpose", transpose, transpose_shape,
                                  transpose_on)
    _linear_rules(self.forward_p, self.transpose_p)
    _linear_rules(self.transpose_p, self.forward_p)

  def forward(self, *operands: Any, **params: Any) -> jax.Array:
    return self.forward_p.bind(*operands, **params)

  def transpose(self, *operands: Any, **params: Any) -> jax.Array:
    return self.transpose_p.bind(*operands, **params)


def _primitive(name: str, impl, shape_fn, impl_on=None) -> jex_core.Primitive:
  p = jex_core.Primitive(name)
  p.def_impl(lambda *args, **params: impl(*args, **params))

  def abstract_eval(*avals, **params):
    shape = shape_fn(*(a.shape for a in avals), **params)
    # The linear operand's type with the new shape: its dtype, and inside shard_map how it
    # varies over the manual mesh axes (pooling keeps every dim's role).
    return avals[-1].update(shape=shape)

  p.def_abstract_eval(abstract_eval)
  mlir.register_lowering(p, mlir.lower_fun(
      lambda *args, **params: impl(*args, **params), multiple_results=False))
  for platform, fn in (impl_on or {}).items():
    mlir.register_lowering(p, mlir.lower_fun(
        lambda *args, fn=fn, **params: fn(*args, **params), multiple_results=False),
        platform=platform)
  batching.primitive_batchers[p] = lambda args, dims, **params: _batch(p, args, dims, params)
  return p


def _linear_rules(p: jex_core.Primitive, transpose_p: jex_core.Primitive) -> None:
  def jvp(primals, tangents, **params):
    *res, lin = primals
    out = p.bind(*res, lin, **params)
    t = tangents[-1]
    if type(t) is ad.Zero:
      return out, ad.Zero.from_primal_value(out)
    return out, p.bind(*res, ad.instantiate_zeros(t), **params)

  def transpose(ct, *operands, **params):
    *res, lin = operands
    assert ad.is_undefined_primal(lin) and not any(ad.is_undefined_primal(r) for r in res)
    if type(ct) is ad.Zero:
      return [None] * len(res) + [ad.Zero(lin.aval)]
    return [None] * len(res) + [transpose_p.bind(*res, ct, **params)]

  ad.primitive_jvps[p] = jvp
  ad.primitive_transposes[p] = transpose


def _batch(p: jex_core.Primitive, args, dims, params):
  size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
  moved = [jnp.broadcast_to(a, (size, *a.shape)) if d is None
           else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
  return p.bind(*moved, **params), 0
