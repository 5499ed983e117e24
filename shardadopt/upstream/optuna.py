"""optuna's private names, and the keyword names it renamed. Checked on optuna 4.0-5.1."""

from __future__ import annotations

from typing import Any

from shardadopt.upstream.base import attribute, changed


def study_storage(study: Any) -> Any:
    """``Study._storage``: the ``BaseStorage`` a study reads and writes (what heartbeats, failure records and
    requeue write to by trial id; ``optuna.Study`` has no public getter). Checked on optuna 4.0-5.1."""
    return attribute(study, "_storage", "study_storage", "optuna")


def trial_id(trial: Any) -> int:
    """``Trial._trial_id`` / ``FrozenTrial._trial_id``: the storage's id of a trial (unique across the studies of a
    storage, unlike ``number``), which every ``BaseStorage`` method takes. Checked on optuna 4.0-5.1."""
    return attribute(trial, "_trial_id", "trial_id", "optuna")


def stale_trial_callback_keyword() -> str:
    """The ``RDBStorage`` keyword of the callback run on a trial whose heartbeat went stale:
    ``heartbeat_stale_trial_callback`` from optuna 4.9 (``failed_trial_callback`` is deprecated there),
    ``failed_trial_callback`` before. Checked on optuna 4.0-5.1."""
    import inspect

    from optuna.storages import RDBStorage

    parameters = inspect.signature(RDBStorage.__init__).parameters
    for name in ("heartbeat_stale_trial_callback", "failed_trial_callback"):
        if name in parameters:
            return name
    raise changed("stale_trial_callback_keyword", "RDBStorage(heartbeat_stale_trial_callback=...)", "optuna")
