"""optuna's private names. Checked on optuna 4.9-5.0."""

from __future__ import annotations

from typing import Any

from shardadopt.upstream.base import _attribute


def study_storage(study: Any) -> Any:
    """``Study._storage``: the ``BaseStorage`` a study reads and writes (what heartbeats, failure records and
    requeue write to by trial id; ``optuna.Study`` has no public getter). Checked on optuna 4.9-5.0."""
    return _attribute(study, "_storage", "study_storage", "optuna")


def trial_id(trial: Any) -> int:
    """``Trial._trial_id`` / ``FrozenTrial._trial_id``: the storage's id of a trial (unique across the studies of a
    storage, unlike ``number``), which every ``BaseStorage`` method takes. Checked on optuna 4.9-5.0."""
    return _attribute(trial, "_trial_id", "trial_id", "optuna")
