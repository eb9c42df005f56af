"""The argument checks every entry point shares: ints, bools, named choices, tuples of ints.

The public functions (``api_max.py``, ``api_avg.py``, ``adaptive.py``), the window arithmetic
(``windows.py``), the graph nodes (``graph/base.py``, which names the node in front of the
message) and the Flax and Equinox layers (``interop/_args.py``, under the framework's argument
names) check their arguments with these. Each raises a ``TypeError`` (a value of the wrong
kind) or a ``ValueError`` (the right kind, a wrong value) whose message names the argument,
repeats the value received and says what is allowed.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

# Sizes, strides, dilations, padding, the padded extent and the number of taps must each fit in
# int32: XLA and the kernels index with it, and a larger value is a mistake, not a pool.
MAX_SIZE = 2**31 - 1


def is_int(v: Any) -> bool:
  """A Python or NumPy int; a bool (``True`` is 1 to Python) is not one."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _traced(value: Any) -> bool:
  if isinstance(value, jax.core.Tracer):
    return True
  if isinstance(value, (tuple, list)):
    return any(_traced(v) for v in value)
  return False


def check_static(name: str, value: Any) -> None:
  """TypeError if ``value`` is (or holds) a traced value: a window size, stride or padding
  passed as an argument of a ``jax.jit`` function is traced unless it is marked static."""
  if _traced(value):
    raise TypeError(
        f"{name} must be static Python ints, known when the function is traced; got the traced "
        f"value {value!r}. Under jax.jit, mark the argument static: jax.jit(f, "
        f"static_argnums=...) or jax.jit(f, static_argnames=...) (pass a tuple, which hashes, "
        f"not a list), or close over the value instead of passing it.")


def check_bool(name: str, value: Any, *, hint: str = "") -> bool:
  """``value`` as a Python bool: a Python or NumPy bool, nothing else (not 0 or 1).

  ``hint`` follows "a bool" in the message (the graph's: ``" (True or False)"``).
  """
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool{hint}; got {value!r}.")
  return bool(value)


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
  """ValueError unless ``value`` is one of ``allowed``."""
  if value not in allowed:
    raise ValueError(f"{name} must be one of {tuple(allowed)}; got {value!r}.")


def check_name(name: str, value: Any, allowed: Sequence[Any]) -> Any:
  """One of ``allowed`` (strings, and ``None`` where it is allowed): a TypeError for a value of
  another type (a list, a number), a ValueError for another string. Returns ``value``."""
  if not (isinstance(value, str) or (value is None and None in allowed)):
    raise TypeError(f"{name} must be one of {tuple(allowed)}; got {value!r}.")
  check_choice(name, value, allowed)
  return value


def int_tuple(name: str, value: Any, n: int | None, *, default: int | None = None,
              minimum: int = 1) -> tuple[int, ...]:
  """Checks a per-spatial-dim tuple of ints (``window_shape``, ``strides``, ``dilation``).

  ``n`` is the number of entries; ``None`` takes any number (a shape), and then ``value`` is
  required. ``None`` gives ``(default,) * n`` where there is a default.
  """
  if value is None:
    if default is None or n is None:
      raise TypeError(f"{name} is required; got None.")
    return (default,) * n
  check_static(name, value)
  if is_int(value):
    one_each = "ints" if n is None else f"{n} ints, one per spatial dim"
    raise TypeError(f"{name} must be a tuple of {one_each}; got the int {value!r}.")
  try:
    items = tuple(value)
  except TypeError:
    raise TypeError(f"{name} must be a tuple of ints; got {value!r}.") from None
  if not all(is_int(v) for v in items):
    raise TypeError(f"{name} must be a tuple of ints; got {value!r}.")
  if n is not None and len(items) != n:
    raise ValueError(
        f"{name} must have one entry per spatial dim ({n}); got {value!r} of length "
        f"{len(items)}.")
  items = tuple(operator.index(v) for v in items)
  if any(v < minimum for v in items):
    raise ValueError(f"{name} entries must be >= {minimum}; got {value!r}.")
  if any(v > MAX_SIZE for v in items):
    raise ValueError(f"{name} entries must be at most 2**31 - 1; got {value!r}.")
  return items


def check_divisor(name: str, value: Any) -> int | None:
  """``None`` or a positive int (``divisor_override``)."""
  if value is None:
    return None
  if not is_int(value):
    raise TypeError(f"{name} must be a positive int or None; got {value!r}.")
  if value < 1:
    raise ValueError(f"{name} must be a positive int or None; got {value!r}.")
  return int(value)


def check_norm(name: str, value: Any) -> float:
  """The order of an Lp norm: a finite real number ``>= 1``, as a Python float (``p`` in
  jaxpool's and Flax's terms, PyTorch's ``norm_type`` in Equinox's)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a finite number >= 1; got {value!r}.")
  p = float(value)
  if math.isinf(p):
    raise ValueError(f"{name} must be finite (for {name}=inf, use max_pool of |x|); got "
                     f"{value!r}.")
  if not p >= 1:  # NaN fails too
    raise ValueError(f"{name} must be a finite number >= 1; got {value!r}.")
  return p
