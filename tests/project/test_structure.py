"""How the library sits in JAX and how its modules sit together: no global changes to JAX's
state, no import circles, and the fused activation.

Importing jaxpool, running the ops' gradients and tracing and lowering every op under every
transformation (the Pallas kernels included) must leave JAX's rule tables as they were: the only
entries it may add are the rules of jaxpool's own primitives (named ``jaxpool_*``). The test
runs in a fresh interpreter so that nothing else has imported jaxpool.

No module of jaxpool imports one that imports it back, directly or through others, at the top or
lazily inside a function (the graph package's base node types sit in ``base.py`` for this).
Nothing under ``jaxpool/`` imports the public package itself (``jaxpool/__init__.py``, the
face): the graph, the interop layers and ``optimize`` take the public functions from
``jaxpool._src``, so that the layers drawn in docs/architecture.md are the layers of the imports.
Only the backend registry reaches the Pallas backends (``jaxpool/_src/pallas/``), and every
module under ``jaxpool/`` stays within 500 lines.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from core_strategies import assert_bitwise

import jaxpool

_TABLES_SCRIPT = textwrap.dedent('''
    import jax, jax.numpy as jnp
    # JAX's own modules that jaxpool uses, imported first: their rules are JAX's, not ours.
    import jax.experimental.pallas, jax.experimental.pallas.triton, jax.experimental.pallas.tpu
    import jax.custom_batching, jax.extend.core
    try:  # (Pallas loads it lazily on some paths; it registers JAX's Mosaic GPU rules)
      import jax.experimental.mosaic.gpu
    except ImportError:
      pass
    from jax._src.interpreters import ad, batching, mlir

    def snapshot():
      tables = dict(jvp=ad.primitive_jvps, transpose=ad.primitive_transposes,
                    lower=mlir._lowerings)
      # (Some of the batching tables are write-only proxies in front of a dict.)
      tables.update({n: getattr(batching, n) for n in dir(batching)
                     if n.endswith("batchers") and isinstance(getattr(batching, n), dict)})
      out = {name: dict(t) for name, t in tables.items()}
      out["platform_lower"] = {k: dict(v) for k, v in mlir._platform_specific_lowerings.items()}
      return out

    before = snapshot()
    import jaxpool
    x = jnp.asarray(jax.random.normal(jax.random.key(0), (2, 6, 6, 3)))
    for impl in ("xla", "pallas"):
      def loss(v, impl=impl):
        y = jaxpool.max_pool(v, (3, 3), (2, 2), 1, implementation=impl, activation="relu")
        y2, i = jaxpool.max_pool_with_indices(v, (2, 2), implementation=impl)
        z = jaxpool.avg_pool(v, (2, 2), (2, 2), implementation=impl)
        return (y ** 2).sum() + y2.sum() + jnp.sin(z).sum() + i.sum()
      # The gradient runs on the XLA path. Everything else is traced and lowered, not
      # compiled: every rule that JAX looks up runs in Python while tracing and lowering; XLA's
      # compiler (most of the time, for the kernels in interpret mode) reads no rule table.
      if impl == "xla":
        jax.jit(jax.grad(loss))(x)
      else:
        jax.jit(jax.grad(loss)).lower(x)
      jax.jit(jax.vmap(jax.grad(loss))).lower(x[:, None])
      jax.jit(lambda v, loss=loss: jax.jvp(loss, (v,), (v,))).lower(x)
      jax.jit(jax.hessian(loss)).lower(x[:1, :3, :3, :1])
    jax.grad(lambda v: jaxpool.lp_pool(v, 3, (2, 2)).sum())(x)
    jaxpool.max_unpool(*jaxpool.max_pool_with_indices(x, (2, 2), (2, 2)), (6, 6))
    after = snapshot()

    problems = []
    for table, entries in after.items():
      old = before[table]
      for key, value in entries.items():
        if table == "platform_lower":
          continue
        if key in old:
          if old[key] is not value:
            problems.append(f"{table}: {key} replaced")
        elif not str(getattr(key, "name", key)).startswith("jaxpool_"):
          problems.append(f"{table}: {key} added")
    for platform, entries in after["platform_lower"].items():
      for key, value in entries.items():
        old = before["platform_lower"].get(platform, {})
        if key in old and old[key] is not value:
          problems.append(f"platform_lower[{platform}]: {key} replaced")
        elif key not in old and not str(getattr(key, "name", key)).startswith("jaxpool_"):
          problems.append(f"platform_lower[{platform}]: {key} added")
    print("PROBLEMS", problems)
''')


def _module_imports(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """For each module under ``root`` (the package ``package``), the modules of the package that it
  imports anywhere in its source: at the top, inside functions, under ``if``."""
  files = {}
  for path in root.rglob("*.py"):
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
      parts.pop()
    files[".".join(parts)] = path
  graph = {}
  for mod, path in files.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the module's package (a package's own __init__ counts)
          keep = len(mod.split(".")) - node.level + (path.name == "__init__.py")
          base = ".".join(mod.split(".")[:keep] + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
      else:
        continue
      deps |= {t for t in targets if t in files and t != mod}
    graph[mod] = deps
  return graph


def _import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle (``[a, b, ..., a]``), or None."""
  state: dict[str, str] = {}
  stack: list[str] = []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == "open":
        return [*stack[stack.index(d):], d]
      if d not in state and (cycle := visit(d)):
        return cycle
    state[m] = "done"
    stack.pop()
    return None

  for m in sorted(graph):
    if m not in state and (cycle := visit(m)):
      return cycle
  return None


