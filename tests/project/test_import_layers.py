"""Imports in shardadopt/ run one way: no cycle between modules, no arrow from a lower layer up.

Every module under shardadopt/ is read with ``ast`` (nothing is imported, so no torch): each ``import`` and
``from ... import`` counts, at module level and inside functions alike (an in-function import still ties the two
modules together; it only moves the failure to run time), and so do the module names in a package's lazy ``_LAZY``
table. ``from package import name`` is an arrow to the submodule ``package.name`` where one exists, else to the
package. Imports under ``if TYPE_CHECKING:`` count for the layers (an annotation naming a class from above is
knowledge of the layer above) but not for cycles: they never run, so they cannot meet a half-imported module, and
an annotation naming the caller (a watcher typed with the fence that owns it) is not a dependency on it.

``LAYERS`` lists the layers from the bottom up; a module belongs to the layer whose entry is the longest prefix of
its name (``shardadopt.fence`` covers ``shardadopt.fence.*``; the bare ``shardadopt`` entry is the package's
``__init__`` only). A module may import its own layer and every layer below, never one above, and no chain of
imports may lead back to where it started. A new module must be placed in a layer. And no module takes another
module's private names (the last tests).
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "shardadopt"

# Bottom to top: (layer, module prefixes).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # reading upstream: the private-name accessors, source probes, the installed releases, behaviour probes of torch
    ("foundations", ("shardadopt.upstream",)),
    # the core, from here up to hpo: it knows nothing about patching (no patch contract, patches or package API)
    ("mechanisms", ("shardadopt.parallel", "shardadopt.gradnorm", "shardadopt.loadtime", "shardadopt.lifecycle",
                    "shardadopt.fence")),
    ("adoption", ("shardadopt.adapters", "shardadopt.adopt", "shardadopt.online")),
    ("checkpoint", ("shardadopt.checkpoint",)),
    ("hpo", ("shardadopt.hpo",)),
    # the patch machinery: what a patch is, the registry that applies patches, the refusal where one could not apply
    ("patch contract", ("shardadopt.patching",)),
    ("patches", ("shardadopt.patches",)),
    ("package API", ("shardadopt",)),  # enable() / disable() / status() and the lazy public names
    # test support for the suite, selftest and the benchmarks
    ("testing", ("shardadopt.testing",)),
    ("commands", ("shardadopt.selftest", "shardadopt.commands", "shardadopt.cli", "shardadopt.__main__")),
]

@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    line: int
    typing_only: bool = False  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{MODULES[self.importer].relative_to(PACKAGE.parent)}:{self.line}"


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str:
    """The shardadopt module ``name`` (a module, or a name inside one) lives in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _typing_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def _imported_names(module: str, tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(imported dotted name, the node that names it) for every import in ``tree``, relative ones resolved."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield (submodule if submodule in MODULES else base), node
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
              and isinstance(node.value, ast.Dict)):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value, value


def _arrows() -> list[Arrow]:
    arrows = set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _typing_only(tree)
        for name, node in _imported_names(module, tree):
            if name == "shardadopt" or name.startswith("shardadopt."):
                imported = _owner(name)
                if imported != module:
                    arrows.add(Arrow(module, imported, node.lineno, id(node) in typing_only))
    return sorted(arrows, key=lambda a: (a.importer, a.line, a.imported))


def _covers(prefix: str, module: str) -> bool:
    return module == prefix or (prefix != "shardadopt" and module.startswith(prefix + "."))


