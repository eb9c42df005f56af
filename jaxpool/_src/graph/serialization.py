"""Saving and loading a graph's parameters and model state: :func:`save_params`,
:func:`load_params`.

The file is a NumPy ``.npz`` archive with one array per ``"<node>/<name>"`` (a node's name may
hold ``/``: the last one separates), in its own dtype; dtypes NumPy does not know natively
(``bfloat16``, the float8 types) are stored as unsigned integers of the same size, their names
kept in a JSON entry ``__jaxpool__``, so that a load gives back the same bits. Nothing is
pickled (``np.load(..., allow_pickle=False)``). The graph itself pickles (``pickle.dumps``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "jaxpool.graph arrays 1"
_META = "__jaxpool__"


def save_params(path: str | os.PathLike, params: Mapping[str, Mapping[str, Any]]) -> str:
  """Writes ``{node: {name: array}}`` (parameters from ``Graph.init``, or the model state from
  ``Graph.init_state``) to ``path`` as an ``.npz`` archive, dtypes kept.

  The file is written next to ``path`` and renamed onto it, so a reader never sees half of it.

  Args:
    path: the file to write (taken as given: no ``.npz`` is appended).
    params: node names to dicts of arrays.

  Returns:
    the path written.

  Raises:
    TypeError: ``params`` is not a dict of dicts of arrays with str keys.
    ValueError: an array's name holds ``/``.

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
      a = np.asarray(jax.device_get(value))
      k = f"{node}/{name}"
      if np.dtype(a.dtype.str) != a.dtype:  # bfloat16, float8...: not a dtype .npy can name
        dtypes[k] = a.dtype.name
        a = a.view(f"u{a.dtype.itemsize}")
      arrays[k] = a
  meta = {"format": FORMAT, "nodes": list(params), "dtypes": dtypes}
  arrays[_META] = np.asarray(json.dumps(meta))
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      np.savez(f, allow_pickle=False, **arrays)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def load_params(path: str | os.PathLike) -> dict[str, dict[str, jax.Array]]:
  """Reads what :func:`save_params` wrote: ``{node: {name: jax.Array}}``, same dtypes and order.

  Raises:
    ValueError: the file is not one that :func:`save_params` wrote.
  """
  path = os.fspath(path)
  with np.load(path, allow_pickle=False) as f:
    if _META not in f.files:
      raise ValueError(f"{path!r} is not a file that jaxpool.graph.save_params wrote (it has no "
                       f"{_META!r} entry).")
    meta = json.loads(str(f[_META]))
    if meta.get("format") != FORMAT:
      raise ValueError(f"{path!r}: unknown format {meta.get('format')!r}; this version reads "
                       f"{FORMAT!r}.")
    out: dict[str, dict[str, jax.Array]] = {node: {} for node in meta["nodes"]}
    for k in f.files:
      if k == _META:
        continue
      node, name = k.rsplit("/", 1)
      a = f[k]
      if k in meta["dtypes"]:
        a = a.view(jnp.dtype(meta["dtypes"][k]))
      out[node][name] = jnp.asarray(a)
  return out
