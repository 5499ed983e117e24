"""What patch probes use to recognise upstream code: its syntax tree, read structurally, and a way to say "unknown".

A probe answers ``needed`` only when it finds the upstream shape its patch fixes, ``not-needed`` only when it finds
the shape of the fix, and raises :class:`Undecided` otherwise; the registry reports that patch ``unsupported`` with
the message (``shardadopt doctor`` exits 1), so an upstream rewrite is noticed instead of training unpatched.
Nothing here imports upstream.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
import textwrap
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class Undecided(Exception):
    """The probe found neither the broken nor the fixed upstream shape; the message names what it looked for."""


def undecided(where: str, looked_for: str) -> Undecided:
    return Undecided(f"{where}: found neither {looked_for}; this upstream release changed the code the patch "
                     f"replaces (check it for a fix, then update shardadopt)")


def source_tree(function: Callable[..., Any]) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The syntax tree of ``function`` (a plain function or method; wrappers are unwrapped first)."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    module = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = module.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise Undecided(f"{getattr(function, '__qualname__', function)} is not a function definition")
    return node


def upstream_function(owner: Any, name: str, where: str) -> Callable[..., Any]:
    """``owner.name``, or :class:`Undecided` naming what is missing."""
    function = inspect.getattr_static(owner, name, None) if isinstance(owner, type) else getattr(owner, name, None)
    if isinstance(function, (staticmethod, classmethod)):
        function = function.__func__
    if function is None:
        raise Undecided(f"{where}: {getattr(owner, '__name__', owner)}.{name} does not exist in this release "
                        f"(renamed or removed upstream; the patch needs updating)")
    return function


def callee(call: ast.Call) -> str | None:
    """The called name: ``f`` for ``f(...)`` and ``a.b.f(...)``."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Every call of ``name`` under ``node`` (by the last part of the called expression)."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and callee(n) == name]


def names(node: ast.AST) -> set[str]:
    """Every identifier and attribute name read under ``node``, and identifier-like strings (``getattr(m, "x")``)."""
    found: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            found.add(n.value)
    return found


def if_chain(node: ast.If) -> list[tuple[ast.expr | None, list[ast.stmt]]]:
    """``if a: .. elif b: .. else: ..`` as ``[(a, body), (b, body), (None, else body)]``."""
    chain: list[tuple[ast.expr | None, list[ast.stmt]]] = []
    current: ast.If | None = node
    while current is not None:
        chain.append((current.test, current.body))
        orelse = current.orelse
        if len(orelse) == 1 and isinstance(orelse[0], ast.If):
            current = orelse[0]
        else:
            if orelse:
                chain.append((None, orelse))
            current = None
    return chain


def if_chains(node: ast.AST) -> Iterator[list[tuple[ast.expr | None, list[ast.stmt]]]]:
    """Every ``if`` chain under ``node``, each once (an ``elif`` is part of its chain, not a chain of its own)."""
    elifs = {id(n.orelse[0]) for n in ast.walk(node)
             if isinstance(n, ast.If) and len(n.orelse) == 1 and isinstance(n.orelse[0], ast.If)}
    for n in ast.walk(node):
        if isinstance(n, ast.If) and id(n) not in elifs:
            yield if_chain(n)


def body_calls(body: Iterable[ast.stmt], name: str) -> list[ast.Call]:
    return [c for statement in body for c in calls(statement, name)]


def in_order(node: ast.AST) -> list[ast.AST]:
    """The nodes under ``node`` sorted by source position (``ast.walk`` is breadth-first)."""
    located = [n for n in ast.walk(node) if hasattr(n, "lineno")]
    return sorted(located, key=lambda n: (n.lineno, n.col_offset))


def enclosing_tests(tree: ast.AST, node: ast.AST) -> list[ast.expr]:
    """The tests of the ``if`` statements (and ``elif`` branches) ``node`` sits inside, outermost first; for a node
    in an ``else``/``elif`` branch that includes the tests it follows (a condition on the way there)."""
    parents = {id(child): parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    tests, current = [], node
    while id(current) in parents:
        parent = parents[id(current)]
        if isinstance(parent, ast.If) and current is not parent.test:
            tests.append(parent.test)
        current = parent
    return tests[::-1]


@functools.cache
def _package_roots(package: str) -> tuple[str, ...]:
    spec = importlib.util.find_spec(package)
    return tuple(spec.submodule_search_locations or ()) if spec is not None else ()


def package_file(package: str, *parts: str) -> str | None:
    """The path of the installed ``package``'s file ``parts`` (``"distributed", "tensor_parallel.py"``), found without
    importing the package (the location is looked up once per process); None where that release has no such file."""
    for root in _package_roots(package):
        path = os.path.join(root, *parts)
        if os.path.exists(path):
            return path
    return None
