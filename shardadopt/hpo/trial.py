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

Ending a trial and faults away from a control call: ``shardadopt.hpo.rounds`` (``TrialRounds``, this class's base,
holds the control rounds and the trial's end).
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Sequence
from typing import Any

import optuna

from shardadopt.hpo import errors, preempt
from shardadopt.hpo.channel import OP_INIT, OP_REPORT, OP_SET_ATTR, OP_SHOULD_PRUNE, OP_SUGGEST, Channel
from shardadopt.hpo.errors import PackedError
from shardadopt.hpo.rounds import TrialInfo, TrialRounds

# report() round, rank 0's aux: the prune decision, or which call raised (its error is the payload).
_KEEP, _PRUNE, _REPORT_RAISED, _PRUNE_RAISED = 0, 1, 2, 3


class DistributedTrial(TrialRounds, optuna.trial.BaseTrial):
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

    def _adopt(self, info: TrialInfo) -> None:
        self._params = dict(info.params)
        self._distributions = dict(info.distributions)
        self._user_attrs = dict(info.user_attrs)
        self._channel.context = f"trial {info.number}"

    # -- what every rank knows locally (``number``, ``rank``, ``world_size``, ``closed``: ``TrialRounds``) ----------

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

    # -- rounds -----------------------------------------------------------------------------------------------------

    def _suggest(self, method: str, name: str, *args: Any, **kwargs: Any) -> Any:
        def call() -> tuple[Any, Any]:
            value = getattr(self._trial, method)(name, *args, **kwargs)
            return value, self._trial.distributions[name]

        value, distribution = self._root_call(OP_SUGGEST, call)
        self._params[name] = value
        self._distributions[name] = distribution
        return value


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
