"""Every ```python block of README.md and docs/*.md runs, as a user would paste it.

One test a page. Its blocks run in order, in one fresh namespace (a module of their own), on the
CPU, in a temporary working directory: the page's first block holds its imports (``nan`` and
``inf`` included), each later block may use what an earlier one defined. The conventions:

- **A session** is a block of ``>>>`` prompts (``...`` continues a statement). Each statement
  runs; the lines after it, up to the next prompt, are what it shows (what it prints, then an
  expression's value), compared after dropping ``# comments`` and collapsing whitespace. An
  array shows as ``print`` shows it with four digits (``np.printoptions(precision=4)``), a tuple
  its elements side by side (the rows of two 2-D arrays on shared lines), anything else its
  ``repr``; the ``repr`` of an array matches too. A statement that raises shows
  ``ExceptionName: message``; one that shows nothing must show nothing.
- **A script** is any other block: it runs as a whole. A ```text block right after it (blank
  lines between at most) is what it prints, compared the same way.
- **Markers**, an HTML comment on the line right before the block's fence (invisible on the
  site and on GitHub): ``<!-- skip: REASON -->`` never runs the block (REASON says why);
  ``<!-- needs: gpu -->`` and ``<!-- needs: 8 devices -->`` run it only where JAX has a GPU or
  that many devices, and skip it (with that reason) elsewhere. What a skipped block defines is
  missing for the blocks after it: mark those too, or keep such a block self-contained.

Shell blocks (```sh, ```bash), plain ``` blocks and ```text blocks are never run.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(skip|needs):\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
  """A ```python block: where it starts (1-based line of its first code line) and its text."""
  line: int
  code: str
  marker: tuple[str, str] | None = None   # ("skip", reason) or ("needs", what)
  output: str | None = None               # the ```text block right after it, if any
  session: bool = field(init=False)

  def __post_init__(self):
    self.session = self.code.lstrip().startswith(">>>")


def blocks(text: str) -> list[Block]:
  """The page's ```python blocks, with their markers and the ```text blocks that follow them."""
  lines = text.splitlines()
  found: list[Block] = []
  i = 0
  last_closed_python = None   # index of the line after the last closed python block
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    lang, start = m.group(1), i
    j = i + 1
    while j < len(lines) and not lines[j].startswith("```"):
      j += 1
    body = "\n".join(lines[start + 1:j])
    if lang == "python":
      marker = None
      if start > 0 and (mm := MARKER.match(lines[start - 1])):
        marker = (mm.group(1), mm.group(2))
      found.append(Block(start + 2, body, marker))
      last_closed_python = j + 1
    elif lang == "text" and last_closed_python is not None and found and all(
        not s.strip() for s in lines[last_closed_python:start]):
      found[-1].output = body
    j += 1
    i = j
    if lang != "python":
      last_closed_python = None
  return found


def normalise(text: str) -> str:
  """Drops ``# comments`` and collapses whitespace."""
  return " ".join(" ".join(line.split("#", 1)[0] for line in text.splitlines()).split())


def _is_array(v) -> bool:
  return isinstance(v, (jax.Array, np.ndarray, np.generic))


def display(value) -> str:
  """What a session shows for ``value`` (module docstring): arrays as printed, tuples side by
  side."""
  if isinstance(value, tuple) and any(_is_array(v) for v in value):
    parts = [display(v).splitlines() or [""] for v in value]
    rows = max(len(p) for p in parts)
    return "\n".join("   ".join(p[r] if r < len(p) else "" for p in parts) for r in range(rows))
  if _is_array(value):
    with np.printoptions(precision=4):
      return str(np.asarray(value))
  return repr(value)


def statements(code: str, first_line: int):
  """Splits a session into (line, source, expected output) triples."""
  out: list[list] = []
  for k, line in enumerate(code.splitlines()):
    stripped = line.strip()
    if stripped.startswith(">>>"):
      out.append([first_line + k, stripped[4:] if len(stripped) > 3 else "", []])
    elif stripped.startswith("...") and out and not out[-1][2]:
      out[-1][1] += "\n" + (stripped[4:] if len(stripped) > 3 else "")
    elif out:
      out[-1][2].append(line)
    elif stripped:
      raise AssertionError(f"line {first_line + k}: text before the first >>> prompt")
  return [(ln, src, "\n".join(exp)) for ln, src, exp in out]


def _compile(src: str, path: str, line: int, mode: str):
  # Padding with newlines makes tracebacks name the page's own line numbers.
  return compile("\n" * (line - 1) + src, path, mode)


