"""No module under shardadopt/ takes another module's private (``_``) names; what modules share is public.

Read with ``ast`` (nothing imported): ``from shardadopt.x import _name`` from another module, and ``alias._name``
where ``alias`` is bound to another shardadopt module by an import (``import shardadopt``, ``from shardadopt.x
import y`` of a module ``y``), at module level or inside a function. Dunder names (``__version__``) are public. Tests
may reach private names; this checks the package only.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "shardadopt"


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


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
