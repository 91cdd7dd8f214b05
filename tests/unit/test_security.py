"""No code loads pickles: every module of the packages is scanned for unpickling calls, and the
scan finds what it looks for.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

from tests.conftest import ROOT


def _unpickling_calls(path: Path, root: Path = ROOT) -> list[str]:
    """Calls in ``path`` that unpickle: pickle/dill ``load(s)``, cloudpickle, and
    ``torch.load`` unless it passes ``weights_only=True`` (torch's restricted unpickler,
    which builds tensors and plain containers only and runs no code)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)):
            continue
        name = f"{node.func.value.id}.{node.func.attr}"
        safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                   and k.value.value is True for k in node.keywords)
        if (name in ("pickle.load", "pickle.loads", "dill.load", "dill.loads")
                or node.func.value.id == "cloudpickle" or (name == "torch.load" and not safe)):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_code_loads_pickles() -> None:
    # the farm reads safetensors; the one torch.load (adopt's reader of other tools' files)
    # must go through torch's restricted unpickler
    hits = [hit for d in ("worker", "producer", "engine_dump", "sglang_patch", "vllm_hook",
                          "bench", "ops", "training")
            for p in (ROOT / d).rglob("*.py") for hit in _unpickling_calls(p)]
    assert hits == []
    assert pickle  # the test itself uses pickle only to build the hostile message


def test_the_pickle_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("import pickle, torch\npickle.loads(b'')\ntorch.load('x')\n"
                   "torch.load('x', weights_only=False)\ntorch.load('x', weights_only=True)\n")
    assert _unpickling_calls(bad, tmp_path) == [f"probe.py:{n}" for n in (2, 3, 4)]
