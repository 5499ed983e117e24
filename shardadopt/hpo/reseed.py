"""Re-run the best configurations with fresh seeds before promoting one: the best of many noisy trials is partly luck.

``reseed(storage, study_name, top=K, seeds=S)`` enqueues each of the study's ``K`` best configurations ``S`` times
into its companion study ``<study_name>-reseed``, each copy with a ``seed`` user attribute (and ``reseed_of``: the
number of the trial in the search whose configuration it repeats). Jobs run the companion like any study (same
script, same ``hp_space``, ``study_name="<name>-reseed"``): ``optimize`` seeds Python, NumPy and torch with the
trial's ``seed`` on every rank before the objective, and the Trainer backend trains with
``TrainingArguments.seed`` (and ``data_seed`` when set) replaced by it, so model initialisation and data order
change. Re-runs are never pruned, and a job on a companion runs at most the re-runs waiting there.

Why a companion study rather than the search's own: every sampler reads the study's whole history, and Optuna has
no public way to hide trials from it, so re-runs there would count as new, heavily repeated points of the search
(TPE would concentrate on them). In their own study the search's history stays what the sampler proposed, and the
re-runs are all enqueued, so the companion's sampler never proposes anything.

``configurations(study, companion)`` ranks configurations by the mean over their seeds once re-runs exist (the
search's own run counts as one seed): ``shardadopt hpo best|status`` report mean, spread and number of seeds.
Idempotent: a (configuration, seed) pair already in the companion, in any state, is not enqueued again.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from shardadopt.hpo.provenance import ATTR_PARAMS_HASH, ATTR_SPACE_VERSION, params_hash

ATTR_SEED = "seed"  # on a re-run: the training seed
ATTR_RESEED_OF = "reseed_of"  # on a re-run: the trial of the search whose configuration it repeats; on a companion
# study (study user attribute): the name of the search it re-runs
COMPANION_SUFFIX = "-reseed"


def companion_name(study_name: str) -> str:
    """The name of the study holding ``study_name``'s re-runs (``NAME-reseed``)."""
    return f"{study_name}{COMPANION_SUFFIX}"


def is_companion(study: optuna.Study) -> bool:
    """Whether ``study`` holds the re-runs of another study (created by ``reseed``).

    Args:
        study: a study.

    Returns:
        True for a companion study.
    """
    return study.user_attrs.get(ATTR_RESEED_OF) is not None


def load_companion(storage: BaseStorage, study_name: str) -> optuna.Study | None:
    """The companion study of ``study_name`` in ``storage``, or None when nothing was re-run.

    Args:
        storage: the storage holding the search.
        study_name: the search's name.

    Returns:
        The companion study, or None.
    """
    try:  # not by listing summaries: they read every study's trials, and fail on one another client deletes meanwhile
        return optuna.load_study(study_name=companion_name(study_name), storage=storage)
    except KeyError:
        return None


