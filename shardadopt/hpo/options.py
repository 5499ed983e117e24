"""The options of ``shardadopt.hpo.optimize``, each group a frozen dataclass: ``StudySpec`` (the study rank 0
creates or attaches to, shared by many jobs), ``DurabilityOptions`` (what rank 0 records on every trial, heartbeats,
unpruned trials, warm start) and ``ControlOptions`` (the control plane's group and timeouts); and the table of
``optimize``'s pre-1.0 keyword arguments and the option that replaces each, for its error message.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

DEFAULT_HEARTBEAT_INTERVAL = 30.0  # seconds between a running trial's heartbeats (requeue's grace: 180 s)


@dataclass(frozen=True)
class StudySpec:
    """The study ``optimize`` creates or attaches to on rank 0, so that many torchrun jobs can share it.

    ``storage``: a URL or an Optuna storage (``None`` with ``output_dir``: a journal file there). Jobs giving the
    same ``study_name`` attach as workers (``load_if_exists``). ``sampler`` defaults to ``default_sampler()`` (TPE,
    multivariate, constant liar).
    """

    storage: str | os.PathLike | optuna.storages.BaseStorage | None = None
    study_name: str | None = None
    load_if_exists: bool = True
    direction: str | None = None
    directions: Sequence[str] | None = None
    sampler: optuna.samplers.BaseSampler | None = None
    pruner: optuna.pruners.BasePruner | None = None
    output_dir: str | None = None


@dataclass(frozen=True)
class DurabilityOptions:
    """What rank 0 records on every trial and how it keeps a running trial visibly alive.

    ``space_version`` (default, given ``hp_space``: a hash of its source) versions the search space; attaching to a
    study created with another version raises ``SpaceVersionMismatch`` unless ``allow_space_mismatch``.
    ``data_snapshot`` and ``topology`` (default from ``$LOCAL_WORLD_SIZE``) are recorded on every trial.
    ``heartbeat_interval`` (seconds; None: off) paces the heartbeat of a running trial on persistent storages.
    ``unpruned_trials``: the first N sampled trials of the study run to the end whatever the pruner says, for
    ``shardadopt hpo check-pruning`` (``shardadopt.hpo.pruning_check``). ``warm_start_from``: with a ``StudySpec``,
    enqueue the ``warm_start_top`` best configurations of that study (an older space version, same storage) into
    this one on attach, mapped onto ``hp_space`` (``shardadopt.hpo.warmstart``; idempotent).
    """

    hp_space: Callable[..., Any] | None = None
    space_version: str | None = None
    allow_space_mismatch: bool = False
    data_snapshot: str | None = None
    topology: str | None = None
    heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL
    unpruned_trials: int = 0
    warm_start_from: str | None = None
    warm_start_top: int = 5


@dataclass(frozen=True)
class ControlOptions:
    """The control plane (see ``DistributedTrial``): the gloo ``group`` its messages use (default: a dedicated
    one; a given group turns the fault fence and hang detection off, with a ``FenceOffWarning``), ``timeout``,
    the seconds after which a silent peer counts as lost (default ``$SHARDADOPT_HPO_TIMEOUT``, 600 s), and
    ``hang_timeout``, the seconds a rank may go without progress inside a trial before it counts as hung (default
    ``$SHARDADOPT_HANG_TIMEOUT``, 900 s; ``math.inf``: off): the trial fails as ``hang`` against that rank, or,
    when it cannot be interrupted, every rank exits with ``shardadopt.fence.HANG_EXIT_CODE`` (see
    ``shardadopt.fence``)."""

    group: Any = None
    timeout: float | None = None
    hang_timeout: float | None = None


# optimize()'s former keyword arguments and what replaces each (pre-1.0 API change).
MOVED_OPTIONS = {name: f"StudySpec({name}=...) as the study" for name in (
    "storage", "study_name", "load_if_exists", "direction", "directions", "sampler", "pruner", "output_dir")}
MOVED_OPTIONS.update({name: f"durability=DurabilityOptions({name}=...)" for name in (
    "hp_space", "space_version", "allow_space_mismatch", "data_snapshot", "topology", "heartbeat_interval")})
MOVED_OPTIONS.update(group="control=ControlOptions(group=...)",
                     control_timeout="control=ControlOptions(timeout=...)",
                     hang_timeout="control=ControlOptions(hang_timeout=...)")


__all__ = ["StudySpec", "DurabilityOptions", "ControlOptions", "MOVED_OPTIONS", "DEFAULT_HEARTBEAT_INTERVAL"]
