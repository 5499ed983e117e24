"""Check, once per problem, that early values predict final ones before trusting a pruner with the budget.

``DurabilityOptions(unpruned_trials=N)`` (``hyperparameter_search(unpruned_trials=N)``) runs the first ``N``
sampled trials of a study to the end whatever the pruner says (they carry the ``unpruned`` user attribute;
re-runs from ``shardadopt hpo reseed`` run in a companion study that is never pruned).

``check_pruning(study, rung)`` then compares, over the trials that ran to the end, the value each reported at the
rung (default: the first step all of them reported) with its final value: Spearman and Kendall rank correlation,
and whether the top third at the rung contains the trial that ended best. The verdict is ``trust`` (both hold:
rho >= 0.5 and the best is in the top third), ``distrust`` or ``insufficient`` (fewer than 5 trials). Trials the
pruner let through are a biased sample (the ones it already liked), so the check uses the ``unpruned`` trials
when there are at least 5 of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial, TrialState

from shardadopt.hpo.failures import ATTR_RETRY_OF
from shardadopt.hpo.reseed import ATTR_SEED

ATTR_UNPRUNED = "unpruned"
ATTR_WARM_START_OF = "warm_start_of"
MIN_TRIALS = 5
MIN_SPEARMAN = 0.5


class KeepUnpruned(BasePruner):
    """The study's pruner, except that trials marked ``unpruned`` always run to the end."""

    def __init__(self, pruner: BasePruner) -> None:
        self.pruner = pruner

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if trial.user_attrs.get(ATTR_UNPRUNED):
            return False
        return self.pruner.prune(study, trial)


def keep_unpruned(pruner: BasePruner) -> KeepUnpruned:
    """``pruner`` wrapped so ``unpruned`` trials run to the end; HyperbandPruner is refused, since Optuna's samplers
    recognise it by type (its brackets would be lost).

    Args:
        pruner: the study's pruner.

    Returns:
        The wrapping pruner.
    """
    if isinstance(pruner, optuna.pruners.HyperbandPruner):
        raise ValueError("unpruned_trials with HyperbandPruner: Optuna's samplers recognise Hyperband by its type, "
                         "so it cannot be wrapped; run the unpruned trials in a study with MedianPruner or "
                         "SuccessiveHalvingPruner, or with NopPruner, and check them there")
    return KeepUnpruned(pruner)


def mark_unpruned(trial: optuna.Trial, limit: int) -> bool:
    """Mark ``trial`` ``unpruned`` while the study has fewer than ``limit`` such trials; only trials the sampler
    proposed count (not retries, warm starts or re-runs, which repeat known configurations). Jobs starting trials
    at the same moment may each mark one beyond ``limit``: more unpruned trials, never fewer.

    Args:
        trial: the trial starting now (rank 0's Optuna trial).
        limit: how many unpruned trials the study should have.

    Returns:
        True when ``trial`` was marked.
    """
    if limit <= 0 or any(key in trial.user_attrs for key in (ATTR_RETRY_OF, ATTR_WARM_START_OF, ATTR_SEED)):
        return False
    marked = sum(1 for t in trial.study.get_trials(deepcopy=False) if t.user_attrs.get(ATTR_UNPRUNED))
    if marked >= limit:
        return False
    trial.set_user_attr(ATTR_UNPRUNED, True)
    return True


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank (as Spearman's rho needs)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho: Pearson correlation of the ranks (nan when either side is constant).

    Args:
        x: one value per trial.
        y: another value per trial, in the same order.

    Returns:
        rho, in [-1, 1], or nan.
    """
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else float("nan")


def kendall(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b (ties corrected; nan when either side is constant).

    Args:
        x: one value per trial.
        y: another value per trial, in the same order.

    Returns:
        tau-b, in [-1, 1], or nan.
    """
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else float("nan")


@dataclass
class PruningCheck:
    study: str
    rung: int | None
    trials: list[int]  # the trials compared: ran to the end and reported at the rung
    unpruned_only: bool  # whether only trials marked unpruned were used
    spearman: float
    kendall: float
    top_third: list[int]  # trials best at the rung (a third of them, rounded up)
    final_best: int | None
    best_in_top_third: bool
    verdict: str  # trust | distrust | insufficient
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_pruning(study: optuna.Study, rung: int | None = None) -> PruningCheck:
    """Do the values at ``rung`` rank the trials that ran to the end as their final values do?

    Args:
        study: the search.
        rung: the step whose values are compared (default: the first step every finished trial reported).

    Returns:
        The correlations, whether the top third at the rung holds the final best, and the verdict.
    """
    if len(study.directions) > 1:
        raise ValueError(f"study {study.study_name!r} has several objectives; Optuna prunes single-objective studies")
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.intermediate_values]
    unpruned = [t for t in complete if t.user_attrs.get(ATTR_UNPRUNED)]
    unpruned_only = len(unpruned) >= MIN_TRIALS
    pool = unpruned if unpruned_only else complete
    if rung is None and pool:
        rung = max(min(t.intermediate_values) for t in pool)  # the first step every one of them reported
    trials = [t for t in pool if rung in t.intermediate_values]
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE

    def best_first(values: list[float]) -> list[int]:
        return sorted(range(len(values)), key=lambda i: -values[i] if maximize else values[i])

    at_rung = [float(t.intermediate_values[rung]) for t in trials]
    final = [float(t.value) for t in trials]
    numbers = [t.number for t in trials]
    if len(trials) < MIN_TRIALS:
        where = "unpruned " if unpruned_only else ""
        return PruningCheck(study.study_name, rung, numbers, unpruned_only, float("nan"), float("nan"), [], None,
                            False, "insufficient",
                            f"{len(trials)} {where}trial(s) ran to the end and reported at step {rung}; at least "
                            f"{MIN_TRIALS} are needed (run some without pruning: unpruned_trials=20)")
    third = math.ceil(len(trials) / 3)
    top_third = [numbers[i] for i in best_first(at_rung)[:third]]
    final_best = numbers[best_first(final)[0]]
    rho, tau = spearman(at_rung, final), kendall(at_rung, final)
    contained = final_best in top_third
    sample = f"{len(trials)} {'unpruned ' if unpruned_only else ''}trials that ran to the end"
    if not unpruned_only:
        sample += " (the pruner chose which: a biased sample; run unpruned_trials=20 for a fair one)"
    if contained and rho >= MIN_SPEARMAN:
        verdict, reason = "trust", (f"over {sample}, the values at step {rung} rank trials like their final values "
                                    f"(Spearman {rho:.2f}, Kendall {tau:.2f}) and the top third at that step holds "
                                    f"the final best (#{final_best}): pruning from step {rung} on loses little")
    else:
        problems = []
        if not rho >= MIN_SPEARMAN:
            problems.append(f"Spearman {rho:.2f} < {MIN_SPEARMAN} (Kendall {tau:.2f})")
        if not contained:
            problems.append(f"the final best #{final_best} is not in the top third at that step {top_third}")
        verdict, reason = "distrust", (f"over {sample}: " + "; ".join(problems) + f": pruning at step {rung} would "
                                       "stop trials that end well; put the first rung later (n_warmup_steps) or "
                                       "prune less")
    return PruningCheck(study.study_name, rung, numbers, unpruned_only, rho, tau, top_third, final_best, contained,
                        verdict, reason)


__all__ = ["check_pruning", "PruningCheck", "KeepUnpruned", "keep_unpruned", "mark_unpruned", "spearman", "kendall",
           "ATTR_UNPRUNED"]
