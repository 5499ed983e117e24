"""Fault fences: when one rank fails or hangs inside a collective section, every rank leaves it within a bound.

From Python, a thread blocked in a gloo or NCCL collective cannot be interrupted, so a rank that raises (or stops
making progress) inside a section every rank entered together leaves its peers waiting for the process group's
timeout. ``fenced(what)`` makes every rank raise at once instead; ``rebuild_world()`` makes the broken groups usable
again. One mechanism per module: ``records`` (store keys, trip records), ``breaking`` (the break: NCCL abort, gloo
connection shutdown), ``watcher`` (the watcher and hang-monitor threads), ``hang_decision`` (which ranks are hung),
``frames`` (where the main thread is), ``progress_hooks``, ``section`` (``Fence``, ``fenced``) and ``rebuild``.
The design, its bounds and what is not covered: ``docs/fence.md``.
"""

from __future__ import annotations

from shardadopt.fence.breaking import break_training_groups, protect_group, protected, publish_listeners
from shardadopt.fence.errors import HANG_KIND, HangError, PeerFailedError
from shardadopt.fence.progress_hooks import progress
from shardadopt.fence.rebuild import generation, rebuild_world
from shardadopt.fence.records import POLL_INTERVAL
from shardadopt.fence.section import (
    DEFAULT_HANG_TIMEOUT,
    HANG_TIMEOUT_ENV,
    Fence,
    fenced,
    gathered_error,
    resolve_hang_timeout,
)
from shardadopt.fence.watcher import BREAK_GRACE, HANG_EXIT_CODE, control_wait

__all__ = [
    "BREAK_GRACE", "DEFAULT_HANG_TIMEOUT", "HANG_EXIT_CODE", "HANG_KIND", "HANG_TIMEOUT_ENV", "POLL_INTERVAL",
    "Fence", "HangError", "PeerFailedError", "break_training_groups", "control_wait", "fenced", "gathered_error",
    "generation", "progress", "protect_group", "protected", "publish_listeners", "rebuild_world",
    "resolve_hang_timeout",
]
