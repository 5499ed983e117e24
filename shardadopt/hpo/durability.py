"""Dead workers, failure records and retries: what keeps a long study healthy.

A running trial carries ``host``, ``pid`` and a ``heartbeat`` timestamp (user attributes, refreshed by
``TrialHeartbeat`` on the rank that talks to storage). That works on every storage; on RDB storages Optuna's own
heartbeat is recorded as well, so ``optuna.storages.fail_stale_trials`` keeps working. ``requeue`` fails stale
trials as ``preempted`` and re-enqueues each transient failure once, with ``retry_of`` naming the failed trial.

Checkpoints: each trial writes into a directory of its own, ``checkpoint_name(trial)`` under a root
(``trial-<number>-<start time>``, recorded on the trial as ``checkpoint_dir``), so two live trials never share
one, not even with equal parameters (a retry and a fresh trial, or two enqueued copies). ``requeue`` hands the
dead trial's directory to its retry (``resume_from``), which resumes from its last complete checkpoint and
writes into its own directory.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState

from shardadopt import upstream
from shardadopt.hpo.failures import ATTR_KIND, ATTR_MESSAGE, ATTR_RETRY_OF, PREEMPTED, TRANSIENT
from shardadopt.hpo.provenance import ATTR_PARAMS_HASH, params_hash

ATTR_HEARTBEAT = "heartbeat"
ATTR_HOST = "host"
ATTR_PID = "pid"
ATTR_CHECKPOINT_DIR = "checkpoint_dir"  # this trial's checkpoint directory, relative to its root
ATTR_RESUME_FROM = "resume_from"  # on a retry: the dead trial's checkpoint directory, relative to the root
DEFAULT_GRACE_PERIOD = 180.0


class TrialHeartbeat:
    """Refresh a running trial's heartbeat every ``interval`` seconds from a daemon thread.

    >>> with TrialHeartbeat(upstream.study_storage(study), upstream.trial_id(trial), interval=30):
    ...     train()
    """

    def __init__(self, storage: BaseStorage, trial_id: int, interval: float = 30.0):
        self._storage, self._trial_id, self._interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_forever, name=f"shardadopt-heartbeat-{trial_id}",
                                        daemon=True)

    def __enter__(self) -> TrialHeartbeat:
        self._storage.set_trial_user_attr(self._trial_id, ATTR_HOST, socket.gethostname())
        self._storage.set_trial_user_attr(self._trial_id, ATTR_PID, os.getpid())
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval + 5)

    def _beat(self) -> None:
        self._storage.set_trial_user_attr(self._trial_id, ATTR_HEARTBEAT, time.time())
        if isinstance(self._storage, RDBStorage) and self._storage.get_heartbeat_interval() is not None:
            self._storage.record_heartbeat(self._trial_id)

    def _beat_forever(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception:  # a storage hiccup must not kill training; the next beat retries
                continue


def checkpoint_name(trial: optuna.trial.BaseTrial) -> str:
    """``trial-<number>-<start time, microseconds>``: unique per live trial (numbers are unique in a study; the
    start time, the same on every rank of a ``DistributedTrial``, tells studies sharing a root apart)."""
    start = trial.datetime_start or datetime.datetime.now()
    return f"trial-{trial.number}-{start:%Y%m%dT%H%M%S%f}"


def record_checkpoint_dir(trial: optuna.trial.BaseTrial, name: str) -> None:
    """Record ``name`` (relative to the checkpoint root) on the trial, so a retry can find what it wrote.
    Collective on a ``DistributedTrial`` (the first time)."""
    if trial.user_attrs.get(ATTR_CHECKPOINT_DIR) != name:
        trial.set_user_attr(ATTR_CHECKPOINT_DIR, name)


def heartbeat_age(trial: FrozenTrial, now: float | None = None) -> float | None:
    """Seconds since the trial's last heartbeat (or since it started, if it never beat)."""
    now = time.time() if now is None else now
    beat = trial.user_attrs.get(ATTR_HEARTBEAT)
    if beat is not None:
        return now - float(beat)
    if trial.datetime_start is not None:
        return now - trial.datetime_start.timestamp()
    return None


