"""Adaptive pooling's plan: the arguments checked, PyTorch's bins and their index tables.

Adaptive pooling splits a spatial dim of size ``L`` into ``O`` bins; bin ``i`` spans
``[floor(i*L/O), ceil((i+1)*L/O))`` (PyTorch's rule). Neighbouring bins share one element where
``i*L/O`` is not an integer; with ``O > L`` an element lies in up to ``ceil(O/L) + 1`` bins.

Every table is NumPy arithmetic at trace time (``Table``, cached per size pair); the
computations that read them are in ``adaptive_xla.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import numpy as np

from jaxpool._src.api_args import check_plane
from jaxpool._src.checks import check_choice, check_static
from jaxpool._src.checks import is_int as _is_int
from jaxpool._src.windows import DATA_FORMATS, MAX_SIZE, taps_dtype
from jaxpool._src.windows import spatial_axes as _spatial_axes


# ----------------------------------------------------------------------------- arguments


def _output_size(output_size: Any) -> tuple[int | None, ...]:
  """Checks ``output_size``: one int >= 1 or None per spatial dim."""
  check_static("output_size", output_size)
  if _is_int(output_size) or isinstance(output_size, (bool, np.bool_)):
    raise TypeError(
        "output_size must be a tuple with one entry (an int >= 1 or None) per spatial dim, "
        f"e.g. (7, 7); got {output_size!r}.")
  try:
    items = tuple(output_size)
  except TypeError:
    raise TypeError(
        f"output_size must be a tuple of ints >= 1 or None; got {output_size!r}.") from None
  if not items:
    raise ValueError(f"output_size must name at least one spatial dim; got {output_size!r}.")
  for v in items:
    if v is not None and not _is_int(v):
      raise TypeError(
          f"output_size entries must be ints >= 1 or None; got {v!r} in {output_size!r}.")
    if v is not None and v < 1:
      raise ValueError(
          f"output_size entries must be ints >= 1 or None; got {v!r} in {output_size!r}.")
    if v is not None and v > MAX_SIZE:
      raise ValueError(
          f"output_size entries must be at most 2**31 - 1; got {v!r} in {output_size!r}.")
  return tuple(None if v is None else int(v) for v in items)


def check_nonempty(x: jax.Array, axes: tuple[int, ...]) -> None:
  if any(x.shape[a] == 0 for a in axes):
    raise ValueError(
        f"x must have non-empty spatial dims (axes {axes}); got shape {tuple(x.shape)}.")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static configuration of one adaptive call (hashable: a jit static argument)."""

  in_spatial: tuple[int, ...]
  out_spatial: tuple[int, ...]
  channels_last: bool

  @property
  def nspatial(self) -> int:
    return len(self.in_spatial)

  def axes(self, ndim: int) -> tuple[int, ...]:
    return _spatial_axes(ndim, self.nspatial, self.channels_last)

  def stages(self, ndim: int) -> list[tuple[int, Table]]:
    """``(axis, table)`` per spatial dim, the last dim first (the row-major tie order)."""
    axes = self.axes(ndim)
    return [(axes[d], table(self.in_spatial[d], self.out_spatial[d]))
            for d in reversed(range(self.nspatial))]

  def box_sizes(self, ndim: int, dtype) -> np.ndarray:
    """Elements per output bin (the average's divisor), shaped to broadcast on the output."""
    size = np.ones((), np.int64)
    for L, o in zip(self.in_spatial, self.out_spatial, strict=True):
      start, end = bins(L, o)
      size = np.multiply.outer(size, end - start)
    shape = [1] * ndim
    for a, o in zip(self.axes(ndim), self.out_spatial, strict=True):
      shape[a] = o
    return size.reshape(shape).astype(dtype)


def make_plan(x: jax.Array, output_size: Any, data_format: str) -> Plan:
  sizes = _output_size(output_size)
  check_choice("data_format", data_format, DATA_FORMATS)
  n = len(sizes)
  if x.ndim < n + 1:
    layout = "(*batch, *spatial, C)" if data_format == "channels_last" else "(*batch, C, *spatial)"
    raise ValueError(
        f"x must have at least {n + 1} dims, {layout} with len(output_size) = {n} spatial dims "
        f"(output_size={output_size!r}); got shape {tuple(x.shape)}.")
  channels_last = data_format == "channels_last"
  axes = _spatial_axes(x.ndim, n, channels_last)
  check_nonempty(x, axes)
  in_spatial = tuple(int(x.shape[a]) for a in axes)
  out_spatial = tuple(L if o is None else o for L, o in zip(in_spatial, sizes, strict=True))
  # Before any bin table (whose size grows with output_size) is built.
  check_plane(f"output_size={output_size!r}", out_spatial, "the output plane")
  check_fits(x, axes, out_spatial, f"output_size={output_size!r}")
  return Plan(in_spatial, out_spatial, channels_last)


# ----------------------------------------------------------------------------- memory


