"""The tree is the architecture: lower layers import nothing from the layers above them, and no module keeps
mutable state at module level (everything an engine holds is owned by that engine)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the folders of the package it must not import (at any depth, but under `if TYPE_CHECKING:`)
ABOVE = {
    "kernels": ("stages", "pipeline", "api", "benchmarks", "cli"),
    "storage": ("stages", "pipeline", "api", "benchmarks", "cli"),
    "models": ("stages", "pipeline", "api", "benchmarks", "cli"),
    "stages": ("pipeline", "api", "benchmarks", "cli"),
    "pipeline": ("api", "benchmarks", "cli"),
    "api": ("benchmarks", "cli"),
    "benchmarks": ("cli",),  # the CLI includes `sluice bench`: the options both use live in options.py
}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import outside `if TYPE_CHECKING:` blocks."""
    found = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.ImportFrom) and child.module:
                found.append((child.lineno, child.module))
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            walk(child)

    walk(tree)
    return found


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def upward(folder: str) -> list[str]:
    bad = []
    for path in _files(folder):
        for line, module in _imports(ast.parse(path.read_text())):
            parts = module.split(".")
            if parts[0] == "sluice" and len(parts) > 1 and parts[1] in ABOVE[folder]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", list(ABOVE))
def test_no_upward_imports(folder):
    assert upward(folder) == []


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    """The check must fail where it should: a kernels file importing the pipeline."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "bad.py").write_text("def f():\n    from sluice.pipeline.engine import Engine\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert upward("kernels") == ["kernels/bad.py:2 imports sluice.pipeline.engine"]


MUTABLE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def module_state(path: Path) -> list[str]:
    """Module-level names bound to a mutable container or a `global` statement (constants in CAPS that are tuples,
    frozensets or mappings read only are fine: the check flags dict/list/set literals bound to lower-case names and
    every `global`)."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, MUTABLE):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bad += [f"{path.name}:{node.lineno} {t.id}" for t in targets
                    if isinstance(t, ast.Name) and not t.id.isupper() and not t.id.startswith("__")]
    bad += [f"{path.name}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return bad


# the one exception: Python's GIL switch interval is the process's, so the count of CPU workers shortening it is too
PROCESS_WIDE = {"compute.py _gil"}


def test_no_module_global_mutable_state():
    found = [s for folder in ABOVE for p in _files(folder) for s in module_state(p)]
    found += [s for p in (ROOT / "cli.py", ROOT / "options.py", ROOT / "errors.py", ROOT / "log.py") for s in module_state(p)]
    assert {re.sub(r":\d+", "", f) for f in found} == PROCESS_WIDE, found


def test_module_state_is_caught(tmp_path):
    (tmp_path / "bad.py").write_text("CACHE = {}\n_seen = []\ndef f():\n    global _seen\n")
    assert module_state(tmp_path / "bad.py") == ["bad.py:2 _seen", "bad.py:4 global _seen"]
