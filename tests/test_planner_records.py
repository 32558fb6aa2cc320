"""The planner passes named records, not anonymous tuples, between its functions.

Layers: (a) only (no processes): every module of ``megatron_hexiseq/planner`` is parsed with ``ast``
(nothing is imported). No function (nested ones and methods included) takes or returns a tuple of
more than three fields without a name: no parameter, return, variable or field annotation is
``tuple[A, B, C, D, ...]`` with more than three fields or a bare ``tuple``, no module-level type
alias is one, and no ``return`` statement returns a literal tuple of more than three items. A record
is a ``NamedTuple`` or a dataclass. Sort keys (functions named ``key`` or ``*_key``) are exempt: they
are compared whole, never unpacked. ``tuple[X, ...]`` (any length, one type) is a sequence, not a
record. (b) and (c): none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLANNER = Path(__file__).resolve().parent.parent / "megatron_hexiseq" / "planner"
MAX_FIELDS = 3


def _wide_tuples(annotation: ast.expr | None) -> list[str]:
    """The anonymous tuple types of more than ``MAX_FIELDS`` fields (or bare ``tuple``) inside an
    annotation, as source text."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    out = []
    subscripted = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            if node.value.id == "tuple":
                subscripted.add(id(node.value))
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                variadic = any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in elts)
                if not variadic and len(elts) > MAX_FIELDS:
                    out.append(ast.unparse(node))
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "tuple" and id(node) not in subscripted:
            out.append("tuple")
    return out


def _is_sort_key(name: str) -> bool:
    return name == "key" or name.endswith("_key")


def violations(source: str, filename: str) -> list[str]:
    """Every anonymous wide tuple in ``source``: ``file:line: what``."""
    tree = ast.parse(source)
    out = []

    def report(node: ast.AST, what: str) -> None:
        out.append(f"{filename}:{node.lineno}: {what}")

    exempt: set[int] = set()  # annotations and returns of sort keys
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_sort_key(node.name):
            exempt |= {id(n) for n in ast.walk(node.returns)} if node.returns else set()
            exempt |= {id(r.value) for r in ast.walk(node) if isinstance(r, ast.Return) and r.value}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None:
                    for t in _wide_tuples(a.annotation):
                        report(node, f"{node.name}() parameter {a.arg}: {t}")
            if node.returns is not None and id(node.returns) not in exempt:
                for t in _wide_tuples(node.returns):
                    report(node, f"{node.name}() returns {t}")
        elif isinstance(node, ast.AnnAssign):
            for t in _wide_tuples(node.annotation):
                report(node, f"annotation {ast.unparse(node.target)}: {t}")
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            if id(node.value) not in exempt and len(node.value.elts) > MAX_FIELDS:
                report(node, f"returns a tuple of {len(node.value.elts)} items")
    for node in tree.body:  # type aliases
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript):
            for t in _wide_tuples(node.value):
                report(node, f"type alias {ast.unparse(node.targets[0])}: {t}")
    return out


def test_no_anonymous_wide_tuples_in_the_planner():
    files = sorted(PLANNER.glob("*.py"))
    assert len(files) > 15
    found = [v for f in files for v in violations(f.read_text(), f.name)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "source, count",
    [
        ("def f() -> tuple[int, int, int, int]: ...", 1),
        ("def f(x: tuple[int, str, float, bool] | None): ...", 1),
        ("def f() -> list[tuple | None]: ...", 1),
        ("def f():\n    return 1, 2, 3, 4", 1),
        ("X = dict[tuple, int]", 1),
        ("def f():\n    y: tuple[int, int, int, int, int] = g()", 1),
        ("def f() -> tuple[int, int, int]: ...", 0),
        ("def f() -> tuple[float, ...]: ...", 0),
        ("def key() -> tuple:\n    return 1, 2, 3, 4", 0),
        ("def node_key() -> tuple[int, int, int, int]: ...", 0),
        ("class R(NamedTuple):\n    a: int\n    b: int\n    c: int\n    d: int", 0),
    ],
)
def test_the_check_finds_what_it_should(source, count):
    assert len(violations(source, "x.py")) == count
