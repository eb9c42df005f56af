"""Packaging check (``make package-check``, part of ``make test``): what users install works.

1. Builds the sdist and, from it, the wheel (``python -m build``, in build isolation).
2. Checks their contents: the sdist carries every file of ``tests/`` and ``examples/`` that git
   tracks (when run from a git checkout), the licence, citation and changelog; the wheel carries
   the package, ``py.typed`` and the licence, and no tests; neither carries lab material
   (``lab_material``: probes, run logs, patches, notebooks); the wheel's metadata has the SPDX
   licence, the Python floor, and no runtime dependency on a test-only package.
3. Installs the wheel, without extras, into a new plain virtual environment (no system site
   packages: pip installs jax and the rest from the index) and runs a max pool, its gradient and
   its JVP there, in isolated mode (``python -I``), away from the source tree.
4. Unpacks the sdist and, with this Python's test dependencies and the sdist's own ``jaxpool``,
   collects its whole test suite (``pytest --collect-only``: a missing helper fails here) and runs
   a quick part of it.

Everything happens in a temporary directory, removed at the end (so is the ``jaxpool.egg-info``
that setuptools writes into the source tree, unless it was there before).

Usage, from the repository root::

  .venv/bin/python tests/project/packaging_check.py          # what `make package-check` runs
  .venv/bin/python tests/project/packaging_check.py --sdist-tests tests  # the whole suite
  .venv/bin/python tests/project/packaging_check.py --constraint floors.txt  # pin the venv

The Python running this script needs ``build`` and the test dependencies (``pip install -e
".[test]"``); the fresh environment is made from the same interpreter.
"""

from __future__ import annotations

import argparse
import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICK_TESTS = ["tests/ops/test_errors.py"]
# Besides the package: what the sdist must carry for its tests and docs to work.
SDIST_REQUIRED = ["LICENSE", "CITATION.cff", "CHANGELOG.md", "README.md", "pyproject.toml",
                  "MANIFEST.in", "mkdocs.yml", "tests/conftest.py", "tests/support/reference.py",
                  "tests/support/core_strategies.py", "tests/sharding/sharding_checks.py",
                  "examples/train_digits.py", "docs/index.md",
                  "benchmarks/results/pooling_cpu.json"]


def lab_material(path: str) -> bool:
  """Whether a file (a path relative to the repository root, with ``/``) is lab material, which
  neither the sdist nor the wheel may carry: the old probes, run logs, patches, lab notebooks."""
  name = path.rsplit("/", 1)[-1]
  return ("benchmarks/probes/" in f"/{path}" or name.endswith((".log", ".patch"))
          or name.startswith("NOTES"))


# Packages only the tests use: they must not be runtime dependencies.
TEST_ONLY = ["chex", "pytest", "hypothesis", "flax", "equinox", "optax"]

SMOKE = r"""
import importlib.metadata as md
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxpool

assert jaxpool.__file__.startswith(sys.prefix), jaxpool.__file__   # the installed wheel
assert jaxpool.__version__ == md.version("jaxpool"), (jaxpool.__version__, md.version("jaxpool"))
# The ties example of docs/semantics.md: ties go to the first maximum in row-major window order.
x = jnp.array([[1., 3., 3., 0.],
               [2., 3., 1., 3.],
               [0., 1., 2., 2.],
               [4., 0., 2., 2.]]).reshape(1, 4, 4, 1)
pool = lambda v: jaxpool.max_pool(v, (2, 2), strides=(2, 2))
y = pool(x)
np.testing.assert_array_equal(y[0, ..., 0], [[3., 3.], [4., 2.]])
dx = jax.jit(jax.grad(lambda v: pool(v).sum()))(x)
want = np.zeros((4, 4), np.float32)
want[0, 1] = want[0, 2] = want[3, 0] = want[2, 2] = 1
np.testing.assert_array_equal(dx[0, ..., 0], want)
np.testing.assert_array_equal(dx, jaxpool.max_pool_grad(x, jnp.ones_like(y), (2, 2), (2, 2)))
# Forward mode: each output's tangent is the input tangent at its argmax (the flat indices here).
t = jnp.arange(16.0).reshape(1, 4, 4, 1)
np.testing.assert_array_equal(jax.jvp(pool, (x,), (t,))[1][0, ..., 0], [[1., 2.], [12., 10.]])
for name in sys.argv[1:]:                     # the test-only packages
  assert importlib.util.find_spec(name) is None, f"{name} was installed without extras"
print(f"  fresh venv: python {sys.version.split()[0]}, jax {jax.__version__}, "
      f"jaxlib {md.version('jaxlib')}, numpy {np.__version__}, "
      f"jaxtyping {md.version('jaxtyping')}: max_pool, grad, jvp OK")
"""


def run(cmd, **kw):
  shown = [c if len(str(c)) < 100 else "'<code>'" for c in cmd]
  print("  $", " ".join(str(c) for c in shown), flush=True)
  subprocess.run([str(c) for c in cmd], check=True, **kw)


def fail(msg):
  sys.exit(f"package-check FAILED: {msg}")


def git_files(*dirs):
  """Files git tracks under ``dirs``, or None outside a git checkout (e.g. in an sdist)."""
  try:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", *dirs], check=True,
                         capture_output=True, text=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  return set(out.split())