@pytest.mark.parametrize("sub", ["", "_src/graph"])
def test_no_import_circles(sub):
  root = pathlib.Path(jaxpool.__file__).parent / sub
  package = ".".join(["jaxpool", *pathlib.PurePath(sub).parts])
  graph = _module_imports(root, package)
  assert len(graph) > 5, graph
  cycle = _import_cycle(graph)
  assert cycle is None, "import circle: " + " -> ".join(cycle or ())


def test_import_circle_check_sees_lazy_imports(tmp_path):
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg.b import f\n")
  (pkg / "b.py").write_text("def f():\n  from pkg import a\n  return a\n")
  (pkg / "c.py").write_text("from . import a\n")
  graph = _module_imports(pkg, "pkg")
  assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
  assert _import_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_jax_rule_tables_are_left_as_they_were():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _TABLES_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "PROBLEMS []" in out.stdout, out.stdout[-3000:]


# ----------------------------------------------------------------------------- fused ReLU


def _tie_rich(rng, shape):
  x = rng.integers(-2, 3, shape).astype(np.float32)  # zeros, negatives, ties
  flat = x.reshape(-1)
  flat[rng.choice(flat.size, 3, replace=False)] = np.nan
  flat[rng.choice(flat.size, 3, replace=False)] = -np.inf
  flat[rng.choice(flat.size, 3, replace=False)] = -0.0
  return x


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("kw", [
    dict(window_shape=(3, 3), strides=(2, 2), padding=1),
    dict(window_shape=(2, 3), strides=(1, 2), padding="SAME", dilation=(2, 1), ceil_mode=True),
    dict(window_shape=(9, 9), strides=(2, 2), padding=2),  # above the unroll threshold
])
def test_fused_relu_is_relu_after_the_pool(rng, kw, implementation):
  x = _tie_rich(rng, (2, 11, 10, 3))
  fused = lambda v: jaxpool.max_pool(v, **kw, activation="relu", implementation=implementation)
  unfused = lambda v: jax.nn.relu(jaxpool.max_pool(v, **kw, implementation=implementation))
  y = ref.max_pool(x, **kw)
  dy = rng.integers(-3, 4, y.shape).astype(np.float32)
  t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  @jax.jit  # value, gradient and jvp of both, one compile
  def run(x, dy, t):
    out = []
    for f in (fused, unfused):
      value, vjp = jax.vjp(f, x)
      out.append((value, vjp(dy)[0], jax.jvp(f, (x,), (t,))[1]))
    return out

  (y_fused, g_fused, t_fused), (y_unfused, g_unfused, t_unfused) = run(x, dy, t)
  assert_bitwise(y_fused, y_unfused)
  assert_bitwise(y_fused, np.maximum(y, 0).astype(np.float32))
  assert_bitwise(g_fused, g_unfused)
  # and against the reference: a window whose maximum is not positive sends nothing
  assert_bitwise(g_fused, ref.max_pool_grad(x, np.where(y > 0, dy, 0), **kw).astype(np.float32))
  assert_bitwise(t_fused, t_unfused)


