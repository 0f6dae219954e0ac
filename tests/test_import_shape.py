"""The import graph of toolkit/ keeps its layers: the commands (toolkit/tasks) import the shared layer below them
(toolkit/jobhosts, toolkit/check, ...), never one another, and no module imports itself back through others. Every
import counts: those inside functions and under TYPE_CHECKING too."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parent.parent / "toolkit"


def _modules() -> dict[str, Path]:
    """Every module of toolkit/ by dotted name (a package by its own name, for its __init__.py)."""
    out = {}
    for path in TOOLKIT.rglob("*.py"):
        parts = path.relative_to(TOOLKIT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the toolkit modules it imports. `from pkg import name` is an edge to the submodule pkg.name when that
    is a module, else to pkg (its __init__)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# Cycles left to their owners, one line each; the list only shrinks (a cycle gone must be deleted here).
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycle_in_toolkit() -> None:
    cycles = _cycles(_graph())
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "modules that import each other (through the others listed):\n" + "\n".join(
        ", ".join(c) for c in new)
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a cycle, delete it from KNOWN_CYCLES: {gone}"


def test_the_cycle_finder_finds_one() -> None:
    """The check above can fail: a circle of three, and one module importing itself through a package."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_commands_import_no_other_command() -> None:
    """A command module of toolkit/tasks imports only the layers below (toolkit.jobhosts and the rest), never
    another module of toolkit/tasks; and nothing below imports a command."""
    graph = _graph()
    commands = {name for name in graph if name.startswith("toolkit.tasks.")}
    assert {"toolkit.tasks.start", "toolkit.tasks.status", "toolkit.tasks.run"} <= commands
    crossing = {name: sorted(graph[name] & commands) for name in sorted(commands) if graph[name] & commands}
    assert not crossing, f"commands importing commands: {crossing}"
    above = {name: sorted(graph[name] & (commands | {"toolkit.tasks"})) for name in graph
             if not name.startswith("toolkit.tasks") and name != "toolkit.cli"
             and graph[name] & (commands | {"toolkit.tasks"})}
    assert not above, f"modules below the commands importing them: {above}"
