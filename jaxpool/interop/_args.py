"""Argument checks of the interop layers: each framework's forms, under its argument names.

The core (``jaxpool._src.windows``, with the shared checks of ``jaxpool._src.checks``) checks
jaxpool's own forms. A layer that mirrors Flax or Equinox takes that framework's forms instead
(Equinox: an int for every spatial dim) and must name the arguments as its user wrote them
(``use_ceil``, not the core's ``ceil_mode``), so it checks and normalises here, at
construction, and hands the core plain tuples of Python ints.
Every error is a ``TypeError`` (wrong kind of value) or ``ValueError`` (wrong size or length)
that names the argument and repeats the value received.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpool._src.checks import check_bool, check_name, is_int
from jaxpool._src.windows import (DATA_FORMATS, IMPLEMENTATIONS, padding_hint,
                                   padding_string)


_NO_CROP = "negative padding, which lax.reduce_window reads as cropping, is not supported"


def _items(name: str, value: Any, what: str) -> tuple[Any, ...]:
  """The entries of a sequence argument; strings, dicts, sets and scalars are refused."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be {what}; got {value!r} (a bool is not an int).")
  if isinstance(value, (str, bytes, dict, set, frozenset)):
    raise TypeError(f"{name} must be {what}; got {value!r}.")
  if isinstance(value, np.ndarray) and value.ndim == 0:
    raise TypeError(f"{name} must be {what}; got {value!r}.")
  try:
    return tuple(value)
  except TypeError:
    raise TypeError(f"{name} must be {what}; got {value!r}.") from None


def _ints(name: str, value: Any, n: int | None, what: str, minimum: int) -> tuple[int, ...]:
  items = _items(name, value, what)
  if not all(is_int(v) for v in items):
    why = " (a bool is not an int)" if any(isinstance(v, (bool, np.bool_)) for v in items) else ""
    raise TypeError(f"{name} must be {what}; got {value!r}{why}.")
  if n is not None and len(items) != n:
    raise ValueError(f"{name} must be {what}; got {value!r} of length {len(items)}.")
  if any(v < minimum for v in items):
    raise ValueError(f"{name} entries must be >= {minimum}; got {value!r}.")
  return tuple(int(v) for v in items)


# ----------------------------------------------------------------------------- Flax's forms


def flax_window(value: Any) -> tuple[int, ...]:
  """``window_shape``: a sequence of ints; its length is the number of spatial dims.

  Flax's pooling takes no int here (``nn.max_pool(x, 2)`` fails in ``len``): nothing says how
  many spatial dims an int would cover, so an int is refused with the tuple to write instead.
  """
  what = "a sequence of ints, one per spatial dim, e.g. (2, 2) for 2-D"
  if is_int(value):
    raise TypeError(f"window_shape must be {what} (Flax's pooling takes no int here: "
                    f"len(window_shape) is the number of spatial dims); got the int {value!r}.")
  window = _ints("window_shape", value, None, what, minimum=1)
  if not window:
    raise ValueError(f"window_shape must name at least one spatial dim; got {value!r}.")
  return window


def flax_per_dim(name: str, value: Any, n: int) -> tuple[int, ...] | None:
  """``strides`` or ``dilation`` beside a Flax ``window_shape`` of length ``n``: ``None`` (all
  ones) or ``n`` ints. An empty sequence means all ones too, as ``strides or (1,) * n`` does in
  Flax."""
  if value is None:
    return None
  what = f"None or a sequence of {n} ints, one per spatial dim, e.g. {(2,) * n}"
  if is_int(value):
    raise TypeError(f"{name} must be {what} (Flax's pooling takes no int here); got the int "
                    f"{value!r}.")
  if not _items(name, value, what):
    return None
  return _ints(name, value, n, what, minimum=1)


