"""Packages meet through public names: no module imports an underscore name from a module of
another package (a subpackage counts as a package of its own). Read from every import (ast),
those inside functions too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "producer", "training", "engine_dump", "sglang_patch", "vllm_hook", "bench")


def _package_of(module: str, is_init: bool) -> str:
    return module if is_init else module.rpartition(".")[0]


def _imports(path: Path) -> Iterator[tuple[str, str]]:
    """(module imported from, name) for every ``from X import name`` of the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                yield node.module, a.name


def private_imports() -> list[str]:
    known = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            init = rel.name == "__init__"
            known[".".join(rel.parts[:-1] if init else rel.parts)] = init
    bad = []
    for mod, init in sorted(known.items()):
        path = ROOT / Path(*mod.split("."))
        path = path / "__init__.py" if init else path.with_suffix(".py")
        here = _package_of(mod, init)
        for src, name in _imports(path):
            if src.split(".")[0] not in PACKAGES or not name.startswith("_"):
                continue
            # `from pkg import _module` names a module of pkg
            there = src if f"{src}.{name}" in known else _package_of(src, known.get(src, False))
            if there != here:
                bad.append(f"{mod} imports {src}.{name}")
    return bad


def test_no_module_imports_a_private_name_of_another_package() -> None:
    assert private_imports() == []
