"""This process's fence state, shared by the break, the watcher and ``rebuild_world``, and the lock that orders them.

``generation`` and ``tripped`` are the same on every rank (fences and rebuilds are collective). A break runs while
holding ``BREAK_LOCK`` (re-entrant), so no rebuild slips in between a watcher's look at the generation and its break.
"""

from __future__ import annotations

import threading


class FenceState:
    """Counters of this process's fences; read and written under ``BREAK_LOCK`` where the order matters."""

    def __init__(self) -> None:
        self.generation = 0  # how many times rebuild_world re-initialised the process groups
        self.tripped = -1  # the last generation a trip record was seen in
        self.protecting = 0  # open protected() blocks
        self.protections = 0  # starts and ends of protected() blocks
        self.control_waits = 0  # open control_wait() blocks


STATE = FenceState()
BREAK_LOCK = threading.RLock()
