"""The detection-head example of docs/roi.md runs and prints what the page says."""

import contextlib
import io
import pathlib
import re

DOC = pathlib.Path(__file__).parents[2] / "docs" / "roi.md"


def test_detection_head_example_runs():
  text = DOC.read_text()
  section = text[text.index("## A detection head"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, str(DOC), "exec"), {})
  assert out.getvalue().strip() == "(2, 32, 48, 16) [(2, 4), (1, 4)]"
