"""Every relative link of README.md and docs/*.md leads somewhere: the file exists and, for a link
to a heading (`page.md#heading`), the page has that heading; docs/index.md lists every document."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 150

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def links(page: Path) -> list[str]:
    """The link targets of a Markdown page, code blocks and inline code left out."""
    text = _CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [match.group(1) for pattern in (_INLINE, _REFERENCE) for match in pattern.finditer(text)]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    """'target (why)' for each relative link of `page` that leads nowhere."""
    broken = []
    for target in links(page):
        if _EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target} (no {_shown(destination)})")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target} (no heading #{anchor} in {_shown(destination)})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_checker_sees_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A heading, with punctuation\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#a-heading-with-punctuation) [ok](https://example.com/x.md)\n"
                    "[gone](missing.md) [gone](other.md#no-such-heading) ![gone](figure.png)\n"
                    "`[not a link](nowhere.md)`\n\n```\n[not a link](nowhere.md)\n```\n\n[ref]: missing-too.md\n",
                    encoding="utf-8")
    assert [entry.split(" ")[0] for entry in broken_links(page)] == [
        "missing.md", "other.md#no-such-heading", "figure.png", "missing-too.md"]


def test_the_index_lists_every_document():
    listed = {(DOCS / target).resolve() for target in links(DOCS / "index.md") if not _EXTERNAL.match(target)}
    unlisted = [page.name for page in DOCS.glob("*.md") if page.name != "index.md" and page.resolve() not in listed]
    assert unlisted == [], "docs/index.md does not list these documents"


def test_the_readme_stays_short_and_points_to_the_index():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the details belong in docs/"
    assert "docs/index.md" in links(ROOT / "README.md")
