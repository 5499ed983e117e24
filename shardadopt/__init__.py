"""shardadopt: train models that transformers sharded at load time with accelerate, Trainer and Optuna.

    import shardadopt
    shardadopt.enable()

``enable()`` patches only what the installed upstream lacks (each patch probes upstream first), lazily: nothing
from transformers or accelerate is imported here. ``disable()`` restores every original object. The fixes are
also plain functions for code that prefers no monkeypatching.

Each patch state change is logged on rank 0 to the ``shardadopt`` logger at INFO; the package itself only adds a
``logging.NullHandler``, so nothing is printed unless the application configures logging.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
import warnings
from collections.abc import Iterable
from typing import Any

from shardadopt.patching.registry import PatchStatus, Registry

__version__ = "0.1.0"  # pyproject.toml reads it from here

logging.getLogger("shardadopt").addHandler(logging.NullHandler())

__all__ = ["enable", "disable", "status", "PatchStatus", "UntestedUpstreamWarning", "__version__",
           "clip_grad_norm_", "total_norm",
           "topology", "Topology", "TopologyError",
           "split_param_groups", "split_param_groups_by_mesh", "AdoptionKwargs", "adopt_model",
           "fix_tp_grad_accumulation", "agree_sampling_rng"]

_WARNED: set[str] = set()  # the untested-release lines already shown in this process

# Public names that live in modules importing torch: loaded on first use so `import shardadopt` stays cheap. A name
# mapped to its own submodule (the documented subpackages: `shardadopt.checkpoint.latest(...)` after a plain
# `import shardadopt`) is that module.
_LAZY = {
    "adapters": "shardadopt.adapters",
    "adopt": "shardadopt.adopt",
    "checkpoint": "shardadopt.checkpoint",
    "cleanexit": "shardadopt.lifecycle.cleanexit",
    "fence": "shardadopt.fence",
    "hpo": "shardadopt.hpo",
    "loadtime": "shardadopt.loadtime",
    "refusal": "shardadopt.patching.refusal",
    "restarts": "shardadopt.lifecycle.restarts",
    "upstream": "shardadopt.upstream",
    "versions": "shardadopt.upstream.versions",
    "clip_grad_norm_": "shardadopt.gradnorm",
    "total_norm": "shardadopt.gradnorm",
    "topology": "shardadopt.parallel.topology",
    "Topology": "shardadopt.parallel.topology",
    "TopologyError": "shardadopt.parallel.topology",
    "split_param_groups": "shardadopt.parallel.optim",
    "split_param_groups_by_mesh": "shardadopt.parallel.optim",
    "AdoptionKwargs": "shardadopt.adopt",
    "adopt_model": "shardadopt.adopt",
    "fix_tp_grad_accumulation": "shardadopt.parallel.tp",
    "agree_sampling_rng": "shardadopt.parallel.sampling",
}


def _registry() -> Registry:
    from shardadopt.patches import process_registry

    return process_registry()


def enable(only: Iterable[str] | None = None, exclude: Iterable[str] | None = None) -> list[PatchStatus]:
    """Enable the patches (all, or ``only`` these ids, minus ``exclude`` and ``$SHARDADOPT_DISABLE``).

    Idempotent. Returns the status of every patch; patches whose upstream modules are not imported yet are
    ``pending`` and apply when those modules are imported. When an installed transformers / accelerate / peft / trl
    is newer than the tested range (``shardadopt.upstream.versions.TESTED``), or a patch could not decide or apply, one
    warning line says so (once per process and situation); a load-time-sharded model that needs such a patch is
    then refused at accelerate ``prepare`` / ``Trainer``.

    Args:
        only: enable just these patch ids.
        exclude: leave these patch ids off (upstream's behaviour for what they fix).

    Returns:
        One ``PatchStatus`` per registered patch.
    """
    from shardadopt.patching.states import untested_summary

    states = _registry().enable(only=only, exclude=exclude)
    line = untested_summary(states)
    if line is not None and line not in _WARNED:
        _WARNED.add(line)
        warnings.warn(line, UntestedUpstreamWarning, stacklevel=2)
    return states


class UntestedUpstreamWarning(UserWarning):
    """An installed upstream release is newer than the tested range, or a patch could not decide or apply."""


def disable() -> list[PatchStatus]:
    """Revert every applied patch, restoring the original upstream objects.

    Returns:
        One ``PatchStatus`` per registered patch, after the revert.
    """
    return _registry().disable()


def status() -> list[PatchStatus]:
    """One record per patch: ``id``, ``state`` (applied, not-needed, unsupported, off, pending) and ``reason``.

    Returns:
        One ``PatchStatus`` per registered patch.
    """
    return _registry().status()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.rpartition(".")[2] == name else getattr(module, name)
    raise AttributeError(f"module 'shardadopt' has no attribute {name!r}")


# Modules that were importable at the package root before 0.2 moved them into the layer packages: importing the old
# path still works, with a DeprecationWarning naming the new one. (``shardadopt.<name>`` after ``import shardadopt``
# stays the documented form and does not warn.)
_MOVED = {
    "shardadopt.cleanexit": "shardadopt.lifecycle.cleanexit",
    "shardadopt.refusal": "shardadopt.patching.refusal",
    "shardadopt.restarts": "shardadopt.lifecycle.restarts",
    "shardadopt.topology": "shardadopt.parallel.topology",
    "shardadopt.versions": "shardadopt.upstream.versions",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a pre-0.2 module path in ``_MOVED`` and hands back the module at its new path."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(f"{spec.name} moved to {_MOVED[spec.name]}; import it from there (or use "
                      f"shardadopt.{spec.name.rpartition('.')[2]} after `import shardadopt`)", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(_MOVED[spec.name])
        self._spec = module.__spec__  # the import system stamps the old path's spec on the module: put it back
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._spec


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
