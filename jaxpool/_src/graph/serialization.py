"""Saving and loading a graph's parameters and model state: :func:`save_params`,
:func:`load_params`.

The file is a NumPy ``.npz`` archive with one array per ``"<node>/<name>"`` (a node's name may
hold ``/``: the last one separates), in its own dtype; dtypes NumPy does not know natively
(``bfloat16``, the float8 types) are stored as unsigned integers of the same size, their names
kept in a JSON entry ``__jaxpool__``, so that a load gives back the same bits. Nothing is
pickled (``np.load(..., allow_pickle=False)`` reads the file). :func:`load_params` reads the
archive itself (zipfile and NumPy's ``.npy`` header parser), checks every size against the bytes
there before it allocates, and turns whatever a damaged file makes those readers raise into one
:class:`ParamsFileError` naming the path. The graph itself pickles (``pickle.dumps``).
"""

from __future__ import annotations

import io
import json
import math
import os
import secrets
import struct
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "jaxpool.graph arrays 1"
_META = "__jaxpool__"
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a member first; an empty archive


class ParamsFileError(ValueError):
  """A file that :func:`load_params` cannot read as a complete parameter file: not an archive
  that :func:`save_params` wrote (a text file, a pickle, a single ``.npy`` array, an unrelated
  ``.npz``), one that is truncated or damaged, or one whose metadata does not match its arrays.
  The message names the path and what is wrong. A ``ValueError``."""


def save_params(path: str | os.PathLike, params: Mapping[str, Mapping[str, Any]]) -> str:
  """Writes ``{node: {name: array}}`` (parameters from ``Graph.init``, or the model state from
  ``Graph.init_state``) to ``path`` as an ``.npz`` archive, dtypes kept.

  The write is atomic and durable: the archive is written to a new file in ``path``'s folder,
  flushed and synced to disk (``os.fsync``), renamed onto ``path`` (``os.replace``), and the
  folder is synced, so that after a crash or a power cut ``path`` holds the old file or the new
  one, never part of one.

  Args:
    path: the file to write (taken as given: no ``.npz`` is appended).
    params: node names to dicts of arrays (JAX or NumPy arrays, or Python numbers: anything
      ``np.asarray`` makes a bool, integer, float or complex array of).

  Returns:
    the path written.

  Raises:
    TypeError: ``params`` is not a dict of dicts with str keys, or a leaf is not a numeric
      array (``None``, a string, an object array...): the message names its path in the tree,
      ``params['node']['name']``. Nothing is written then.
    ValueError: an array's name is empty or holds ``/``.
    OSError: the file cannot be written (the old file, if any, is left as it was).

  Example:
    >>> import os, tempfile, jax.numpy as jnp
    >>> p = {"fc": {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.zeros(3)}}
    >>> f = save_params(os.path.join(tempfile.mkdtemp(), "params.npz"), p)
    >>> load_params(f)["fc"]["w"].dtype
    dtype(bfloat16)
  """
  path = os.fspath(path)
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a dict {{node name: {{name: array}}}}; got "
                    f"{type(params).__name__}.")
  arrays: dict[str, np.ndarray] = {}
  dtypes: dict[str, str] = {}
  for node, entry in params.items():
    if not isinstance(node, str) or not isinstance(entry, Mapping):
      raise TypeError(f"params must be a dict {{node name: {{name: array}}}}; got entry "
                      f"{node!r}: {type(entry).__name__}.")
    for name, value in entry.items():
      if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"params[{node!r}]: array names must be non-empty str without '/'; got "
                         f"{name!r}.")
      a = _savable(f"params[{node!r}][{name!r}]", value)
      k = f"{node}/{name}"
      if np.dtype(a.dtype.str) != a.dtype:  # bfloat16, float8...: not a dtype .npy can name
        dtypes[k] = a.dtype.name
        a = a.view(f"u{a.dtype.itemsize}")
      arrays[k] = a
  meta = {"format": FORMAT, "nodes": list(params), "dtypes": dtypes}
  arrays[_META] = np.asarray(json.dumps(meta))
  _write_durably(path, lambda f: np.savez(f, allow_pickle=False, **arrays))
  return path


def _savable(where: str, value: Any) -> np.ndarray:
  """``value`` as a NumPy array of a dtype the file stores (bool, integer, float, complex, and
  JAX's extra floats such as bfloat16), or a TypeError naming ``where``."""
  what = f"{type(value).__name__}"
  try:
    a = np.asarray(jax.device_get(value))
  except Exception as e:  # noqa: BLE001 - whatever the leaf's conversion raises
    raise TypeError(f"{where}: cannot save a {what} as an array ({type(e).__name__}: {e}).") \
        from None
  if a.dtype.hasobject or not (a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.number)):
    raise TypeError(
        f"{where}: only bool, integer, float and complex arrays can be saved; got {what} "
        f"{value!r:.80} (dtype {a.dtype}).")
  return a


def _write_durably(path: str, write) -> None:
  """``write(file)`` into a new file beside ``path``, synced, renamed onto ``path``, the folder
  synced; the new file is removed if any step fails."""
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise FileNotFoundError(
        f"cannot write {path!r}: its folder {folder!r} does not exist (create it first, "
        f"e.g. os.makedirs({os.path.dirname(path) or '.'!r}, exist_ok=True))")
  tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
  flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
  try:
    with os.fdopen(os.open(tmp, flags, 0o666), "wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  _sync_folder(folder)


def _sync_folder(folder: str) -> None:
  """Syncs a folder's entries (the rename) to disk where the platform can (not on Windows)."""
  try:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
  except OSError:  # pragma: no cover - Windows cannot open a folder
    return
  try:
    os.fsync(fd)
  except OSError:  # pragma: no cover - file systems that cannot sync a folder
    pass
  finally:
    os.close(fd)


# What reading a damaged archive can raise, from zipfile, zlib, struct, NumPy's .npy reader and
# json: each becomes a ParamsFileError naming the path.
_READ_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, struct.error, EOFError,
                OSError, ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError,
                NotImplementedError, RuntimeError, OverflowError)


