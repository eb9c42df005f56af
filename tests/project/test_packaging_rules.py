"""The sdist and the wheel carry no lab material: no probes, run logs, patches or lab notebooks.

Building the archives takes a while (``make package-check`` builds both and applies the same
``lab_material`` rule to their file lists); here the sdist's file list is computed from
``MANIFEST.in`` with setuptools' own manifest machinery, and the wheel's from
``pyproject.toml``'s packages and package data, over the files in the working tree.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import tomllib
from pathlib import Path

import pytest

setuptools_egg_info = pytest.importorskip("setuptools.command.egg_info")

ROOT = Path(__file__).resolve().parents[2]


def _load_packaging_check():
  spec = importlib.util.spec_from_file_location(
      "packaging_check", Path(__file__).with_name("packaging_check.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# One rule for what lab material is: the one `make package-check` applies to the built archives.
lab_material = _load_packaging_check().lab_material


def sdist_files(root: Path) -> list[str]:
  """The files ``MANIFEST.in``'s rules select from the tree at ``root`` (what setuptools'
  sdist adds besides the package, README.md and pyproject.toml)."""
  file_list = setuptools_egg_info.FileList()
  lines = (root / "MANIFEST.in").read_text().splitlines()
  cwd = Path.cwd()
  try:
    os.chdir(root)  # FileList globs relative to the working directory
    for line in lines:
      line = line.strip()
      if line and not line.startswith("#"):
        file_list.process_template_line(line)
  finally:
    os.chdir(cwd)
  return sorted(f.replace("\\", "/") for f in file_list.files)


def wheel_files(root: Path) -> list[str]:
  """The files the wheel takes from the tree at ``root``: every module of the packages
  ``[tool.setuptools.packages.find]`` includes and the ``package-data`` patterns."""
  config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
  includes = config["packages"]["find"]["include"]
  files = []
  for init in root.rglob("__init__.py"):
    package = init.parent.relative_to(root).as_posix().replace("/", ".")
    if any(fnmatch.fnmatch(package, pattern) for pattern in includes):
      files += [p.relative_to(root).as_posix() for p in init.parent.glob("*.py")]
  for package, patterns in config.get("package-data", {}).items():
    base = root / package.replace(".", "/")
    for pattern in patterns:
      files += [p.relative_to(root).as_posix() for p in base.glob(pattern) if p.is_file()]
  return sorted(set(files))


def test_lab_material_rule():
  assert lab_material("benchmarks/probes/sweep_gpu.py")
  assert lab_material("benchmarks/probes/NOTES.md")
  assert lab_material("benchmarks/results/raw/bench_h200.log")
  assert lab_material("x/rows_store_early_s19.patch")
  assert not lab_material("benchmarks/launches_gpu.py")
  assert not lab_material("docs/design/index.md")


def test_the_sdist_carries_no_lab_material():
  files = sdist_files(ROOT)
  assert "benchmarks/pooling_gpu.py" in files and "docs/index.md" in files  # the rules ran
  lab = [f for f in files if lab_material(f)]
  assert not lab, f"MANIFEST.in lets {len(lab)} lab files into the sdist: {lab[:10]}"


def test_the_wheel_carries_no_lab_material():
  files = wheel_files(ROOT)
  assert "jaxpool/__init__.py" in files and any(f.endswith(".json") for f in files)
  lab = [f for f in files if lab_material(f)]
  assert not lab, f"pyproject.toml lets {len(lab)} lab files into the wheel: {lab[:10]}"


def test_manifest_rules_keep_lab_files_out(tmp_path):
  """The rules, not only today's tree: lab files planted where they used to live stay out."""
  for name in ["MANIFEST.in", "pyproject.toml"]:
    (tmp_path / name).write_text((ROOT / name).read_text())
  planted = ["benchmarks/probes/sweep_gpu.py", "benchmarks/probes/NOTES.md",
             "benchmarks/probes/raw/bench.log", "benchmarks/results/run.log",
             "benchmarks/rows_s19.patch", "docs/NOTES.md", "tests/run.log"]
  kept = ["benchmarks/pooling_gpu.py", "docs/index.md", "tests/conftest.py"]
  for name in planted + kept + ["jaxpool/__init__.py"]:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("")
  files = sdist_files(tmp_path)
  assert set(kept) <= set(files)
  assert not [f for f in files if lab_material(f)]
