"""``DistributedTrial``: one Optuna trial seen consistently by every rank of a torch.distributed job.

Rank 0 wraps the real trial; the other ranks pass ``None``. Every method that touches the trial is collective
(call it on every rank, in the same order): rank 0 does the work and every rank gets the same result, or raises
the same exception (its original type, the rank it came from named, see ``shardadopt.hpo.errors``). Properties
that only reflect earlier calls (``params``, ``distributions``, ``user_attrs``, ``number``, ``datetime_start``)
are kept in step on every rank and need no communication.

Pruning: ``report(value, step)`` is one control round in which rank 0 reports and also asks the pruner, so the
decision reaches every rank with the report; the ``should_prune()`` that follows returns that decision without
another round (one control round per report + should_prune). ``should_prune()`` *returns* the same bool on
every rank, as Optuna's API does, so ``if trial.should_prune(): raise optuna.TrialPruned()`` works unchanged;
``report_and_maybe_prune`` does both and raises. Called on its own (not right after ``report``), ``should_prune``
asks rank 0's pruner in its own round.

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

Past 400 lines for one reason: ``DistributedTrial`` implements Optuna's whole ``BaseTrial`` interface (every
``suggest_*``, ``report``, ``should_prune``, the attributes), each method a collective that reads best beside the
others.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from shardadopt.fence import Fence
from shardadopt.fence.errors import RANK_ATTRIBUTE, origin_rank, summary
from shardadopt.hpo import errors, preempt
from shardadopt.hpo.channel import (
    OP_END,
    OP_FINISH,
    OP_INIT,
    OP_NAMES,
    OP_REPORT,
    OP_SET_ATTR,
    OP_SHOULD_PRUNE,
    OP_SUGGEST,
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

# report() round, rank 0's aux: the prune decision, or which call raised (its error is the payload).
_KEEP, _PRUNE, _REPORT_RAISED, _PRUNE_RAISED = 0, 1, 2, 3


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


class DistributedTrial(optuna.trial.BaseTrial):
    """A trial every rank can use: pass the real ``optuna.Trial`` on rank 0 and ``None`` on the other ranks.

    Constructing it is collective. ``group`` is a gloo process group for the control messages (default: one
    dedicated gloo group over the world, created once; a given group turns the fault fence off, with a
    ``FenceOffWarning``); ``timeout`` bounds every control round (seconds; default ``$SHARDADOPT_HPO_TIMEOUT`` or
    600): a dead or stuck peer raises ``PeerLostError`` naming it; ``hang_timeout`` (seconds without progress,
    default ``$SHARDADOPT_HANG_TIMEOUT`` or 900, ``math.inf``: off) bounds a hang (``shardadopt.fence``). Use it as a
    context manager in a hand-written loop so an exception on any rank ends the trial on all of them;
    ``shardadopt.hpo.optimize`` does that for you and passes a ready ``DistributedTrial`` to the objective.
    """

    def __init__(self, trial: optuna.trial.BaseTrial | None, *, group: Any = None, timeout: float | None = None,
                 hang_timeout: float | None = None):
        channel = Channel(group, timeout, hang_timeout)

        def info() -> TrialInfo:
            if trial is None:
                raise ValueError("DistributedTrial(None) on rank 0: rank 0 must pass the real optuna trial "
                                 "(the other ranks pass None)")
            if isinstance(trial, DistributedTrial):
                raise TypeError("DistributedTrial(DistributedTrial(...)): the trial is already distributed; "
                                "shardadopt.hpo.optimize passes a DistributedTrial to the objective, use it as is")
            return TrialInfo.of(trial)

        self._setup(channel, trial if channel.is_root else None, None)
        try:
            self._info = self._root_call(OP_INIT, info)
        except BaseException:
            self._finish()  # no trial: stop the watchdog
            raise
        self._adopt(self._info)

    @classmethod
    def _started(cls, channel: Channel, trial: optuna.trial.BaseTrial | None, info: TrialInfo) -> DistributedTrial:
        """A trial whose start ``optimize`` already announced in its command round (no extra round)."""
        self = cls.__new__(cls)
        self._setup(channel, trial, info)
        self._adopt(info)
        return self

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

    def _adopt(self, info: TrialInfo) -> None:
        self._params = dict(info.params)
        self._distributions = dict(info.distributions)
        self._user_attrs = dict(info.user_attrs)
        self._channel.context = f"trial {info.number}"

    # -- what every rank knows locally ------------------------------------------------------------------------------

    @property
    def number(self) -> int:
        return self._info.number

    @property
    def params(self) -> dict[str, Any]:
        return dict(self._params)

    @property
    def distributions(self) -> dict[str, Any]:
        return dict(self._distributions)

    @property
    def user_attrs(self) -> dict[str, Any]:
        return dict(self._user_attrs)

    @property
    def datetime_start(self) -> datetime.datetime | None:
        return self._info.datetime_start

    @property
    def multi_objective(self) -> bool:
        """Whether the study has several objectives (then Optuna has no pruning and ``report`` raises)."""
        return self._info.multi_objective

    @property
    def rank(self) -> int:
        return self._channel.rank

    @property
    def world_size(self) -> int:
        return self._channel.world

    @property
    def closed(self) -> bool:
        return self._outcome is not None

    # -- collective: rank 0 acts, every rank gets the result ----------------------------------------------------------

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float:
        """Optuna's ``suggest_float``, sampled on rank 0; collective.

        Args:
            name: the parameter's name.
            low: the lower bound.
            high: the upper bound.
            step: the grid step, or None.
            log: sample on a log scale.

        Returns:
            Rank 0's value, on every rank.
        """
        return self._suggest("suggest_float", name, low, high, step=step, log=log)

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        """Optuna's ``suggest_int``, sampled on rank 0; collective.

        Args:
            name: the parameter's name.
            low: the lower bound.
            high: the upper bound (included).
            step: the grid step.
            log: sample on a log scale.

        Returns:
            Rank 0's value, on every rank.
        """
        return self._suggest("suggest_int", name, low, high, step=step, log=log)

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        """Optuna's ``suggest_categorical``, sampled on rank 0; collective.

        Args:
            name: the parameter's name.
            choices: the values to choose from.

        Returns:
            Rank 0's choice, on every rank.
        """
        return self._suggest("suggest_categorical", name, choices)

    def suggest_uniform(self, name: str, low: float, high: float) -> float:
        """Optuna 4.x's deprecated ``suggest_uniform``, sampled on rank 0; collective."""
        return self._suggest("suggest_uniform", name, low, high)

    def suggest_loguniform(self, name: str, low: float, high: float) -> float:
        """Optuna 4.x's deprecated ``suggest_loguniform``, sampled on rank 0; collective."""
        return self._suggest("suggest_loguniform", name, low, high)

    def suggest_discrete_uniform(self, name: str, low: float, high: float, q: float) -> float:
        """Optuna 4.x's deprecated ``suggest_discrete_uniform``, sampled on rank 0; collective."""
        return self._suggest("suggest_discrete_uniform", name, low, high, q)

    def report(self, value: float, step: int) -> None:
        """Report on rank 0 and take rank 0's prune decision in the same round (see the module docstring).

        Args:
            value: the intermediate value (rank 0's is recorded).
            step: the step it belongs to.
        """
        payload = None
        decision = _KEEP
        if self._channel.is_root and not self.closed:
            try:
                preempt.check()  # a SIGTERM on rank 0 ends the trial here, on every rank
                self._trial.report(value, step)
            except Exception as exc:
                decision, payload = _REPORT_RAISED, pickle.dumps(errors.pack(exc, 0))
            else:
                try:
                    decision = _PRUNE if self._trial.should_prune() else _KEEP
                except Exception as exc:
                    decision, payload = _PRUNE_RAISED, pickle.dumps(errors.pack(exc, 0))
        table, data = self._round(OP_REPORT, aux=decision, payload=payload)
        decision = table[0][3]
        if decision == _REPORT_RAISED:
            raise self._raise(pickle.loads(data))
        self._decision = (self._channel.rounds, pickle.loads(data) if decision == _PRUNE_RAISED else
                          decision == _PRUNE)

    def should_prune(self) -> bool:
        """Rank 0's pruner decision, the same bool on every rank.

        Returns:
            True when the trial should stop, on every rank.
        """
        if self._decision is not None and self._decision[0] == self._channel.rounds and not self.closed:
            _, decision = self._decision
            self._decision = None
            if isinstance(decision, PackedError):
                raise self._raise(decision)
            return decision
        return self._root_call(OP_SHOULD_PRUNE, lambda: self._trial.should_prune())

    def report_and_maybe_prune(self, value: float, step: int) -> None:
        """``report(value, step)``, then raise ``optuna.TrialPruned`` on every rank when rank 0's pruner says so.

        Args:
            value: the intermediate value (rank 0's is recorded).
            step: the step it belongs to.

        Raises:
            optuna.TrialPruned: on every rank, when rank 0's pruner prunes the trial.
        """
        self.report(value, step)
        if self.should_prune():
            raise optuna.TrialPruned(f"trial {self.number} pruned at step {step}")

    def set_user_attr(self, key: str, value: Any) -> None:
        """Set a user attribute of the trial in rank 0's storage; collective.

        Args:
            key: the attribute's name.
            value: a JSON-able value.
        """
        key, value = self._root_call(OP_SET_ATTR, lambda: (self._trial.set_user_attr(key, value), (key, value))[1])
        self._user_attrs[key] = value

    def set_system_attr(self, key: str, value: Any) -> None:
        """Optuna 4.x only (deprecated there, removed in 5.0)."""
        self._root_call(OP_SET_ATTR, lambda: self._trial.set_system_attr(key, value))

    def set_constraint(self, key: str, value: float) -> None:
        """Optuna 5.0: a constraint value for constrained optimisation."""
        self._root_call(OP_SET_ATTR, lambda: self._trial.set_constraint(key, value))

    @property
    def system_attrs(self) -> dict[str, Any]:
        """Collective: read from rank 0's storage."""
        return self._root_call(OP_SET_ATTR, lambda: dict(self._trial.system_attrs))

    @property
    def constraints(self) -> dict[str, float]:
        """Collective: read from rank 0's storage (optuna 5.0)."""
        return self._root_call(OP_SET_ATTR, lambda: dict(self._trial.constraints))

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

    def __enter__(self) -> DistributedTrial:
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

    def _suggest(self, method: str, name: str, *args: Any, **kwargs: Any) -> Any:
        def call() -> tuple[Any, Any]:
            value = getattr(self._trial, method)(name, *args, **kwargs)
            return value, self._trial.distributions[name]

        value, distribution = self._root_call(OP_SUGGEST, call)
        self._params[name] = value
        self._distributions[name] = distribution
        return value

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


def report_and_maybe_prune(trial: DistributedTrial, value: float, step: int) -> None:
    """Report ``value`` at ``step`` and raise ``optuna.TrialPruned`` on every rank when rank 0's pruner says so.

    Args:
        trial: the trial, on every rank.
        value: the intermediate value (rank 0's is recorded).
        step: the step it belongs to.

    Raises:
        optuna.TrialPruned: on every rank, when rank 0's pruner prunes the trial.
    """
    trial.report_and_maybe_prune(value, step)
