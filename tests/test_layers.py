"""Imports point down the layers of docs/architecture.md: no upward edge, so no cycle between layers.

The map's table is the single source: each row names a layer, its modules (paths under llmkit/,
a trailing "/" for a whole package, the longest match wins) and the layers it may import, which
may only be rows above it in the table (so the map itself has no cycle); a layer may also import
what those may import. Every import statement of the package is checked, at module level and
inside functions alike (an import inside a function cannot hide a cycle), with the file and line
of each violation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmkit"
MAP = ROOT / "docs" / "architecture.md"


def read_map(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module pattern -> layer, layer -> every layer it may import) from the map's table."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| layer | modules | may import"):
            rows = []
            continue
        if len(cells) >= 3 and line.startswith("|") and not set(cells[0]) <= set("-: "):
            rows.append(cells)
        elif rows and not line.startswith("|"):
            break
    assert rows, f"{MAP.name}: no table with columns 'layer | modules | may import'"
    patterns: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for layer, modules, may, *_ in rows:
        names = {n.strip() for n in re.split(r"[,\s]+", may) if n.strip() not in ("", "—", "-")}
        unknown = names - set(allowed)
        assert not unknown, f"{MAP.name}: layer {layer} may import {sorted(unknown)}, not rows above it"
        allowed[layer] = set().union(names, *(allowed[n] for n in names))
        for pattern in re.findall(r"`([^`]+)`", modules):
            assert pattern not in patterns, f"{MAP.name}: {pattern} is in two layers"
            patterns[pattern] = layer
    return patterns, allowed


PATTERNS, ALLOWED = read_map(MAP.read_text())


def layer_of(path: str) -> str | None:
    """The layer of a module file (a path under llmkit/), by its longest matching pattern."""
    best = None
    for pattern, layer in PATTERNS.items():
        if (path == pattern or (pattern.endswith("/") and path.startswith(pattern))) and (
            best is None or len(pattern) > len(best[0])
        ):
            best = (pattern, layer)
    return None if best is None else best[1]


def module_file(name: str) -> str | None:
    """``llmkit.a.b`` -> ``a/b.py`` or ``a/b/__init__.py`` (paths under llmkit/), if it exists."""
    parts = name.split(".")[1:]
    for rel in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if rel != ".py" and (PACKAGE / rel).is_file():
            return rel
    return None


def _for_type_checkers(tree: ast.AST) -> set[int]:
    """The ids of the import statements under ``if TYPE_CHECKING:`` (they never run)."""
    return {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }


def imports(rel: str, run: bool = False) -> list[tuple[int, str]]:
    """(line, target file) of every llmkit module ``rel`` imports, anywhere in its code (with
    ``run``, those that can run: not the ones under ``if TYPE_CHECKING:``)."""
    module = "llmkit." + rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    package = module.split(".") if rel.endswith("__init__.py") else module.split(".")[:-1]
    if rel == "__init__.py":
        package = ["llmkit"]
    out = []
    tree = ast.parse((PACKAGE / rel).read_text())
    skip = _for_type_checkers(tree) if run else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*base, *([node.module] if node.module else [])])
            names = [f"{base}.{a.name}" if module_file(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for name in names:
            target = module_file(name) if name.split(".")[0] == "llmkit" else None
            if target is not None:
                out.append((node.lineno, target))
    return out


def violations(edges: list[tuple[str, int, str]]) -> list[str]:
    """The edges (file, line, imported file) that go from a layer to one it may not import."""
    out = []
    for src, line, dst in edges:
        a, b = layer_of(src), layer_of(dst)
        if a is None or b is None:
            continue  # reported by test_every_module_is_in_a_layer_of_the_map
        if a != b and b not in ALLOWED[a]:
            out.append(f"llmkit/{src}:{line} ({a}) imports llmkit/{dst} ({b}): not a layer below {a}")
    return out


def cycles(edges: list[tuple[str, int, str]]) -> list[list[str]]:
    """The import cycles of a graph of (file, line, imported file): its strongly connected
    components of more than one module (Tarjan), each sorted, with a module importing itself."""
    graph: dict[str, set[str]] = {}
    for src, _, dst in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


FILES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_layer_of_the_map():
    lost = [f for f in FILES if layer_of(f) is None]
    assert not lost, f"modules in no layer of the map in docs/architecture.md: {lost}"


def test_imports_point_down_the_layers():
    edges = [(f, line, dst) for f in FILES for line, dst in imports(f)]
    assert len(edges) > 300  # the walk sees the package's imports
    bad = violations(edges)
    assert not bad, "imports against the layers of docs/architecture.md:\n" + "\n".join(bad)


# Cycles known and not yet mended, each with why; the test fails when one is mended (drop it here)
# as well as on any new one. None are left.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycle_inside_a_layer():
    """The package's imports form no cycle, not even inside one layer, and not through an import
    inside a function: each layer is layered too (the IR: errors, attributes, printer, opdef, core,
    dialects, builder, ...). Imports under ``if TYPE_CHECKING:`` never run, so they do not count."""
    edges = [(f, line, dst) for f in FILES for line, dst in imports(f, run=True)]
    found = cycles(edges)
    assert found == KNOWN_CYCLES, (
        "import cycles (modules importing each other):\n"
        + "\n".join(" <-> ".join(f"llmkit/{m}" for m in c) for c in found if c not in KNOWN_CYCLES)
        + "".join(f"\nmended, drop it from KNOWN_CYCLES: {c}" for c in KNOWN_CYCLES if c not in found)
    )


def test_a_cycle_is_reported():
    edges = [
        ("a.py", 1, "b.py"),
        ("b.py", 1, "c.py"),
        ("c.py", 1, "a.py"),
        ("c.py", 2, "d.py"),
        ("e.py", 1, "e.py"),
    ]
    assert cycles(edges) == [["a.py", "b.py", "c.py"], ["e.py"]]
    assert cycles([("a.py", 1, "b.py"), ("b.py", 1, "c.py")]) == []


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ("framework/tensor.py", "framework/dispatch.py"),  # upward, as a method importing dispatch was
        ("framework/executor.py", "framework/compiler/native/run.py"),  # the executor calling its kernels
        ("framework/compiler/decompose.py", "framework/jit/static_function.py"),
        ("models/llama/model.py", "infer/engine.py"),  # siblings: neither imports the other
        ("framework/opspec.py", "framework/ops/__init__.py"),
    ],
)
def test_an_upward_import_is_reported(src, dst):
    assert violations([(src, 7, dst)]) == [
        f"llmkit/{src}:7 ({layer_of(src)}) imports llmkit/{dst} ({layer_of(dst)}): not a layer below "
        f"{layer_of(src)}"
    ]


def test_imports_inside_functions_are_seen(tmp_path, monkeypatch):
    """An import inside a function counts like one at the top of the module."""
    pkg = tmp_path / "llmkit"
    (pkg / "framework").mkdir(parents=True)
    (pkg / "framework" / "dispatch.py").write_text("")
    (pkg / "framework" / "tensor.py").write_text("def f():\n    from .dispatch import apply\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert imports("framework/tensor.py") == [(2, "framework/dispatch.py")]
    (pkg / "framework" / "tensor.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .dispatch import apply\n"
    )
    assert imports("framework/tensor.py", run=True) == []  # a hint's import never runs
