"""``shardadopt hpo plot``: a study as pictures (PNG), with matplotlib from the ``shardadopt[plot]`` extra.

``figures(study, companion)`` builds the matplotlib figures (``Figure`` objects, no pyplot state, so it is safe in
a server or a test): ``history`` (each completed trial's value and the best so far), ``intermediate`` (one line
per trial that reported values; pruned trials dashed, ending in a cross), ``importances`` (Optuna's PED-ANOVA
parameter importances: no extra dependency) and ``seed_spread`` (each re-run configuration's values over seeds,
mean and standard deviation, from ``shardadopt hpo reseed``). A figure that cannot be drawn yet (no re-runs,
too few trials for importances) is left out, with the reason. ``write_plots`` saves them as ``<name>.png``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from shardadopt.hpo.reseed import configurations

PLOTS = ("history", "intermediate", "importances", "seed_spread")
MISSING = "plots need matplotlib: pip install 'shardadopt[plot]'"


def figure_class() -> type:
    """matplotlib's ``Figure``, or an ImportError naming the extra that brings it.

    Returns:
        ``matplotlib.figure.Figure``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    return Figure


@dataclass
class PlotReport:
    written: dict[str, str] = field(default_factory=dict)  # plot -> PNG path
    skipped: dict[str, str] = field(default_factory=dict)  # plot -> why it was not drawn

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def figures(study: optuna.Study, companion: optuna.Study | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The figures that can be drawn for ``study`` (and its re-runs), and why each other one cannot.

    Args:
        study: the search.
        companion: its companion study of re-runs, for ``seed_spread``.

    Returns:
        Plot name -> matplotlib figure, and plot name -> why it cannot be drawn yet.
    """
    if len(study.directions) > 1:
        raise ValueError(f"study {study.study_name!r} has several objectives: plot draws single-objective studies")
    figure = figure_class()
    drawn: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name, draw in (("history", _history), ("intermediate", _intermediate), ("importances", _importances),
                       ("seed_spread", _seed_spread)):
        fig = figure(figsize=(7, 4.5), layout="constrained")
        reason = draw(fig, study, companion)
        if reason is None:
            drawn[name] = fig
        else:
            skipped[name] = reason
    return drawn, skipped


def write_plots(study: optuna.Study, out_dir: str | os.PathLike, companion: optuna.Study | None = None,
                dpi: int = 80) -> PlotReport:
    """Draw what :func:`figures` can and write each figure as ``out_dir/<name>.png``.

    Args:
        study: the search.
        out_dir: the directory for the PNGs (created when missing).
        companion: its companion study of re-runs, for ``seed_spread``.
        dpi: the PNGs' resolution.

    Returns:
        The paths written and, for each plot not drawn, why.
    """
    drawn, skipped = figures(study, companion)
    os.makedirs(out_dir, exist_ok=True)
    report = PlotReport(skipped=skipped)
    for name, fig in drawn.items():
        path = os.path.join(os.fspath(out_dir), f"{name}.png")
        fig.savefig(path, dpi=dpi)
        report.written[name] = path
    return report


def _history(fig: Any, study: optuna.Study, companion: optuna.Study | None) -> str | None:
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return "no completed trials"
    ax = fig.add_subplot()
    numbers = [t.number for t in complete]
    values = [t.value for t in complete]
    pick = max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min
    best, best_so_far = None, []
    for value in values:
        best = value if best is None else pick(best, value)
        best_so_far.append(best)
    ax.scatter(numbers, values, label="completed trial", color="tab:blue")
    ax.step(numbers, best_so_far, where="post", label="best so far", color="tab:red")
    ax.set(title=f"{study.study_name}: optimisation history", xlabel="trial", ylabel="objective value")
    ax.legend()
    return None


def _intermediate(fig: Any, study: optuna.Study, companion: optuna.Study | None) -> str | None:
    trials = [t for t in study.get_trials(deepcopy=False) if t.intermediate_values]
    if not trials:
        return "no trial reported intermediate values"
    ax = fig.add_subplot()
    for trial in trials:
        steps = sorted(trial.intermediate_values)
        pruned = trial.state == TrialState.PRUNED
        ax.plot(steps, [trial.intermediate_values[s] for s in steps], linestyle="--" if pruned else "-",
                marker="x" if pruned else ".", markevery=[len(steps) - 1] if pruned else None, alpha=0.8,
                label=f"#{trial.number} {trial.state.name.lower()}", gid=f"trial-{trial.number}")
    ax.set(title=f"{study.study_name}: intermediate values (dashed, x: pruned)", xlabel="step",
           ylabel="intermediate value")
    if len(trials) <= 12:
        ax.legend(fontsize="small")
    return None


def _importances(fig: Any, study: optuna.Study, companion: optuna.Study | None) -> str | None:
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    names = {name for t in complete for name in t.params}
    if len(complete) < 2 or not names:
        return f"{len(complete)} completed trial(s) with {len(names)} parameter(s): importances need 2 and 1"
    try:
        importances = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    except (ValueError, RuntimeError) as exc:  # e.g. every trial has the same parameters
        return f"Optuna could not compute importances: {exc}"
    if not importances:
        return "Optuna found no parameter importances"
    ax = fig.add_subplot()
    ordered = sorted(importances.items(), key=lambda item: item[1])
    ax.barh([name for name, _ in ordered], [value for _, value in ordered], color="tab:green")
    ax.set(title=f"{study.study_name}: parameter importances (PED-ANOVA)", xlabel="importance")
    return None


def _seed_spread(fig: Any, study: optuna.Study, companion: optuna.Study | None) -> str | None:
    rerun = [c for c in configurations(study, companion) if c.reruns]
    if not rerun:
        return "no finished seed re-runs (shardadopt hpo reseed, then run the companion study)"
    ax = fig.add_subplot()
    for position, config in enumerate(rerun):
        ax.scatter([position] * len(config.values), config.values, color="tab:blue", alpha=0.6,
                   label="one seed" if position == 0 else None)
        ax.errorbar([position], [config.mean], yerr=[config.std], fmt="o", color="tab:red", capsize=6,
                    label="mean ± std" if position == 0 else None)
    ax.set_xticks(range(len(rerun)), [f"#{c.trial}\n({len(c.values)} seeds)" for c in rerun])
    ax.set(title=f"{study.study_name}: re-runs with fresh seeds", xlabel="configuration (trial of the search)",
           ylabel="objective value")
    ax.legend()
    return None


__all__ = ["figures", "write_plots", "PlotReport", "figure_class", "PLOTS", "MISSING"]
