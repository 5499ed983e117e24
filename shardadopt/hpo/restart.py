"""A search that ``torchrun --max-restarts`` restarted goes on where its dead attempt left the study.

Rank 0 records on every trial the torchrun job and attempt that ran it (``shardadopt.lifecycle.restarts.current()``: the
same on every node, one id per job, kept in the agent's store). When a restarted attempt attaches to the study,
before it samples anything, ``resume_search`` settles what the earlier attempts of this job left:

- a trial still RUNNING is dead (torchrun stops every worker of an attempt before it starts the next): it is
  failed as ``preempted``, so it never runs twice at once with its retry;
- the trial each earlier attempt ended on (the one the death interrupted) is retried once, as ``requeue`` retries a
  transient failure (``preempted``, ``comm_error``, ``hang``; never a retry, never a deterministic failure): its
  parameters enqueued with ``retry_of`` and ``resume_from`` (its checkpoint directory), so the retry resumes from
  its last complete checkpoint;
- the sampler is reseeded: a seeded sampler, built again by the restarted script, would propose the configurations
  its seed gave the first attempt again;
- the job's ``n_trials`` counts the earlier attempts' trials: the study ends with as many trials as one
  uninterrupted run, the interrupted trial replaced by its retry.

Other jobs' trials are left to their own restarts and to ``shardadopt hpo requeue``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from shardadopt.hpo.durability import ATTR_CHECKPOINT_DIR, ATTR_RESUME_FROM, record_failure
from shardadopt.hpo.failures import ATTR_KIND, ATTR_RETRY_OF, PREEMPTED, TRANSIENT
from shardadopt.hpo.provenance import ATTR_PARAMS_HASH, params_hash
from shardadopt.hpo.reseed import ATTR_RESEED_OF, ATTR_SEED
from shardadopt.lifecycle import restarts

ATTR_JOB = "torchrun_job"  # the torchrun job that ran the trial (shardadopt.lifecycle.restarts.Attempt.job)
ATTR_ATTEMPT = "torchrun_attempt"  # that job's attempt (from 1)
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


@dataclass
class Resumption:
    """What ``resume_search`` found and did: trials failed as dead, retries enqueued (failed trial -> retry), trials
    not retried and why, and how many of the earlier attempts' trials count against this job's ``n_trials``."""

    interrupted: list[int] = field(default_factory=list)
    retried: dict[int, int] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)
    done: int = 0


def attempt_attrs() -> dict[str, Any]:
    """The user attributes naming this torchrun job and attempt; empty outside torchrun's agent store."""
    attempt = restarts.current()
    return {} if attempt is None else {ATTR_JOB: attempt.job, ATTR_ATTEMPT: attempt.number}


def resume_search(study: optuna.Study, attempt: restarts.Attempt | None = None) -> Resumption:
    """Settle the trials this job's earlier attempts left in ``study`` (rank 0, before the first trial).

    Args:
        study: the study this attempt works on.
        attempt: this attempt (default: ``shardadopt.lifecycle.restarts.current()``); nothing is done on a first
        attempt.

    Returns:
        What was failed and retried, and the number of earlier trials this job already ran.
    """
    attempt = attempt if attempt is not None else restarts.current()
    report = Resumption()
    if attempt is None or not attempt.restarted:
        return report
    trials = study.get_trials(deepcopy=False)
    # a seeded sampler, built again by the restarted script, would propose the first attempt's points again
    study.sampler.reseed_rng()
    earlier = _earlier_attempts(trials, attempt)
    for trial in earlier:
        if trial.state == TrialState.RUNNING:
            record_failure(study, trial, PREEMPTED,
                           f"torchrun restarted the job (attempt {attempt.number}): attempt "
                           f"{trial.user_attrs[ATTR_ATTEMPT]}, which ran this trial, ended before the trial did")
            report.interrupted.append(trial.number)
    last: dict[int, int] = {}  # each earlier attempt -> the trial it ended on
    for trial in earlier:
        number = trial.user_attrs[ATTR_ATTEMPT]
        last[number] = max(last.get(number, -1), trial.number)
    superseded = {t.user_attrs.get(ATTR_RETRY_OF) for t in trials} - {None}
    now = {t.number: t for t in study.get_trials(deepcopy=False)}  # re-read: failed above, perhaps
    for number in sorted(last.values()):
        trial = now[number]
        why = _not_retried(trial, superseded)
        if why:
            report.skipped[number] = why
            continue
        attrs = {ATTR_RETRY_OF: number, ATTR_PARAMS_HASH: params_hash(trial.params), ATTR_JOB: attempt.job}
        attrs.update({key: trial.user_attrs[key] for key in (ATTR_SEED, ATTR_RESEED_OF) if key in trial.user_attrs})
        if ATTR_CHECKPOINT_DIR in trial.user_attrs:  # the retry resumes from there, writes elsewhere
            attrs[ATTR_RESUME_FROM] = trial.user_attrs[ATTR_CHECKPOINT_DIR]
        study.enqueue_trial(trial.params, user_attrs=attrs)
        report.retried[number] = max(t.number for t in study.get_trials(deepcopy=False))
        superseded.add(number)
    report.done = sum(1 for t in _earlier_attempts(study.get_trials(deepcopy=False), attempt)
                      if t.number not in superseded and t.state in _FINISHED)
    return report


def _earlier_attempts(trials: list, attempt: restarts.Attempt) -> list:
    """The trials of ``trials`` that earlier attempts of ``attempt``'s job ran."""
    return [t for t in trials if t.user_attrs.get(ATTR_JOB) == attempt.job
            and t.user_attrs.get(ATTR_ATTEMPT, attempt.number) < attempt.number]


def _not_retried(trial: optuna.trial.FrozenTrial, superseded: set) -> str | None:
    """Why the trial an attempt ended on gets no retry (None: it gets one)."""
    if trial.state != TrialState.FAIL:
        return f"it ended {trial.state.name}, not interrupted"
    if trial.number in superseded:
        return "already retried"
    kind = trial.user_attrs.get(ATTR_KIND)
    if kind not in TRANSIENT:
        return f"failure kind {kind!r} is not transient"
    if trial.user_attrs.get(ATTR_RETRY_OF) is not None:
        return "already a retry (one retry per configuration)"
    if not trial.params:
        return "no parameters were sampled before it failed"
    return None


__all__ = ["ATTR_JOB", "ATTR_ATTEMPT", "Resumption", "attempt_attrs", "resume_search"]