def stale_trials(study: optuna.Study, grace_period: float = DEFAULT_GRACE_PERIOD,
                 now: float | None = None) -> list[FrozenTrial]:
    """RUNNING trials whose heartbeat is older than ``grace_period`` seconds."""
    stale = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        age = heartbeat_age(trial, now)
        if age is not None and age > grace_period:
            stale.append(trial)
    return stale


def record_failure(study: optuna.Study, trial: FrozenTrial | int, kind: str, message: str) -> None:
    """Attach the failure kind and message to a trial and set it to FAIL (if it is still running)."""
    trial_id = upstream.trial_id(trial) if isinstance(trial, FrozenTrial) else trial
    storage = upstream.study_storage(study)
    storage.set_trial_user_attr(trial_id, ATTR_KIND, kind)
    storage.set_trial_user_attr(trial_id, ATTR_MESSAGE, message[:2000])
    if storage.get_trial(trial_id).state == TrialState.RUNNING:
        storage.set_trial_state_values(trial_id, TrialState.FAIL)


@dataclass
class RequeueReport:
    failed_stale: list[int] = field(default_factory=list)
    retried: dict[int, int] = field(default_factory=dict)  # failed trial number -> enqueued trial number
    skipped: dict[int, str] = field(default_factory=dict)  # failed trial number -> why it was not retried

    def as_dict(self) -> dict[str, Any]:
        return {"failed_stale": self.failed_stale, "retried": self.retried, "skipped": self.skipped}


def requeue(study: optuna.Study, grace_period: float = DEFAULT_GRACE_PERIOD, now: float | None = None,
            ) -> RequeueReport:
    """Fail stale trials as ``preempted``; enqueue one retry of each transient failure. Idempotent.

    Deterministic failures (``oom``, ``nan_loss``, ``config_error``, ``error``) are never retried, nor is a
    retry retried. Run it from one place (cron, a controller), not from every worker.

    Args:
        study: the study to look after.
        grace_period: seconds without a heartbeat before a running trial counts as stale.
        now: the current time (seconds since the epoch; default: now), for tests.

    Returns:
        A report of the trials failed as stale and the retries enqueued.
    """
    report = RequeueReport()
    for trial in stale_trials(study, grace_period, now):
        age = heartbeat_age(trial, now)
        record_failure(study, trial, PREEMPTED,
                       f"no heartbeat for {age:.0f}s (grace period {grace_period:.0f}s); last seen on "
                       f"{trial.user_attrs.get(ATTR_HOST, '?')} pid {trial.user_attrs.get(ATTR_PID, '?')}")
        report.failed_stale.append(trial.number)
    storage = upstream.study_storage(study)
    if isinstance(storage, RDBStorage) and storage.get_heartbeat_interval() is not None:
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        optuna.storages.fail_stale_trials(study)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            if trial.number in before and ATTR_KIND not in trial.user_attrs:
                record_failure(study, trial, PREEMPTED, "Optuna heartbeat went stale")
                report.failed_stale.append(trial.number)

    trials = study.get_trials(deepcopy=False)
    already_retried = {t.user_attrs.get(ATTR_RETRY_OF) for t in trials} - {None}
    for trial in trials:
        if trial.state != TrialState.FAIL or trial.number in already_retried:
            continue
        kind = trial.user_attrs.get(ATTR_KIND)
        if kind not in TRANSIENT:
            report.skipped[trial.number] = f"failure kind {kind!r} is not transient"
        elif trial.user_attrs.get(ATTR_RETRY_OF) is not None:
            report.skipped[trial.number] = "already a retry (one retry per configuration)"
        elif not trial.params:
            report.skipped[trial.number] = "no parameters were sampled before it failed"
        else:
            attrs = {ATTR_RETRY_OF: trial.number, ATTR_PARAMS_HASH: params_hash(trial.params)}
            if ATTR_CHECKPOINT_DIR in trial.user_attrs:  # the retry resumes from there, writes elsewhere
                attrs[ATTR_RESUME_FROM] = trial.user_attrs[ATTR_CHECKPOINT_DIR]
            study.enqueue_trial(trial.params, user_attrs=attrs)
            report.retried[trial.number] = max(t.number for t in study.get_trials(deepcopy=False))
    return report
