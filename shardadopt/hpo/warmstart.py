"""Start the study of a new search-space version from the best configurations of the old one.

A study's history only means something under the space that produced it, so a new space version gets a new study
(``SpaceVersionMismatch`` refuses the old one). ``warm_start(storage, old, new, top=K, space=...)`` enqueues the
``K`` best configurations of ``old`` (ranked as ``shardadopt hpo best`` ranks them: by the mean over seeds once
re-runs exist) into ``new``, mapped onto the new space: a parameter the new space dropped is dropped, one outside a
new range is clipped to it (``out_of_range="clip"``, onto its step grid too) or the trial is skipped
(``out_of_range="skip"``), a categorical value the new space no longer offers skips the trial, and a parameter new
in the space is left to the sampler. Every enqueued trial carries ``warm_start_of`` (``{"study": old, "number": n}``);
a trial already warm-started into ``new`` is not enqueued again (idempotent, like ``requeue``).

``space``: the new space as ``{name: distribution}``; ``space_distributions(hp_space)`` reads it from an
``hp_space(trial)`` function. Without it, the distributions the new study's trials already used are taken.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import BaseStorage

from shardadopt.hpo.pruning_check import ATTR_WARM_START_OF
from shardadopt.hpo.reseed import configurations, load_companion

OUT_OF_RANGE = ("clip", "skip")


def space_distributions(hp_space: Callable[[optuna.Trial], Any]) -> dict[str, BaseDistribution]:
    """The distributions ``hp_space`` suggests from, read by running it once on a scratch in-memory trial
    (a conditional space yields the branch that trial took).

    Args:
        hp_space: a ``hp_space(trial)`` function, as ``hyperparameter_search`` takes it.

    Returns:
        Parameter name -> Optuna distribution.
    """
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" in the job's log
    try:
        scratch = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    finally:
        optuna.logging.set_verbosity(verbosity)
    hp_space(scratch)
    return dict(scratch.distributions)


def import_space(target: str) -> Callable[[optuna.Trial], Any]:
    """``module:function`` (e.g. ``examples.hpo_search:hp_space_v2``) to the ``hp_space`` function it names; the
    module is looked up from the current directory first, as ``python -m`` does.

    Args:
        target: ``module:function``.

    Returns:
        The function.
    """
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--space {target!r}: use module:function, e.g. my_search:hp_space")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--space {target!r}: cannot import it ({type(exc).__name__}: {exc}); run from the "
                         "directory holding the module, or set PYTHONPATH") from exc


def map_params(params: Mapping[str, Any], space: Mapping[str, BaseDistribution], out_of_range: str = "clip",
               ) -> tuple[dict[str, Any] | None, list[str]]:
    """``params`` on ``space``: the mapped parameters (None: the trial cannot be expressed there) and what changed.

    Args:
        params: a trial's parameters.
        space: the new space's distributions.
        out_of_range: ``"clip"`` a value outside a new range onto it, or ``"skip"`` the trial.

    Returns:
        The mapped parameters (None when the trial is skipped) and one line per change.
    """
    if out_of_range not in OUT_OF_RANGE:
        raise ValueError(f"out_of_range={out_of_range!r}: use one of {OUT_OF_RANGE}")
    mapped: dict[str, Any] = {}
    notes: list[str] = []
    for name, value in params.items():
        distribution = space.get(name)
        if distribution is None:
            notes.append(f"{name} dropped (not in the new space)")
            continue
        if isinstance(distribution, CategoricalDistribution):
            if value not in distribution.choices:
                return None, notes + [f"{name}={value!r} is not among the new choices {list(distribution.choices)}"]
            mapped[name] = value
            continue
        if not isinstance(distribution, (FloatDistribution, IntDistribution)) or isinstance(value, (bool, str)):
            return None, notes + [f"{name}={value!r} does not fit the new distribution {distribution!r}"]
        fitted = _fit(float(value), distribution)
        if fitted != value:
            if out_of_range == "skip":
                return None, notes + [f"{name}={value!r} is outside the new range "
                                      f"[{distribution.low}, {distribution.high}]"]
            notes.append(f"{name} clipped from {value!r} to {fitted!r}")
        mapped[name] = fitted
    for name in space:
        if name not in params:
            notes.append(f"{name} is new: the sampler picks it")
    return mapped, notes


def _fit(value: float, distribution: FloatDistribution | IntDistribution) -> float | int:
    """The nearest value the distribution can produce (inside its range, on its step grid)."""
    low, high, step = distribution.low, distribution.high, distribution.step
    fitted = min(max(value, low), high)
    if step is not None:
        fitted = low + round((fitted - low) / step) * step
        fitted = min(fitted, low + math.floor((high - low) / step) * step)
    if isinstance(distribution, IntDistribution):
        return int(round(fitted))
    return value if math.isclose(fitted, value, rel_tol=1e-9, abs_tol=1e-12) else float(fitted)


@dataclass
class WarmStartReport:
    source: str
    target: str
    enqueued: dict[int, dict[str, Any]] = field(default_factory=dict)  # old trial -> params enqueued
    skipped: dict[int, str] = field(default_factory=dict)  # old trial -> why it cannot be expressed in the new space
    present: list[int] = field(default_factory=list)  # old trials warm-started into the target before
    notes: dict[int, list[str]] = field(default_factory=dict)  # old trial -> what the mapping changed

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def warm_start(storage: BaseStorage, source: str, target: str, top: int,
               space: Mapping[str, BaseDistribution] | None = None, out_of_range: str = "clip") -> WarmStartReport:
    """Enqueue the ``top`` best configurations of study ``source`` into ``target`` (created with the source's
    directions when missing), mapped onto ``space``. Idempotent.

    Args:
        storage: the storage holding both studies.
        source: the old study's name.
        target: the new study's name.
        top: how many of the best configurations to enqueue.
        space: the new space's distributions (None: those ``target``'s trials used).
        out_of_range: ``"clip"`` or ``"skip"``, as :func:`map_params`.

    Returns:
        What was enqueued, mapped how, and what was skipped.
    """
    if top < 1:
        raise ValueError(f"warm start needs --top >= 1, got {top}")
    if source == target:
        raise ValueError(f"warm start from {source!r} into itself: give the new space version's study as --to")
    old = optuna.load_study(study_name=source, storage=storage)
    new = optuna.create_study(study_name=target, storage=storage, directions=old.directions, load_if_exists=True)
    if [d.name for d in new.directions] != [d.name for d in old.directions]:
        raise ValueError(f"study {target!r} optimises {[d.name for d in new.directions]}, {source!r} "
                         f"{[d.name for d in old.directions]}: their values do not compare")
    trials = new.get_trials(deepcopy=False)
    if space is None:
        space = {name: d for t in trials for name, d in t.distributions.items()}
        if not space:
            raise ValueError(f"study {target!r} has no trials to read the new space from: pass the space "
                             "(--space module:hp_space, or space_distributions(hp_space))")
    report = WarmStartReport(source, target)
    done = {(a.get("study"), a.get("number")) for t in trials
            if isinstance(a := t.user_attrs.get(ATTR_WARM_START_OF), dict)}
    for config in configurations(old, load_companion(storage, source))[:top]:
        if (source, config.trial) in done:
            report.present.append(config.trial)
            continue
        mapped, notes = map_params(config.params, space, out_of_range)
        if notes:
            report.notes[config.trial] = notes
        if mapped is None:
            report.skipped[config.trial] = notes[-1]
            continue
        new.enqueue_trial(mapped, user_attrs={ATTR_WARM_START_OF: {"study": source, "number": config.trial}})
        report.enqueued[config.trial] = mapped
    return report


__all__ = ["warm_start", "WarmStartReport", "map_params", "space_distributions", "import_space",
           "ATTR_WARM_START_OF"]
