"""The patches, one module each: a thin adapter from an upstream call into shardadopt's core.

Each module is named after its patch id (``-`` -> ``_``), defines ``PATCH = Patch(id="<id>", ...)``
(:mod:`shardadopt.patching.contract`) and must not import transformers, accelerate or optuna at module level: the
registry applies it when those are imported. Nothing lists them by hand: :func:`discover` imports every module of
this package and collects its ``PATCH``, sorted by id (the order :mod:`shardadopt.patching.stacking` starts from).
"""

from __future__ import annotations

import importlib
import pkgutil

from shardadopt.patching.contract import Patch
from shardadopt.patching.registry import Registry, make_process_wide, process_wide


def discover() -> list[Patch]:
    """Every patch module's ``PATCH``, sorted by id.

    Returns:
        The patches shardadopt ships.

    Raises:
        TypeError: a module defines no ``PATCH`` (a ``Patch``).
        ValueError: a module is not named after its patch's id.
    """
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        patch = getattr(module, "PATCH", None)
        if not isinstance(patch, Patch):
            raise TypeError(f"{module.__name__} defines no PATCH = Patch(id=..., ...); every module in "
                            f"{__name__} is a patch (move helpers elsewhere)")
        if patch.id.replace("-", "_") != info.name:
            raise ValueError(f"{module.__name__} defines patch {patch.id!r}: rename the module to "
                             f"{patch.id.replace('-', '_')}.py (a patch module is named after its id)")
        found.append(patch)
    return sorted(found, key=lambda patch: patch.id)


ALL_PATCHES: list[Patch] = discover()


def process_registry() -> Registry:
    """The registry of every patch shardadopt ships, created once per process; ``shardadopt.enable()``,
    ``disable()`` and ``status()`` drive it.

    Returns:
        The process-wide registry.
    """
    return process_wide() or make_process_wide(Registry(ALL_PATCHES))