def test_fused_relu_bad_name():
  with pytest.raises(ValueError, match="activation must be one of .*'gelu'"):
    jaxpool.max_pool(jnp.ones((1, 4, 1)), (2,), activation="gelu")


# ----------------------------------------------------------------------------- layers


def _face_names(init: pathlib.Path) -> set[str]:
  """The names ``jaxpool/__init__.py`` (the face) defines: its imports and assignments."""
  names = set()
  for node in ast.parse(init.read_text(), str(init)).body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names |= {a.asname or a.name.split(".")[0] for a in node.names}
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names |= {t.id for t in targets if isinstance(t, ast.Name)}
  return names


def _face_imports(root: pathlib.Path, package: str) -> list[str]:
  """Every import, in a module under ``root`` (the package ``package``) other than the face
  ``root/__init__.py`` itself, that binds the face: ``import jaxpool``, ``import jaxpool.x``
  (which binds ``jaxpool``), ``from jaxpool import <a name the face defines>``, or the same
  written relatively. ``from jaxpool import graph`` (a module, not one of the face's names)
  passes."""
  face = _face_names(root / "__init__.py") - {p.stem for p in root.iterdir()}
  found = []
  for path in sorted(root.rglob("*.py")):
    if path == root / "__init__.py":
      continue
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found += [f"{path}:{node.lineno}: import {a.name}" for a in node.names
                  if a.name == package or (a.name.startswith(package + ".") and not a.asname)]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          keep = len(parts) - node.level
          base = ".".join(parts[:keep] + ([base] if base else []))
        if base == package:
          found += [f"{path}:{node.lineno}: from {package} import {a.name}" for a in node.names
                    if a.name in face or a.name == "*"]
  return found


def test_nothing_under_jaxpool_imports_the_face():
  root = pathlib.Path(jaxpool.__file__).parent
  assert {"max_pool", "optimize", "Geometry"} <= _face_names(root / "__init__.py")
  found = _face_imports(root, "jaxpool")
  assert not found, ("modules under jaxpool/ import the public package (the face); import the "
                     "functions from jaxpool._src instead:\n" + "\n".join(found))


def test_face_import_check_sees_every_form(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "_src").mkdir(parents=True)
  (pkg / "__init__.py").write_text("from pkg._src.api import f as f\n__version__ = '1'\n")
  (pkg / "sub.py").write_text("")
  (pkg / "_src" / "__init__.py").write_text("")
  (pkg / "_src" / "api.py").write_text("def f():\n  import pkg\n  return pkg\n")
  (pkg / "_src" / "b.py").write_text("from pkg import f\nfrom pkg import sub\n")
  (pkg / "_src" / "c.py").write_text("from .. import __version__\nimport pkg._src.api\n"
                                     "import pkg._src.api as ok\nfrom pkg._src import api\n")
  found = sorted(line.split(": ", 1)[1] for line in _face_imports(pkg, "pkg"))
  assert found == ["from pkg import __version__", "from pkg import f", "import pkg",
                   "import pkg._src.api"]


# ----------------------------------------------------------------------------- one rule, one place

# Copies allowed for now, by path under jaxpool/ (a module or a package): none are left. Add an
# entry only for a copy in a module someone else is rewriting, and remove it once the copy goes.
_NOT_YET: dict[str, set[str]] = {}


def _code(path: pathlib.Path) -> str:
  """A module's code without its docstrings, comments and white space."""
  tree = ast.parse(path.read_text(), str(path))
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      body[0].value.value = ""
  return "".join(ast.unparse(tree).split())


