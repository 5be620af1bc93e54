"""No import cycle among the project's modules, and the loader never imports the trainer adapters."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "shard_tools")


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (a deferred import is a cycle too)."""
    modules = {_module(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_module_imports_itself_through_others():
    graph = _graph()
    assert [m for m in graph if m in _reach(graph, m)] == []
    assert "pipeline.loader" in _reach(graph, "pipeline") and "pipeline.kinds.sa1b" in _reach(graph, "pipeline.loader")


def test_the_loader_side_never_imports_the_trainers():
    graph = _graph()
    for module in ("pipeline.loader", "pipeline.stream", "pipeline.read", "pipeline.kinds"):
        assert not _reach(graph, module) & {"pipeline.trainers", "pipeline.hf_datasets"}, module
