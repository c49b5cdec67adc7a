"""The package's shape: imports only point down (no circle), a public module never imports an
underscore name from another public module, no function is longer than 90 lines and no class
longer than 400.

Every module counts, subpackages included (``laplace/_curvature.py`` is the module
``laplace._curvature``, ``laplace/__init__.py`` is ``laplace``); a module is public when no part
of its dotted name starts with an underscore. The imports are read from the source with ``ast``
(module level, inside functions and under ``TYPE_CHECKING`` alike), so a lazy import that closes
a circle fails too. Importing a subpackage's module from outside runs the subpackage's
``__init__`` first, so it counts as an import of the subpackage too.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "multiscale_jac"
MAX_FUNCTION_LINES = 90
MAX_CLASS_LINES = 400
#: classes longer than ``MAX_CLASS_LINES`` when the rule came (issue 26), at most as long as
#: then: none may grow, and one that is split leaves this table
KNOWN_LONG_CLASSES = {
    "jacnorm.py: _Job": 525,
    "subset.py: ParamSubset": 416,
}


def _name(path: Path) -> str:
    """The module's dotted name inside the package (the top ``__init__.py``: ``__init__``)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache
def _files() -> dict[str, Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def _modules() -> dict[str, ast.Module]:
    return {m: ast.parse(p.read_text(), filename=str(p)) for m, p in _files().items()}


def _is_package(module: str) -> bool:
    return _files()[module].name == "__init__.py" and module != "__init__"


def _public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    """The dotted name (inside the package, ``""`` for the package itself) that ``from X
    import ...`` in ``module`` reads from; ``None`` outside the package."""
    if node.level == 0:
        name = node.module or ""
        if name != "multiscale_jac" and not name.startswith("multiscale_jac."):
            return None
        return name.removeprefix("multiscale_jac").lstrip(".")
    here = module.split(".") if _is_package(module) else module.split(".")[:-1]
    if module == "__init__":
        here = []
    base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
    return ".".join([*base, *(node.module.split(".") if node.module else [])])


def _owner(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a module."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in modules:
            return ".".join(parts[:k])
    return None


def _imports(module: str, tree: ast.Module, modules: set[str]) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every import of a package module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            if base is None:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                if sub in modules:  # from . import x, from .laplace import _curvature
                    found.append((sub, "", node.lineno))
                elif base and (target := _owner(base, modules)):
                    found.append((target, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "multiscale_jac" and len(parts) > 1:
                    target = _owner(".".join(parts[1:]), modules)
                    if target:
                        found.append((target, "", node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    graph: dict[str, set[str]] = {}
    for m, tree in modules.items():
        targets = set()
        for t, _, _ in _imports(m, tree, names):
            parts = t.split(".")
            for k in range(1, len(parts) + 1):  # a subpackage's __init__ runs first
                above = ".".join(parts[:k])
                inside = m == above or m.startswith(above + ".")
                if above in names and (k == len(parts) or not inside):
                    targets.add(above)
        graph[m] = targets - {m}
    return graph


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


def test_every_module_is_read() -> None:
    """Subpackages included: every ``.py`` file under the package is one module here."""
    files = list(PACKAGE.rglob("*.py"))
    assert len(_modules()) == len(files)
    assert {"laplace", "laplace._subset_ggn", "enums", "__init__"} <= set(_modules())


def test_no_import_circle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a made-up graph with a circle is caught."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_resolve_in_subpackages() -> None:
    """Relative imports of a subpackage's modules name the right modules."""
    graph = _graph()
    assert "laplace" in graph["testing"]  # from .laplace import SubnetLaplace
    assert {"fisher", "laplace._base"} <= graph["laplace._diag"]  # .., .
    assert "laplace" not in graph["laplace._diag"]  # inside its own package


def test_public_modules_import_no_private_names_of_public_modules() -> None:
    modules = _modules()
    names = set(modules)
    bad = [
        f"{m}:{line} imports {name} from {target}"
        for m, tree in modules.items()
        if _public(m)
        for target, name, line in _imports(m, tree, names)
        if _public(target) and name.startswith("_") and target != m
    ]
    assert not bad, "\n".join(bad)


def _long(tree: ast.Module, kinds: tuple[type, ...], limit: int) -> list[tuple[str, int, int]]:
    """``(name, line, lines)`` of every node of ``kinds`` longer than ``limit`` lines."""
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.end_lineno - node.lineno + 1 > limit
    ]


def _long_nodes(kinds: tuple[type, ...], limit: int) -> dict[str, tuple[int, int]]:
    """``{"file: name": (line, lines)}`` over the package."""
    return {
        f"{_files()[m].relative_to(PACKAGE)}: {name}": (line, lines)
        for m, tree in _modules().items()
        for name, line, lines in _long(tree, kinds, limit)
    }


def _report(found: dict[str, tuple[int, int]]) -> str:
    return "\n".join(f"{k} at line {line} ({lines} lines)" for k, (line, lines) in found.items())


def test_no_function_over_90_lines() -> None:
    long = _long_nodes((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not long, _report(long)


def test_no_class_over_400_lines() -> None:
    long = _long_nodes((ast.ClassDef,), MAX_CLASS_LINES)
    bad = {k: v for k, v in long.items() if v[1] > KNOWN_LONG_CLASSES.get(k, MAX_CLASS_LINES)}
    assert not bad, _report(bad)
    assert set(KNOWN_LONG_CLASSES) <= set(long), "split now: remove it from KNOWN_LONG_CLASSES"


def test_length_checks_can_fail() -> None:
    """A made-up class of 401 lines and a function of 91 are caught, nested ones too."""
    body = "\n".join(f"    x{i} = {i}" for i in range(400))
    tree = ast.parse(f"class Big:\n{body}\n\nclass Small:\n    pass\n")
    assert _long(tree, (ast.ClassDef,), MAX_CLASS_LINES) == [("Big", 1, 401)]
    inner = textwrap.indent("def f():\n" + "\n".join(f"    y{i} = {i}" for i in range(90)), "    ")
    tree = ast.parse(f"class C:\n{inner}\n")
    assert _long(tree, (ast.FunctionDef,), MAX_FUNCTION_LINES) == [("f", 2, 91)]


@pytest.mark.parametrize("layer", ["enums", "packing", "subset"])
def test_bottom_layers_import_nothing_above(layer: str) -> None:
    allowed = {"enums": set(), "packing": {"enums"}, "subset": set()}[layer]
    assert _graph()[layer] <= allowed


def _byte_arithmetic(tree: ast.AST) -> list[tuple[int, str]]:
    """Arithmetic on bytes: a binary operation with an operand named ``activations`` or
    ``itemsize``, or a call of ``element_size()``, outside ``estimate_seconds`` (the cost
    model's seconds)."""
    found = []
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "estimate_seconds":
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp) or id(node) in skip:
            continue
        for side in (node.left, node.right):
            name = getattr(side, "attr", None) or getattr(side, "id", None)
            call = isinstance(side, ast.Call) and getattr(side.func, "attr", "") == "element_size"
            if name in ("activations", "itemsize") or call:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_only_the_memory_model_computes_a_working_set() -> None:
    """One memory model (``_memory``): every working set, chunk from bytes and minimum of a
    ``MemoryBudgetError`` is computed there; other modules pass it what they measured."""
    offenders = {
        module: found
        for module, tree in _modules().items()
        if module != "_memory" and (found := _byte_arithmetic(tree))
    }
    assert offenders == {}


def _budget_errors_and_byte_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """A ``MemoryBudgetError(...)`` raised, and a byte constant: a module-level name ending in
    ``BYTES``, or a KiB/MiB/GiB power of two (``2**20``, ``1 << 30``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "MemoryBudgetError":
            found.append((node.lineno, ast.unparse(node)[:60]))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.LShift)):
            left, right = node.left, node.right
            if isinstance(left, ast.Constant) and isinstance(right, ast.Constant):
                # KiB, MiB, GiB: 2**10k or 1 << 10k (a seed's range, 2**32, is not bytes)
                unit = right.value % 10 == 0 and right.value >= 10
                if unit and (left.value == 2 or isinstance(node.op, ast.LShift)):
                    found.append((node.lineno, ast.unparse(node)))
    for node in getattr(tree, "body", []):
        targets = list(node.targets) if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name) and t.id.endswith("BYTES"):
                found.append((node.lineno, t.id))
    return found


def test_only_the_memory_model_holds_the_budget_rule_and_byte_constants() -> None:
    """``_memory`` owns the budget: it alone raises ``MemoryBudgetError`` (``fit_budget``) and
    holds byte constants; other modules import them. (``enums`` defines the error; its message
    states the minimum in MiB.)"""
    offenders = {
        module: found
        for module, tree in _modules().items()
        if module not in ("_memory", "enums") and (found := _budget_errors_and_byte_constants(tree))
    }
    assert offenders == {}


def test_the_budget_check_can_fail() -> None:
    tree = ast.parse("X_BYTES = 8 * 2**20\ndef f():\n    raise MemoryBudgetError(1, 2, 'x')\n")
    assert sorted(line for line, _ in _budget_errors_and_byte_constants(tree)) == [1, 1, 3]


#: what measures (``tune=True``) and calibrates: whole modules, and the parts of others that
#: hand ``_tuning.tune`` their routes or recall its choice (classes, or methods of a class)
TUNING_CODE = {
    "_tuning": None,
    "_calibration": None,
    "engine": ("_RouteTiming",),
    "fisher": ("_FisherTuning",),
    "jacnorm": ("_Job.tune", "_Job._take", "_Job._try_routes", "_Job._dropped", "_Job._larger"),
    "layerwise": ("LayerwiseRun._kernel", "LayerwiseRun._trial"),
}


def _span(tree: ast.Module, dotted: str) -> int:
    """Lines of the class or ``Class.method`` named ``dotted`` in ``tree``."""
    nodes: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        (node,) = [n for n in nodes if getattr(n, "name", None) == part]
        nodes = getattr(node, "body", [])
    return node.end_lineno - node.lineno + 1  # type: ignore[operator]


def test_tuning_and_calibration_stay_small() -> None:
    """Measuring and calibrating take at most 600 lines of the package (they took about
    1,530 when every default call could time routes)."""
    lines = 0
    for module, parts in TUNING_CODE.items():
        if parts is None:
            lines += len(_files()[module].read_text().splitlines())
        else:
            lines += sum(_span(_modules()[module], p) for p in parts)
    assert 100 < lines <= 600, lines
