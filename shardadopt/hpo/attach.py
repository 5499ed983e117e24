"""Attach a torchrun job to a (possibly shared) study, and give each trial a checkpoint directory of its own.

``attach_study`` is what rank 0 of every job runs before any training: resolve the storage (a bad URL raises
``StorageError`` here), create the study or load the one other jobs already use (``load_if_exists``), refuse a
study created with another search-space version, and warn when too many workers share a small budget.

``trial_checkpoint_dir(trial, root)`` is this trial's own directory (``durability.checkpoint_name``: trial number
and start time, the same on every rank), recorded on the trial, so no other live trial writes there, whatever its
parameters; no collective, so any ranks may ask. ``resume_checkpoint(trial, root)`` is the latest complete
checkpoint to continue from: the trial's own, or for a retry enqueued by ``requeue`` the dead trial's
(``shardadopt.checkpoint.latest`` skips interrupted saves).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from shardadopt.hpo.durability import ATTR_CHECKPOINT_DIR, ATTR_RESUME_FROM, checkpoint_name
from shardadopt.hpo.provenance import check_space_version
from shardadopt.hpo.storage import default_sampler, resolve_storage

# Concurrent trials above this share of the budget make the sampler propose mostly blind (constant liar or not).
MAX_CONCURRENT_FRACTION = 0.25


class ConcurrencyWarning(UserWarning):
    """More workers share the study than its trial budget can inform."""


def attach_study(storage: Any = None, *, study_name: str | None = None, load_if_exists: bool = True,
                 direction: str | None = None, directions: Sequence[str] | None = None,
                 sampler: optuna.samplers.BaseSampler | None = None, pruner: optuna.pruners.BasePruner | None = None,
                 output_dir: str | None = None, space: str | None = None, allow_space_mismatch: bool = False,
                 n_trials: int | None = None, heartbeat_interval: int | None = None,
                 grace_period: int | None = None) -> optuna.Study:
    """Create or load the study this job works on (call it on the rank that talks to storage only).

    ``space``: the search-space version (see ``provenance.space_version``); None skips the check.
    ``n_trials``: this job's budget, for the concurrency warning.

    Args:
        storage: a storage URL, path or Optuna storage (None: a journal file under ``output_dir``).
        study_name: the study's name; jobs passing the same name work on the same study.
        load_if_exists: attach to an existing study of that name (else creating it fails when it exists).
        direction: ``"minimize"`` or ``"maximize"`` for a single objective.
        directions: one direction per objective, for several.
        sampler: the sampler (default: :func:`shardadopt.hpo.storage.default_sampler`).
        pruner: the pruner (default: Optuna's).
        output_dir: where the default journal file goes.
        space: the search-space version recorded on the study and checked on attach.
        allow_space_mismatch: attach even when the study was created with another space version.
        n_trials: this job's budget, for the concurrency warning.
        heartbeat_interval: seconds between trial heartbeats (database storages).
        grace_period: seconds without a heartbeat before a trial counts as stale.

    Returns:
        The ``optuna.Study``.
    """
    rdb_kwargs = {}
    if heartbeat_interval is not None:
        rdb_kwargs["heartbeat_interval"] = heartbeat_interval
    if grace_period is not None:
        rdb_kwargs["grace_period"] = grace_period
    resolved = resolve_storage(storage, output_dir=output_dir, **rdb_kwargs)
    study = optuna.create_study(storage=resolved, study_name=study_name, load_if_exists=load_if_exists,
                                direction=direction, directions=directions,
                                sampler=sampler if sampler is not None else default_sampler(), pruner=pruner)
    if space is not None:
        check_space_version(study, space, allow_mismatch=allow_space_mismatch)
    if n_trials:
        running = len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        workers = running + 1
        if workers > MAX_CONCURRENT_FRACTION * n_trials:
            warnings.warn(f"study {study.study_name!r}: {workers} concurrent trials ({running} running in other "
                          f"jobs + this one) for a budget of {n_trials} trials per job: the sampler proposes most "
                          f"trials without seeing the results of the others. Keep concurrent workers below "
                          f"{MAX_CONCURRENT_FRACTION:.0%} of the trials, or give each job more trials",
                          ConcurrencyWarning, stacklevel=2)
    return study


def trial_checkpoint_dir(trial: optuna.trial.BaseTrial, root: str | os.PathLike) -> str:
    """``root/trial-<number>-<start time>``: where this trial checkpoints; no other live trial writes there.

    No collective: any subset of ranks may call it (``if trial.rank == 0: ...`` included). The name is recorded on
    the trial as ``checkpoint_dir``, so ``requeue`` can point a retry at it: by ``optimize`` when the trial starts,
    or here for a plain Optuna trial (in a hand-written ``DistributedTrial`` loop, call it once with rank 0's
    Optuna trial). Not created here.

    Args:
        trial: the Optuna trial (or a ``DistributedTrial``).
        root: the directory holding every trial's checkpoints.

    Returns:
        The trial's own checkpoint directory.
    """
    from shardadopt.hpo.trial import DistributedTrial

    name = checkpoint_name(trial)
    if not isinstance(trial, DistributedTrial) and trial.user_attrs.get(ATTR_CHECKPOINT_DIR) != name:
        trial.set_user_attr(ATTR_CHECKPOINT_DIR, name)
    return os.path.join(os.fspath(root), name)


def resume_checkpoint(trial: optuna.trial.BaseTrial, root: str | os.PathLike) -> str | None:
    """The latest complete ``shardadopt.checkpoint`` this trial continues from, or None: its own under
    ``trial_checkpoint_dir(trial, root)``, else, for a retry, the dead trial's (``resume_from``, set by
    ``requeue``). No collective, like ``trial_checkpoint_dir``.

    Args:
        trial: the Optuna trial (or a ``DistributedTrial``).
        root: the directory holding every trial's checkpoints.

    Returns:
        The checkpoint's path, or None for a fresh trial.
    """
    from shardadopt import checkpoint

    own = checkpoint.latest(trial_checkpoint_dir(trial, root))
    dead = trial.user_attrs.get(ATTR_RESUME_FROM)
    return own if own is not None or dead is None else checkpoint.latest(os.path.join(os.fspath(root), dead))


__all__ = ["attach_study", "trial_checkpoint_dir", "resume_checkpoint", "ConcurrencyWarning",
           "MAX_CONCURRENT_FRACTION"]
