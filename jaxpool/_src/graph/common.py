"""What the node modules share: argument checks whose errors name the node, the layout of
per-example images, padding policies, and :class:`Initializer`.

The single values go through the core's checks (``jaxpool._src.checks``), the window arguments
through its window arithmetic (``jaxpool._src.windows``); a node's error names it in front of
the core's message (``Node._check``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpool._src import checks, windows
from jaxpool._src.graph.base import Node, Spec

PADDING_POLICIES = ("VALID", "SAME", "FULL")
POOL_PADDING_POLICIES = (*PADDING_POLICIES, "SAME_LOWER")  # the pooling nodes' (as the core's)
BOOL_HINT = " (True or False)"  # the graph's messages say what a bool is


def batch_shape(x: jax.Array, spec: Spec) -> tuple[int, ...]:
  return tuple(x.shape[:x.ndim - len(spec.shape)])


def check_bool(node: Node, name: str, value: Any) -> bool:
  """A bool (``checks.check_bool``), the error naming ``node``."""
  return node._check(checks.check_bool, name, value, hint=BOOL_HINT)


def check_choice(node: Node, name: str, value: Any, allowed: Sequence[Any]) -> Any:
  """One of the names ``allowed`` (``checks.check_name``), the error naming ``node``."""
  return node._check(checks.check_name, name, value, allowed)


def check_float_dtype(node: Node, name: str, value: Any) -> np.dtype:
  dt = check_dtype(node, name, value)
  if not jnp.issubdtype(dt, jnp.floating):
    raise node._fail(f"{name} must be a float dtype; got {value!r}.", TypeError)
  return dt


def check_real(node: Node, name: str, value: Any, low: float, high: float | None, *,
               open_low: bool = False, open_high: bool = False) -> float:
  """A real number (not a bool) in ``[low, high]`` (``(`` / ``)`` where open; ``high`` None: no
  bound), as a Python float; a TypeError or ValueError naming ``node`` otherwise."""
  interval = (f"{'(' if open_low else '['}{low:g}, "
              f"{'inf)' if high is None else f'{high:g}' + (')' if open_high else ']')}")
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
    raise node._fail(f"{name} must be a number in {interval}; got {value!r}.", TypeError)
  v = float(value)
  if not (v > low if open_low else v >= low) or (
      high is not None and not (v < high if open_high else v <= high)):
    raise node._fail(f"{name} must be a number in {interval}; got {value!r}.")
  return v


def check_dtype(node: Node, name: str, value: Any) -> np.dtype:
  if value is None:  # np.dtype(None) is float64: never what was meant
    raise node._fail(f"{name} must be a dtype; got None.", TypeError)
  try:
    return np.dtype(value)
  except TypeError:
    raise node._fail(f"{name} must be a dtype; got {value!r}.", TypeError) from None


def check_window(node: Node, window: Any) -> tuple[int, ...]:
  """A windowed node's ``window``: one int >= 1 per spatial dim, at least one dim."""
  n = node._check(windows.spatial_rank, window, "window")
  return node._check(checks.int_tuple, "window", window, n)


def check_image(node: Node, spec: Spec, window: tuple[Any, ...],
                data_format: str = "channels_last", what: str = "window") -> None:
  """A windowed node's input: ``(*spatial, C)`` per example (``(C, *spatial)`` channels-first),
  one spatial dim per entry of ``window`` (or of the argument ``what`` names)."""
  if len(spec.shape) != len(window) + 1:
    layout = "(*spatial, C)" if data_format == "channels_last" else "(C, *spatial)"
    raise node._fail(
        f"input {node.inputs[0]!r} must be {layout} with {len(window)} spatial dims "
        f"({what} {window}); got shape {spec.shape}.")


def check_data_format(node: Node, value: Any) -> str:
  """``"channels_last"`` (``(*spatial, C)`` per example) or ``"channels_first"``
  (``(C, *spatial)``), the core's ``data_format`` (``jaxpool._src.windows.DATA_FORMATS``)."""
  return check_choice(node, "data_format", value, windows.DATA_FORMATS)


def spatial_shape(shape: Sequence[int], data_format: str) -> tuple[int, ...]:
  """The spatial dims of a per-example image shape."""
  return tuple(shape[:-1] if data_format == "channels_last" else shape[1:])


def channel_axis(data_format: str) -> int:
  """The channel axis of an image, counted from the end (per-example and batched alike) for
  channels-last, from the start of the per-example dims for channels-first."""
  return -1 if data_format == "channels_last" else 0


def spatial_axes(x: jax.Array, spec: Spec, data_format: str) -> tuple[int, ...]:
  """The axes of ``x`` (``(*batch, *spec.shape)``) that are spatial."""
  return windows.spatial_axes(x.ndim, len(spec.shape) - 1, data_format == "channels_last")


