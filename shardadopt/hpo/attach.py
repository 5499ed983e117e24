"""Attach a torchrun job to a (possibly shared) study, and key each trial's checkpoints by its parameters.

``attach_study`` is what rank 0 of every job runs before any training: resolve the storage (a bad URL raises
``StorageError`` here), create the study or load the one other jobs already use (``load_if_exists``), refuse a
study created with another search-space version, and warn when too many workers share a small budget.

``trial_checkpoint_dir(trial, root)`` is a directory named by ``params_hash(trial.params)``, not the trial number,
so the retry ``requeue`` enqueues with the same parameters finds what the dead trial wrote;
``resume_checkpoint(trial, root)`` is its latest complete checkpoint (``shardadopt.checkpoint.latest`` skips
interrupted saves).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from shardadopt.hpo.provenance import check_space_version, params_hash
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
    """``root/params-<hash of the trial's parameters>``: where this trial (and any retry of it) checkpoints.

    Call it after the search space was sampled (the parameters are the key). Not created here.
    """
    params = trial.params
    if not params:
        raise ValueError(f"trial {trial.number} has no parameters yet: sample the search space before asking for "
                         "its checkpoint directory (the directory is keyed by the parameters)")
    return os.path.join(os.fspath(root), f"params-{params_hash(params)}")


def resume_checkpoint(trial: optuna.trial.BaseTrial, root: str | os.PathLike) -> str | None:
    """The latest complete ``shardadopt.checkpoint`` of this parameter set under ``root``, or None."""
    from shardadopt import checkpoint

    return checkpoint.latest(trial_checkpoint_dir(trial, root))


__all__ = ["attach_study", "trial_checkpoint_dir", "resume_checkpoint", "ConcurrencyWarning",
           "MAX_CONCURRENT_FRACTION"]
