"""Helpers that call ``shardadopt.enable()`` as users do, and leave the process's patches as they found them.

The one-process references of the tests run the same rank functions in the test process itself; one that left
shardadopt enabled there made a later test see shardadopt's wrappers instead of upstream's functions.
:func:`keeps_patch_state` wraps such a helper: afterwards, what the helper enabled is disabled again unless its
caller had shardadopt enabled already (then it stays on), and what it disabled is enabled again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def enabled_patches() -> frozenset[str]:
    """The ids of the patches that are not ``off`` in this process (empty when shardadopt is disabled or was
    never enabled).

    Returns:
        Patch ids, as ``shardadopt.status()`` names them.
    """
    from shardadopt.patching.registry import process_wide
    from shardadopt.patching.states import OFF

    registry = process_wide()
    if registry is None:
        return frozenset()
    return frozenset(s.id for s in registry.status() if s.state != OFF)


def keeps_patch_state(function: Callable[P, R]) -> Callable[P, R]:
    """Decorate a helper that calls ``shardadopt.enable()`` (or ``disable()``): when it returns or raises,
    shardadopt is disabled again if it was disabled before the call, and enabled again (the same patches) if the
    helper disabled it; a caller's own ``enable()`` stays on.

    Args:
        function: the helper (a rank function too: the pool pickles it by its module and name, which stay its own).

    Returns:
        The wrapped helper.
    """

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import shardadopt

        before = enabled_patches()
        try:
            return function(*args, **kwargs)
        finally:
            after = enabled_patches()
            if not before and after:
                shardadopt.disable()
            elif before and not after:
                shardadopt.enable(only=before)

    return wrapper


def probe_state(pid: str) -> tuple[str, str]:
    """Enable only ``pid`` (with the patches it depends on) in a fresh registry of every patch, then revert it.

    Args:
        pid: a patch id.

    Returns:
        The patch's state and reason on the installed upstream.
    """
    import importlib

    from shardadopt.patches import ALL_PATCHES
    from shardadopt.patching.registry import Registry

    registry = Registry(ALL_PATCHES)
    patch = next(p for p in ALL_PATCHES if p.id == pid)
    for module in patch.modules:
        importlib.import_module(module)
    try:
        status = {s.id: s for s in registry.enable(only=[pid, *patch.depends_on])}[pid]
    finally:
        registry.disable()
    return status.state, status.reason