def array_axis(x: jax.Array, spec: Spec, axis: int) -> int:
  """A per-example ``axis`` (negative from the end) as an axis of ``x`` (``(*batch, *shape)``)."""
  return axis if axis < 0 else x.ndim - len(spec.shape) + axis


def flatten_example(x: jax.Array, spec: Spec, data_format: str) -> jax.Array:
  """``(*batch, *spec.shape) -> (*batch, prod(spec.shape))`` in channels-last order: a
  channels-first image ``(C, *spatial)`` is flattened as ``(*spatial, C)``, so that the result
  equals the channels-last graph's."""
  batch = batch_shape(x, spec)
  if data_format == "channels_first" and len(spec.shape) > 1:
    x = jnp.moveaxis(x, len(batch), -1)
  return x.reshape((*batch, math.prod(spec.shape)))


def check_axis(node: Node, name: str, axis: Any) -> int:
  """A per-example axis: an int (NumPy ints taken, bools not), negative from the end."""
  if not checks.is_int(axis):
    raise node._fail(f"{name} must be an int; got {axis!r}.", TypeError)
  return int(axis)


def axis_in_range(node: Node, name: str, axis: int, spec: Spec, input_name: str) -> int:
  """``axis`` as a non-negative per-example axis of ``spec``; ValueError if out of range."""
  rank = len(spec.shape)
  if not -rank <= axis < rank:
    raise node._fail(f"{name} {axis} is out of range for input {input_name!r} of per-example "
                     f"shape {spec.shape}.")
  return axis % rank


def check_padding(node: Node, padding: Any, n: int, policies: tuple[str, ...] = PADDING_POLICIES
                  ) -> str | tuple[tuple[int, int], ...]:
  """A padding policy (one of ``policies``, in any case, returned in upper case), or ``n``
  explicit ``(lo, hi)`` pairs."""
  if isinstance(padding, str) and padding.upper() in policies:
    return windows.padding_string(padding, policies)
  if isinstance(padding, str) or not isinstance(padding, Iterable):
    raise node._fail(f"padding must be one of {policies} or (lo, hi) pairs; got "
                     f"{padding!r}.", ValueError if isinstance(padding, str) else TypeError)
  return node._check(windows.padding_pairs, padding, n)


def resolve_padding(policy: str | tuple[tuple[int, int], ...], in_spatial: Sequence[int],
                    window: Sequence[int], strides: Sequence[int], dilation: Sequence[int]
                    ) -> tuple[tuple[int, int], ...]:
  """A padding policy (in any case, as the nodes take it) as ``(lo, hi)`` pairs, one per
  spatial dim.

  ``"VALID"``: none. ``"SAME"``: ``ceil(L / s)`` outputs, the odd element of padding at the end
  (ONNX SAME_UPPER, as :func:`jaxpool.max_pool`); ``"SAME_LOWER"`` (pooling nodes) puts it at
  the start. ``"FULL"``: ``e - 1`` on both sides (``e`` the
  effective window ``d * (k - 1) + 1``): every window that touches a real element. The core
  computes them (``jaxpool._src.windows.resolve_string_padding``).

  Example:
    >>> resolve_padding("SAME", (7,), (3,), (2,), (1,))
    ((1, 1),)
  """
  if isinstance(policy, str):
    policy = windows.padding_string(
        policy, POOL_PADDING_POLICIES,
        what=f"one of {POOL_PADDING_POLICIES} (in any case) or (lo, hi) pairs")
    return windows.resolve_string_padding(policy, in_spatial, window, strides, dilation)
  return tuple(policy)


@dataclass(frozen=True)
class Initializer:
  """A ``jax.nn.initializers`` factory by name, with its arguments, called when used.

  ``Initializer("he_normal")(key, shape, dtype)`` is
  ``jax.nn.initializers.he_normal()(key, shape, dtype)``. Unlike the closure the factory
  returns, it pickles (by name and arguments) and compares equal to an equal config, so nodes
  that hold one do too. Nodes take any initializer function as well.

  Example:
    >>> init = Initializer("variance_scaling", (1.0, "fan_in", "normal"))
    >>> init(jax.random.key(0), (3, 2), jnp.float32).shape
    (3, 2)
  """

  name: str
  args: tuple[Any, ...] = ()
  kwargs: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if not callable(getattr(jax.nn.initializers, self.name, None)):
      raise ValueError(f"Initializer: jax.nn.initializers has no factory {self.name!r}.")
    object.__setattr__(self, "args", tuple(self.args))
    object.__setattr__(self, "kwargs", tuple(sorted(dict(self.kwargs).items())))

  def __call__(self, key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32
               ) -> jax.Array:
    factory = getattr(jax.nn.initializers, self.name)
    return factory(*self.args, **dict(self.kwargs))(key, shape, dtype)
