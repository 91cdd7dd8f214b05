"""The farm's import rules: import-linter's contracts (pyproject.toml, ``[tool.importlinter]``:
the packages' layers, worker's layers, each layer's forbidden libraries, the hooks' independence),
proven here on a copy of the tree to fail for each kind of violation; what a static import graph
cannot see (``__import__``, ``importlib.import_module`` of our own modules) and import circles
are read from every import in the source (ast), those inside functions too."""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "producer", "training", "engine_dump", "sglang_patch", "vllm_hook")
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


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter's verdict on the tree at ``root`` (its pyproject.toml's contracts)."""
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})


# A package may not run these as a process (``[..., "-m", "producer", ...]``) any more than
# import them: the layers above it
ABOVE = {"worker": {"producer", "training"}, "training": {"producer"},
         "engine_dump": {"worker", "producer", "training"}}


def _runs_above(node: ast.AST, pkg: str) -> str | None:
    """``"-m" <module>`` in a list or tuple literal, the module of a layer above ``pkg``."""
    if not isinstance(node, ast.List | ast.Tuple):
        return None
    items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    for flag, target in itertools.pairwise(items):
        if flag == "-m" and isinstance(target, str) and \
                target.split(".")[0] in ABOVE.get(pkg, set()):
            return target
    return None


def dynamic_imports(root: Path) -> list[str]:
    """Imports by name at run time that the contracts cannot see: any ``__import__``,
    ``importlib.import_module`` of a module of ours, and ``-m`` of a layer above."""
    bad = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                above = _runs_above(node, pkg)
                if above and isinstance(node, ast.List | ast.Tuple):
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: runs -m {above}")
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                    f, ast.Attribute) else ""
                arg = node.args[0] if node.args else None
                target = arg.value if isinstance(arg, ast.Constant) else None
                ours = isinstance(target, str) and target.split(".")[0] in PACKAGES
                if name == "__import__" or (name == "import_module" and ours):
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {name}({target!r})")
    return bad


def test_the_import_contracts_hold() -> None:
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_no_module_imports_one_of_ours_by_name_at_run_time() -> None:
    assert dynamic_imports(ROOT) == []


# Each kind of violation the rules exist for: (file, line added, what must say so)
VIOLATIONS = {
    "core imports state, relatively": (
        "worker/core/units.py", "from ..state import index", "worker: the app's modules"),
    "state imports training": (
        "worker/state/keys.py", "from training import index", "producer over training"),
    "the task imports the producer": (
        "worker/tasks.py", "import producer.status", "producer over training"),
    "server imports a hook": (
        "worker/server/limits.py", "import sglang_patch.plugin",
        "the worker imports neither hook"),
    "core reaches torch through engine_dump": (
        "worker/core/units.py", "from engine_dump import cuda_stager",
        "worker.core needs no Celery"),
    "a module imports by name": (
        "worker/core/units.py", "_m = __import__('producer.status')", "__import__"),
    "a step issues Redis commands itself": (
        "worker/steps/janitor.py", "import redis", "reach Redis only through worker.state"),
    "the producer issues Redis commands itself": (
        "producer/status.py", "from redis import Redis", "reach Redis only through worker.state"),
    "the worker runs the producer as a process": (
        "worker/steps/reconciler.py", "_cmd = [sys.executable, '-m', 'producer', 'enqueue']",
        "runs -m producer"),
}


@pytest.mark.parametrize("kind", list(VIOLATIONS))
def test_each_kind_of_violation_fails_the_check(tmp_path: Path, kind: str) -> None:
    # Given a copy of the tree with one violation added
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    rel, line, said = VIOLATIONS[kind]
    with open(tmp_path / rel, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    # When the import rules are checked, Then they fail and name the rule broken
    res = lint_imports(tmp_path)
    found = res.stdout + "\n".join(dynamic_imports(tmp_path))
    assert said in found, found
    assert res.returncode != 0 or dynamic_imports(tmp_path)


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


def _index_internals(tree: ast.AST) -> list[int]:
    """Lines that reach a run index's Redis client or key builder (``index.r``,
    ``rt.index.k(...)``): what only worker/state may touch."""
    return sorted(n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr in ("r", "k")
                  and ((isinstance(n.value, ast.Name) and n.value.id == "index")
                       or (isinstance(n.value, ast.Attribute) and n.value.attr == "index")))


def test_only_the_state_layer_reaches_the_run_indexs_redis() -> None:
    # Given every module outside worker/state (the self-test: a synthetic use is found)
    assert _index_internals(ast.parse("rt.index.r.get(x)\nindex.k('done')")) == [1, 2]
    found = [f"{name}:{line}" for name, path in modules().items()
             if not name.startswith("worker.state")
             for line in _index_internals(ast.parse(path.read_text()))]
    # Then none reaches the index's client or keys: it asks the index (or a state module)
    assert not found, found


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
