"""tests/README.md lists every test file and helper script under ``tests/``, each in the row of
its folder (a file at the top, ``conftest.py``, anywhere in the text), and names no test file
that is not there."""

from __future__ import annotations

import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _rows(text: str) -> dict[str, str]:
  """The README's table: each folder (``ops``, ``kernels``, ...) and its row's text."""
  return {m.group(1): m.group(2)
          for m in re.finditer(r"^\| `([\w/]+)/` \|(.*)$", text, flags=re.MULTILINE)}


def readme_problems(tests: pathlib.Path) -> list[str]:
  """What ``tests/README.md`` misses (a ``.py`` file under ``tests`` its folder's row does not
  name) or names in excess (a ``test_*.py`` that does not exist)."""
  text = (tests / "README.md").read_text()
  rows = _rows(text)
  problems = []
  files = sorted(p.relative_to(tests) for p in tests.rglob("*.py")
                 if "__pycache__" not in p.parts and p.name != "__init__.py")
  for rel in files:
    folder = rel.parent.as_posix()
    where = text if folder == "." else rows.get(folder, "")
    if f"`{rel.name}`" not in where:
      problems.append(f"{rel.as_posix()} is not listed in its folder's row")
  names = {rel.name for rel in files}
  for named in sorted(set(re.findall(r"`(test_\w+\.py)`", text)) - names):
    problems.append(f"{named} is listed but does not exist")
  return problems


def test_the_readme_lists_every_test_file():
  problems = readme_problems(TESTS)
  assert not problems, "tests/README.md:\n" + "\n".join(problems)


def test_the_check_finds_a_missing_and_a_stale_file(tmp_path):
  (tmp_path / "ops").mkdir()
  (tmp_path / "conftest.py").write_text("")
  (tmp_path / "ops" / "test_a.py").write_text("")
  (tmp_path / "ops" / "helper.py").write_text("")
  (tmp_path / "README.md").write_text(
      "| Folder | What |\n|---|---|\n| `ops/` | `test_a.py`, `helper.py` |\n\n`conftest.py`\n")
  assert readme_problems(tmp_path) == []
  (tmp_path / "ops" / "test_b.py").write_text("")
  (tmp_path / "README.md").write_text(
      "| Folder | What |\n|---|---|\n| `ops/` | `test_a.py`, `test_c.py` |\n"
      "| `kernels/` | `helper.py` |\n")
  assert readme_problems(tmp_path) == [
      "conftest.py is not listed in its folder's row",
      "ops/helper.py is not listed in its folder's row",
      "ops/test_b.py is not listed in its folder's row",
      "test_c.py is listed but does not exist"]
