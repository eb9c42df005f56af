"""Checks that every relative link of the built docs site resolves: the file and the anchor.

``python docs/check_links.py [SITE_DIR]`` (``make docs`` runs it after ``mkdocs build``; the
default SITE_DIR is ``site``) reads every HTML page of the built site, follows each relative
``href`` and ``src`` (links, images, scripts, style sheets) to its file, and a ``#fragment`` to an
element with that ``id`` (or an ``<a name>``) in the page it points at. It prints one line per
broken link (page, link, what is missing) and exits with 1 if there is any. Links with a scheme
(``https:``, ``mailto:``) are not followed; a link that starts with ``/`` is reported, since it
depends on where the site is served.

It checks the HTML rather than the Markdown, so it also sees what mkdocs does not validate: text
that a hook inserts (the changelog page shows CHANGELOG.md) and what mkdocstrings renders.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

ROOT_URL = "http://site/"   # resolves links as a browser would, from a root they cannot leave
LINK_ATTRS = {"a": "href", "link": "href", "img": "src", "script": "src", "iframe": "src"}


class _Page(HTMLParser):
  """The links and the anchor names of one HTML page."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.links: list[str] = []
    self.anchors: set[str] = set()

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    if a.get("id"):
      self.anchors.add(a["id"])
    if tag == "a" and a.get("name"):
      self.anchors.add(a["name"])
    link = a.get(LINK_ATTRS.get(tag, ""))
    if link is not None:
      self.links.append(link)


def _parse(path: Path) -> _Page:
  page = _Page()
  page.feed(path.read_text(encoding="utf-8", errors="replace"))
  return page


def _target_file(site: Path, path: str) -> Path | None:
  """The file that a site-relative URL path serves, or None."""
  path = path.lstrip("/")
  f = site / unquote(path)
  if path == "" or path.endswith("/") or f.is_dir():
    f = f / "index.html"
  return f if f.is_file() else None


def broken_links(site: Path) -> list[str]:
  """One line per broken relative link of the site in ``site``, as ``page: link (why)``.

  ``404.html`` is left out: mkdocs writes its links from the site's root on purpose (the page is
  served for any missing path).
  """
  site = site.resolve()
  pages = {p: _parse(p) for p in sorted(site.rglob("*.html"))}
  problems = []
  for path, page in pages.items():
    rel = path.relative_to(site).as_posix()
    if rel == "404.html":
      continue
    for link in page.links:
      parts = urlsplit(link)
      if parts.scheme or parts.netloc or link.startswith("//"):
        continue
      where = f"{rel}: {link}"
      if link.startswith("/"):
        problems.append(f"{where} (an absolute path: depends on where the site is served)")
        continue
      url = urlsplit(urljoin(ROOT_URL + rel, link))
      target = path if not parts.path else _target_file(site, url.path)
      if target is None:
        problems.append(f"{where} (no such file in the site)")
        continue
      if url.fragment and target.suffix == ".html":
        anchors = (pages[target] if target in pages else _parse(target)).anchors
        if unquote(url.fragment) not in anchors:
          problems.append(f"{where} (no anchor #{url.fragment} in "
                          f"{target.relative_to(site).as_posix()})")
  return problems


def main(argv: list[str]) -> int:
  site = Path(argv[1] if len(argv) > 1 else "site")
  if not (site / "index.html").is_file():
    print(f"check_links: {site} holds no built site (run mkdocs build first)", file=sys.stderr)
    return 2
  problems = broken_links(site)
  for p in problems:
    print(p)
  n = len(list(site.rglob("*.html")))
  print(f"check_links: {len(problems)} broken link(s) in the {n} pages of {site}",
        file=sys.stderr)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
