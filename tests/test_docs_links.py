"""Links between the docs resolve: every relative Markdown link of README.md,
CONTRIBUTING.md and docs/*.md names a file of the repository, and a ``#fragment``
names a heading of that page (GitHub's anchors). Pages are cut and sections moved
(issue 38); a link left pointing at a removed section fails here, not in a reader's
browser."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCED.sub("", page.read_text()))}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One line per link of ``page`` that leaves the repository, names no file, or
    names a heading the target page lacks."""
    problems = []
    for link in LINK.findall(FENCED.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:: not a file of ours
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.is_relative_to(root.resolve()):
            problems.append(f"{page.name}: {link} leaves the repository")
        elif not target.exists():
            problems.append(f"{page.name}: {link} names no file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            problems.append(f"{page.name}: {link} names no heading of {target.name}")
    return problems


def test_every_link_between_the_docs_resolves():
    problems = [p for page in PAGES for p in broken_links(page)]
    assert problems == [], "\n".join(problems)


def test_the_checker_finds_a_missing_page_a_missing_heading_and_a_link_outside(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## The per-step call (`step()`)\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "[ok](b.md#the-per-step-call-step) [ok](#a) [web](https://example.org/x)\n"
        "[gone](c.md) [moved](b.md#conversion) [out](../../elsewhere.md)\n"
        "```python\nx = [1](2)\n```\n# A\n"
    )
    assert broken_links(page, tmp_path) == [
        "a.md: c.md names no file",
        "a.md: b.md#conversion names no heading of b.md",
        "a.md: ../../elsewhere.md leaves the repository",
    ]
