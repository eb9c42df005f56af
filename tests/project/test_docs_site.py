"""The built docs site: no broken link, an API reference that lists every public name.

The site is built once for the file (``mkdocs build --strict`` into a temporary folder, a few
seconds). ``docs/check_links.py`` follows every relative link and anchor of the HTML (the
changelog page, which a hook fills from CHANGELOG.md, and mkdocstrings' pages included);
``make docs`` runs it on ``site/`` too.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import check_links  # noqa: E402

# The modules whose ``__all__`` is the public API (docs/versioning.md), and the API reference's
# heading ids: mkdocstrings gives each documented object the id of its full dotted path.
PUBLIC_MODULES = ("jaxpool", "jaxpool.graph", "jaxpool.interop.flax_linen",
                  "jaxpool.interop.flax_nnx", "jaxpool.interop.equinox", "jaxpool.interop.keras")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
  pytest.importorskip("mkdocstrings", reason="the docs extra (pip install -e '.[docs]')")
  out = tmp_path_factory.mktemp("site")
  done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                         "--site-dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
  return out


def test_no_broken_links(site):
  assert check_links.broken_links(site) == []


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_api_reference_lists_every_public_name(site, module):
  framework = {"flax_linen": "flax", "flax_nnx": "flax", "equinox": "equinox"}
  if (needs := framework.get(module.rsplit(".", 1)[-1])) is not None:
    pytest.importorskip(needs)
  exported = importlib.import_module(module).__all__
  ids = set(re.findall(r'\bid="([^"]+)"', (site / "api" / "index.html").read_text()))
  missing = [name for name in exported if f"{module}.{name}" not in ids]
  assert not missing, f"docs/api.md does not document {module}'s {missing}"


def test_public_modules_export_what_they_define():
  """``__all__`` holds every public name a module imports or defines, and only those."""
  for module in ("jaxpool", "jaxpool.graph"):
    m = importlib.import_module(module)
    public = {n for n in vars(m) if not n.startswith("_")}
    public -= {n for n, v in vars(m).items() if type(v).__name__ == "module"}   # submodules
    assert sorted(public) == sorted(m.__all__), module


def test_edit_links_point_at_main(site):
  page = (site / "index.html").read_text()
  assert "https://github.com/jaxpool/jaxpool/edit/main/docs/index.md" in page


def test_link_checker_finds_broken_links(tmp_path):
  """check_links on a made-up site: a missing page, a missing anchor, an absolute path."""
  (tmp_path / "a").mkdir()
  (tmp_path / "index.html").write_text(
      '<h1 id="top">x</h1><a href="a/">ok</a> <a href="a/#sec">ok</a> <a href="#top">ok</a>'
      '<a href="b/">no page</a> <a href="a/#nope">no anchor</a> <a href="/a/">absolute</a>'
      '<a href="https://example.com/x">not followed</a><img src="img/p.png">')
  (tmp_path / "a" / "index.html").write_text(
      '<h2 id="sec">s</h2><a href="../">ok</a><a href="../index.html#top">ok</a>'
      '<a href="../index.html#gone">no anchor</a>')
  assert check_links.broken_links(tmp_path) == [
      "a/index.html: ../index.html#gone (no anchor #gone in index.html)",
      "index.html: b/ (no such file in the site)",
      "index.html: a/#nope (no anchor #nope in a/index.html)",
      "index.html: /a/ (an absolute path: depends on where the site is served)",
      "index.html: img/p.png (no such file in the site)",
  ]
