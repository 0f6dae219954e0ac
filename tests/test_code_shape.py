"""The shape of toolkit/'s code that a newcomer relies on (issue 28): no function over MAX_FUNCTION_LINES lines, no
class over MAX_METHODS methods outside toolkit/testing, no `_private` name imported from another toolkit module, and
no toolkit module imported under a one-letter alias (`envvars as E`): a reader sees `protocol.KILL`, not `P.KILL`.
The import graph's layers and cycles are tests/test_import_shape.py's."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

TOOLKIT = Path(__file__).resolve().parent.parent / "toolkit"
MAX_FUNCTION_LINES = 60  # def line to last line, docstring included, decorators not
MAX_METHODS = 20


def _trees() -> list[tuple[Path, ast.Module]]:
    return _parsed(TOOLKIT)


@functools.cache
def _parsed(root: Path) -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(root.rglob("*.py"))]


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(TOOLKIT.parent)}:{getattr(node, 'lineno', 0)}"


def long_functions() -> list[str]:
    return [f"{_where(path, node)} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path, tree in _trees() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def big_classes() -> list[str]:
    out = []
    for path, tree in _trees():
        if "testing" in path.relative_to(TOOLKIT).parts:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_METHODS:
                    out.append(f"{_where(path, node)} {node.name}: {len(methods)} methods")
    return out


def private_imports() -> list[str]:
    """`from toolkit.x import _name` anywhere in toolkit/ (a name private to its module is used from outside)."""
    return [f"{_where(path, node)} from {node.module} import {alias.name}"
            for path, tree in _trees() for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit")
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


def one_letter_aliases() -> list[str]:
    out = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit") or (
                    isinstance(node, ast.Import) and any(a.name.startswith("toolkit") for a in node.names)):
                out += [f"{_where(path, node)} {alias.name} as {alias.asname}" for alias in node.names
                        if alias.asname is not None and len(alias.asname) == 1]
    return out


def test_no_function_is_over_60_lines() -> None:
    assert long_functions() == []


def test_no_class_outside_testing_has_over_20_methods() -> None:
    assert big_classes() == []


def test_no_private_name_is_imported_from_another_module() -> None:
    assert private_imports() == []


def test_no_toolkit_module_is_imported_under_a_one_letter_name() -> None:
    assert one_letter_aliases() == []


def test_the_checks_find_what_they_look_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check on a module made to break its rule (so none of them passes by looking at nothing)."""
    package = tmp_path / "toolkit"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    methods = "\n".join(f"    def m{i}(self):\n        pass" for i in range(MAX_METHODS + 1))
    (package / "bad.py").write_text(f"from toolkit import envvars as E\n"
                                    f"from toolkit.contracts.protocol import _secret\n\n"
                                    f"def long():\n{body}\n\nclass Big:\n{methods}\n")
    monkeypatch.setattr(sys.modules[__name__], "TOOLKIT", package)
    assert [line.split()[-3:] for line in long_functions()] == [["long:", "61", "lines"]]
    assert [line.split()[-3:] for line in big_classes()] == [["Big:", "21", "methods"]]
    assert [line.split(" ", 1)[1] for line in private_imports()] == ["from toolkit.contracts.protocol import _secret"]
    assert [line.split(" ", 1)[1] for line in one_letter_aliases()] == ["envvars as E"]
