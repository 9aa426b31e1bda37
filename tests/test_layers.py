"""The layering of ropekit, read from the code's imports (top-level and inside functions).

Every room (a subpackage, or a top-level module) sits on a floor and imports only rooms on
lower floors: no import runs up or sideways, so there is no import cycle between rooms either,
and none inside one (checked module by module). `encodings` imports nothing else of ropekit.
The floors are drawn in docs/architecture.md; change both together.

Also read from the code's syntax tree: no function in src/ over 80 lines (issue 17), no class in
compare/ over 250 (issue 55).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "ropekit"

# Bottom to top. A room may import the rooms of any floor below its own.
FLOORS: list[set[str]] = [
    {"ropekit", "outdir", "distributed", "allocator"},  # version; processes; output folders; malloc
    {"utils"},  # atomic writes (through outdir's checks)
    {"encodings", "data", "results", "figures", "options"},  # the math; text; files; figures
    {"model", "hf"},  # the two kinds of model
    {"backbone"},  # the seam: everything above talks to models through it
    {"train", "evals", "analysis", "serve"},  # what ropekit does to a model (never to each other)
    {"report"},  # assembles the results of the floor below
    {"compare", "demo"},  # pipelines over everything below
    {"cli", "cli_reference"},  # the command line
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
# Rooms on one floor that may import each other (the CLI reference documents the CLI).
BESIDE = {("cli_reference", "cli")}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ropekit module ``path`` imports, anywhere in it (lazy imports included)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target]
            # `from . import x` / `from ropekit import x`: x may itself be a module.
            targets += [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t == "ropekit" or t.startswith("ropekit.")}
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ropekit"


FILES = sorted(SRC.rglob("*.py"))


def test_every_room_has_a_floor():
    rooms = {_room(_module(p)) for p in FILES}
    assert rooms <= set(FLOOR), f"rooms without a floor: {sorted(rooms - set(FLOOR))}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_only_point_down(path):
    here = _room(_module(path))
    known = {_module(p) for p in FILES}
    for target in _imports(path):
        if target not in known:
            continue  # a name imported from a module, not a module
        there = _room(target)
        if there == here or (here, there) in BESIDE:
            continue
        assert FLOOR[there] < FLOOR[here], f"{_module(path)} imports {target}: {here} -> {there}"


def test_no_module_names_a_module_above_it():
    """A module named as a string (``importlib.import_module(table[kind])``) is an edge the
    import test cannot read: no file holds the name of a module of a room above its own or beside
    it. results.py once held the owners of its record kinds so, two floors down (issue 55)."""
    known = {_module(p) for p in FILES}
    for path in FILES:
        here = _room(_module(path))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in known:
                there = _room(node.value)
                assert there == here or FLOOR[there] < FLOOR[here], (
                    f"{_module(path)}:{node.lineno} names {node.value!r}: {here} -> {there}"
                )


def test_encodings_import_nothing_else_of_ropekit():
    for path in (SRC / "encodings").rglob("*.py"):
        outside = {t for t in _imports(path) if _room(t) != "encodings"}
        assert outside == set(), f"{path.name} imports {sorted(outside)}"


def test_no_import_cycle_between_modules():
    known = {_module(p) for p in FILES}
    graph = {_module(p): {t for t in _imports(p) if t in known} for p in FILES}
    # A package's __init__ re-exports its modules: an edge into a package is not a cycle
    # through its modules, so only module -> module edges inside one room are followed.
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt == node or nxt in (node.rsplit(".", 1)[0],) or _is_package(nxt):
                continue
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _is_package(module: str) -> bool:
    return (SRC.parent / module.replace(".", "/") / "__init__.py").is_file()


def test_train_evals_analysis_never_ask_which_kind_a_model_is():
    """They talk to models through the Backbone: no import of the Hugging Face integration or
    of transformers, no isinstance on Decoder or on transformers' classes."""
    for room in ("train", "evals", "analysis"):
        for path in (SRC / room).rglob("*.py"):
            where = path.relative_to(SRC)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for target in _imports(path):
                assert not target.startswith("ropekit.hf"), f"{where} imports {target}"
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom | ast.Import):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                    names += [a.name for a in getattr(node, "names", [])]
                    assert not any(n.startswith("transformers") for n in names), where
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                    kinds = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
                    assert "Decoder" not in kinds and "PreTrainedModel" not in kinds, (
                        f"{where}:{node.lineno} isinstance(..., {kinds})"
                    )


# Issue 17: no function in src/ is longer than this, counted from its `def` line to the last
# line of its body, docstring included (decorators above the `def` are not counted).
MAX_FUNCTION_LINES = 80


def _long_functions(path: Path) -> list[str]:
    """``path:function (N lines)`` for each function or method of ``path`` over the limit."""
    where = path.relative_to(SRC.parents[1])
    return [
        f"{where}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_function_over_the_line_limit():
    """Long functions are split into named stages (issue 17); the message names each one."""
    long = [entry for path in FILES for entry in _long_functions(path)]
    listed = ", ".join(long)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (def to last line): {listed}"


# Issue 55: no class in compare/ is longer than this (its comparison class once held planning,
# costing, claiming, running and assembling in 653 lines; each is a module now).
MAX_COMPARE_CLASS_LINES = 250


def test_no_class_in_compare_over_the_line_limit():
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted((SRC / "compare").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno - node.lineno + 1 > MAX_COMPARE_CLASS_LINES
    ]
    assert not long, f"classes in compare/ over {MAX_COMPARE_CLASS_LINES} lines: {long}"