def _rule_copies(root: pathlib.Path) -> list[str]:
  """Where a module under ``root`` (``jaxpool/``) restates a rule that has one home: its own
  ``is_int`` or ``lowest`` function (homes: ``_src/checks.py``, ``_src/dtypes.py``), a "must be
  a bool" message (``checks.check_bool``), the effective window ``d * (k - 1) + 1``
  (``windows.effective_window``) or the spatial-axes formula ``range(ndim - 1 - n, ndim - 1)``
  (``windows.spatial_axes``). The Pallas kernels (``_src/pallas/``) keep their own index
  arithmetic and are not read."""
  homes = {"is_int": "checks.py", "_is_int": "checks.py", "lowest": "dtypes.py",
           "_lowest": "dtypes.py"}
  found = []
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root)
    if rel.parts[:2] == ("_src", "pallas"):
      continue
    allowed = set().union(*(v for k, v in _NOT_YET.items() if rel.as_posix().startswith(k)))
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.FunctionDef) and node.name in homes:
        if path.name != homes[node.name] and node.name not in allowed:
          found.append(f"{rel}:{node.lineno}: def {node.name}")
      elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and "must be a bool" in node.value and "must be a bool array" not in node.value):
        if path.name != "checks.py" and "must be a bool" not in allowed:
          found.append(f"{rel}:{node.lineno}: a 'must be a bool' message")
    code = _code(path)
    if path.name != "windows.py" and "d * (k - 1) + 1" not in allowed and "*(k-1)+1" in code:
      found.append(f"{rel}: the effective window written out")
    if path.name != "windows.py" and "spatial axes" not in allowed and (
        "range(ndim-1-" in code or "range(ndim-n," in code):
      found.append(f"{rel}: the spatial-axes formula written out")
  return found


def test_each_rule_has_one_home():
  root = pathlib.Path(jaxpool.__file__).parent
  found = _rule_copies(root)
  assert not found, "a rule restated outside its home:\n" + "\n".join(found)


# ------------------------------------------------------------------------ graph: gradient classes


def test_graph_nodes_name_their_gradient_classes_by_reference():
  """A forward node holds its gradient and gradient-state classes themselves (no table of class
  names), and a gradient node's forward node is a field of its own name, so that ``forward``
  stays every node's forward method."""
  import dataclasses

  import jaxpool.graph as jg
  from jaxpool._src.graph import base

  assert jg.MaxPool.gradient_class is jg.PoolingGradient
  assert jg.DilatedMaxPool.gradient_class is jg.PoolingGradient
  assert jg.Conv.gradient_class is jg.ConvolutionGradient
  assert jg.BatchNorm.gradient_class is jg.BatchNormalizationGradient
  assert jg.BatchNorm.state_class is jg.BatchNormalizationState
  assert jg.Dropout.gradient_class is jg.DropoutGradient
  assert jg.Dropout.state_class is jg.DropoutGradientState
  assert jg.Activation.gradient_class is jg.Gradient
  assert jg.Activation.state_class is jg.GradientState
  forward = [c for c in vars(jg).values()
             if isinstance(c, type) and issubclass(c, jg.Node) and c.is_filter]
  assert len(forward) > 15
  for cls in forward:
    assert issubclass(cls.gradient_class, jg.GradientNode), cls
    assert issubclass(cls.state_class, jg.GradientState), cls
  assert not any(hasattr(c, "gradient_kind") or hasattr(c, "state_kind") for c in forward)
  assert not hasattr(base, "register_gradient_class")

  x = jg.Input("x", shape=(6, 6, 2))
  pool = jg.MaxPool("pool", x, window=(2, 2))
  grad = pool.gradient_filter(jg.Input("dy", shape=(3, 3, 2)))
  assert type(grad) is jg.PoolingGradient and grad.forward_node is pool
  state = grad.gradient_state
  assert isinstance(state, jg.GradientState) and state.forward_node is pool
  for node in (grad, state):
    assert "forward" not in {f.name for f in dataclasses.fields(node)}
    assert type(node).forward is jg.Node.forward  # the method, not shadowed by a field
  same = jg.PoolingGradient("pool.grad", pool, "dy", x, state)  # MPS's initializer, positional
  assert same == grad
  with pytest.raises(TypeError, match="forward_node must be a forward filter node"):
    jg.PoolingGradient("g", x, "dy", x, None)


# ----------------------------------------------------------------------------- one way down


# What a family folder under ``_src/`` (ROI pooling's ``_src/roi/``, and the op families to come:
# any package there but these) may take from the Pallas package: the shared building blocks.
_NOT_FAMILIES = {"pallas", "graph", "optimize"}
_FAMILY_MAY_USE = {"jaxpool._src.pallas.calls", "jaxpool._src.pallas.triton.tile"}


