"""Where launch configurations are kept: the disk cache, the tables shipped with the package,
and the keys both are indexed by (``tuning/tuner.py`` chooses and tunes; this module stores).

The disk cache is a folder (``$JAXPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxpool``, else
``~/.cache/jaxpool``) holding one JSON file an entry under ``tune/``. An entry is used only
when the jaxpool, jax and jaxlib versions, the device kind and the CUDA platform and driver
versions it was tuned with are this process's (:func:`environment`). Entries are written to a
temporary file and renamed: a reader never sees a partial entry, and of several processes
writing the same key at once one file wins, each complete. An entry that cannot be read is
warned about once and tuned again; a cache that cannot be written keeps its entries in memory.

The shipped tables (``launch_tables/<device kind>.json``) hold entries for known GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import json
import os
import re
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxpool._src import settings

from jaxpool._src.pallas.triton.config import MAX_ROWS, MAX_TILE, MAX_WARPS, Launch, pow2_ceil

def launch_name(launch: Launch | Sequence[int]) -> str:
  """``(8, 64, 4)`` -> ``"8x64x4"``: how reports, logs and cache entries name a launch."""
  return "x".join(map(str, launch))

# The entries' and tables' format. 2: the kernels number their programs in memory order and
# the tuner samples in rounds. 3: the max forward's candidates include blocks of several
# output rows. 4: so do those of the max forward with taps (and a format-3 entry may have
# been tuned with only the heuristic timed: drawing the inputs spent the budget). An entry of
# another format was tuned among other candidates or for other kernels, so it is not used
# (silently, as an entry of another environment) and the kernel is tuned again. 5: the max
# forwards' candidates include loops over the output planes, the average forward's blocks of
# rows and loops, and the average forward's key how it counts its divisor. 6: the backwards'
# candidates include blocks of rows, the max forward with taps' loops with half the lanes.
# 7: every kernel's candidates include its tile and the tile of half its columns with 16 bytes
# per thread (the backwards' in blocks of rows too), the max forward with taps' the loop with
# one row. 8: the max backward of 16-bit floats selects two lanes an instruction, which
# changed its launches' speeds (those tuned for the one-lane select are tuned again). 9: in
# channels_last the candidates include the tile of columns that pads the kernel's columns
# least (least_waste_tile), and the forwards' loops over the output planes with it.
FORMAT = 9
CACHE_ENV = settings.SETTINGS["cache_dir"].env
TABLES = "launch_tables"  # the shipped tables: a package folder beside this module


class TuningWarning(UserWarning):
  """The tuning cache could not be read or written (the configuration is still chosen)."""



def cache_dir() -> str:
  """``$JAXPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxpool``, else ``~/.cache/jaxpool``."""
  explicit = settings.get("cache_dir")
  if explicit:
    return explicit
  base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
  return os.path.join(os.path.expanduser(base), "jaxpool")


# ----------------------------------------------------------------------------- keys


@dataclasses.dataclass(frozen=True)
class Key:
  """What one tuned configuration serves: an op on a dtype, layout and geometry class."""

  op: str  # "max_fwd", "argmax_fwd", "avg_fwd", "max_bwd", "avg_bwd"
  dtype: str
  layout: str  # "channels_last" or "channels_first"
  geometry: str  # geometry_class(...)

  def name(self) -> str:
    return f"{self.op}|{self.dtype}|{self.layout}|{self.geometry}"


def geometry_class(window: Sequence[int], strides: Sequence[int], dilation: Sequence[int],
                   cols: int, lanes: int, work: int) -> str:
  """The shapes that share a configuration: same window, strides and dilation; ``cols``
  (the kernel's columns) and ``lanes`` rounded up to powers of two (at most 256 and 1024);
  ``work`` (elements the kernel writes) in three classes: below 2^20, below 2^24, more."""
  size = "S" if work < 2**20 else ("M" if work < 2**24 else "L")
  fmt = lambda t: "x".join(str(int(v)) for v in t)
  return (f"k{fmt(window)}s{fmt(strides)}d{fmt(dilation)}"
          f"w{pow2_ceil(min(cols, 256))}l{pow2_ceil(min(lanes, 1024))}{size}")



# ----------------------------------------------------------------------- environment and tables


def _driver_version(path: str = "/proc/driver/nvidia/version") -> str:
  """The NVIDIA driver's version from the first line of ``path``, e.g. ``NVRM version: NVIDIA
  UNIX x86_64 Kernel Module  535.104.05  ...`` or ``... Open Kernel Module for x86_64
  580.159.04  ...``; "" where it cannot be read."""
  try:
    with open(path, encoding="utf-8") as f:
      line = f.readline()
  except OSError:
    return ""
  m = (re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", line)
       or re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", line))
  return m.group(1) if m else line.strip()


def environment(device: Any = None) -> dict[str, str]:
  """What an entry is valid for: versions, device kind, CUDA platform and driver versions."""
  import jaxlib

  from jaxpool._src.version import __version__ as jaxpool_version
  dev = device if device is not None else jax.devices()[0]
  platform_version = ""
  with contextlib.suppress(Exception):
    platform_version = str(dev.client.platform_version)
  return {"jaxpool": jaxpool_version, "jax": jax.__version__,
          "jaxlib": getattr(jaxlib, "__version__", ""), "device_kind": str(dev.device_kind),
          "platform_version": platform_version, "driver": _driver_version()}


def table_name(device_kind: str) -> str:
  """The shipped table's file name for a device kind: ``NVIDIA_H100_80GB_HBM3.json``."""
  return re.sub(r"[^A-Za-z0-9]+", "_", device_kind).strip("_") + ".json"


def shipped_table(device_kind: str) -> dict[str, Launch]:
  """The shipped table of ``device_kind`` (empty when none ships): key name -> launch."""
  try:
    text = importlib.resources.files(__package__).joinpath(TABLES, table_name(device_kind))
    data = json.loads(text.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return {}
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    return {}
  entries = data.get("entries", {})
  return {k: Launch.of(v) for k, v in entries.items() if _valid_launch(v)}



def _valid_launch(v: Any) -> bool:
  """Three (or five) powers of two: a tile of at most ``MAX_TILE`` elements, at most
  ``MAX_WARPS`` warps (and a block of at most ``MAX_ROWS`` rows, output rows for a forward and
  blocks of input rows for a backward, or ``0`` planes: at most ``MAX_ROWS`` rows of every
  plane, looped over)."""
  if not (isinstance(v, (list, tuple)) and len(v) in (3, 5)
          and all(type(n) is int for n in v)):  # (not bool, a subclass of int)
    return False
  loop = len(v) == 5 and v[3] == 0
  return (all(n >= 1 and n & (n - 1) == 0 for i, n in enumerate(v) if not (loop and i == 3))
          and v[0] * v[1] <= MAX_TILE and v[2] <= MAX_WARPS
          and (len(v) == 3 or max(v[3], 1) * v[4] <= MAX_ROWS))


# ----------------------------------------------------------------------------- the store


class Store:
  """The configurations found so far (``memory``), the disk cache and the shipped table.

  Args:
    cache: the cache folder (default :func:`cache_dir`, read when first needed).
    env: what entries must match (default :func:`environment` of the default device).
    table: the shipped table (default :func:`shipped_table` of ``env``'s device kind).
    fresh: look in memory only, whatever the cache and the table hold (a retune).
  """

  def __init__(self, cache: str | None = None, env: Mapping[str, str] | None = None,
               table: Mapping[str, Launch] | None = None, fresh: bool = False):
    self.fresh = fresh
    self._cache = cache
    self._env = dict(env) if env is not None else None
    self._table = dict(table) if table is not None else None
    self.memory: dict[str, Launch] = {}
    self._writable = True
    self._warned: set[str] = set()

  @property
  def env(self) -> dict[str, str]:
    if self._env is None:
      self._env = environment()
    return self._env

  @property
  def cache(self) -> str:
    if self._cache is None:
      self._cache = cache_dir()
    return self._cache

  @property
  def table(self) -> dict[str, Launch]:
    if self._table is None:
      self._table = shipped_table(self.env["device_kind"])
    return self._table if settings.get("tune_table") == "on" else {}

  def path(self, key: Key) -> str:
    """The cache file of ``key`` (its name hashes the key and the environment)."""
    ident = json.dumps({"key": key.name(), "env": self.env}, sort_keys=True)
    digest = hashlib.sha256(ident.encode()).hexdigest()[:32]
    return os.path.join(self.cache, "tune", f"{digest}.json")

  def _warn_once(self, tag: str, message: str) -> None:
    if tag not in self._warned:
      self._warned.add(tag)
      warnings.warn(message, TuningWarning, stacklevel=3)

  def read(self, key: Key) -> Launch | None:
    """The cached launch of ``key``, or None (missing, corrupt: warned once, other env)."""
    path = self.path(key)
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
      return None
    except (OSError, ValueError) as e:
      self._warn_once(f"corrupt:{path}", f"jaxpool: ignoring the unreadable tuning cache entry "
                      f"{path} ({type(e).__name__}: {e}); the configuration is tuned again")
      return None
    launch = data.get("launch") if isinstance(data, dict) else None
    if isinstance(data, dict) and isinstance(data.get("format"), int) \
        and data["format"] != FORMAT:
      return None  # another format: tuned for other kernels or candidates, not used
    if (not isinstance(data, dict) or data.get("format") != FORMAT
        or not _valid_launch(launch)):
      self._warn_once(f"corrupt:{path}", f"jaxpool: ignoring the malformed tuning cache entry "
                      f"{path}; the configuration is tuned again")
      return None
    if data.get("key") != key.name() or data.get("env") != self.env:
      return None  # another jaxlib, driver, device kind or jaxpool: not used
    assert isinstance(launch, list)  # (_valid_launch)
    return Launch.of(launch)

  def write(self, key: Key, launch: Launch, extra: Mapping[str, Any]) -> bool:
    """Writes ``key``'s entry (a temporary file renamed over the entry); False where the
    cache cannot be written (warned once; the entry stays in memory)."""
    if not self._writable:
      return False
    path = self.path(key)
    entry = {"format": FORMAT, "key": key.name(), "env": self.env, "launch": list(launch),
             **extra}
    tmp = None
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(entry, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
      return True
    except OSError as e:
      if tmp is not None:
        with contextlib.suppress(OSError):
          os.remove(tmp)
      self._writable = False
      self._warn_once("readonly", f"jaxpool: cannot write the tuning cache in {self.cache} "
                      f"({type(e).__name__}: {e}); tuned configurations are kept in memory "
                      f"for this process (set {CACHE_ENV} to a writable folder)")
      return False

  def lookup(self, key: Key) -> tuple[Launch, str] | None:
    """``(launch, source)`` from memory, the cache or the shipped table, or None."""
    name = key.name()
    if name in self.memory:
      return self.memory[name], "memory"
    if self.fresh:
      return None
    cached = self.read(key)
    if cached is not None:
      return cached, "cache"
    if name in self.table:
      return self.table[name], "table"
    return None

