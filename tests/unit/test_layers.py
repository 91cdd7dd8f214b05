"""The farm's layers, read from every import in the source (ast), those inside functions too.

worker: ``core`` ← ``state`` ← ``server`` ← ``steps`` ← the app's modules; each imports only
the layers to its left. ``training`` imports ``worker.core`` only; ``engine_dump`` (the dump
both engine hooks write) imports nothing of the farm, of either hook or of an engine; each hook
(``sglang_patch``, ``vllm_hook``) imports ``engine_dump`` and nothing of the farm or the other
hook; no module is part of an import circle. ``if TYPE_CHECKING:`` imports count for the
layers, not for circles (they never run)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "producer", "training", "engine_dump", "sglang_patch", "vllm_hook")
FARM = PACKAGES[:3]
HOOKS = ("sglang_patch", "vllm_hook")
LAYERS = ("worker.core", "worker.state", "worker.server", "worker.steps")
# Libraries a layer may not import at all (the rest of its rule is the layer order).
FORBIDDEN = {
    "worker.core": ("celery", "kombu", "redis", "aiohttp", "transformers", "torch"),
    "worker.state": ("celery", "aiohttp", "transformers", "torch"),
    "worker.server": ("celery", "torch"),
    "worker.steps": ("aiohttp", "transformers", "torch"),
    "training": ("celery", "kombu", "redis", "aiohttp"),
    "engine_dump": ("sglang", "vllm", "sgl_kernel", *FARM, *HOOKS),
    "sglang_patch": ("vllm_hook",),
    "vllm_hook": ("sglang_patch",),
}
# Flat modules per package, at most (subpackages hold families and layers).
MAX_FLAT = 25


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = p
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path, known: dict[str, Path]) -> Iterator[tuple[str, bool]]:
    """(module imported, only for type checking), resolved to a module of ``known`` or a
    library's top-level name."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            for sub in node.body:
                typing_only.update(id(n) for n in ast.walk(sub))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` names a module; `from mod import name` names mod
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        for name in names:
            top = name.split(".")[0]
            yield (name if top in PACKAGES else top), id(node) in typing_only


def layer_of(mod: str) -> str | None:
    for layer in LAYERS:
        if mod == layer or mod.startswith(layer + "."):
            return layer
    return None


def test_each_layer_imports_only_the_layers_below_it_and_its_libraries() -> None:
    known = modules()
    bad = []
    for mod, path in sorted(known.items()):
        for imp, _ in imports(path, known):
            here = layer_of(mod)
            rule = FORBIDDEN.get(here or mod.split(".")[0], ())
            if imp.split(".")[0] in rule:
                bad.append(f"{mod} imports {imp}")
            if mod.startswith("training") and imp.startswith(("worker", "producer")) and \
                    layer_of(imp) != "worker.core":
                bad.append(f"{mod} imports {imp} (training imports worker.core only)")
            if mod.split(".")[0] in HOOKS and imp.split(".")[0] in FARM:
                bad.append(f"{mod} imports {imp} (a hook imports nothing of the farm)")
            if here is None or not imp.startswith("worker"):
                continue
            there = layer_of(imp)
            if there is None and imp != "worker":  # the app's modules, above every layer
                bad.append(f"{mod} imports {imp} (a layer never imports the app's modules)")
            elif there is not None and LAYERS.index(there) > LAYERS.index(here):
                bad.append(f"{mod} imports {imp} (a layer above it)")
    assert bad == []


def test_no_module_is_part_of_an_import_circle() -> None:
    known = modules()
    graph = {m: {i for i, typing in imports(p, known) if i in known and i != m and not typing}
             for m, p in known.items()}
    circles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert circles == []


def test_no_package_keeps_more_than_25_flat_modules() -> None:
    subpackages = [p for p in ROOT.glob("*/*/") if p.is_dir() and p.parent.name != "tests"]
    for pkg in [ROOT / p for p in PACKAGES] + subpackages:  # tests/<tier>/: test files
        flat = [p for p in pkg.glob("*.py") if p.name != "__init__.py"]
        assert len(flat) <= MAX_FLAT, f"{pkg.relative_to(ROOT)}: {len(flat)} flat modules"


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    comp.add(n)
                    if n == node:
                        break
                out.append(comp)
    return out


def test_docs_architecture_lists_every_module_under_its_package() -> None:
    # Given docs/architecture.md's sections: a "**`pkg/`**" heading, then "- `mod.py` ..." lines
    listed: dict[str, set[str]] = {}
    section = None
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("**`") and line.split("`")[1].endswith("/"):
            section = listed.setdefault(line.split("`")[1].rstrip("/"), set())
        elif section is not None and line.startswith("- `"):
            section.add(line.split("`")[1])
    # Then each module of the packages is listed under its own package, and nothing else is
    want: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            if p.name not in ("__init__.py", "__main__.py"):
                want.setdefault(str(p.parent.relative_to(ROOT)), set()).add(p.name)
    assert listed == want