def check_sdist(sdist: Path):
  with tarfile.open(sdist) as tf:
    top = tf.getnames()[0].split("/")[0]
    names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
  missing = [f for f in SDIST_REQUIRED if f not in names]
  tracked = git_files("tests", "examples", "jaxpool")
  if tracked is not None:
    missing += sorted(f for f in tracked if f not in names)
  if missing:
    fail(f"the sdist lacks {missing}")
  lab = sorted(n for n in names if lab_material(n))
  if lab:
    fail(f"the sdist carries {len(lab)} lab files: {lab[:10]}")
  print(f"  sdist: {len(names)} entries; has {', '.join(SDIST_REQUIRED[:3])}, tests/ and "
        f"examples/ whole" + (" (every git-tracked file)" if tracked is not None else ""))
  return top


def check_wheel(wheel: Path):
  with zipfile.ZipFile(wheel) as zf:
    names = zf.namelist()
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_bytes(zf.read(meta_name))
  if any(n.startswith("tests/") for n in names):
    fail("the wheel carries tests/")
  lab = sorted(n for n in names if lab_material(n))
  if lab:
    fail(f"the wheel carries {len(lab)} lab files: {lab[:10]}")
  for want in ("jaxpool/__init__.py", "jaxpool/py.typed",
               "jaxpool/_src/pallas/tuning/launch_tables/NVIDIA_H100_80GB_HBM3.json",
               "jaxpool/_src/pallas/tuning/observations.json",
               "jaxpool/_src/optimize/cost_tables/NVIDIA_H200.json"):
    if want not in names:
      fail(f"the wheel lacks {want}")
  if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
    fail("the wheel lacks its LICENSE")
  if meta["License-Expression"] != "Apache-2.0":
    fail(f"License-Expression is {meta['License-Expression']!r}")
  if meta["Requires-Python"] != ">=3.11":
    fail(f"Requires-Python is {meta['Requires-Python']!r}")
  runtime = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
  bad = [r for r in runtime if re.match(r"[\w.-]+", r).group().lower() in TEST_ONLY]
  if bad:
    fail(f"test-only packages among the runtime dependencies: {bad}")
  print(f"  wheel: {wheel.name}; License-Expression {meta['License-Expression']}, "
        f"Requires-Python {meta['Requires-Python']}, runtime deps {runtime}")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sdist-tests", nargs="+", default=QUICK_TESTS,
                  help=f"tests to run in the unpacked sdist (default: {' '.join(QUICK_TESTS)})")
  ap.add_argument("--constraint", action="append", default=[],
                  help="a pip constraints file for the fresh venv (e.g. the lowest versions)")
  ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
  ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
  args = ap.parse_args()

  t_start = time.perf_counter()
  timings = {}
  egg_info = ROOT / "jaxpool.egg-info"
  egg_info_before = egg_info.exists()
  work = Path(tempfile.mkdtemp(prefix="jaxpool-package-check."))
  try:
    t = time.perf_counter()
    print("[1/4] build the sdist, then the wheel from it", flush=True)
    run([sys.executable, "-m", "build", "--outdir", work / "dist", ROOT],
        stdout=subprocess.DEVNULL)
    (sdist,) = (work / "dist").glob("*.tar.gz")
    (wheel,) = (work / "dist").glob("*.whl")
    timings["build"] = time.perf_counter() - t

    t = time.perf_counter()
    print("[2/4] check their contents", flush=True)
    top = check_sdist(sdist)
    check_wheel(wheel)
    timings["checks"] = time.perf_counter() - t

    t = time.perf_counter()
    print("[3/4] install the wheel, no extras, into a new plain venv; run it there", flush=True)
    venv = work / "venv"
    # Nothing of this process's environment may leak in: no PYTHONPATH (pip would see the source
    # tree's egg-info as jaxpool installed), isolated mode (-I) for pip and the smoke test.
    # No bytecode is written (pip --no-compile, PYTHONDONTWRITEBYTECODE): faster to install and
    # to remove.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    run([sys.executable, "-I", "-m", "venv", venv], env=env)
    py = venv / "bin" / "python"
    constraints = [a for c in args.constraint for a in ("-c", Path(c).resolve())]
    run([py, "-I", "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
         *constraints, wheel], cwd=work, env=env)
    run([py, "-I", "-c", SMOKE, *TEST_ONLY], cwd=work, env=env)
    timings["fresh venv"] = time.perf_counter() - t

    t = time.perf_counter()
    print("[4/4] the sdist's tests: collect all, run " + " ".join(args.sdist_tests), flush=True)
    with tarfile.open(sdist) as tf:
      tf.extractall(work / "sdist", filter="data")
    src = work / "sdist" / top
    env = dict(os.environ, PYTHONPATH=str(src))
    found = subprocess.run([sys.executable, "-c", "import jaxpool; print(jaxpool.__file__)"],
                           cwd=src, env=env, check=True, capture_output=True, text=True).stdout
    if not Path(found.strip()).is_relative_to(src):
      fail(f"the sdist's tests would import jaxpool from {found.strip()}")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run([*pytest, "--collect-only", "tests"], cwd=src, env=env,
                               capture_output=True, text=True)
    tail = collected.stdout.strip().splitlines()[-1:]
    if collected.returncode != 0:
      print(collected.stdout[-5000:], collected.stderr[-5000:])
      fail("collecting the sdist's tests")
    print(f"  collected: {tail[0] if tail else '?'}")
    run([*pytest, "-n", str(args.workers), *args.sdist_tests], cwd=src, env=env)
    timings["sdist tests"] = time.perf_counter() - t
  finally:
    t = time.perf_counter()
    if args.keep:
      print(f"kept {work}")
    else:
      shutil.rmtree(work, ignore_errors=True)
    if not egg_info_before:
      shutil.rmtree(egg_info, ignore_errors=True)
    timings["clean-up"] = time.perf_counter() - t
  total = time.perf_counter() - t_start
  print("package-check passed in " + f"{total:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ")")


if __name__ == "__main__":
  main()
