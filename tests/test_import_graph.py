"""The package's own import graph: no cycles, and the library never imports the testbed or the CLI.

Layers: (a) only (no processes): every module of ``megatron_hexiseq`` is parsed with ``ast``
(nothing is imported), each ``import``/``from ... import`` of an own module becomes an edge, at
module top and inside functions alike. ``from package import name`` counts as an edge to
``package.name`` when that is a module, else to ``package``. A module's edge to its own parent
package ``__init__`` is dropped (Python runs the parent first anyway). Every imported own module
must exist in this tree. (b) and (c): none.

Library = every module outside ``megatron_hexiseq.testbed``, ``megatron_hexiseq.commands``,
``cli``, ``__main__`` and ``pretrain_gpt`` (the entry points).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_hexiseq"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
UPPER = ("testbed", "commands")  # subpackages only entry points may import
ENTRY_POINTS = {f"{PACKAGE}.cli", f"{PACKAGE}.__main__", f"{PACKAGE}.pretrain_gpt"}


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from X import ...`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _own_imports(module: str) -> list[tuple[str, list[str]]]:
    """``(imported module, names it is asked for)`` of every own-package import in ``module``'s file."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(module, node)
            if src.split(".")[0] == PACKAGE:
                out.append((src, [a.name for a in node.names]))
    return out


def imports_of(module: str) -> set[str]:
    """Own modules that ``module`` imports anywhere in its file."""
    found: set[str] = set()
    for src, names in _own_imports(module):
        for name in [f"{src}.{n}" if f"{src}.{n}" in MODULES else src for n in names] or [src]:
            while name and name not in MODULES:  # "pkg.mod.attr" -> "pkg.mod"
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def missing_imports(module: str) -> list[str]:
    """Own modules ``module`` imports that are not in the tree (an editable install elsewhere
    would quietly supply them)."""
    return sorted({src for src, _ in _own_imports(module) if src not in MODULES})


MODULES = module_names()
GRAPH = {m: imports_of(m) for m in MODULES}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each as one cycle
    path through it so the message shows which imports to cut."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

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
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_path(graph, comp) for comp in comps]


def _cycle_path(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (BFS)."""
    start, members = comp[0], set(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return (
                        [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
                    )
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def is_library(module: str) -> bool:
    upper = any(module == f"{PACKAGE}.{u}" or module.startswith(f"{PACKAGE}.{u}.") for u in UPPER)
    return not upper and module not in ENTRY_POINTS


def upward_imports(module: str) -> list[str]:
    """The testbed/commands modules that library ``module`` imports (empty for non-library)."""
    if not is_library(module):
        return []
    return sorted(t for t in GRAPH[module] if not is_library(t) and t not in ENTRY_POINTS)


def test_graph_finds_real_edges() -> None:
    """The parser sees both module-top and function-level imports of known modules."""
    assert f"{PACKAGE}.errors" in GRAPH[f"{PACKAGE}.layout"]
    assert f"{PACKAGE}.layout" in GRAPH[f"{PACKAGE}.cli"] | {
        t for m in GRAPH if m.startswith(f"{PACKAGE}.commands") for t in GRAPH[m]
    }


def test_cycle_finder_on_a_known_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(map(tuple, find_cycles(graph))) == [("a", "b", "c", "a"), ("e", "e2", "e")]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_own_import_exists(module: str) -> None:
    assert not missing_imports(module), (
        f"{module} imports modules that do not exist: {missing_imports(module)}"
    )


def test_no_import_cycles() -> None:
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


LIBRARY = sorted(m for m in MODULES if is_library(m))


@pytest.mark.parametrize("module", LIBRARY)
def test_library_does_not_import_testbed_or_commands(module: str) -> None:
    bad = upward_imports(module)
    assert not bad, (
        f"library module {module} imports {', '.join(bad)} (testbed/commands depend on the library)"
    )


def _in(module: str, sub: str) -> bool:
    return module == f"{PACKAGE}.{sub}" or module.startswith(f"{PACKAGE}.{sub}.")


TESTBED = sorted(m for m in MODULES if _in(m, "testbed"))


@pytest.mark.parametrize("module", TESTBED)
def test_testbed_does_not_import_commands(module: str) -> None:
    """Layers: library < testbed < commands/cli. The CLI may use the testbed, never the reverse."""
    bad = sorted(t for t in GRAPH[module] if _in(t, "commands") or t in ENTRY_POINTS)
    assert not bad, (
        f"testbed module {module} imports {', '.join(bad)} (commands/cli sit above the testbed)"
    )
