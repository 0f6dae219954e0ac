"""The import graph of toolkit/ keeps its layers: the commands (toolkit/launcher/tasks) import the shared layer below
them (toolkit/launcher/jobhosts, toolkit/launcher/check, ...), never one another, and no module imports itself back
through others. Every import counts: those inside functions and under TYPE_CHECKING too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

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
    """A command module of toolkit/launcher/tasks imports only the layers below (toolkit.launcher.jobhosts and the
    rest), never another module of toolkit/launcher/tasks; and nothing below imports a command."""
    graph = _graph()
    commands = {name for name in graph if name.startswith("toolkit.launcher.tasks.")}
    assert {"toolkit.launcher.tasks.start", "toolkit.launcher.tasks.status", "toolkit.launcher.tasks.run"} <= commands
    crossing = {name: sorted(graph[name] & commands) for name in sorted(commands) if graph[name] & commands}
    assert not crossing, f"commands importing commands: {crossing}"
    above = {name: sorted(graph[name] & (commands | {"toolkit.launcher.tasks"})) for name in graph
             if not name.startswith("toolkit.launcher.tasks") and name != "toolkit.launcher.cli"
             and graph[name] & (commands | {"toolkit.launcher.tasks"})}
    assert not above, f"modules below the commands importing them: {above}"


# The house, bottom up: a module may import its own folder and the floors below it, never a floor above.
# toolkit/testing is the tests' scaffolding and stands above everything; toolkit/__init__.py holds nothing.
ROOT_HELPERS = {"toolkit.atomicfile", "toolkit.errors", "toolkit.freeports", "toolkit.memcgroup", "toolkit.netif",
                "toolkit.printable", "toolkit.privatedir",
                "toolkit.procs", "toolkit.standby"}
FLOORS = [("root helpers", ROOT_HELPERS), ("contracts", "toolkit.contracts"),
          ("processes", ("toolkit.agent", "toolkit.scheduler", "toolkit.train")), ("launcher", "toolkit.launcher"),
          ("testing", "toolkit.testing")]


def _floor(module: str) -> int:
    for level, (_, members) in enumerate(FLOORS):
        if isinstance(members, set):
            if module in members:
                return level
        elif any(module == m or module.startswith(m + ".") for m in ([members] if isinstance(members, str)
                                                                      else members)):
            return level
    raise AssertionError(f"{module} stands on no floor: add it to FLOORS in {__file__}")


def _process(module: str) -> str | None:
    return next((p for p in ("toolkit.agent", "toolkit.scheduler", "toolkit.train")
                 if module == p or module.startswith(p + ".")), None)


def test_the_walls_hold() -> None:
    """agent, scheduler and train import only contracts and the root helpers (and themselves), never each other nor
    the launcher; contracts import only root helpers; nothing imports a floor above its own."""
    graph = _graph()
    wrong = []
    for module, targets in sorted(graph.items()):
        if module == "toolkit":
            continue
        for target in sorted(targets - {"toolkit"}):
            upward = _floor(target) > _floor(module)
            sideways = _process(module) and _process(target) and _process(module) != _process(target)
            if upward or sideways:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports through a wall:\n" + "\n".join(wrong)


def test_the_walls_test_can_fail(monkeypatch) -> None:
    """A train module importing the launcher, and one importing the agent, are both found."""
    fake = {"toolkit.train.x": {"toolkit.launcher.plan", "toolkit.agent.slots", "toolkit.contracts.protocol"},
            "toolkit.launcher.plan": set(), "toolkit.agent.slots": set(), "toolkit.contracts.protocol": set()}
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: fake)
    with pytest.raises(AssertionError, match="train.x -> toolkit.agent.slots") as caught:
        test_the_walls_hold()
    assert "toolkit.train.x -> toolkit.launcher.plan" in str(caught.value)
    assert "protocol" not in str(caught.value)
