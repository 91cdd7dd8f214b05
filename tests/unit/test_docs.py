"""The guide and the reference pages: every relative link leads to a file and a heading there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "ops" / "RUNBOOK.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    # Given a page of the guide or the reference
    links = [t for t in LINK.findall(page.read_text()) if "://" not in t]
    # When each relative link is followed
    broken = []
    for target in links:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and anchor not in anchors(dest)):
            broken.append(target)
    # Then it names a file there, and a heading of that file when it names one
    assert not broken, f"{page.name}: broken links {broken}"


def test_the_readme_is_a_guide_not_a_manual() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make demo" in readme and "make test" in readme
