"""``optimize``: Optuna's ``study.optimize`` for objectives that run on every rank of a torch.distributed job.

Rank 0 runs the real ``study.optimize`` (so ``n_trials``, ``timeout``, ``study.stop()``, ``catch``, callbacks,
``gc_after_trial`` and the progress bar behave exactly as Optuna's); the other ranks run a worker loop that waits
for rank 0's next command. Before each trial rank 0 sends START (the trial's number and state); when its loop
ends, for whatever reason, it sends STOP, carrying the error when it ended with one. So:

- every trial runs on every rank, with a ``DistributedTrial`` whose calls are collective and consistent;
- an exception on any rank ends the trial on every rank (see ``DistributedTrial``); rank 0 tells Optuna FAIL
  once, recording the error and the rank it came from as user attributes; then Optuna's ``catch`` decides on
  rank 0 and the decision reaches every rank: the next START, or a STOP that makes every rank raise the same
  error type (the originating rank raises its own exception object);
- ``timeout``, ``n_trials``, ``study.stop()`` and KeyboardInterrupt on rank 0 end the loop on every rank after
  the current trial;
- a dead or stuck peer raises ``PeerLostError`` naming it on the survivors, within the control timeout, and stops
  the study (the process group cannot be trusted any more).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import optuna

from shardadopt.hpo import errors, failures
from shardadopt.hpo.channel import OP_COMMAND, OP_ROOT_CALL, Channel
from shardadopt.hpo.errors import PeerLostError
from shardadopt.hpo.trial import COMPLETE, FAIL, PRUNED, DistributedTrial, Outcome, TrialInfo

Objective = Callable[[DistributedTrial], Any]

# Rank 0 records on every failed trial: failures.ATTR_KIND, failures.ATTR_MESSAGE, and the originating rank.
ATTR_RANK = "failure_rank"

_START, _STOP = "start", "stop"


def optimize(study: optuna.Study | Callable[[], optuna.Study] | None, objective: Objective,
             n_trials: int | None = None, timeout: float | None = None, n_jobs: int = 1,
             catch: Iterable[type[Exception]] | type[Exception] = (),
             callbacks: Iterable[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] | None = None,
             gc_after_trial: bool = False, show_progress_bar: bool = False, *, group: Any = None,
             control_timeout: float | None = None) -> optuna.Study | None:
    """Run ``objective(trial)`` on every rank for each trial of ``study``; a collective call.

    ``study`` matters on rank 0 only (the other ranks may pass ``None``); it may be a zero-argument function
    that creates it, called on rank 0 only, whose errors every rank raises. ``objective`` receives a
    ``DistributedTrial`` on every rank; rank 0's return value is the trial's value. ``callbacks`` run on rank 0.
    The arguments have Optuna's meaning; ``n_jobs`` must be 1 when the world has more than one rank (a trial
    already uses every rank). ``group`` and ``control_timeout`` configure the control plane (see
    ``DistributedTrial``). Returns the study on rank 0 and ``None`` elsewhere; without an initialised process
    group it is plain ``study.optimize`` with a ``DistributedTrial`` for the objective.
    """
    if isinstance(catch, type):
        catch = (catch,)
    catch = tuple(catch)
    channel = Channel(group, control_timeout)
    if n_jobs != 1 and channel.world > 1:
        raise ValueError(f"optimize(n_jobs={n_jobs}) with {channel.world} ranks: every trial already runs on all "
                         "ranks, so trials cannot run in parallel threads; use n_jobs=1 (start more torchrun jobs "
                         "on one shared storage to run trials concurrently)")
    if channel.is_root:
        return _root_loop(channel, study, objective, n_trials, timeout, n_jobs, catch, callbacks, gc_after_trial,
                          show_progress_bar)
    _worker_loop(channel, objective, gc_after_trial)
    return None


def run_on_root(channel: Channel, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0; its result on every rank, or its exception raised on every rank. Collective."""
    result: Any = None
    if channel.is_root:
        try:
            result = (True, fn())
        except BaseException as exc:
            result = (False, errors.pack(exc, 0))
    ok, value = channel.broadcast_object(0, result, OP_ROOT_CALL)
    if not ok:
        raise errors.unpack(value, channel.rank)
    return value


