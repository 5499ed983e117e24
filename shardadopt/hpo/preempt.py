"""SIGTERM ends the running trial as ``preempted`` on every rank, instead of killing the job mid-round.

Rank 0 installs the handler while ``optimize`` runs (main thread only). The handler only sets a flag; rank 0
turns it into a ``PreemptedError`` at the trial's next control call (``report``, ``suggest_*``, ``set_user_attr``,
...), so the error reaches every rank in one consistent round and the trial is recorded as FAIL/``preempted``;
the study then stops. A second SIGTERM terminates the process at once (the scheduler's grace ran out).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardadopt.hpo.failures import PreemptedError

_requested = threading.Event()


def requested() -> bool:
    return _requested.is_set()


def check() -> None:
    """Raise ``PreemptedError`` when a SIGTERM arrived while the handler was installed."""
    if _requested.is_set():
        raise PreemptedError("SIGTERM received: the trial was stopped at its next control call so a retry can "
                             "resume it (shardadopt hpo requeue)")


@contextmanager
def sigterm_preempts() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if _requested.is_set():  # second SIGTERM: stop now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        _requested.set()

    _requested.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _requested.clear()
