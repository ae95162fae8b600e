"""The layers import one way: runtime <- calibration <- builders <- server <- cli <- benchmarks, and inside
runtime its rooms in their order, with no circles.

Walks the import statements of every module (AST, nothing is imported) and fails on an import of a
higher layer or room, on a cycle between modules, on a function-level import of a project package, and on
an import of a bare top-level name of ours (``runtime``, ``builders``, ...) instead of ``cabinllm.*``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "calibration", "builders", "server", "cli", "benchmarks")  # each may import only those before it
# Inside runtime, each room may import only itself and those before it; the package's face (its __init__) sits above.
RUNTIME_ROOMS = ("errors", "kernels", "formats", "speech", "kv", "model", "generation", "sources", "engine", "dialogue",
                 "backends")
NAMESPACE = "cabinllm"


def project_modules() -> dict[str, Path]:
    """Every module of the layered packages, by dotted name."""
    modules = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join((NAMESPACE,) + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
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
        found += [(name, id(node) in top) for name in names
                  if name.split(".")[0] in (NAMESPACE, *LAYERS)]
    return found


def layer(module: str) -> str:
    """The layer of a dotted module name (``cabinllm.runtime.kv.cache`` -> ``runtime``)."""
    return module.split(".")[1]


def runtime_rank(module: str) -> int:
    """The room of a runtime module by its place in RUNTIME_ROOMS; the package's face ranks above every room."""
    parts = module.split(".")
    return len(RUNTIME_ROOMS) if len(parts) == 2 else RUNTIME_ROOMS.index(parts[2])


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
        rank = LAYERS.index(layer(name))
        upward += [f"{name} -> {t}" for t in targets if LAYERS.index(layer(t)) > rank]
    assert not upward, f"upward imports: {upward}"


def test_runtime_rooms_import_in_their_order():
    runtime = {name: targets for name, targets in graph().items() if layer(name) == "runtime"}
    upward = [f"{name} -> {t}" for name, targets in runtime.items() for t in targets
              if layer(t) == "runtime" and runtime_rank(t) > runtime_rank(name)]
    assert not upward, f"imports against the order of runtime's rooms {RUNTIME_ROOMS}: {upward}"


def test_every_import_of_ours_goes_through_the_namespace():
    bare = [f"{name}: {target}" for name, path in project_modules().items()
            for target, _ in imports_of(path) if target.split(".")[0] != NAMESPACE]
    assert not bare, f"imports of bare top-level names (use cabinllm.*): {bare}"


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