def _families(root: pathlib.Path) -> set[str]:
  """The op-family folders under ``root/_src`` (``jaxpool/``), as module prefixes."""
  return {f"jaxpool._src.{d.name}" for d in (root / "_src").iterdir()
          if (d / "__init__.py").exists() and d.name not in _NOT_FAMILIES}


def _pallas_importers(root: pathlib.Path) -> set[str]:
  """The modules under ``root`` (``jaxpool/``), outside ``_src/pallas/``, that import anything
  from ``jaxpool._src.pallas``, as paths under ``root`` (an op family's folder may take the
  shared building blocks, :data:`_FAMILY_MAY_USE`)."""
  graph = _module_imports(root, "jaxpool")
  families = _families(root)
  found = set()
  for mod, deps in graph.items():
    rel = mod.split(".")[1:]
    if rel[:2] == ["_src", "pallas"]:
      continue
    if any(mod == f or mod.startswith(f + ".") for f in families):
      deps = deps - _FAMILY_MAY_USE
    if any(d == "jaxpool._src.pallas" or d.startswith("jaxpool._src.pallas.") for d in deps):
      found.add("/".join(rel) + ".py")
  return found


def test_only_the_registry_reaches_the_pallas_backends():
  """The public functions, adaptive pooling, the graph, the interop layers and ``optimize`` go
  through the registry (``dispatch.py``); ``tune.py`` is the kernels' own tuning tool."""
  root = pathlib.Path(jaxpool.__file__).parent
  assert _pallas_importers(root) == {"_src/dispatch.py", "tune.py"}


# The rooms of ``_src/pallas/``: what a module (by its name under the package, the longest
# prefix here) may import of the package. Downward only: the Triton kernels and their launch
# space import neither the calls nor tuning nor sharding; tuning takes the launch space
# (``triton.config``) and nothing else of the Triton room; the calls (``triton.ops``) take the
# kernels, the launch space and the tuner; sharding takes the tuner and the calls'
# description (``calls``), no kernel; the registry's ``ops`` and ``backend`` sit on top.
_TRITON_KERNELS = {f"triton.{m}" for m in ("max", "avg", "rows", "backward", "tile")}
_PALLAS_ROOMS = {
    "": set(),
    "calls": set(),
    "triton": _TRITON_KERNELS,
    "triton.config": _TRITON_KERNELS,
    "triton.ops": {"triton", "tuning", "calls"},
    "tuning": {"tuning", "triton.config"},
    "tpu": {"tpu", "calls"},
    "sharding": {"sharding", "calls", "tuning"},
    "ops": {"triton.ops", "tpu.ops", "sharding", "calls"},
    "backend": {"ops", "sharding"},
    "types": set(),
}
# Every room may take the kernels' modes and ops (``types.py``, which imports nothing of the
# package).
_PALLAS_ROOMS = {room: allowed | {"types"} for room, allowed in _PALLAS_ROOMS.items()}


def _within(name: str, prefixes) -> bool:
  return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


def _room_breaches(graph: dict[str, set[str]], package: str) -> list[str]:
  """The imports, among the modules of ``package`` (``jaxpool._src.pallas``), that a room's
  rule (:data:`_PALLAS_ROOMS`) does not allow, as ``"a -> b"``."""
  found = []
  for mod, deps in sorted(graph.items()):
    if not (mod == package or mod.startswith(package + ".")):
      continue
    name = mod[len(package) + 1:]
    room = max((r for r in _PALLAS_ROOMS if _within(name, [r]) and (r or not name)), key=len,
               default=None)
    if room is None:
      found.append(f"{name}: in no room")
      continue
    for d in sorted(deps):
      if d.startswith(package + ".") and not _within(d[len(package) + 1:], _PALLAS_ROOMS[room]):
        found.append(f"{name} -> {d[len(package) + 1:]}")
  return found


