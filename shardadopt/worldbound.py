"""Caches of objects bound to one torch.distributed world, emptied when shardadopt destroys that world.

A cache keyed weakly on the world's ``ProcessGroup`` object would be emptied when the object is freed, but torch can
keep a destroyed world's Python object alive for good: ``torch.distributed.nn.functional`` (which
``DistributedDataParallel`` imports) binds the world current at its import as default arguments. So an owner of such
a cache (the HPO control groups, ``shardadopt.hpo.channel``) registers a ``forget`` callback that drops what belongs
to any world but the current one, and ``fence.rebuild_world`` and ``cleanexit.release_process_groups`` call
:func:`world_destroyed` right after they destroy the process groups.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_FORGET: list[Callable[[], None]] = []
_LOCK = threading.Lock()


def on_world_destroyed(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever shardadopt destroyed the process groups (once per callback, however often this is
    called with it).

    Args:
        forget: drops the objects of worlds other than the current one (none when torch.distributed is not
            initialised); it must not run collectives.
    """
    with _LOCK:
        if forget not in _FORGET:
            _FORGET.append(forget)


def world_destroyed() -> None:
    """The process groups were destroyed (and maybe a new world initialised): every registered cache forgets the
    objects of the worlds that are gone."""
    with _LOCK:
        callbacks = list(_FORGET)
    for forget in callbacks:
        forget()
