"""The package's shape (issue 47): no import circle, no folder a tool would take for build output.

The circle check reads every ``import`` in ``src/recap`` (at module level and inside functions:
a lazy import only hides a circle) except those under ``if TYPE_CHECKING:``, which never run.
It failed on the tree before this test: 11 modules in one circle (decoding -> target ->
base -> batch / prefix / profile -> base, base -> decoding, profile -> models -> target,
profile -> bench.environment -> recap) and bench.data <-> bench.repeats."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "recap"
OUTPUT_NAMES = {"target", "build", "dist", "out"}
"""Folder names the common global ignore templates (Rust, Maven, Python, Node) treat as build output."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return hidden


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (each import resolved to the longest known module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hidden = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports that module (what import tools count);
            # `from module import name` imports the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (networkx,
    which torch already installs)."""
    import networkx

    components = networkx.strongly_connected_components(networkx.DiGraph(
        [(module, imported) for module, imports in graph.items() for imported in imports]))
    return [sorted(component) for component in components if len(component) > 1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_package_has_no_import_circle():
    graph = _graph()
    assert len(graph) > 50 and graph["recap.decoding"], "the import walk found nothing"
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle():
    """Negative control: the same walk on a graph with one edge added back (base -> decoding,
    the lazy import `TargetModel.reference_generate` had) reports the circle."""
    graph = _graph()
    graph["recap.verifier.base"] = graph["recap.verifier.base"] | {"recap.decoding"}
    assert any({"recap.decoding", "recap.verifier.base"} <= set(circle) for circle in _circles(graph))


@pytest.mark.parametrize("folder", sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"))
def test_no_package_folder_looks_like_build_output(folder):
    assert folder.name not in OUTPUT_NAMES, f"{folder}: global ignore files treat '{folder.name}/' as build output"


def _foreign_underscore_writes(source: str) -> list[str]:
    """Assignments in a class's methods to ``other._name`` (not ``self``) where the class never
    sets ``self._name`` itself: one object writing another class's private state (as
    `ChunkedPrefill` once set six of a lane's fields). A copy of the class's own object
    (``copy._pool`` in `FastMemory.snapshot`) sets its own class's names and passes."""
    found = []
    for cls in (node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)):
        own, foreign = set(), []
        for node in ast.walk(cls):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in (t for x in targets for t in (x.elts if isinstance(x, ast.Tuple) else [x])):
                if isinstance(target, ast.Attribute) and target.attr.startswith("_") \
                        and not target.attr.startswith("__"):
                    if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
                        own.add(target.attr)
                    else:
                        foreign.append((target.attr, f"{cls.name}:{node.lineno} {ast.unparse(target)}"))
        found += [where for name, where in foreign if name not in own]
    return found


def test_no_class_writes_another_class_underscore_state():
    found = [f"{path.relative_to(PACKAGE)} {where}" for path in PACKAGE.rglob("*.py")
             for where in _foreign_underscore_writes(path.read_text(encoding="utf-8"))]
    assert found == []


def test_the_underscore_check_finds_a_foreign_write():
    """Negative control: the pattern the chunked prefill had before the runners owned their lanes."""
    source = ("class ChunkedPrefill:\n"
              "    def __init__(self, lane):\n"
              "        self.lane = lane\n"
              "        lane._kv, lane.past_len = None, 0\n")
    assert _foreign_underscore_writes(source) == ["ChunkedPrefill:4 lane._kv"]


def _parameter_counts(source: str) -> list[tuple[str, int, bool]]:
    """(name, positional or required parameters, compiled) of every function in ``source``;
    compiled: decorated with numba's ``njit`` / ``jit`` / ``intrinsic``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = len(args.posonlyargs) + len(args.args)
            required = positional - len(args.defaults) + sum(default is None for default in args.kw_defaults)
            compiled = any(word in ast.unparse(decorator) for decorator in node.decorator_list
                           for word in ("njit", "jit", "intrinsic"))
            out.append((f"{node.name}:{node.lineno}", max(positional, required), compiled))
    return out


def _too_many(source: str) -> list[str]:
    return [name for name, count, compiled in _parameter_counts(source) if count > (12 if compiled else 10)]


def test_no_function_takes_too_many_parameters():
    """At most 10 positional or required parameters, 12 in a compiled kernel (where arrays
    stand in for objects): RECAP's memory goes to its kernels as one named structure."""
    found = [f"{path.relative_to(PACKAGE)} {name}" for path in PACKAGE.rglob("*.py")
             for name in _too_many(path.read_text(encoding="utf-8"))]
    assert found == []


def test_the_parameter_check_finds_a_long_signature():
    """Negative control: ``_fuse``'s signature before the memory became one structure."""
    names = ", ".join(f"a{i}" for i in range(23))
    assert _too_many(f"@njit(cache=True)\ndef _fuse({names}):\n    pass\n") == ["_fuse:2"]
    assert _too_many("def plain(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n") == ["plain:1"]


@pytest.mark.xdist_group("layout")
def test_xdist_groups_reach_the_scheduler(request):
    """`make test` runs ``--dist loadgroup``: tests marked ``xdist_group`` share one worker
    (Gemma-3-270M loaded once, the native instruction-set build run once). pytest-xdist groups
    by a suffix on the node id, which pytest 9 ignores (hence pytest < 9 in pyproject.toml):
    without it the suffix is gone and this fails."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("not under pytest-xdist --dist loadgroup")
    assert request.node.nodeid.endswith("@layout")
