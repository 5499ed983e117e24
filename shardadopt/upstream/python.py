"""CPython's private names. Checked on CPython 3.10-3.13."""

from __future__ import annotations

import sys
from typing import Any

from shardadopt.upstream.base import attribute


def module_initializing(module: Any) -> bool:
    """``module.__spec__._initializing``: whether importlib is still executing the module (unset, so False, once
    done and for modules imported without a spec). Checked on CPython 3.10-3.13."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def thread_frame(ident: int | None) -> Any:
    """``sys._current_frames()[ident]``: the innermost Python frame thread ``ident`` is running, or None (no such
    thread). CPython's; the frames of other threads are read without stopping them. Checked on CPython 3.10-3.13."""
    return attribute(sys, "_current_frames", "thread_frame", "python")().get(ident)
