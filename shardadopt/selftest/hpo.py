"""Selftest scenario for distributed Optuna HPO: a pruned study on every rank equals the same study in one process.

Each trial's intermediate value is a sum of terms split across the ranks and combined with an all-reduce on the
training group (so every rank must take part in every step); rank 0 reports it through ``DistributedTrial`` and
the pruner's decision reaches every rank. The single-process reference runs plain Optuna on the same sampler seed
with the whole sum: trial states, parameters and reported values must agree, and every rank must have run each
trial up to the step Optuna recorded (an out-of-step rank would have hung the all-reduce instead).
"""

from __future__ import annotations

import math
from typing import Any

from shardadopt.selftest.scenario import Context, Scenario

N_TRIALS = 8
STEPS = 5
TERMS = 64  # split evenly across the ranks


def _terms(x: float, y: int, step: int) -> list[float]:
    return [math.sin(i * x) ** 2 * (1 + y) / (step + 1) + (x - 0.4) ** 2 for i in range(TERMS)]


def _study():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=11),
                               pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))


def _summary(study) -> list[tuple]:
    return [(t.number, t.state.name, t.params, dict(t.intermediate_values)) for t in study.trials]


def hpo_rank(ctx: Context) -> dict[str, Any]:
    import optuna
    import torch
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize

    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if ctx.device == "cuda" else "cpu"
    seen: list[list] = []

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        y = trial.suggest_int("y", 0, 3)
        seen.append([trial.number, -1])
        value = 0.0
        for step in range(STEPS):
            local = torch.tensor(sum(_terms(x, y, step)[rank::world]), dtype=torch.float64, device=device)
            dist.all_reduce(local)  # the "training" collective
            value = local.item()
            seen[-1][1] = step
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    study = _study() if rank == 0 else None
    optimize(study, objective, n_trials=N_TRIALS, control=ControlOptions(timeout=120))
    seen_all: list = [None] * world
    dist.all_gather_object(seen_all, seen)
    return {"study": _summary(study) if study is not None else None, "seen": seen_all}


def hpo_reference(ctx: Context) -> list[tuple]:
    import optuna

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        y = trial.suggest_int("y", 0, 3)
        value = 0.0
        for step in range(STEPS):
            value = sum(_terms(x, y, step))
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    study = _study()
    study.optimize(objective, n_trials=N_TRIALS)
    return _summary(study)


def compare_studies(result: dict[str, Any], expected: list[tuple]) -> str | None:
    got = result["study"]
    if [(n, s, p) for n, s, p, _ in got] != [(n, s, p) for n, s, p, _ in expected]:
        return f"trial states/params differ from one process: {[row[:2] for row in got]} vs " \
               f"{[row[:2] for row in expected]}"
    if not any(state == "PRUNED" for _, state, _, _ in got):
        return "no trial was pruned: the scenario does not exercise pruning"
    for (number, _, _, values), (_, _, _, reference) in zip(got, expected):
        if values.keys() != reference.keys() or any(
                not math.isclose(values[k], reference[k], rel_tol=1e-12) for k in values):
            return f"trial {number}: reported values {values} differ from one process's {reference}"
    recorded = [[number, len(values) - 1] for number, _, _, values in got]
    for rank, seen in enumerate(result["seen"]):
        if seen != recorded:
            return f"rank {rank} left trials at {seen}, Optuna recorded {recorded}"
    return None


SCENARIOS = [
    Scenario(
        name="hpo-prune-in-step",
        description="Optuna study with pruning on N ranks: same trial states/params/values as one process",
        run=hpo_rank,
        reference=hpo_reference,
        compare=compare_studies,
        unsupported=lambda nproc: "needs at least 2 processes" if nproc < 2 else None,
    ),
]
