"""Check every relative link and image of the built documentation site (standard library only).

    mkdocs build --strict && python docs/check_links.py            # checks ./site
    python docs/check_links.py path/to/site

Parses every HTML file under the site, resolves each relative ``href``/``src`` (and the ``#fragment``
it names, against the ``id``/``name`` attributes of the target page) and exits 1 listing every broken
one with the page it is on. External links (http, https, and protocol-relative ``//host``) are listed
as skipped, not fetched: CI has no internet. ``mailto:``, ``javascript:``, ``data:`` and the like are
ignored.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
LINK_ATTRS = {"href", "src"}


class _Page(HTMLParser):
    """The links (attribute values of href/src) and the anchor targets (id/name) of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in LINK_ATTRS:
                self.links.append(value.strip())
            elif name == "id" or (name == "name" and tag == "a"):
                self.anchors.add(value)

    handle_startendtag = handle_starttag


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    page.close()
    return page


def _target(site: Path, page: Path, path: str) -> Path:
    """The file a relative (or site-absolute) URL path points to, as a web server would serve it."""
    base = site if path.startswith("/") else page.parent
    target = (base / unquote(path).lstrip("/")).resolve()
    if target.is_dir() or path.endswith("/"):
        target = target / "index.html"
    return target


def check(site: Path) -> tuple[list[str], dict[str, set[str]], int]:
    """(broken links as 'page: link (why)', external URL -> pages it is on, links checked)."""
    pages = sorted(site.rglob("*.html"))
    parsed = {p.resolve(): _parse(p) for p in pages}
    broken: list[str] = []
    external: dict[str, set[str]] = defaultdict(set)
    checked = 0
    for page, info in parsed.items():
        shown = page.relative_to(site.resolve()).as_posix()
        for link in info.links:
            if not link:
                continue
            parts = urlsplit(link)
            if parts.scheme in ("http", "https") or link.startswith("//"):
                external[link].add(shown)
                continue
            if parts.scheme:  # mailto:, javascript:, data:, tel:, ...
                continue
            checked += 1
            target = _target(site.resolve(), page, parts.path) if parts.path else page
            try:
                target.relative_to(site.resolve())
            except ValueError:
                broken.append(f"{shown}: {link} (outside the site: {target})")
                continue
            if not target.is_file():
                broken.append(f"{shown}: {link} (no file {target.relative_to(site.resolve()).as_posix()})")
                continue
            fragment = unquote(parts.fragment)
            if fragment and target.suffix == ".html":
                anchors = parsed[target].anchors if target in parsed else _parse(target).anchors
                if fragment not in anchors:
                    where = target.relative_to(site.resolve()).as_posix()
                    broken.append(f"{shown}: {link} (no anchor #{fragment} in {where})")
    return broken, external, checked


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    site = Path(args[0]) if args else ROOT / "site"
    if not site.is_dir() or not any(site.rglob("*.html")):
        print(f"check_links: no HTML under {site}; run `mkdocs build --strict` first", file=sys.stderr)
        return 2
    broken, external, checked = check(site)
    n_pages = sum(1 for _ in site.rglob("*.html"))
    for url in sorted(external):
        print(f"skipped (external, not fetched): {url}  [on {', '.join(sorted(external[url]))}]")
    if broken:
        print(f"check_links: {len(broken)} broken link(s) in {site}:", file=sys.stderr)
        for line in broken:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"check_links: OK: {checked} relative links on {n_pages} pages resolve; {len(external)} external skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
