"""The module paths public before the package moved into layer packages: the old import path still gives the module
(with a DeprecationWarning naming the new path), the attribute form after ``import shardadopt`` gives it silently."""

from __future__ import annotations

import json
import subprocess
import sys

MOVED = {
    "shardadopt.cleanexit": "shardadopt.lifecycle.cleanexit",
    "shardadopt.refusal": "shardadopt.patching.refusal",
    "shardadopt.restarts": "shardadopt.lifecycle.restarts",
    "shardadopt.topology": "shardadopt.parallel.topology",
    "shardadopt.versions": "shardadopt.upstream.versions",
}

# A fresh interpreter: an old path already in sys.modules would not go through the finder again. Each old path is
# imported once, so one interpreter checks them all. ``from shardadopt.versions import TESTED`` goes first, under
# warnings-as-errors (the warning is raised, and the import works once it is not an error).
CHECK = """
import importlib, json, sys, warnings
moved = json.loads(sys.argv[1])
warnings.simplefilter("error", DeprecationWarning)
try:
    from shardadopt.versions import TESTED
    raise SystemExit("no DeprecationWarning for from shardadopt.versions import TESTED")
except DeprecationWarning as warning:
    assert "shardadopt.upstream.versions" in str(warning), warning
warnings.simplefilter("ignore")
from shardadopt.versions import TESTED
from shardadopt.upstream.versions import TESTED as NEW
assert TESTED is NEW
import shardadopt
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attribute = getattr(shardadopt, old.rpartition(".")[2])
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)], [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        again = importlib.import_module(old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    if old != "shardadopt.versions":  # imported above already
        assert len(messages) == 1 and new in messages[0], (old, messages)
    assert module is again is attribute is sys.modules[new], (old, module, attribute)
    assert module.__spec__.name == new, module.__spec__.name
print("checked", len(moved))
"""


def test_old_module_paths_import_with_a_deprecation_warning():
    result = subprocess.run([sys.executable, "-c", CHECK, json.dumps(MOVED)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"checked {len(MOVED)}"