def _root_loop(channel: Channel, study: Any, objective: Objective, n_trials: int | None, timeout: float | None,
               n_jobs: int, catch: tuple, callbacks: Any, gc_after_trial: bool,
               show_progress_bar: bool) -> optuna.Study:
    fatal: list[BaseException] = []  # a lost peer: the study must stop even when `catch` covers the error

    def run_trial(trial: optuna.Trial) -> Any:
        try:
            info = TrialInfo.of(trial)
            if channel.world > 1:
                channel.broadcast_object(0, (_START, info), OP_COMMAND)
            outcome = _run_objective(DistributedTrial._started(channel, trial, info), objective)
        except PeerLostError as exc:
            outcome = Outcome(FAIL, exc, 0, errors.summary(exc))
        if isinstance(outcome.error, PeerLostError):
            fatal.append(outcome.error)
            trial.study.stop()
        if outcome.state == FAIL:
            _record_failure(trial, outcome)
            raise outcome.error
        if outcome.state == PRUNED:
            raise outcome.error if outcome.error is not None else optuna.TrialPruned()
        return outcome.value

    try:
        if callable(study) and not isinstance(study, optuna.Study):
            study = study()
        if not isinstance(study, optuna.Study):
            raise TypeError(f"optimize() needs an optuna.Study (or a function creating one) on rank 0, "
                            f"got {type(study).__name__}")
        study.optimize(run_trial, n_trials=n_trials, timeout=timeout, n_jobs=n_jobs, catch=catch,
                       callbacks=callbacks, gc_after_trial=gc_after_trial, show_progress_bar=show_progress_bar)
        if fatal:
            raise fatal[0]
    except BaseException as exc:
        if channel.world > 1 and channel.broken is None:
            channel.broadcast_object(0, (_STOP, errors.pack(exc, 0)), OP_COMMAND)
        raise
    if channel.world > 1:
        channel.broadcast_object(0, (_STOP, None), OP_COMMAND)
    return study


def _worker_loop(channel: Channel, objective: Objective, gc_after_trial: bool) -> None:
    own_error: BaseException | None = None  # the last trial's error if it started here: re-raised as itself
    while True:
        command, detail = channel.broadcast_object(0, None, OP_COMMAND)
        if command == _STOP:
            if detail is None:
                return
            if detail.rank == channel.rank and own_error is not None:
                raise own_error
            raise errors.unpack(detail, channel.rank)
        outcome = _run_objective(DistributedTrial._started(channel, None, detail), objective)
        own_error = outcome.error if outcome.state == FAIL and outcome.rank == channel.rank else None
        if gc_after_trial:
            gc.collect()


def _run_objective(trial: DistributedTrial, objective: Objective) -> Outcome:
    """Run the objective on this rank and agree with the other ranks on how the trial ended."""
    try:
        value = objective(trial)
    except optuna.TrialPruned as exc:
        outcome = trial.close(PRUNED, exc)
        if outcome.state == PRUNED:
            outcome.error = exc
        return outcome
    except BaseException as exc:  # KeyboardInterrupt too: the other ranks must leave this trial as well
        return trial.close(FAIL, exc)
    outcome = trial.close(COMPLETE)
    if outcome.state == COMPLETE:
        outcome.value = value
    return outcome


def _record_failure(trial: optuna.Trial, outcome: Outcome) -> None:
    """Record why the trial failed, and where, on the trial itself (Optuna only logs the error)."""
    origin = "diverged" if outcome.rank is None else outcome.rank
    where = "the ranks diverged" if outcome.rank is None else f"raised on rank {outcome.rank}"
    try:
        trial.set_user_attr(failures.ATTR_KIND, failures.classify(outcome.error))
        trial.set_user_attr(failures.ATTR_MESSAGE, f"{outcome.summary} ({where})"[:2000])
        trial.set_user_attr(ATTR_RANK, origin)
    except Exception:  # storage trouble must not hide the trial's own error
        pass


__all__ = ["optimize", "run_on_root", "ATTR_RANK"]
