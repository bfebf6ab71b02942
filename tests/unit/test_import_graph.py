"""The package's import graph: no cycles, counting every import a module makes (at the top, in a
function, or under ``TYPE_CHECKING``: a lazy import does not hide a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import replicheck

ROOT = Path(replicheck.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package that ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:
                    found.add(sub)  # a submodule imported by name
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scanner_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """A cycle closed only by a function-level import, or only under TYPE_CHECKING, is found."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from pkg import b\n")
    b = tmp_path / "b.py"
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    known = {"pkg", "pkg.a", "pkg.b"}
    graph = {"pkg.a": _imports("pkg.a", a, known), "pkg.b": _imports("pkg.b", b, known), "pkg": set()}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_cycle_in_the_package() -> None:
    """No module of replicheck reaches itself through the modules it imports."""
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    assert len(graph) > 100, "the scan must see the whole package"
    assert _cycles(graph) == []


SPECIFIC = {
    "DistributedDataParallel",
    "FSDPModule",
    "DTensor",
    "GradTap",
    "GradHealth",
    "ShardLayout",
    "LockstepReplays",
    "AloneReplays",
    "DataParallel",
    "Sharded",
    "SingleProcess",
    "no_sync",
    "set_requires_gradient_sync",
    "register_comm_hook",
}


def test_the_step_core_names_no_specific_parallelism() -> None:
    """No code of ``guard/step`` (comments and docstrings aside) names a parallelism, its wrapper
    types or their hooks: the step asks the seam (``guard.parallel.base.Parallelism``)."""
    found = []
    for path in sorted((ROOT / "guard" / "step").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if name in SPECIFIC:
                found.append(f"{path.name}:{node.lineno} {name}")
            if isinstance(node, ast.alias) and node.name.split(".")[-1] in SPECIFIC:
                found.append(f"{path.name}:{node.lineno} import {node.name}")
    assert found == []