def fresh_seeds(config_hash: str, count: int) -> list[int]:
    """``count`` seeds for one configuration: derived from its parameter hash, so every call asks for the same
    ones (idempotence) and two configurations do not share them.

    Args:
        config_hash: the configuration's parameter hash.
        count: how many seeds.

    Returns:
        ``count`` seeds, the same for every call with these arguments.
    """
    return [int(hashlib.sha256(f"{config_hash}/{i}".encode()).hexdigest()[:8], 16) % 2**31 for i in range(count)]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (where imported) like ``transformers.set_seed``, on this rank.

    Args:
        seed: the seed.
    """
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)


@dataclass
class Configuration:
    """One parameter set and every finished run of it: the search's trial and its re-runs."""

    params: dict[str, Any]
    params_hash: str
    trial: int  # the trial of the search that found it
    values: list[float] = field(default_factory=list)  # the search's value first, then each re-run's
    seeds: list[int | None] = field(default_factory=list)  # None: the search's own run (the script's seed)
    reruns: list[int] = field(default_factory=list)  # companion trial numbers

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (0 for a single run)."""
        if len(self.values) < 2:
            return 0.0
        mean = self.mean
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / (len(self.values) - 1))

    def as_dict(self) -> dict[str, Any]:
        return {"trial": self.trial, "params": self.params, "mean": self.mean, "std": self.std,
                "n_seeds": len(self.values), "values": self.values, "seeds": self.seeds, "reruns": self.reruns}


def configurations(study: optuna.Study, companion: optuna.Study | None = None) -> list[Configuration]:
    """The search's completed configurations, best first: once any has a finished re-run, those with re-runs by
    their mean over seeds, then the others by their single value; before that, by value (single objective).

    Args:
        study: the search.
        companion: its companion study of re-runs (None: no re-runs).

    Returns:
        One :class:`Configuration` per distinct parameter set, best first.
    """
    if len(study.directions) > 1:
        raise ValueError(f"study {study.study_name!r} has {len(study.directions)} objectives: seed re-runs rank "
                         "single-objective studies only")
    by_hash: dict[str, Configuration] = {}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        key = params_hash(trial.params)
        config = by_hash.setdefault(key, Configuration(dict(trial.params), key, trial.number))
        config.values.append(float(trial.value))
        config.seeds.append(None)
    for rerun in _reruns(companion, states=(TrialState.COMPLETE,)):
        config = by_hash.get(rerun.user_attrs.get(ATTR_PARAMS_HASH) or params_hash(rerun.params))
        if config is not None:
            config.values.append(float(rerun.value))
            config.seeds.append(rerun.user_attrs[ATTR_SEED])
            config.reruns.append(rerun.number)
    sign = -1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else 1.0
    return sorted(by_hash.values(), key=lambda c: (not c.reruns if _any_reruns(by_hash) else False,
                                                   sign * c.mean, c.trial))


def _any_reruns(by_hash: dict[str, Configuration]) -> bool:
    return any(c.reruns for c in by_hash.values())


def _reruns(companion: optuna.Study | None, states: tuple[TrialState, ...] | None = None) -> list[FrozenTrial]:
    if companion is None:
        return []
    return [t for t in companion.get_trials(deepcopy=False, states=states) if ATTR_SEED in t.user_attrs]


@dataclass
class ReseedReport:
    companion: str
    enqueued: dict[int, list[int]] = field(default_factory=dict)  # search trial -> seeds enqueued now
    present: dict[int, list[int]] = field(default_factory=dict)  # search trial -> seeds already in the companion

    def as_dict(self) -> dict[str, Any]:
        return {"companion": self.companion, "enqueued": self.enqueued, "present": self.present}


def reseed(storage: BaseStorage, study_name: str, top: int, seeds: int) -> ReseedReport:
    """Enqueue the ``top`` best configurations of ``study_name`` ``seeds`` times each, with fresh seeds, into its
    companion study (created on first use, with the search's direction and space version). Idempotent.

    Args:
        storage: the storage holding the search.
        study_name: the search's name.
        top: how many of the best configurations to re-run.
        seeds: how many re-runs of each.

    Returns:
        What was enqueued and what was already there.
    """
    if top < 1 or seeds < 1:
        raise ValueError(f"reseed needs --top >= 1 and --seeds >= 1, got top={top}, seeds={seeds}")
    study = optuna.load_study(study_name=study_name, storage=storage)
    if is_companion(study):
        raise ValueError(f"study {study_name!r} already holds re-runs (of {study.user_attrs[ATTR_RESEED_OF]!r}): "
                         "reseed the search itself")
    companion = load_companion(storage, study_name)
    ranked = configurations(study, companion)[:top]
    if not ranked:
        raise ValueError(f"study {study_name!r} has no completed trials to re-run")
    if companion is None:
        companion = optuna.create_study(study_name=companion_name(study_name), storage=storage,
                                        directions=study.directions, load_if_exists=True)
        companion.set_user_attr(ATTR_RESEED_OF, study_name)
        if ATTR_SPACE_VERSION in study.user_attrs:  # the same jobs (same hp_space) attach to it
            companion.set_user_attr(ATTR_SPACE_VERSION, study.user_attrs[ATTR_SPACE_VERSION])
    # a waiting trial has no params yet: its configuration is the params_hash recorded when it was enqueued
    present = {(t.user_attrs.get(ATTR_PARAMS_HASH), t.user_attrs[ATTR_SEED]) for t in _reruns(companion)}
    report = ReseedReport(companion.study_name)
    for config in ranked:
        for seed in fresh_seeds(config.params_hash, seeds):
            if (config.params_hash, seed) in present:
                report.present.setdefault(config.trial, []).append(seed)
                continue
            companion.enqueue_trial(config.params, user_attrs={ATTR_SEED: seed, ATTR_RESEED_OF: config.trial,
                                                               ATTR_PARAMS_HASH: config.params_hash})
            report.enqueued.setdefault(config.trial, []).append(seed)
    return report


def waiting_reruns(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


__all__ = ["reseed", "configurations", "Configuration", "ReseedReport", "companion_name", "load_companion",
           "is_companion", "fresh_seeds", "seed_everything", "ATTR_SEED", "ATTR_RESEED_OF"]