def run_session(block: Block, ns: dict, path: str) -> None:
  for line, src, expected in statements(block.code, block.line):
    where = f"{path}:{line}: >>> {src.splitlines()[0]}"
    try:
      code = _compile(src, str(ROOT / path), line, "eval")
      is_expr = True
    except SyntaxError:
      code = _compile(src, str(ROOT / path), line, "exec")
      is_expr = False
    printed = io.StringIO()
    try:
      with contextlib.redirect_stdout(printed):
        value = eval(code, ns)  # noqa: S307 - the docs' own examples
      shown = [display(value), repr(value)] if is_expr and value is not None else [""]
      shown = [printed.getvalue() + s for s in shown]
    except Exception as e:   # an error the page shows, or a failure
      shown = [f"{printed.getvalue()}{type(e).__name__}: {e}"]
      if not normalise(expected):
        raise AssertionError(f"{where} raised {shown[0]}") from e
    want = normalise(expected)
    got = [normalise(s) for s in shown]
    assert want in got, f"{where}\n  the page shows: {want!r}\n  it gives:       {got[0]!r}"


def run_script(block: Block, ns: dict, path: str) -> None:
  code = _compile(block.code, str(ROOT / path), block.line, "exec")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(code, ns)  # noqa: S102 - the docs' own examples
  if block.output is not None:
    want, got = normalise(block.output), normalise(printed.getvalue())
    assert want == got, (f"{path}:{block.line}: the block prints\n{printed.getvalue()}\n"
                         f"where the page shows\n{block.output}")


def unmet(marker: tuple[str, str] | None) -> str | None:
  """Why a marked block does not run here, or None if it does."""
  if marker is None:
    return None
  kind, what = marker
  if kind == "skip":
    return what or "skip"
  if what == "gpu":
    return None if jax.default_backend() == "gpu" else "needs a GPU"
  if m := re.fullmatch(r"(\d+) devices", what):
    return None if jax.device_count() >= int(m.group(1)) else f"needs {what}"
  raise AssertionError(f"unknown marker <!-- needs: {what} -->")


def _pages_with_python():
  return [p for p in PAGES if "```python" in p.read_text()]


@pytest.mark.parametrize("page", _pages_with_python(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_snippets_run(page, tmp_path, monkeypatch):
  rel = str(page.relative_to(ROOT))
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("KERAS_BACKEND", "jax")
  module = types.ModuleType("doc_snippets_" + re.sub(r"\W", "_", rel))
  monkeypatch.setitem(sys.modules, module.__name__, module)
  ns = module.__dict__
  skipped = []
  try:
    # A user's JAX: rank promotion allowed (tests/conftest.py makes it raise for the library's
    # own tests).
    with jax.numpy_rank_promotion("allow"):
      for block in blocks(page.read_text()):
        if (reason := unmet(block.marker)) is not None:
          skipped.append(f"line {block.line}: {reason}")
          continue
        (run_session if block.session else run_script)(block, ns, rel)
  finally:
    keras_hook = sys.modules.get("jaxpool.interop.keras")
    if keras_hook is not None and keras_hook.is_enabled():
      keras_hook.disable()
  if skipped:
    pytest.skip(f"{rel}: ran the other blocks; skipped " + "; ".join(skipped))


def test_blocks_parser():
  """The parser's conventions on a made-up page: markers, sessions, a script's printed output."""
  page = "\n".join([
      "```python", "import math", "```", "", "```text", "hi", "```",
      "<!-- skip: needs a TPU -->", "```python", ">>> 1 + 1", "2", "```",
      "```sh", "make test", "```"])
  b = blocks(page)
  assert [(x.line, x.session, x.marker, x.output) for x in b] == [
      (2, False, None, "hi"), (10, True, ("skip", "needs a TPU"), None)]
  assert statements(">>> x = (1,\n...      2)\n>>> x\n(1, 2)   # a comment", 5) == [
      (5, "x = (1,\n     2)", ""), (7, "x", "(1, 2)   # a comment")]
  assert normalise("[[1. 2.]     # c\n [3. 4.]]") == "[[1. 2.] [3. 4.]]"
  two = (np.array([[9., 9.], [8., 9.]]), np.array([[0, 5], [7, 5]]))
  assert normalise(display(two)) == normalise("[[9. 9.]   [[0 5]\n [8. 9.]]   [7 5]]")
  ns: dict = {}
  run_session(Block(1, ">>> print('a')\na\n>>> int('x')\nValueError: invalid literal for int() "
                       "with base 10: 'x'\n>>> 2 * 3   # six\n6"), ns, "README.md")
  with pytest.raises(AssertionError, match="the page shows: '7'"):
    run_session(Block(1, ">>> 2 * 3\n7"), ns, "README.md")
  with pytest.raises(AssertionError, match="raised NameError"):
    run_session(Block(1, ">>> undefined_name"), ns, "README.md")
