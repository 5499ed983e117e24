"""The checkout's ``tools/*.py`` scripts imported as modules, for the tests of what they build and record.

The scripts are not part of the package; a test loads one by name with :func:`load_tool` (once per process, so
every test module that uses a script shares its module and the objects it defines).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"  # a source checkout's tools/ folder


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` of this checkout as the module ``name`` (registered in ``sys.modules``: the fixes that
    ``tools/upstream_diffs.py`` loads import its dataclasses from there).

    Args:
        name: the script's file name without ``.py``.

    Returns:
        The module, loaded on the first call and the same object on every later one.
    """
    path = TOOLS / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