def _layer(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module``'s layer (longest matching prefix), or None when none matches."""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if _covers(prefix, module)]
    return max(matches)[1] if matches else None


def _cycles(arrows: list[Arrow]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    edges: dict[str, set[str]] = {}
    for arrow in arrows:
        edges.setdefault(arrow.importer, set()).add(arrow.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(edges.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    return found


@pytest.fixture(scope="module")
def arrows() -> list[Arrow]:
    return _arrows()


def test_every_module_has_a_layer():
    unplaced = [module for module in MODULES if _layer(module) is None]
    assert not unplaced, f"modules in no layer of tests/project/test_import_layers.py LAYERS (add each): {unplaced}"


def test_no_import_cycle(arrows):
    problems = []
    run_time = [a for a in arrows if not a.typing_only]
    for component in _cycles(run_time):
        inside = [a for a in run_time if a.importer in component and a.imported in component]
        problems.append(f"import cycle among {', '.join(component)}:\n" + "\n".join(
            f"    {a.where()} {a.importer} imports {a.imported}" for a in inside))
    assert not problems, "\n".join(problems)


def test_no_import_from_a_layer_above(arrows):
    problems = []
    for arrow in arrows:
        low, high = _layer(arrow.importer), _layer(arrow.imported)
        if low is None or high is None or high <= low:
            continue
        problems.append(f"{arrow.where()}: {arrow.importer} (layer {LAYERS[low][0]!r}) imports {arrow.imported} "
                        f"(layer {LAYERS[high][0]!r}, above it): imports run from a layer down only; move what both "
                        f"need below both")
    assert not problems, "\n".join(problems)


ROOT_MODULES = {"shardadopt", "shardadopt.__main__", "shardadopt.cli"}  # the public entry points


def test_folders_are_the_layers():
    """Each layer is a set of whole packages (the folders show the layers); the root holds only the entry points."""
    root = {name for name in MODULES if name.count(".") <= 1 and MODULES[name].name != "__init__.py"
            or name == "shardadopt"}
    assert root == ROOT_MODULES, f"modules at the package root beside the entry points: {sorted(root - ROOT_MODULES)}"
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            is_package = prefix in MODULES and MODULES[prefix].name == "__init__.py"
            assert is_package or prefix in ROOT_MODULES, f"layer {layer!r} names {prefix}, which is not a package"


# No module takes another module's private (``_``) names; what modules share is public. Counted: ``from shardadopt.x
# import _name`` from another module, and ``alias._name`` where ``alias`` is bound to another shardadopt module by an
# import (``import shardadopt``, ``from shardadopt.x import y`` of a module ``y``), at module level or inside a
# function. Dunder names (``__version__``) are public. Tests may reach private names; this checks the package only.

def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def private_uses(module: str, tree: ast.Module) -> list[str]:
    """Each place ``module`` takes another shardadopt module's private name, as ``line: what``."""
    uses, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.name != module:
                    # ``import shardadopt.x`` binds ``shardadopt``; ``import shardadopt.x as y`` binds ``y``
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "shardadopt"
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source not in MODULES or source == module:
                continue
            for alias in node.names:
                if _private(alias.name):
                    uses.append(f"{node.lineno}: from {source} import {alias.name}")
                elif f"{source}.{alias.name}" in MODULES and f"{source}.{alias.name}" != module:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _private(node.attr)):
            uses.append(f"{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return uses


def test_no_module_takes_another_modules_private_names():
    found = {}
    for module, path in MODULES.items():
        uses = private_uses(module, ast.parse(path.read_text(), str(path)))
        if uses:
            found[str(path.relative_to(PACKAGE.parent))] = uses
    assert not found, "private names taken from another module (make them public where modules share them):\n" + \
        "\n".join(f"  {path}: {use}" for path, uses in sorted(found.items()) for use in uses)


def test_the_check_sees_both_forms():
    """Both spellings are found, and a module's own private names are not."""
    tree = ast.parse("from shardadopt.parallel.topology import _world\nimport shardadopt\nshardadopt._registry()\n"
                     "from shardadopt.parallel import tp\ntp._helper()\n_own = 1\n")
    assert private_uses("shardadopt.cli", tree) == ["1: from shardadopt.parallel.topology import _world",
                                                    "3: shardadopt._registry", "5: shardadopt.parallel.tp._helper"]
