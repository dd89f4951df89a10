"""Import arrows point one way: resources <- worker-side pipeline (roles, engines) <- driver.

resources/ knows nothing of the training pipeline, so it can plan and start workers for any
role; the code that runs on workers never imports the driver, so a worker process does not
load the trainer, and a driver change cannot break what runs on the workers. Every import
counts, including those inside functions, which would otherwise hide a circle until run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ("pipeline.cli", "pipeline.trainer", "pipeline.inflight", "pipeline.recipes", "pipeline.fleet",
          "pipeline.outputs", "pipeline.update")
# Pure modules the worker side builds on: they import neither the roles nor the driver.
PURE = ("pipeline/algorithms.py", "pipeline/advantages.py", "pipeline/schedules.py", "pipeline/policy_losses.py",
        "pipeline/records.py", "pipeline/models.py", "pipeline/experience.py",
        "pipeline/metrics.py", "pipeline/screening.py", "pipeline/checkpoint.py", "pipeline/events.py",
        "pipeline/monitor.py", "pipeline/dashboard.py", "pipeline/rewards.py")


def imported_modules(path: Path, root: Path = ROOT, runtime_only: bool = False) -> set[str]:
    """Every module `path` imports, at any depth; `from a import b` yields a and a.b, and a
    relative import is resolved against the file's package. With `runtime_only`, imports
    under `if TYPE_CHECKING:` (never executed) are left out."""
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in _nodes(ast.parse(path.read_text(), filename=str(path)), runtime_only):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _nodes(tree: ast.AST, runtime_only: bool):
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def violations(path: Path, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    return sorted(name for name in imported_modules(path, root)
                  if any(name == f or name.startswith(f + ".") for f in forbidden))


def test_imported_modules_sees_nested_relative_and_from_imports(tmp_path):
    source = tmp_path / "pipeline" / "roles" / "m.py"
    source.parent.mkdir(parents=True)
    source.write_text("import os\n\ndef f():\n    from pipeline import trainer\n    import pipeline.fleet.tasks as t\n"
                      "    from ..fleet import groups\n    from . import actor\n")
    assert imported_modules(source, tmp_path) == {
        "os", "pipeline", "pipeline.trainer", "pipeline.fleet.tasks", "pipeline.fleet", "pipeline.fleet.groups",
        "pipeline.roles", "pipeline.roles.actor"}
    assert violations(source, DRIVER, tmp_path) == ["pipeline.fleet", "pipeline.fleet.groups", "pipeline.fleet.tasks",
                                          "pipeline.trainer"]


@pytest.mark.parametrize("path", sorted((ROOT / "resources").rglob("*.py")), ids=lambda p: p.name)
def test_resources_never_import_pipeline(path):
    assert violations(path, ("pipeline",)) == []


WORKER_SIDE = sorted([*(ROOT / "pipeline" / "roles").rglob("*.py"), *(ROOT / "pipeline" / "engines").rglob("*.py")])


@pytest.mark.parametrize("path", WORKER_SIDE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_worker_side_never_imports_the_driver(path):
    assert violations(path, DRIVER) == []


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_import_neither_roles_nor_driver(name):
    assert violations(ROOT / name, ("pipeline.roles", "pipeline.engines", *DRIVER)) == []


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports when it runs (packages' __init__ left out)."""
    paths = {".".join(p.relative_to(root).with_suffix("").parts): p
             for tree in ("pipeline", "resources") for p in (root / tree).rglob("*.py") if p.name != "__init__.py"}
    return {name: (imported_modules(path, root, runtime_only=True) & set(paths)) - {name}
            for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Pairs of modules that reach each other through imports."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {name: reach(name) for name in graph}
    return {frozenset((a, b)) for a in graph for b in reached[a] if a != b and a in reached[b]}




def test_circles_finds_an_indirect_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == {frozenset(p) for p in (("a", "b"), ("b", "c"), ("a", "c"))}


def test_no_import_circles():
    assert circles(module_graph()) == set()


def test_the_checked_trees_are_not_empty():
    # A moved directory would otherwise turn the parametrised checks into zero tests.
    assert len(list((ROOT / "resources").rglob("*.py"))) >= 5
    assert len(WORKER_SIDE) >= 5
