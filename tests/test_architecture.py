"""The package's shape: imports only point down (no circle), a public module never imports an
underscore name from another public module, and no function is longer than 90 lines.

The imports are read from the source with ``ast`` (module level, inside functions and under
``TYPE_CHECKING`` alike), so a lazy import that closes a circle fails too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "multiscale_jac"
MAX_FUNCTION_LINES = 90


@functools.cache
def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in PACKAGE.glob("*.py")}


def _imports(tree: ast.Module, modules: set[str]) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every import of a package module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import x
                found += [(a.name, "", node.lineno) for a in node.names if a.name in modules]
                continue
            name = node.module or ""
            if node.level == 0 and not name.startswith("multiscale_jac"):
                continue
            target = name.removeprefix("multiscale_jac").lstrip(".").split(".")[0]
            if target in modules:
                found += [(target, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "multiscale_jac" and len(parts) > 1 and parts[1] in modules:
                    found.append((parts[1], "", node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    return {m: {t for t, _, _ in _imports(tree, names) if t != m} for m, tree in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return [*stack[stack.index(t) :], t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a made-up graph with a circle is caught."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_public_modules_import_no_private_names_of_public_modules() -> None:
    modules = _modules()
    names = set(modules)
    bad = [
        f"{m}.py:{line} imports {name} from {target}"
        for m, tree in modules.items()
        if not m.startswith("_")
        for target, name, line in _imports(tree, names)
        if not target.startswith("_") and name.startswith("_") and target != m
    ]
    assert not bad, "\n".join(bad)


def _long_functions() -> list[str]:
    out = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_over_90_lines() -> None:
    long = _long_functions()
    assert not long, "\n".join(long)


@pytest.mark.parametrize("layer", ["enums", "packing", "subset"])
def test_bottom_layers_import_nothing_above(layer: str) -> None:
    allowed = {"enums": set(), "packing": {"enums"}, "subset": set()}[layer]
    assert _graph()[layer] <= allowed
