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
  the study (the process group cannot be trusted any more);
- an exception anywhere in the objective, even while the other ranks wait in a training collective, ends the
  trial on every rank within a fraction of a second (the trial's fault fence, see ``shardadopt.hpo.rounds``) and
  the process groups are rebuilt, so with ``catch`` the next trial trains on working groups.

Durable, multi-job studies: pass ``StudySpec(storage=..., study_name=...)`` (a URL or an Optuna storage) instead of
a study, and any number of torchrun jobs attach to the same study as workers (rank 0 of each job alone talks to
storage; a bad URL raises ``StorageError`` on every rank before any training). On every trial rank 0 records the failure
kind of a FAIL (``nan_loss`` for a non-finite objective, ``config_error``, ``preempted`` on SIGTERM, ...), the
reproducibility attributes (search-space version, git SHA, library versions, world size and topology, data
snapshot) and ``params_hash``, and keeps a heartbeat while the trial runs (persistent storages), so
``shardadopt hpo requeue`` can fail dead trials and retry them once; ``trial_checkpoint_dir(trial, root)`` gives
each live trial a directory of its own and ``resume_checkpoint`` finds the dead trial's for its retry. Restarted by
``torchrun --max-restarts``, a job's search goes on: ``shardadopt.hpo.restart`` fails the trial the dead attempt was
running, retries it once, and counts the earlier attempts' trials against ``n_trials``.

Rank 0's study loop and the other ranks' worker loop answer each other message by message, so they stay in one
module; ``optimize``'s options are in ``shardadopt.hpo.options``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import optuna
from optuna.storages import InMemoryStorage

from shardadopt import fence, upstream
from shardadopt.fence.errors import summary
from shardadopt.hpo import errors, failures, preempt, reseed, restart
from shardadopt.hpo.attach import attach_study, resume_checkpoint, trial_checkpoint_dir
from shardadopt.hpo.channel import OP_COMMAND, OP_ROOT_CALL, Channel
from shardadopt.hpo.durability import ATTR_CHECKPOINT_DIR, TrialHeartbeat, checkpoint_name
from shardadopt.hpo.errors import PeerLostError
from shardadopt.hpo.options import MOVED_OPTIONS, ControlOptions, DurabilityOptions, StudySpec
from shardadopt.hpo.provenance import (
    ATTR_PARAMS_HASH,
    check_space_version,
    params_hash,
    reproducibility_attrs,
    space_version,
)
from shardadopt.hpo.pruning_check import keep_unpruned, mark_unpruned
from shardadopt.hpo.rounds import COMPLETE, FAIL, PRUNED, Outcome, TrialInfo
from shardadopt.hpo.trial import DistributedTrial

Objective = Callable[[DistributedTrial], Any]

# Rank 0 records on every failed trial: failures.ATTR_KIND, failures.ATTR_MESSAGE, and the originating rank.
ATTR_RANK = "failure_rank"

_START, _STOP = "start", "stop"
_PROGRESS_BAR_TRIALS = 20  # studies at least this long show optuna's progress bar on rank 0 (on a terminal)


def optimize(study: optuna.Study | StudySpec | Callable[[], optuna.Study] | None, objective: Objective,
             n_trials: int | None = None, timeout: float | None = None, n_jobs: int = 1,
             catch: Iterable[type[Exception]] | type[Exception] = (),
             callbacks: Iterable[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] | None = None,
             gc_after_trial: bool = False, show_progress_bar: bool | None = None, *,
             durability: DurabilityOptions | None = None, control: ControlOptions | None = None,
             **moved: Any) -> optuna.Study | None:
    """Run ``objective(trial)`` on every rank for each trial of ``study``; a collective call.

    ``study`` matters on rank 0 only (the other ranks may pass ``None``): an ``optuna.Study``, a zero-argument
    function that creates it (called on rank 0 only; every rank raises its errors), or a ``StudySpec``: rank 0
    creates the study in its storage or attaches to it, so many jobs share it. ``objective`` receives a
    ``DistributedTrial`` on every rank; rank 0's return value is the trial's value (a non-finite one fails the
    trial as ``nan_loss``). ``callbacks`` run on rank 0. The arguments up to ``show_progress_bar`` have Optuna's
    meaning; ``n_jobs`` must be 1 when the world has more than one rank (a trial already uses every rank);
    ``show_progress_bar=None`` shows it for studies of 20+ trials on a terminal.

    ``durability`` (``DurabilityOptions``): search-space version check, reproducibility attributes and heartbeats.
    SIGTERM on rank 0 ends the running trial as ``preempted`` on every rank at its next control call and stops the
    study. ``control`` (``ControlOptions``): the control plane's group and timeout. Returns the study on rank 0 and
    ``None`` elsewhere; without an initialised process group it is plain ``study.optimize`` with a
    ``DistributedTrial`` for the objective.

    Args:
        study: the study, a function creating it, or a ``StudySpec`` (rank 0; None elsewhere).
        objective: called with a ``DistributedTrial`` on every rank; returns the value (or values).
        n_trials: this job's number of trials (Optuna's meaning).
        timeout: seconds after which no new trial starts.
        n_jobs: must be 1 with more than one rank.
        catch: exception types that fail a trial without stopping the study.
        callbacks: run on rank 0 after each trial.
        gc_after_trial: run the garbage collector after each trial.
        show_progress_bar: Optuna's progress bar (None: for 20+ trials on a terminal).
        durability: space version, reproducibility attributes, heartbeats, unpruned trials, warm start.
        control: the control plane's group, timeout and hang bound.
        **moved: options that moved into ``durability``/``control``: refused with a ``TypeError`` saying where.

    Returns:
        The study on rank 0, None on the other ranks.
    """
    if moved:
        unknown = sorted(set(moved) - set(MOVED_OPTIONS))
        if unknown:
            raise TypeError(f"optimize() got unexpected keyword arguments {unknown}")
        raise TypeError("optimize() options moved: " + "; ".join(
            f"instead of {name}=, pass {MOVED_OPTIONS[name]}" for name in sorted(moved)))
    durability = durability if durability is not None else DurabilityOptions()
    control = control if control is not None else ControlOptions()
    if isinstance(catch, type):
        catch = (catch,)
    catch = tuple(catch)
    channel = Channel(control.group, control.timeout, control.hang_timeout)
    if show_progress_bar is None:
        show_progress_bar = bool(n_trials and n_trials >= _PROGRESS_BAR_TRIALS and sys.stderr.isatty())
    if isinstance(study, StudySpec):
        spec = study

        def study() -> optuna.Study:  # rank 0 only: every rank raises its errors (StorageError, mismatch)
            attached = attach_study(spec.storage, study_name=spec.study_name, load_if_exists=spec.load_if_exists,
                                    direction=spec.direction, directions=spec.directions, sampler=spec.sampler,
                                    pruner=spec.pruner, output_dir=spec.output_dir, space=_space(durability),
                                    allow_space_mismatch=durability.allow_space_mismatch, n_trials=n_trials)
            if durability.warm_start_from:
                _warm_start(spec, attached, durability)
            return attached
    elif durability.warm_start_from:
        raise ValueError("DurabilityOptions(warm_start_from=...) needs the study as a StudySpec (storage and name), "
                         "so the old study can be read from the same storage")
    elif isinstance(study, optuna.Study) and (durability.hp_space is not None or durability.space_version):
        given = study

        def study() -> optuna.Study:  # a function, so a mismatch raises on every rank
            check_space_version(given, _space(durability), allow_mismatch=durability.allow_space_mismatch)
            return given
    if n_jobs != 1 and channel.world > 1:
        raise ValueError(f"optimize(n_jobs={n_jobs}) with {channel.world} ranks: every trial already runs on all "
                         "ranks, so trials cannot run in parallel threads; use n_jobs=1 (start more torchrun jobs "
                         "on one shared storage to run trials concurrently)")
    if channel.is_root:
        attrs = _attrs(channel, durability)
        with preempt.sigterm_preempts():
            return _root_loop(channel, study, objective, n_trials, timeout, n_jobs, catch, callbacks,
                              gc_after_trial, show_progress_bar, attrs, durability.heartbeat_interval,
                              durability.unpruned_trials)
    _worker_loop(channel, objective, gc_after_trial)
    return None


def _space(durability: DurabilityOptions) -> str | None:
    """The search-space version, or None when not versioned (an unreadable ``hp_space`` raises ``ValueError``)."""
    if durability.hp_space is None and not durability.space_version:
        return None
    return space_version(durability.hp_space, durability.space_version)


def _warm_start(spec: StudySpec, study: optuna.Study, durability: DurabilityOptions) -> None:
    from shardadopt.hpo.storage import resolve_storage
    from shardadopt.hpo.warmstart import space_distributions, warm_start

    storage = resolve_storage(spec.storage, output_dir=spec.output_dir, heartbeat_interval=None)
    space = space_distributions(durability.hp_space) if durability.hp_space is not None else None
    warm_start(storage, durability.warm_start_from, study.study_name, durability.warm_start_top, space=space)


def _attrs(channel: Channel, durability: DurabilityOptions) -> dict[str, Any]:
    try:
        version = _space(durability)
    except ValueError:
        version = None  # unreadable source: the attach check raises the explicit error where it matters
    topology = durability.topology
    if topology is None and os.environ.get("LOCAL_WORLD_SIZE"):
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        topology = f"{max(channel.world // max(local, 1), 1)} node(s) x {local} rank(s)"
    attrs = reproducibility_attrs(space=version or "", world_size=channel.world, topology=topology,
                                  data_snapshot=durability.data_snapshot)
    if version is None:
        del attrs["space_version"]
    attrs.update(restart.attempt_attrs())  # a restarted attempt finds the trials this job ran before it died
    return attrs


def run_on_root(channel: Channel, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0; its result on every rank, or its exception raised on every rank. Collective.

    Args:
        channel: the control channel of the ranks.
        fn: the function to run on rank 0.

    Returns:
        ``fn()``'s result, on every rank.
    """
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
               show_progress_bar: bool, attrs: dict[str, Any], heartbeat_interval: float | None,
               unpruned_trials: int = 0) -> optuna.Study:
    fatal: list[BaseException] = []  # a lost peer or SIGTERM: the study stops even when `catch` covers the error

    def run_trial(trial: optuna.Trial) -> Any:
        if preempt.requested():  # SIGTERM between trials: don't start another
            outcome = _preempted_outcome()
        else:
            try:
                for key, value in attrs.items():
                    trial.set_user_attr(key, value)
                # recorded here, so trial_checkpoint_dir is no collective: any subset of ranks may call it
                trial.set_user_attr(ATTR_CHECKPOINT_DIR, checkpoint_name(trial))
                mark_unpruned(trial, unpruned_trials)
                info = TrialInfo.of(trial)
                with _heartbeat(trial, heartbeat_interval):
                    if channel.world > 1:
                        channel.broadcast_object(0, (_START, info), OP_COMMAND)
                    outcome = _run_objective(DistributedTrial._started(channel, trial, info), objective)
            except PeerLostError as exc:  # recorded against the rank that was lost
                outcome = Outcome(FAIL, exc, exc.ranks[0] if exc.ranks else 0, summary(exc))
        if trial.params:
            with contextlib.suppress(Exception):
                trial.set_user_attr(ATTR_PARAMS_HASH, params_hash(trial.params))
        if isinstance(outcome.error, PeerLostError) or preempt.requested():
            fatal.append(outcome.error if outcome.error is not None else _preempted_outcome().error)
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
        pruner = study.pruner
        resumed = restart.resume_search(study)  # after a torchrun restart: the dead attempt's trial retried
        if n_trials is not None:
            n_trials = max(n_trials - resumed.done, 0)
        if reseed.is_companion(study):  # re-runs only, to the end: never let its sampler propose a new point
            waiting = reseed.waiting_reruns(study)
            n_trials = waiting if n_trials is None else min(n_trials, waiting)
            study.pruner = optuna.pruners.NopPruner()
        elif unpruned_trials:
            study.pruner = keep_unpruned(pruner)
        try:
            study.optimize(run_trial, n_trials=n_trials, timeout=timeout, n_jobs=n_jobs, catch=catch,
                           callbacks=callbacks, gc_after_trial=gc_after_trial, show_progress_bar=show_progress_bar)
        finally:
            study.pruner = pruner
        if fatal:
            raise fatal[0]
    except BaseException as exc:
        if channel.world > 1 and channel.broken is None:
            channel.broadcast_object(0, (_STOP, errors.pack(exc, 0)), OP_COMMAND)
        raise
    if channel.world > 1:
        channel.broadcast_object(0, (_STOP, None), OP_COMMAND)
    return study


def _preempted_outcome() -> Outcome:
    try:
        preempt.check()
    except failures.PreemptedError as exc:
        return Outcome(FAIL, exc, 0, summary(exc))
    raise AssertionError("no preemption was requested")


def _heartbeat(trial: optuna.Trial, interval: float | None) -> Any:
    storage = upstream.study_storage(trial.study)
    if interval is None or isinstance(storage, InMemoryStorage):
        return contextlib.nullcontext()
    return TrialHeartbeat(storage, upstream.trial_id(trial), interval=interval)


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
        if (seed := trial.user_attrs.get(reseed.ATTR_SEED)) is not None:  # a re-run: every rank seeds alike
            reseed.seed_everything(int(seed))
        value = objective(trial)
        if trial.rank == 0:
            _check_finite(value)
    except optuna.TrialPruned as exc:
        outcome = trial.close(PRUNED, exc)
        if outcome.state == PRUNED:
            outcome.error = exc
        return outcome
    except BaseException as exc:  # KeyboardInterrupt too: the other ranks must leave this trial as well
        # DCP's CheckpointException (a user's own dcp.save/dcp.load) is a BaseException no `catch` names: the trial
        # fails with this rank's own error inside it, or the first failing rank's, as everywhere else
        return trial.close(FAIL, fence.gathered_error(exc, trial.rank))
    outcome = trial.close(COMPLETE)
    if outcome.state == COMPLETE:
        outcome.value = value
    return outcome


def _check_finite(value: Any) -> None:
    """A NaN/inf objective fails the trial as ``nan_loss`` (Optuna would fail it without saying why)."""
    for v in value if isinstance(value, (list, tuple)) else (value,):
        try:
            number = float(v)
        except (TypeError, ValueError):
            continue  # not a number: Optuna reports what is wrong with it
        failures.check_finite(number)


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


__all__ = ["optimize", "run_on_root", "ATTR_RANK", "trial_checkpoint_dir", "resume_checkpoint"]