def load_params(path: str | os.PathLike) -> dict[str, dict[str, jax.Array]]:
  """Reads what :func:`save_params` wrote: ``{node: {name: jax.Array}}``, same dtypes and order.

  Nothing is unpickled, and no array larger than the file is allocated: every array's size is
  checked against the bytes the archive holds for it before it is read.

  Raises:
    ParamsFileError: (a ``ValueError``) the file is not a complete parameter file that
      :func:`save_params` wrote: not a ``.npz`` archive (a text file, a pickle, a ``.npy``
      array, an empty file), truncated or damaged (a checksum or size that does not match), an
      archive without jaxpool's metadata, or metadata that does not match the arrays. The
      message names the path and what is wrong.
    OSError: the file cannot be opened (missing, a folder, no permission).
  """
  path = os.fspath(path)
  with open(path, "rb") as fh:
    try:
      return _read(fh, path)
    except ParamsFileError:
      raise
    except _READ_ERRORS as e:
      raise ParamsFileError(
          f"{path!r} is not a complete parameter file that jaxpool.graph.save_params wrote: "
          f"it is damaged or truncated ({type(e).__name__}: {e}).") from None


def _fail(path: str, what: str) -> ParamsFileError:
  return ParamsFileError(f"{path!r} is not a file that jaxpool.graph.save_params wrote: {what}.")


def _read(fh, path: str) -> dict[str, dict[str, jax.Array]]:
  head = fh.read(8)
  if not head:
    raise _fail(path, "it is empty")
  if head.startswith(_NPY_MAGIC):
    raise _fail(path, "it is a single .npy array (np.save), not a .npz archive of parameters")
  if not head.startswith(_ZIP_MAGICS):
    raise _fail(path, f"it is not a .npz (zip) archive (it starts with {head!r})")
  size = os.fstat(fh.fileno()).st_size
  fh.seek(0)
  arrays: dict[str, np.ndarray] = {}
  with zipfile.ZipFile(fh) as zf:
    for info in zf.infolist():
      if not info.filename.endswith(".npy") or info.filename[:-4] in arrays:
        raise _fail(path, f"unexpected or repeated member {info.filename!r}")
      if info.compress_type != zipfile.ZIP_STORED or info.file_size > size:
        raise _fail(path, f"member {info.filename!r} is compressed or larger than the file")
      arrays[info.filename[:-4]] = _read_npy(zf.read(info), path, info.filename)
  if _META not in arrays:
    raise _fail(path, f"it has no {_META!r} entry (is it an archive of other arrays?)")
  meta = _read_meta(arrays.pop(_META), path)
  out: dict[str, dict[str, jax.Array]] = {node: {} for node in meta["nodes"]}
  for k, a in arrays.items():
    node, _, name = k.rpartition("/")
    if node not in out or not name:
      raise _fail(path, f"array {k!r} does not belong to a node listed in its metadata")
    if k in meta["dtypes"]:
      dtype = _stored_dtype(meta["dtypes"][k], path, k)
      if a.dtype != np.dtype(f"u{dtype.itemsize}"):
        raise _fail(path, f"array {k!r} is stored as {a.dtype}, not as {dtype}'s bits")
      a = a.view(dtype)
    out[node][name] = jnp.asarray(a)
  missing = sorted(set(meta["dtypes"]) - set(arrays))
  if missing:
    raise _fail(path, f"its metadata names arrays it does not hold: {missing}")
  return out


def _read_npy(data: bytes, path: str, member: str) -> np.ndarray:
  """One ``.npy`` member, its header checked against its bytes before anything is allocated."""
  f = io.BytesIO(data)
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
  elif version == (2, 0):
    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
  else:
    raise _fail(path, f"member {member!r} has .npy version {version}")
  if dtype.hasobject:
    raise _fail(path, f"member {member!r} holds Python objects (pickles), which are never loaded")
  count = math.prod(shape)
  if count * dtype.itemsize != len(data) - f.tell():
    raise _fail(path, f"member {member!r} has {len(data) - f.tell()} bytes of data for shape "
                      f"{shape} of {dtype}")
  a = np.frombuffer(data, dtype, count=count, offset=f.tell())
  return a.reshape(shape, order="F" if fortran else "C")


def _read_meta(a: np.ndarray, path: str) -> dict[str, Any]:
  if a.shape != () or a.dtype.kind != "U":
    raise _fail(path, f"its {_META!r} entry is not a string")
  meta = json.loads(str(a))
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    fmt = meta.get("format") if isinstance(meta, dict) else None
    raise _fail(path, f"unknown format {fmt!r}; this version reads {FORMAT!r}")
  nodes, dtypes = meta.get("nodes"), meta.get("dtypes")
  if (not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes)
      or len(set(nodes)) != len(nodes) or not isinstance(dtypes, dict)
      or not all(isinstance(v, str) for v in dtypes.values())):
    raise _fail(path, f"its {_META!r} entry is malformed: {meta!r:.200}")
  return meta


def _stored_dtype(name: str, path: str, key: str) -> np.dtype:
  try:
    dtype = np.dtype(jnp.dtype(name))
  except TypeError:
    raise _fail(path, f"array {key!r} names an unknown dtype {name!r}") from None
  if not jnp.issubdtype(dtype, jnp.number):
    raise _fail(path, f"array {key!r} names dtype {name!r}, which save_params never writes")
  return dtype
