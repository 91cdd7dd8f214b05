"""Docstrings of the present: at most 8 lines each, and no issue numbers in the source.

A docstring says what a thing is for, the one non-obvious why and the test that shows it;
history belongs in commit messages (docs/ holds the reference). Read with ast, so every module,
class and function counts, nested ones too."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The packages held to it.
PACKAGES = ("worker", "producer", "training", "engine_dump", "sglang_patch", "vllm_hook", "bench")
MAX_LINES = 8
ISSUE_NUMBER = re.compile(r"issue ?#?\d", re.IGNORECASE)
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def sources() -> Iterator[Path]:
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def docstrings(path: Path) -> Iterator[tuple[str, int, str]]:
    """(name, line, docstring) of every module, class and function in ``path`` that has one."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, _DOCUMENTED):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield getattr(node, "name", "<module>"), getattr(node, "lineno", 1), doc


def test_every_docstring_is_at_most_8_lines() -> None:
    # Given every docstring of the packages
    long = [f"{p.relative_to(ROOT)}:{line} {name}: {n} lines"
            for p in sources() for name, line, doc in docstrings(p)
            if (n := len(doc.strip().splitlines())) > MAX_LINES]
    # Then none is longer than 8 lines
    assert not long, "docstrings over 8 lines:\n" + "\n".join(long)


def test_no_source_names_an_issue_number() -> None:
    # Given every source file of the packages, comments and strings included
    found = [f"{p.relative_to(ROOT)}:{i}: {text.strip()}"
             for p in sources() for i, text in enumerate(p.read_text().splitlines(), 1)
             if ISSUE_NUMBER.search(text)]
    # Then none says "issue 9" (history goes in commit messages)
    assert not found, "issue numbers in the source:\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    # Given a module with a 9-line function docstring and an issue number in a comment
    bad = tmp_path / "bad.py"
    body = "\n".join(f"    line {i}" for i in range(2, 10))
    bad.write_text(f'def f():\n    """line 1\n{body}\n    """\n# since Issue #9\n')
    # Then the docstring reads as 9 lines and the comment as an issue number
    assert [len(d.strip().splitlines()) for _, _, d in docstrings(bad)] == [9]
    assert ISSUE_NUMBER.search(bad.read_text())


# A test named in the source or the docs: ``tests/<tier>/test_x.py`` and, after ``::``
# (possibly at the start of the next line), ``test_name``.
TEST_REF = re.compile(r"tests/((?:\w+/)*)(test_\w+\.py)(?:::\s*(test_\w+))?")
DOCS = ("README.md", "docs", "ops", "bench", *PACKAGES)


def test_every_test_the_source_or_docs_names_exists() -> None:
    # Given every reference to a test in the packages, README, docs/ and ops/
    texts = [p for d in DOCS for p in ([ROOT / d] if (ROOT / d).is_file()
                                       else (ROOT / d).rglob("*")) if p.suffix in (".py", ".md")]
    missing = []
    for p in texts:
        for m in TEST_REF.finditer(p.read_text()):
            path = ROOT / "tests" / m.group(1) / m.group(2)
            name = m.group(3)
            if not path.is_file() or (name and not re.search(
                    rf"^(async )?def {name}\b", path.read_text(), re.M)):
                missing.append(f"{p.relative_to(ROOT)}: {' '.join(m.group(0).split())}")
    # Then each names a file that exists and, where given, a test in it
    assert not missing, "references to tests that are not there:\n" + "\n".join(missing)
