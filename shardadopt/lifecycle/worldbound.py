"""Caches of objects bound to one torch.distributed world, emptied when shardadopt destroys that world.

A cache keyed weakly on the world's ``ProcessGroup`` object would be emptied when the object is freed, but torch can
keep a destroyed world's Python object alive for good: ``torch.distributed.nn.functional`` (imported when a
``DistributedDataParallel`` model is built) binds the world current at its import as default arguments. So an owner
of such a cache (the HPO control groups, ``shardadopt.hpo.channel``) registers a ``forget`` callback, and
``fence.rebuild_world`` (once the new world is up) and ``cleanexit.release_process_groups`` (at a successful exit)
call :func:`world_destroyed`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_FORGET: list[Callable[[bool], None]] = []
_LOCK = threading.Lock()


def on_world_destroyed(forget: Callable[[bool], None]) -> None:
    """Call ``forget(exiting)`` whenever shardadopt destroyed the process groups (once per callback, however often
    this is called with it).

    Args:
        forget: drops the objects of every world but the current one (every world when torch.distributed is not
            initialised, or when ``exiting``: the process is about to exit). It must not run collectives.
    """
    with _LOCK:
        if forget not in _FORGET:
            _FORGET.append(forget)


def world_destroyed(exiting: bool = False) -> None:
    """The process groups were destroyed (and maybe a new world initialised): every registered cache forgets the
    objects of the worlds that are gone, or with ``exiting`` all of them. Each callback runs even where an earlier
    one raised; the first error is raised afterwards.

    Args:
        exiting: the process is about to exit (``shardadopt.lifecycle.cleanexit``): the current world's objects go too,
        even
            where that world is left initialised (an NCCL default group).
    """
    with _LOCK:
        callbacks = list(_FORGET)
    error: BaseException | None = None
    for forget in callbacks:
        try:
            forget(exiting)
        except Exception as exc:  # noqa: BLE001  (the other caches are still emptied)
            error = error or exc
    if error is not None:
        raise error
