"""The layers import one way: runtime <- calibration <- builders <- server <- benchmarks, with no circles.

Walks the import statements of every module (AST, nothing is imported) and fails on an import of a
higher layer, on a cycle between modules, and on a function-level import of a project package.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "calibration", "builders", "server", "benchmarks")  # each may import only those before it


def project_modules() -> dict[str, Path]:
    """Every module of the layered packages, by dotted name."""
    modules = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import of a project package in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [(name, id(node) in top) for name in names if name.split(".")[0] in LAYERS]
    return found


def graph() -> dict[str, set[str]]:
    """module -> project modules it imports (a package import counts as its __init__)."""
    modules = project_modules()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges[name] = set()
        for target, _ in imports_of(path):
            while target not in modules and "." in target:  # ``from pkg.mod import name`` of a non-module
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                edges[name].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_package_imports_a_higher_layer():
    upward = []
    for name, targets in graph().items():
        rank = LAYERS.index(name.split(".")[0])
        upward += [f"{name} -> {t}" for t in targets if LAYERS.index(t.split(".")[0]) > rank]
    assert not upward, f"upward imports: {upward}"


def test_no_import_cycles():
    assert find_cycle(graph()) is None, f"import cycle: {' -> '.join(find_cycle(graph()))}"


def test_no_function_level_imports_of_project_packages():
    hidden = [f"{name}: {target}" for name, path in project_modules().items()
              for target, at_top in imports_of(path) if not at_top]
    assert not hidden, f"function-level imports: {hidden}"


@pytest.mark.parametrize("edges, cycle", [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
                                          ({"a": {"b"}, "b": {"c"}, "c": set()}, False)])
def test_the_cycle_finder_finds_cycles(edges, cycle):
    assert (find_cycle(edges) is not None) == cycle