def host_memory() -> int | None:
  """The host's physical memory in bytes (None where the system does not say)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
    return None


def device_memory() -> int | None:
  """The memory of the default backend's local devices together, in bytes: the host's on a
  CPU; None where a device does not say."""
  if jax.default_backend() == "cpu":
    return host_memory()
  total = 0
  for d in jax.local_devices():
    limit = (d.memory_stats() or {}).get("bytes_limit")
    if not limit:
      return None
    total += int(limit)
  return total


def table_bytes(size: int, out: int) -> int:
  """About the host memory that :func:`table` takes for one dim (an upper estimate, NumPy's
  int64 temporaries included), without building it: ``out * k`` gather slots (``k``, the
  longest bin, at most ``ceil(size / out) + 1``), ``size * m`` scatter slots (``m``, the most
  bins an element lies in, at most ``ceil(out / size) + 1``), and the bins' bounds."""
  k = -(-size // out) + 1
  m = -(-out // size) + 1 if out > size else 0
  return 40 * out + 16 * out * k + 48 * size * m


def _gib(n: int) -> str:
  return f"{n / 2**30:.3g} GiB"


def check_fits(x: jax.Array, axes: tuple[int, ...], out_spatial: tuple[int, ...],
               shown: str) -> None:
  """ValueError if the output, or the bin tables built for it on the host, cannot fit in
  memory: checked from the sizes alone, before anything is built (a mistaken ``output_size``
  such as ``(2**31 - 1, 1)`` would otherwise take tens of GiB of host tables first)."""
  in_spatial = tuple(int(x.shape[a]) for a in axes)
  out_shape = list(x.shape)
  for a, o in zip(axes, out_spatial, strict=True):
    out_shape[a] = o
  tables = sum(table_bytes(L, o) for L, o in zip(in_spatial, out_spatial, strict=True))
  tables += 8 * math.prod(out_spatial)  # the average's divisors
  output = math.prod(out_shape) * np.dtype(x.dtype).itemsize
  host, device = host_memory(), device_memory()
  on_host = tables + (output if jax.default_backend() == "cpu" else 0)
  if (host is not None and on_host > host) or (device is not None and output > device):
    where = [f"{_gib(host)} on the host" if host is not None else "",
             f"{_gib(device)} on the devices" if device is not None and
             jax.default_backend() != "cpu" else ""]
    raise ValueError(
        f"{shown} cannot fit: its output of shape {tuple(out_shape)} "
        f"takes {_gib(output)} ({x.dtype}) and its bin tables about {_gib(tables)} of host "
        f"memory, more than the {' and '.join(w for w in where if w)} here. output_size is "
        f"the pooled spatial size, one entry per spatial dim, e.g. (7, 7).")



# ----------------------------------------------------------------------------- bins


def bins(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
  """PyTorch's adaptive bins of a dim: ``(start, end)``, each of length ``out``."""
  i = np.arange(out, dtype=np.int64)
  return (i * size) // out, -((-(i + 1) * size) // out)


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
  """The static index tables of one stage (one spatial dim, ``size`` -> ``out``).

  ``kind``: ``"identity"`` (``out == size``), ``"reshape"`` (``size % out == 0``: the slot table
  is a reshape), ``"gather"`` (``out < size``) or ``"scatter"`` (``out > size``; its tangent is
  in scatter form). ``gather``: ``(out*k,)`` input index of each slot (``size``: past the bin's
  end). For the scatter form, ``slot_out``: ``(size*m,)`` the output (bin) of each input slot
  (``out``: none), ``slot_offset``: the slot's element's offset in that bin (-2: none).
  """

  size: int
  out: int
  kind: str
  k: int
  gather: np.ndarray | None = None
  m: int = 0
  slot_out: np.ndarray | None = None
  slot_offset: np.ndarray | None = None

  @property
  def tap_dtype(self) -> np.dtype:
    return taps_dtype(self.k)


@functools.lru_cache(maxsize=512)
def table(size: int, out: int) -> Table:
  start, end = bins(size, out)
  lens = end - start
  k = int(lens.max())
  if out == size:
    return Table(size, out, "identity", 1)
  if size % out == 0:
    return Table(size, out, "reshape", k)
  slot = np.arange(k)[None, :]
  gather = np.where(slot < lens[:, None], start[:, None] + slot, size).astype(np.int32)
  if out < size:
    return Table(size, out, "gather", k, gather.reshape(-1))
  # Input-major slots: element j lies in bins first[j] .. first[j] + count[j] - 1.
  j = np.arange(size)
  first = np.searchsorted(end, j, side="right")  # the first bin whose end is past j
  count = np.searchsorted(start, j, side="right") - first
  m = int(count.max())
  slot = np.arange(m)[None, :]
  live = slot < count[:, None]
  owner = first[:, None] + slot
  slot_out = np.where(live, owner, out).astype(np.int32)
  slot_offset = np.where(live, j[:, None] - start[np.minimum(owner, out - 1)], -2)
  return Table(size, out, "scatter", k, gather.reshape(-1), m, slot_out.reshape(-1),
                slot_offset.astype(np.int32))
