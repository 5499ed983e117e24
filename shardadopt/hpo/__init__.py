"""Optuna hyperparameter search under torch.distributed that never hangs.

- ``DistributedTrial(trial_or_None)``: one trial, collective and consistent on every rank (rank 0 holds the
  real trial); errors raised on any rank reach every rank.
- ``optimize(study, objective, ...)``: ``study.optimize`` with every trial running on every rank, all ranks in
  step through pruning, failures, ``catch``, ``timeout``, ``n_trials``, ``study.stop()`` and Ctrl-C;
  ``StudySpec`` (a shared, durable study), ``DurabilityOptions`` and ``ControlOptions`` configure it.
- ``run_hp_search_optuna(trainer, ...)`` (``shardadopt.hpo.trainer_backend``): the same for
  ``Trainer.hyperparameter_search(backend="optuna")``; ``shardadopt.enable()`` routes Trainer there.

Control messages travel on a dedicated gloo group with a timeout (``$SHARDADOPT_HPO_TIMEOUT``, default 600 s):
a dead or stuck peer raises ``PeerLostError`` naming it instead of hanging. A rank that raises anywhere in a trial
(even while its peers wait in a training collective) trips the trial's fault fence (``shardadopt.fence``): every
rank leaves the trial at once and the process groups are rebuilt before the next one; a rank that stops making
progress for ``hang_timeout`` seconds fails the trial as ``hang`` the same way (or, not interruptible, every rank
exits so the job is restarted). Names and submodules load lazily, so the storage
and CLI helpers in this package do not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_LAZY = {
    "DistributedTrial": "shardadopt.hpo.trial",
    "report_and_maybe_prune": "shardadopt.hpo.trial",
    "optimize": "shardadopt.hpo.loop",
    "StudySpec": "shardadopt.hpo.options",
    "DurabilityOptions": "shardadopt.hpo.options",
    "ControlOptions": "shardadopt.hpo.options",
    "run_on_root": "shardadopt.hpo.loop",
    "ATTR_RANK": "shardadopt.hpo.loop",
    "run_hp_search_optuna": "shardadopt.hpo.trainer_backend",
    "attach_study": "shardadopt.hpo.attach",
    "trial_checkpoint_dir": "shardadopt.hpo.attach",
    "resume_checkpoint": "shardadopt.hpo.attach",
    "ConcurrencyWarning": "shardadopt.hpo.attach",
    "default_sampler": "shardadopt.hpo.storage",
    "resolve_storage": "shardadopt.hpo.storage",
    "StorageError": "shardadopt.hpo.storage",
    "requeue": "shardadopt.hpo.durability",
    "SpaceVersionMismatch": "shardadopt.hpo.provenance",
    "InvalidConfigError": "shardadopt.hpo.failures",
    "NonFiniteLossError": "shardadopt.hpo.failures",
    "PreemptedError": "shardadopt.hpo.failures",
    "PeerLostError": "shardadopt.hpo.errors",
    "PeerFailedError": "shardadopt.fence.errors",
    "HangError": "shardadopt.fence.errors",
    "FenceOffWarning": "shardadopt.hpo.channel",
    "DesyncError": "shardadopt.hpo.errors",
    "HPOControlError": "shardadopt.hpo.errors",
    "RemoteError": "shardadopt.hpo.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # `shardadopt.hpo.plot.figures(...)`, as in docs/hpo.md
    raise AttributeError(f"module 'shardadopt.hpo' has no attribute {name!r}")
