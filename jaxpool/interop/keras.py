"""Keras 3 on the JAX backend, backed by jaxpool: one call reaches ``model.fit``.

``enable()`` makes Keras's JAX backend pool with jaxpool: ``keras.ops.max_pool``,
``keras.ops.average_pool`` and the layers built on them (``MaxPooling1D/2D/3D``,
``AveragePooling1D/2D/3D``, and every Keras application that uses them) then call
:func:`jaxpool.max_pool` and :func:`jaxpool.avg_pool`, in the training step that ``model.fit``
compiles as anywhere else. The model code does not change::

  import os
  os.environ["KERAS_BACKEND"] = "jax"     # before keras is imported (or set it in the shell)
  import keras
  import jaxpool.interop.keras

  jaxpool.interop.keras.enable()          # the one line
  model = keras.applications.VGG16(weights=None)
  model.compile("adam", "sparse_categorical_crossentropy")
  model.fit(images, labels)               # its pools are jaxpool's

``disable()`` gives Keras its own functions back and ``with enabled(): ...`` enables jaxpool for
a block. Both act on what Keras traces next: a function that Keras has already compiled (the
train function of an earlier ``fit``) keeps the pooling it was traced with; ``model.compile``
makes Keras build a new one.

Keras's semantics are kept: ``"valid"`` and ``"same"`` padding (TensorFlow's ``"SAME"``, the
extra padding at the end), ``strides=None`` meaning the pool size, both data formats, and an
average that divides a ``"same"`` window by its real elements (jaxpool's
``count_include_pad=False``). A call that jaxpool does not take (a padding other than those two,
a window larger than a ``"valid"`` input, a size or stride below 1, a rank under 3) runs Keras's
own function, so its result or error is Keras's. What changes is jaxpool's: the max-pool gradient
goes to the first maximum of a window (deterministic, also on a GPU), half-precision averages
accumulate in float32, and on an NVIDIA GPU the Pallas kernels run.

Keras's backend functions are private (``keras.src.backend.jax.nn``). ``enable()`` checks that
they are where and what it expects (and that ``keras.ops`` reaches them) and otherwise raises a
``RuntimeError`` that names the installed Keras version; the ``jaxpool[keras]`` extra pins the
Keras versions that are tested (docs/interop.md).

Importing this module does not import Keras (Keras picks its backend when it is first
imported, and this module leaves that choice to the user); ``enable()`` does, and says what to
do if Keras is missing or runs on another backend. For a block of code::

  with jaxpool.interop.keras.enabled():
    y = keras.ops.average_pool(x, 3, strides=2, padding="same")   # jaxpool.avg_pool
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from jaxpool._src import api as _api

__all__ = ["enable", "disable", "enabled", "is_enabled", "max_pool", "average_pool"]

# Where Keras keeps its JAX backend's pooling, and the signature that jaxpool's replacements take.
HOOK_MODULE = "keras.src.backend.jax.nn"
_HOOKS = ("max_pool", "average_pool")
_SIGNATURE = ("inputs", "pool_size", "strides", "padding", "data_format")
_PADDINGS = {"valid": "VALID", "same": "SAME"}
_IMPLEMENTATIONS = (None, "xla", "pallas")
_SUPPORTED = "keras>=3.10,<4 (pip install 'jaxpool[keras]')"

_lock = threading.RLock()
# While enabled: Keras's own functions, by name, and the options of jaxpool's calls.
_keras_own: dict[str, Callable[..., Any]] = {}
_options: dict[str, Any] = {"implementation": None}


# ----------------------------------------------------------------------------- the hook point


def _keras() -> ModuleType:
  """The ``keras`` package, imported on first use (importing it picks Keras's backend).

  Raises:
    ImportError: Keras is not installed, or importing it failed (the message says why and
      what to set).
  """
  try:
    return importlib.import_module("keras")
  except ImportError as e:
    if getattr(e, "name", None) == "keras":
      raise ImportError(f"jaxpool.interop.keras needs Keras 3 on the JAX backend: "
                        f"pip install 'jaxpool[keras]' ({e}).") from e
    raise ImportError(
        f"importing keras failed ({e}). Keras chooses its backend when it is first imported "
        f"(TensorFlow by default): set the environment variable KERAS_BACKEND=jax before "
        f"importing it.") from e


def _unsupported(why: str) -> RuntimeError:
  version = getattr(_keras(), "__version__", "of unknown version")
  return RuntimeError(
      f"jaxpool.interop.keras cannot reach the pooling of Keras {version}: {why}. "
      f"jaxpool supports {_SUPPORTED}. Without the hook, jaxpool.optimize still replaces the "
      f"pooling of a training step written with model.stateless_call.")


def _hook_module() -> ModuleType:
  """Keras's JAX backend ``nn`` module, checked to be the one ``keras.ops`` calls.

  Raises:
    RuntimeError: Keras's backend is not JAX, or the module, its pooling functions or their
      signature are not what this module replaces (Keras moved or changed them).
  """
  keras = _keras()
  backend = keras.backend.backend()
  if backend != "jax":
    raise RuntimeError(
        f"jaxpool.interop.keras needs Keras's JAX backend; Keras {keras.__version__} runs on "
        f"{backend!r}. Set the environment variable KERAS_BACKEND=jax before keras is imported.")
  try:
    module = importlib.import_module(HOOK_MODULE)
    keras_backend = importlib.import_module("keras.src.backend")
  except ImportError as e:
    raise _unsupported(f"{HOOK_MODULE} cannot be imported ({e})") from e
  if getattr(keras_backend, "nn", None) is not module:
    raise _unsupported(f"keras.src.backend.nn is not {HOOK_MODULE}, so keras.ops would not "
                       f"reach a function replaced there")
  for name in _HOOKS:
    fn = _keras_own.get(name) or getattr(module, name, None)
    if not callable(fn):
      raise _unsupported(f"{HOOK_MODULE} has no function {name}")
    try:
      params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
      raise _unsupported(f"the signature of {HOOK_MODULE}.{name} cannot be read ({e})") from e
    if params[:len(_SIGNATURE)] != _SIGNATURE or len(params) != len(_SIGNATURE):
      raise _unsupported(f"{HOOK_MODULE}.{name} takes ({', '.join(params)}), not "
                         f"({', '.join(_SIGNATURE)})")
  return module


# ----------------------------------------------------------------------------- the replacements


def _sizes(value: Any, n: int) -> tuple[int, ...] | None:
  """An int or ``n`` ints, as positive Python ints; ``None`` for anything else."""
  items = (value,) * n if isinstance(value, int) else value
  try:
    items = tuple(items)
  except TypeError:
    return None
  ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items)
  return items if ok and len(items) == n else None


def _config(inputs: Any, pool_size: Any, strides: Any, padding: Any,
            data_format: Any) -> dict[str, Any] | None:
  """jaxpool's arguments for a Keras backend pooling call, or ``None`` where Keras's own runs."""
  shape = getattr(inputs, "shape", None)
  if shape is None or len(shape) < 3 or padding not in _PADDINGS:
    return None
  if data_format is None:
    data_format = _keras().config.image_data_format()
  data_format = str(data_format).lower()
  if data_format not in ("channels_last", "channels_first"):
    return None
  n = len(shape) - 2
  window = _sizes(pool_size, n)
  steps = window if strides is None else _sizes(strides, n)
  if window is None or steps is None:
    return None
  spatial = shape[1:-1] if data_format == "channels_last" else shape[2:]
  if padding == "valid" and any(k > size for k, size in zip(window, spatial, strict=True)):
    return None                                # an empty output: Keras's (lax's) result
  return dict(window_shape=window, strides=steps, padding=_PADDINGS[padding],
              data_format=data_format, implementation=_options["implementation"])


def max_pool(inputs: Any, pool_size: Any, strides: Any = None, padding: str = "valid",
             data_format: str | None = None) -> Any:
  """Keras's backend ``max_pool``, computed by :func:`jaxpool.max_pool`.

  Args:
    inputs: ``(batch, *spatial, channels)`` (``"channels_last"``) or
      ``(batch, channels, *spatial)`` (``"channels_first"``).
    pool_size: an int (every spatial dim) or one int per spatial dim.
    strides: as ``pool_size``; ``None`` means ``pool_size`` (Keras's default).
    padding: ``"valid"`` or ``"same"`` (the extra padding at the end).
    data_format: ``"channels_last"``, ``"channels_first"`` or ``None`` (Keras's
      ``image_data_format()``).

  Returns:
    The pooled array; a call jaxpool does not take returns Keras's own result.
  """
  cfg = _config(inputs, pool_size, strides, padding, data_format)
  if cfg is None:
    return _keras_function("max_pool")(inputs, pool_size, strides, padding, data_format)
  return _api.max_pool(inputs, **cfg)


def average_pool(inputs: Any, pool_size: Any, strides: Any = None, padding: str = "valid",
                 data_format: str | None = None) -> Any:
  """Keras's backend ``average_pool``, computed by :func:`jaxpool.avg_pool`.

  A ``"same"`` window is divided by the number of its real elements, as Keras does
  (``count_include_pad=False``).

  Args: as :func:`max_pool`.

  Returns:
    The pooled array; a call jaxpool does not take returns Keras's own result.
  """
  cfg = _config(inputs, pool_size, strides, padding, data_format)
  if cfg is None:
    return _keras_function("average_pool")(inputs, pool_size, strides, padding, data_format)
  return _api.avg_pool(inputs, count_include_pad=False, **cfg)


_REPLACEMENTS: dict[str, Callable[..., Any]] = {"max_pool": max_pool,
                                                "average_pool": average_pool}


def _keras_function(name: str) -> Callable[..., Any]:
  """Keras's own backend function ``name`` (saved by :func:`enable`, else the module's)."""
  fn = _keras_own.get(name)
  if fn is None:
    fn = getattr(_hook_module(), name)
  if fn is _REPLACEMENTS[name]:                  # never call ourselves
    raise RuntimeError(f"Keras's own {HOOK_MODULE}.{name} was lost")
  return fn


# ----------------------------------------------------------------------------- switching


def enable(*, implementation: str | None = None) -> None:
  """Makes Keras's JAX backend pool with jaxpool, for the whole process.

  Everything Keras traces afterwards (``model.fit``'s, ``evaluate``'s and ``predict``'s steps,
  eager ``keras.ops`` calls, a ``stateless_call``) uses :func:`jaxpool.max_pool` and
  :func:`jaxpool.avg_pool`. Calling it again only changes ``implementation``.

  Args:
    implementation: passed to every jaxpool call: ``None`` (the kernels on NVIDIA GPUs, XLA
      elsewhere), ``"xla"`` or ``"pallas"``.

  Raises:
    ValueError: ``implementation`` is not one of those.
    ImportError: Keras is not installed or cannot be imported (e.g. no ``KERAS_BACKEND=jax``).
    RuntimeError: Keras does not run on JAX, or its backend pooling functions are not where or
      what this module expects (the message names the Keras version).
  """
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}; got {implementation!r}.")
  with _lock:
    module = _hook_module()
    if not _keras_own:
      _keras_own.update({name: getattr(module, name) for name in _HOOKS})
    _options["implementation"] = implementation
    for name in _HOOKS:
      setattr(module, name, _REPLACEMENTS[name])


def disable() -> None:
  """Gives Keras its own pooling back (nothing happens if jaxpool is not enabled).

  Functions that Keras compiled while jaxpool was enabled keep jaxpool's pooling; call
  ``model.compile`` again to retrace a model's steps.
  """
  with _lock:
    if not _keras_own:
      return
    module = importlib.import_module(HOOK_MODULE)
    for name in _HOOKS:
      setattr(module, name, _keras_own[name])
    _keras_own.clear()
    _options["implementation"] = None


def is_enabled() -> bool:
  """Whether Keras's JAX backend pools with jaxpool now."""
  with _lock:
    if not _keras_own:
      return False
    module = importlib.import_module(HOOK_MODULE)
    return all(getattr(module, name, None) is _REPLACEMENTS[name] for name in _HOOKS)


@contextlib.contextmanager
def enabled(*, implementation: str | None = None) -> Iterator[None]:
  """Enables jaxpool for a block; afterwards the previous state (and ``implementation``) returns.

  Args:
    implementation: as :func:`enable`.

  Yields:
    Nothing; Keras pools with jaxpool inside the block.
  """
  with _lock:
    was_enabled, before = is_enabled(), _options["implementation"]
    enable(implementation=implementation)
  try:
    yield
  finally:
    with _lock:
      if was_enabled:
        enable(implementation=before)
      else:
        disable()