def flax_padding(value: Any, n: int) -> str | int | tuple[tuple[int, int], ...]:
  """Flax's padding forms: ``"VALID"``, ``"SAME"`` (any case, as ``lax``: the core's
  :func:`~jaxpool._src.windows.padding_string`), one ``(lo, hi)`` pair per spatial dim; plus
  jaxpool's ``"SAME_LOWER"`` and an int (both sides of every dim)."""
  what = (f"'VALID', 'SAME', 'SAME_LOWER', an int, or {n} (lo, hi) pairs, one per spatial dim, "
          f"e.g. {((1, 1),) * n}")
  if isinstance(value, str):
    return padding_string(value, what=what)  # the core's normalisation
  if is_int(value):
    if value < 0:
      raise ValueError(f"padding must be >= 0; got {value!r}.")
    return int(value)  # jaxpool's form: both sides of every spatial dim
  if value is None:
    raise TypeError(f"padding must be {what} (Flax has no padding=None); got None.")
  pairs = _items("padding", value, what)
  if pairs and all(is_int(p) for p in pairs):
    raise TypeError(f"padding must be {what}; got {value!r}, ints where Flax takes (lo, hi) "
                    f"pairs{padding_hint(pairs, n)}")
  out = []
  for p in pairs:
    if is_int(p):
      raise TypeError(f"padding must be {what}; got {value!r}, which mixes ints and pairs.")
    pair = _items("padding", p, what)
    if len(pair) != 2 or not all(is_int(v) for v in pair):
      raise TypeError(f"padding must be {what}; got {value!r}, whose entry {p!r} is not a "
                      "(lo, hi) pair of ints.")
    if pair[0] < 0 or pair[1] < 0:
      raise ValueError(f"padding must be >= 0 ({_NO_CROP}); got {value!r}.")
    out.append((int(pair[0]), int(pair[1])))
  if len(out) != n:
    raise ValueError(f"padding must be {what}; got {value!r} with {len(out)} pairs.")
  return tuple(out)


def flax_config(window_shape: Any, strides: Any = None, padding: Any = "VALID", *,
                dilation: Any = None, ceil_mode: Any = False, data_format: Any = "channels_last",
                implementation: Any = None) -> dict[str, Any]:
  """Checks Flax-style pooling arguments; returns them as the core's keyword arguments.

  Raises:
    TypeError, ValueError: naming the argument and the value received.
  """
  window = flax_window(window_shape)
  n = len(window)
  return dict(window_shape=window, strides=flax_per_dim("strides", strides, n),
              padding=flax_padding(padding, n), dilation=flax_per_dim("dilation", dilation, n),
              ceil_mode=check_bool("ceil_mode", ceil_mode),
              data_format=check_name("data_format", data_format, DATA_FORMATS),
              implementation=check_name("implementation", implementation, IMPLEMENTATIONS))


# ----------------------------------------------------------------------------- Equinox's forms


def eqx_per_dim(name: str, value: Any, n: int) -> tuple[int, ...]:
  """``kernel_size``, ``stride`` or ``dilation``: an int for every spatial dim, or ``n`` ints."""
  what = f"an int or a sequence of {n} ints"
  if is_int(value):
    if value < 1:
      raise ValueError(f"{name} must be >= 1; got {value!r}.")
    return (int(value),) * n
  return _ints(name, value, n, what, minimum=1)


def eqx_padding(value: Any, n: int) -> tuple[tuple[int, int], ...]:
  """Equinox's padding forms: an int, ``n`` ints (symmetric) or ``n`` ``(lo, hi)`` pairs."""
  what = f"an int, a sequence of {n} ints, or a sequence of {n} (lo, hi) pairs"
  if is_int(value):
    if value < 0:
      raise ValueError(f"padding must be >= 0; got {value!r}.")
    return ((int(value), int(value)),) * n
  if value is None:
    raise TypeError(f"padding must be {what} (Equinox has no padding=None); got None.")
  items = _items("padding", value, what)
  if len(items) != n:
    raise ValueError(f"padding must be {what}; got {value!r} of length {len(items)}.")
  if all(is_int(p) for p in items):
    pairs = [(p, p) for p in items]
  elif any(is_int(p) for p in items):
    raise TypeError(f"padding must be {what}; got {value!r}, which mixes ints and pairs.")
  else:
    pairs = []
    for p in items:
      pair = _items("padding", p, what)
      if len(pair) != 2 or not all(is_int(v) for v in pair):
        raise TypeError(f"padding must be {what}; got {value!r}, whose entry {p!r} is not a "
                        "(lo, hi) pair of ints.")
      pairs.append(pair)
  if any(v < 0 for pair in pairs for v in pair):
    raise ValueError(f"padding must be >= 0 ({_NO_CROP}); got {value!r}.")
  return tuple((int(lo), int(hi)) for lo, hi in pairs)
