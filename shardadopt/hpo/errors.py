"""Errors of the distributed HPO control plane, and how an exception travels from one rank to the others.

An exception raised on one rank is pickled and raised again on every other rank with its original type (so
``catch=(ValueError,)`` decides the same way everywhere). The copy names the rank it came from: its
``__cause__`` is a ``RemoteTraceback`` holding the originating rank's traceback, it carries the attribute
``shardadopt_rank``, and on Python >= 3.11 a note "raised on rank N".
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass

from shardadopt.fence.errors import RANK_ATTRIBUTE, origin_rank, summary


class HPOControlError(RuntimeError):
    """Base class of the errors the control plane itself raises."""


class PeerLostError(HPOControlError):
    """A peer rank died or stopped answering control messages within the control timeout.

    ``ranks`` are the ranks that did not reach the control round; ``errors`` maps a rank to the error it recorded
    before it went silent (when it had the chance). The process group can no longer be trusted: the study stops.
    """

    def __init__(self, message: str, ranks: list[int] | None = None, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.ranks = list(ranks or [])
        self.errors = dict(errors or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.ranks, self.errors))


class DesyncError(HPOControlError):
    """The ranks took different paths through the objective (e.g. one returned while another called a trial
    method). The trial fails on every rank; the study goes on when ``RuntimeError`` is in ``catch``."""


class RemoteError(RuntimeError):
    """Stands in for an exception from another rank that could not be pickled; keeps its type name and text."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class RemoteTraceback(Exception):
    """The traceback text of the exception on the rank that raised it (shown as the ``__cause__``)."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class PackedError:
    """An exception in transit: the pickled object, its origin rank and its formatted traceback."""

    blob: bytes
    rank: int
    traceback: str
    summary: str


def pack(exc: BaseException, rank: int) -> PackedError:
    origin = origin_rank(exc, rank)
    text = getattr(exc, "_shardadopt_traceback", None) or "".join(
        traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt (required keyword-only arguments)
    except Exception:
        message = summary(exc).partition(": ")[2]
        blob = pickle.dumps(RemoteError(type(exc).__qualname__, message))
    return PackedError(blob, origin, text, summary(exc))


def unpack(packed: PackedError, local_rank: int) -> BaseException:
    """The exception of ``packed``, ready to raise on this rank, naming the rank it came from. One whose class
    cannot be loaded here (a module only the raising rank imports) arrives as a ``RemoteError``."""
    try:
        exc: BaseException = pickle.loads(packed.blob)
    except Exception:  # noqa: BLE001
        type_name, _, message = packed.summary.partition(": ")
        exc = RemoteError(type_name, message)
    if packed.rank == local_rank:
        return exc
    setattr(exc, RANK_ATTRIBUTE, packed.rank)
    exc._shardadopt_traceback = packed.traceback  # type: ignore[attr-defined]  # forwarded unchanged
    exc.__cause__ = RemoteTraceback(f"\n--- raised on rank {packed.rank} ---\n{packed.traceback}")
    note = f"raised on rank {packed.rank}"
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
    return exc
