"""Errors and failure kinds shared by the fault fence (``shardadopt.fence``) and the HPO layer above it.

They live below both so the fence names the rank an error came from, and marks a hang, the way the HPO control plane
reads it, without importing ``shardadopt.hpo``. Two exception attributes carry that across ranks (they survive
pickling): ``shardadopt_rank`` (the rank an error first came from) and ``shardadopt_failure_kind`` (a kind of
``shardadopt.hpo.failures``).
"""

from __future__ import annotations

RANK_ATTRIBUTE = "shardadopt_rank"
FAILURE_KIND_ATTRIBUTE = "shardadopt_failure_kind"
HANG_KIND = "hang"  # a rank made no progress for the hang timeout inside a fenced section


def origin_rank(exc: BaseException, default: int) -> int:
    """The rank an exception first came from.

    Args:
        exc: the exception.
        default: the rank to report when ``exc`` was raised locally.

    Returns:
        The rank named by ``exc``'s ``shardadopt_rank`` attribute, else ``default``.
    """
    return getattr(exc, RANK_ATTRIBUTE, default)


def summary(exc: BaseException) -> str:
    """``type: text`` of ``exc`` (only the type's name when the text is empty, or when ``__str__`` raises)."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001  (an exception whose __str__ raises still travels)
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def mark_hang(exc: BaseException) -> None:
    """Record on ``exc`` that it follows from a hang (failure kind ``hang``); an exception type refusing attributes
    keeps its own kind."""
    try:
        setattr(exc, FAILURE_KIND_ATTRIBUTE, HANG_KIND)
    except Exception:  # noqa: BLE001
        pass


def is_hang(exc: BaseException) -> bool:
    """Whether ``exc`` was marked as following from a hang (``mark_hang``)."""
    return getattr(exc, FAILURE_KIND_ATTRIBUTE, None) == HANG_KIND


class PeerFailedError(RuntimeError):
    """Another rank failed inside a fenced section; this rank's collectives were broken so it could leave.

    ``rank`` is the rank that failed first and ``message`` its error (``type: text``). The attribute
    ``shardadopt_rank`` is set too, so the HPO control plane treats it as a copy of that rank's error.
    """

    def __init__(self, message: str, rank: int, origin_message: str = ""):
        super().__init__(message)
        self.rank = rank
        self.origin_message = origin_message
        setattr(self, RANK_ATTRIBUTE, rank)

    def __reduce__(self):  # attributes (the failure kind of a hang) travel too
        return (type(self), (self.args[0], self.rank, self.origin_message), self.__dict__)


class HangError(RuntimeError):
    """Raised in the main thread of a rank that made no progress for ``hang_timeout`` seconds inside a fenced
    section, while its peers waited for it (see ``docs/fence.md``). Failure kind ``hang``."""

    def __init__(self, message: str):
        super().__init__(message)
        mark_hang(self)

    def __reduce__(self):
        return (type(self), (self.args[0],))
