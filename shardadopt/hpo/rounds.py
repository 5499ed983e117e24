"""The control rounds of one distributed trial, and how it ends on every rank at once (``TrialRounds``, the base
of ``shardadopt.hpo.DistributedTrial``, which adds Optuna's trial interface on top).

Rank 0 acts and every rank gets the result, or the same exception, in one round over the control channel
(``shardadopt.hpo.channel``). When the ranks are not all making the same call, the round decides the trial's
``Outcome``: the first error by rank, or a ``DesyncError`` naming what each rank was doing.

Ending a trial: when the objective raises on any rank, that rank ends its trial with the error (``close``, done
by ``shardadopt.hpo.optimize`` or by leaving a ``with DistributedTrial(...)`` block). The other ranks' next
control call then raises that same error instead of waiting, so every rank leaves the trial together. After that
the trial is closed and every further call raises the error again without communicating.

Faults away from a control call: the rank that raised may leave peers blocked in a *training* collective, which
no control round can reach. So each trial runs under a fault fence (``shardadopt.fence``): the failing rank trips
it before its end-of-objective round (store flag, its training groups broken), every other rank's watchdog breaks
its own, their blocked collectives raise, and their errors count as copies of the first rank's (``aux`` 1), so the
trial records that rank's error. A rank that stops making progress for ``hang_timeout`` seconds trips the fence as
hung: it raises ``shardadopt.fence.HangError`` where Python can be interrupted (the trial fails as ``hang`` against
it), else every rank exits (see ``shardadopt.fence``). After the trial, however its end went on this rank (its
close may have raised; a Ctrl-C is held until the end rounds are done), every rank takes part in one more round
saying whether it saw the fence tripped, and when any did, every rank rebuilds the process groups
(``Channel.rebuild``) before the next one.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna

from shardadopt.fence import Fence
from shardadopt.fence.errors import RANK_ATTRIBUTE, origin_rank, summary
from shardadopt.hpo import errors, preempt
from shardadopt.hpo.channel import (
    OP_END,
    OP_FINISH,
    OP_NAMES,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_PRUNED,
    Channel,
    defer_sigint,
)
from shardadopt.hpo.errors import DesyncError, PackedError, PeerLostError

COMPLETE = "complete"
PRUNED = "pruned"
FAIL = "fail"


@dataclass
class Outcome:
    """How a trial ended, the same on every rank. ``error`` is the exception to raise on this rank."""

    state: str
    error: BaseException | None = None
    rank: int | None = None  # the rank the error came from (None: the ranks diverged, no single origin)
    summary: str = ""
    traceback: str = ""
    value: Any = None  # the objective's value on this rank, when complete


@dataclass
class TrialInfo:
    """What rank 0 tells the other ranks when a trial starts."""

    number: int
    multi_objective: bool
    datetime_start: datetime.datetime | None
    user_attrs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    distributions: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, trial: optuna.trial.BaseTrial) -> TrialInfo:
        study = getattr(trial, "study", None)
        return cls(number=trial.number, multi_objective=study is not None and len(study.directions) > 1,
                   datetime_start=trial.datetime_start, user_attrs=dict(trial.user_attrs),
                   params=dict(trial.params), distributions=dict(trial.distributions))


class TrialRounds:
    """The control rounds of one trial on this rank and its end: ``close`` (or leaving a ``with`` block) agrees with
    the other ranks on the ``Outcome``. ``DistributedTrial`` builds on it; it is not used on its own."""

    def _setup(self, channel: Channel, trial: optuna.trial.BaseTrial | None, info: TrialInfo | None) -> None:
        self._channel = channel
        self._trial = trial
        self._info = info
        self._outcome: Outcome | None = None
        self._decision: tuple[int, Any] | None = None  # (round, decision) left by report() for should_prune()
        # A rank failing anywhere in the trial breaks every rank's training collectives (shardadopt.fence); only
        # with the control group shardadopt owns, since the groups are rebuilt (a given group= would die too).
        self._fence = Fence(f"trial {info.number}" if info else "a trial", channel.hang_timeout).start() \
            if not channel.local and channel.own_group else None

    @property
    def number(self) -> int:
        return self._info.number

    @property
    def rank(self) -> int:
        return self._channel.rank

    @property
    def world_size(self) -> int:
        return self._channel.world

    @property
    def closed(self) -> bool:
        return self._outcome is not None

    # -- ending -----------------------------------------------------------------------------------------------------

    def close(self, state: str, error: BaseException | None = None) -> Outcome:
        """End the trial on this rank (``COMPLETE``, ``PRUNED`` or ``FAIL`` with ``error``); collective.

        Args:
            state: how the trial ended on this rank: ``COMPLETE``, ``PRUNED`` or ``FAIL`` (this module's constants).
            error: the exception that failed it on this rank, with ``FAIL``.

        Returns:
            The outcome every rank agrees on: the first error by rank (an error raised where it happened wins
            over copies of it received from another rank), else pruned/complete when all ranks say so.
        """
        with defer_sigint():  # Ctrl-C here waits for the trial's end rounds: no rank may skip one of them
            try:
                if self._outcome is None:
                    self._close(state, error)
            finally:
                self._finish()
        return self._outcome

    def _close(self, state: str, error: BaseException | None) -> None:
        status = {COMPLETE: STATUS_OK, PRUNED: STATUS_PRUNED, FAIL: STATUS_ERROR}[state]
        payload, aux = None, 0
        if state == FAIL:
            assert error is not None
            if self._fence is not None and not getattr(error, _DELIVERED, False):
                # Raised here, possibly while peers wait in a training collective: break them out. When another
                # rank failed first, this error is a consequence (a broken collective): mark it as that rank's copy.
                origin = self._fence.trip(error)
                if origin != self._channel.rank and not hasattr(error, RANK_ATTRIBUTE):
                    with contextlib.suppress(Exception):
                        setattr(error, RANK_ATTRIBUTE, origin)
            try:
                packed = errors.pack(error, self._channel.rank)
            except Exception:  # noqa: BLE001  (this rank must still reach the end round the others wait in)
                packed = errors.pack(errors.RemoteError(type(error).__name__, summary(error)),
                                     origin_rank(error, self._channel.rank))
            payload = pickle.dumps(packed)
            aux = int(packed.rank != self._channel.rank)  # 1: a copy of another rank's error
            self._channel.record_error(packed.traceback)
        table = self._exchange(OP_END, status, payload, aux, error)
        if self._outcome is None:  # every rank is at the end of the objective
            statuses = {row[1] for row in table}
            if STATUS_ERROR in statuses:
                self._terminal(table, payload, error)
            elif statuses == {STATUS_OK}:
                self._outcome = Outcome(COMPLETE)
            elif statuses == {STATUS_PRUNED}:
                self._outcome = Outcome(PRUNED)
            else:
                self._desync(table)

    def _finish(self) -> None:
        """The trial ended (or the control plane broke): disarm the fence, then one round in which every rank says
        whether it saw the fence tripped; when any did, every rank rebuilds the process groups it broke. Every rank
        gets here whatever happened in its close (``close`` calls it in ``finally``), so the decision is the same
        everywhere and no rank waits alone in the rebuild's ``init_process_group``."""
        fence, self._fence = self._fence, None
        if fence is None:
            return
        fence.stop()  # no hang decision, and no backstop exit, of this rank's after this point
        if self._channel.broken is not None:
            return
        table = self._channel.exchange(OP_FINISH, aux=int(fence.tripped()))
        if any(row[0] != OP_FINISH for row in table):
            doing = [OP_NAMES.get(row[0], row[0]) for row in table]
            raise PeerLostError(f"shardadopt HPO: ranks out of step at the end of "
                                f"{self._channel.context or 'a trial'}: {doing}")
        if any(row[3] for row in table):
            self._channel.rebuild()

    def __enter__(self) -> TrialRounds:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            outcome = self.close(COMPLETE)
        elif isinstance(exc, optuna.TrialPruned):
            outcome = self.close(PRUNED, exc)
        else:
            outcome = self.close(FAIL, exc)
        if outcome.error is not None and outcome.error is not exc:
            raise outcome.error
        return False

    # -- rounds -----------------------------------------------------------------------------------------------------

    def _root_call(self, op: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0; its result on every rank, or its exception raised on every rank."""
        payload = None
        if self._channel.is_root and not self.closed:
            try:
                preempt.check()
                payload = pickle.dumps((True, fn()))
            except Exception as exc:
                payload = pickle.dumps((False, errors.pack(exc, 0)))
        _, data = self._round(op, payload=payload)
        ok, result = pickle.loads(data)
        if not ok:
            raise self._raise(result)
        return result

    def _round(self, op: int, aux: int = 0, payload: bytes | None = None) -> tuple[list[list[int]], bytes | None]:
        """An in-trial round; raises the trial's error on every rank when another rank ended the trial."""
        table = self._exchange(op, STATUS_OK, payload, aux)
        if self._outcome is not None:
            raise self._outcome.error
        length = table[0][2]
        data = self._channel.broadcast_bytes(0, payload, length, op) if length else None
        return table, data

    def _exchange(self, op: int, status: int, payload: bytes | None, aux: int,
                  local_error: BaseException | None = None) -> list[list[int]]:
        """One round of this trial; when the ranks are not all doing ``op``, decide the trial's outcome."""
        if self._outcome is not None:  # closed: no more communication, the same error again
            if self._outcome.error is not None:
                raise self._outcome.error
            raise RuntimeError(f"trial {self.number} already ended ({self._outcome.state}): "
                               f"{OP_NAMES[op]} cannot be called after the objective finished")
        table = self._channel.exchange(op, status, len(payload) if payload else 0, aux)
        if any(row[0] != op for row in table):
            if any(row[0] == OP_END and row[1] == STATUS_ERROR for row in table):
                self._terminal(table, payload if op == OP_END else None, local_error)
            else:
                self._desync(table)
        return table

    def _terminal(self, table: list[list[int]], payload: bytes | None, local_error: BaseException | None) -> None:
        """Some rank ended the objective with an error: agree on one error and close the trial everywhere."""
        failed = [r for r, row in enumerate(table) if row[0] == OP_END and row[1] == STATUS_ERROR]
        originals = [r for r in failed if table[r][3] == 0]
        src = min(originals or failed)
        me = self._channel.rank
        data = self._channel.broadcast_bytes(src, payload if me == src else None, table[src][2], OP_END)
        packed: PackedError = pickle.loads(data)
        if local_error is not None and packed.rank == me:
            error = local_error  # raise the original object, with its own traceback, where it happened
        else:
            error = errors.unpack(packed, me)
        if error is not local_error:
            _deliver(error)
        self._outcome = Outcome(FAIL, error, packed.rank, packed.summary, packed.traceback)

    def _desync(self, table: list[list[int]]) -> None:
        names = {STATUS_OK: "returned", STATUS_PRUNED: "raised TrialPruned", STATUS_ERROR: "raised"}
        doing = ", ".join(
            f"rank {r}: {OP_NAMES.get(row[0], row[0])}" + (f" ({names[row[1]]})" if row[0] == OP_END else "")
            for r, row in enumerate(table))
        error = _deliver(DesyncError(f"trial {self.number}: the ranks took different paths through the objective "
                                     f"({doing}); every rank must make the same trial calls in the same order"))
        self._outcome = Outcome(FAIL, error, None, summary(error), "")

    def _raise(self, packed: PackedError) -> BaseException:
        """The exception of a method call that raised on rank 0 (the trial goes on if the objective catches it)."""
        return _deliver(errors.unpack(packed, self._channel.rank))


_DELIVERED = "_shardadopt_delivered"  # an error every rank got in the same control round: no rank is left behind


def _deliver(error: BaseException) -> BaseException:
    with contextlib.suppress(Exception):
        setattr(error, _DELIVERED, True)
    return error
