"""The guide and the reference pages: every relative link leads to a file and a heading there."""

from __future__ import annotations

import re
import subprocess
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


# --- every file a page, a module, a unit or the Makefile names is in the repo -------------

TOP_DIRS = ("docs", "ops", "worker", "producer", "engine_dump", "sglang_patch", "vllm_hook",
            "training", "tests", "bench", "examples")
REPO_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*\w)(\.\*)?")
MD_NAME = re.compile(r"(?<![\w./-])([A-Za-z][\w-]*\.md)\b")
README_SECTION = re.compile(r"README(?:'s|,)? (?:section )?\"([^\"]+)\"")
# Paths of other projects that look like ours, with whose they are
EXTERNAL = {"examples/speculative_decoding/main.py": "Model-Optimizer's training script"}
TEXT_SUFFIXES = (".py", ".md", ".toml", ".sh", ".service", ".yml", ".example", ".conf", ".txt")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return out.stdout.split()


def _dangling(path: str, line: str, tracked: set[str], dirs: set[str],
              names: set[str]) -> list[str]:
    """The names in ``line`` of files that are nowhere in the repo."""
    bad = []
    for m in REPO_PATH.finditer(line):
        p = m.group(1).rstrip(".")
        if any(ch in line[m.start():m.end() + 1] for ch in "$*{<") and not m.group(2):
            continue  # a pattern (`test_$$t.py`, `<key>`), not a name
        prefix_ok = m.group(2) and any(t.startswith(p + ".") for t in tracked)
        if not (p in tracked or p in dirs or prefix_ok or p in EXTERNAL):
            bad.append(p)
    bad += [m.group(1) for m in MD_NAME.finditer(line) if m.group(1) not in names]
    readme = anchors(ROOT / "README.md")
    bad += [f'README "{s}"' for s in README_SECTION.findall(line) if slug(s) not in readme]
    return [f"{path}: {b}" for b in bad]


def test_every_file_a_page_or_module_names_is_in_the_repo() -> None:
    # Given every tracked text file (pages, modules, units, the Makefile, CI)
    files = _tracked()
    tracked = set(files)
    dirs = {str(p) for f in files for p in Path(f).parents}
    names = {Path(f).name for f in files}
    # When each path of this repo, each .md name and each README section it names is looked up
    dangling = []
    for f in files:
        if not (f.endswith(TEXT_SUFFIXES) or Path(f).name in ("Makefile", "run")) \
                or f == "tests/unit/test_docs.py":  # this file names missing ones on purpose
            continue
        for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1):
            dangling += _dangling(f"{f}:{n}", line, tracked, dirs, names)
    # Then each is there
    assert not dangling, "names of files that are not in the repo:\n" + "\n".join(dangling)


def test_the_reference_check_finds_what_is_not_there() -> None:
    # Given lines that name a missing design note, a missing module, a gone README section
    tracked, dirs, names = {"worker/app.py", "README.md"}, {"worker"}, {"app.py", "README.md"}
    # Then each is found, and names that are there, patterns and other projects' are not
    assert _dangling("x", "configured by DESIGN.md's rules", tracked, dirs, names)
    assert _dangling("x", "see worker/gone.py", tracked, dirs, names)
    assert _dangling("x", 'see README, "Dependencies"', tracked, dirs, names)
    assert not _dangling("x", "see worker/app.py and README.md", tracked, dirs, names)
    assert not _dangling("x", "tests/trainers/test_$$t.py", tracked, dirs, names)
    assert not _dangling("x", "examples/speculative_decoding/main.py", tracked, dirs, names)
