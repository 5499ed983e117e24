"""A fenced section: ``Fence`` and ``fenced``, what every rank raises when one rank fails or hangs inside it.

A section is entered by every rank together (one HPO trial, one checkpoint save). The rank whose code raises records
itself in the store (first writer wins) and breaks its training groups; every other rank's watcher breaks its own,
so ranks blocked in a collective raise ``PeerFailedError`` naming the failing rank. See ``docs/fence.md``.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from shardadopt.fence import breaking, progress_hooks, records
from shardadopt.fence.errors import HANG_KIND, HangError, PeerFailedError, is_hang, mark_hang, origin_rank, summary
from shardadopt.fence.state import STATE
from shardadopt.fence.watcher import WATCHER

HANG_TIMEOUT_ENV = "SHARDADOPT_HANG_TIMEOUT"
DEFAULT_HANG_TIMEOUT = 900.0  # seconds without progress: longer than a slow evaluation, a save or a first batch


def resolve_hang_timeout(value: float | None = None) -> float:
    """Seconds without progress after which a rank inside a fenced section counts as hung.

    Args:
        value: the timeout; None for ``$SHARDADOPT_HANG_TIMEOUT``, else 900. ``math.inf`` turns hang detection off.

    Returns:
        The timeout in seconds. Raises ``ValueError`` when it is not positive.
    """
    if value is None:
        value = float(os.environ.get(HANG_TIMEOUT_ENV, DEFAULT_HANG_TIMEOUT))
    if not value > 0:
        raise ValueError(f"hang_timeout must be > 0 seconds (math.inf: no hang detection), got {value}")
    return float(value)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Fence:
    """One fenced section, entered by every rank in the same order.

    ``start()`` arms it; ``trip(exc)`` on the rank whose code raised; ``origin()`` says which rank failed first
    (or ``None``); ``stop()`` disarms it (always, before groups are rebuilt).

    Args:
        what: the section, as error messages name it.
        hang_timeout: seconds without progress that count as a hang (default ``resolve_hang_timeout()``;
            ``math.inf``: off).
    """

    def __init__(self, what: str, hang_timeout: float | None = None):
        self.what = what
        self.local = not _distributed()
        self.rank = dist.get_rank() if not self.local else 0
        self.hang_timeout = resolve_hang_timeout(hang_timeout)
        self.generation = STATE.generation

    def start(self) -> Fence:
        """Arm the fence on this rank. Returns the fence."""
        if not self.local:
            if math.isfinite(self.hang_timeout):
                progress_hooks.add_hooks()
            WATCHER.arm(self)
        return self

    def trip(self, exc: BaseException) -> int:
        """This rank raised ``exc`` inside the section: record it (first rank wins, one atomic store request),
        break this rank's groups.

        Args:
            exc: what this rank raised.

        Returns:
            The rank that failed first.
        """
        if self.local:
            return self.rank
        origin = self.rank
        try:
            store = records.default_base_store()
            # a copy of another rank's error (DCP hands every rank all of its ranks' failures) names that rank
            theirs = exc.origin_message if isinstance(exc, PeerFailedError) and exc.origin_message else None
            mine = records.format_trip(origin_rank(exc, self.rank), records.ERROR_KIND,
                                       (theirs or summary(exc))[:2000])
            trip = records.parse_trip(store.compare_set(records.trip_key(self.generation), "", mine))
            origin = trip.origin
            if trip.kind == HANG_KIND:  # whatever this rank raised (DCP wraps errors in its own) follows from the hang
                mark_hang(exc)
            if STATE.tripped != self.generation:  # else this rank's watcher was woken: one request woke them all
                records.wake_all(store, self.generation)
        except Exception:  # noqa: BLE001  (store unreachable: its host died; break anyway)
            pass
        breaking.break_training_groups()
        return origin

    def origin(self) -> tuple[int, str] | None:
        """(rank, message) of the rank that failed or hung first, or ``None`` when nobody tripped the fence."""
        try:
            return self._record()
        except Exception:  # noqa: BLE001
            return None

    def tripped(self) -> bool:
        """Whether any rank tripped this fence's generation; store errors raise (the job cannot go on)."""
        if self.local:
            return False
        return STATE.tripped == self.generation or self._record() is not None  # this rank's watcher read it already

    def _record(self) -> tuple[int, str] | None:
        if self.local:
            return None
        store = records.default_base_store()
        key = records.trip_key(self.generation)
        if not store.check([key]):
            return None
        trip = records.parse_trip(store.get(key))
        return trip.origin, trip.message

    def stop(self) -> None:
        """Disarm the fence on this rank (always, before groups are rebuilt)."""
        if not self.local:
            WATCHER.disarm(self)
            if not WATCHER.armed:
                progress_hooks.remove_hooks()