def test_the_pallas_rooms_import_downward():
  root = pathlib.Path(jaxpool.__file__).parent
  graph = _module_imports(root, "jaxpool")
  rooms = {m.split(".")[3] for m in graph if m.startswith("jaxpool._src.pallas.")}
  assert {"triton", "tpu", "sharding", "tuning", "calls", "ops", "backend"} <= rooms
  breaches = _room_breaches(graph, "jaxpool._src.pallas")
  assert not breaches, "imports against the Pallas rooms' layering:\n" + "\n".join(breaches)
  # the check can fail: a kernel that reached up into tuning or sharding would be caught
  bad = dict(graph, **{"jaxpool._src.pallas.triton.max": {"jaxpool._src.pallas.tuning.tuner"},
                       "jaxpool._src.pallas.tuning.cache": {"jaxpool._src.pallas.triton.ops"}})
  assert _room_breaches(bad, "jaxpool._src.pallas") == [
      "triton.max -> tuning.tuner", "tuning.cache -> triton.ops"]


def test_an_op_family_folder_may_use_the_shared_kernel_blocks(tmp_path):
  """A family folder under ``_src/`` (as ``_src/roi/``) may take the kernels' shared building
  blocks; anything else of the Pallas package stays the registry's."""
  root = tmp_path / "jaxpool"
  for d in ("", "_src", "_src/pallas", "_src/pallas/triton", "_src/fam"):
    (root / d).mkdir(exist_ok=True)
    (root / d / "__init__.py").write_text("")
  for m in ("calls", "ops"):
    (root / "_src/pallas" / f"{m}.py").write_text("")
  (root / "_src/pallas/triton/tile.py").write_text("")
  (root / "_src/dispatch.py").write_text("from jaxpool._src.pallas import ops\n")
  (root / "_src/fam/kernels.py").write_text(
      "from jaxpool._src.pallas.calls import x\nfrom jaxpool._src.pallas.triton import tile\n")
  assert _pallas_importers(root) == {"_src/dispatch.py"}
  (root / "_src/fam/api.py").write_text("from jaxpool._src.pallas import ops\n")
  assert _pallas_importers(root) == {"_src/dispatch.py", "_src/fam/api.py"}


def test_the_registry_holds_typed_backends():
  from jaxpool._src import dispatch
  from jaxpool._src.backend import Backend, Op

  assert [b.label for b in dispatch.REGISTRY] == ["Pallas Triton", "Pallas TPU", "XLA"]
  assert all(isinstance(b, Backend) for b in dispatch.REGISTRY)
  x = jnp.ones((2, 8, 8, 4))
  geom = jaxpool.make_geometry(x.shape, (2, 2), (2, 2))
  assert dispatch.choose(Op.MAX_POOL, "xla", x, geom) is dispatch.XLA
  # a backend declines with its reason, and has no method for what it declines
  triton = dispatch.PALLAS_TRITON
  assert "no Pallas kernel for lp_pool" in triton.supports(Op.LP_POOL, x, geom)
  assert "no Pallas kernel for global pooling" in triton.supports(Op.GLOBAL_POOL, x, None)
  assert "take no mask" in triton.supports(Op.MAX_POOL, x, geom, x > 0)
  with pytest.raises(NotImplementedError, match="Pallas Triton backend has no lp_pool"):
    triton.lp_pool(x, geom, p=2.0)
  # the two Pallas backends are implementation="pallas", each for its own kernels
  tpu = dispatch.PALLAS_TPU
  assert triton.name == tpu.name == "pallas" and (triton.kernels, tpu.kernels) == ("triton", "tpu")
  cf = jaxpool.make_geometry((2, 4, 8, 8), (2, 2), data_format="channels_first")
  assert triton.supports(Op.MAX_POOL, jnp.ones((2, 4, 8, 8)), cf) is None
  assert "channels_last" in tpu.supports(Op.MAX_POOL, jnp.ones((2, 4, 8, 8)), cf)


# ----------------------------------------------------------------------------- sizes

MAX_LINES = 500


def test_no_module_above_500_lines():
  root = pathlib.Path(jaxpool.__file__).parent
  long = {path.relative_to(root).as_posix(): len(path.read_text().splitlines())
          for path in sorted(root.rglob("*.py"))}
  long = {rel: n for rel, n in long.items() if n > MAX_LINES}
  assert not long, f"modules above {MAX_LINES} lines (split them by subject): {long}"