def gathered_error(exc: BaseException, rank: int) -> BaseException:
    """What ``rank`` raises for ``exc`` when ``exc`` is DCP's ``CheckpointException`` (else ``exc`` itself).

    DCP gathers every rank's error into one ``CheckpointException`` raised on every rank: a ``BaseException``, which
    a search's ``catch=(RuntimeError,)`` (or ``except Exception``) lets through, and whose kind is nobody's. On a
    rank that failed: its own error (a copy: DCP pickles it through its gather, same type and attributes, a
    ``HangError`` where it was hung); on the others, ``PeerFailedError`` naming the first rank that failed (a hang
    stays a hang).

    Args:
        exc: what a DCP call raised on this rank.
        rank: this rank.

    Returns:
        The exception to raise instead.
    """
    if "torch.distributed.checkpoint" not in sys.modules:  # DCP never ran here: exc cannot be one of its errors
        return exc
    from torch.distributed.checkpoint import CheckpointException

    if not isinstance(exc, CheckpointException):
        return exc
    raised = {r: failure[0] if isinstance(failure, tuple) else failure  # (error, its stack summary)
              for r, failure in exc.failures.items()}
    if not raised:
        return exc
    if rank in raised:
        return raised[rank]
    first = min(raised)
    error = raised[first]
    text = f"{type(error).__name__}: {error}"
    peer = PeerFailedError(f"rank {first} failed in torch.distributed.checkpoint: {text}", first, text)
    if is_hang(error):
        mark_hang(peer)
    return peer


@contextmanager
def fenced(what: str, hang_timeout: float | None = None) -> Iterator[Fence]:
    """Run a collective section under a fence.

    When any rank raises inside it, every rank raises (the failing rank its own error, the others
    ``PeerFailedError`` naming it) instead of waiting in a collective; when a rank stops making progress for
    ``hang_timeout`` seconds, it raises ``HangError`` (or, not interruptible, every rank exits with
    ``HANG_EXIT_CODE``); a rank named hung raises ``HangError`` whatever it raised on its way out (a broken
    collective, a wrapper such as DCP's ``CheckpointException``). The process groups are broken afterwards: the error
    is fatal for the job unless something rebuilds them (``rebuild_world``).

    Args:
        what: the section, as error messages name it.
        hang_timeout: seconds without progress that count as a hang (default ``resolve_hang_timeout()``;
            ``math.inf``: off).

    Returns:
        A context manager yielding the armed ``Fence``.
    """
    fence = Fence(what, hang_timeout).start()
    try:
        yield fence
    except BaseException as exc:
        origin = fence.trip(exc)
        found = fence.origin()
        hung_here = is_hang(exc) and origin == fence.rank
        if hung_here and found is not None and isinstance(exc, Exception) and not isinstance(exc, HangError):
            # this rank was named hung: what it raised on its way out (a broken collective, a wrapped HangError)
            # follows from the interruption, so it leaves with the HangError a hang outside this section raises
            raise HangError(found[1]) from exc
        if origin != fence.rank and found is not None:
            peer = PeerFailedError(f"rank {found[0]} failed during {what}: {found[1]}; this rank's collectives "
                                   f"were broken so it could leave (the process groups are unusable now)",
                                   found[0], found[1])
            if is_hang(exc):
                mark_hang(peer)
            raise peer from exc
        raise
    finally:
        fence.stop()
