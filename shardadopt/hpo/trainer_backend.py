"""``Trainer.hyperparameter_search(backend="optuna")`` on every rank of a torch.distributed job.

Upstream (every transformers 5.x) runs ``study.optimize`` on rank 0 and hands the other ranks an
``optuna.trial.FixedTrial`` per trial, looping a fixed ``n_trials``: their ``should_prune()`` is always False, so
the first pruned trial leaves them training alone and the job hangs; so do ``timeout=``, ``study.stop()`` and an
exception on one rank. Here every rank runs the same trials through ``shardadopt.hpo.optimize`` with a
``DistributedTrial``, and the prune path of ``Trainer._report_to_hp_search`` asks it (one collective per report).

Extra keyword arguments of ``hyperparameter_search`` understood here (the rest go to ``optuna.create_study`` on
rank 0, as upstream): ``timeout``, ``n_jobs``, ``gc_after_trial``, ``catch`` (as upstream), ``callbacks`` and
``show_progress_bar`` (passed to ``study.optimize`` on rank 0), ``report_unit`` and ``control_timeout``.

``report_unit`` fixes the step at which intermediate values are reported, so trials stay comparable for the
pruner when batch size or accumulation is tuned: ``"examples"`` (default: training examples seen, optimizer
steps x total train batch size over data-parallel ranks), ``"epochs"`` (whole epochs, for ``eval_strategy=
"epoch"``), ``"steps"`` (optimizer steps, upstream's unit), or a function ``trainer -> int``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardadopt.hpo.trial import DistributedTrial

REPORT_UNITS = ("examples", "epochs", "steps")
_UNIT_ATTRIBUTE = "_shardadopt_hpo_report_unit"


def run_hp_search_optuna(trainer: Any, n_trials: int, direction: str | list[str], **kwargs: Any) -> Any:
    """Drop-in for ``transformers.integrations.run_hp_search_optuna``; returns the ``BestRun`` (a list of them for
    several objectives) on every rank (upstream: rank 0 only)."""
    import optuna
    import torch.distributed as dist
    from transformers.trainer_utils import BestRun

    from shardadopt.hpo.channel import Channel
    from shardadopt.hpo.loop import optimize, run_on_root

    report_unit = kwargs.pop("report_unit", "examples")
    control_timeout = kwargs.pop("control_timeout", None)
    optimize_kwargs = {name: kwargs.pop(name) for name in ("timeout", "n_jobs", "gc_after_trial", "catch",
                                                           "callbacks", "show_progress_bar") if name in kwargs}
    if not callable(report_unit) and report_unit not in REPORT_UNITS:
        raise ValueError(f"report_unit={report_unit!r}: use one of {REPORT_UNITS} or a function trainer -> int")
    world_size = trainer.args.world_size
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"hyperparameter_search(backend='optuna') with world_size={world_size} (parallel mode "
            f"{trainer.args.parallel_mode}) needs torch.distributed initialised on every process: the ranks agree "
            "on each trial and each pruning decision through it. Launch with torchrun or `accelerate launch`, or "
            "call torch.distributed.init_process_group() before the search.")
    directions = direction if isinstance(direction, list) else None
    single = None if directions is not None else direction

    def create_study() -> optuna.Study:
        return optuna.create_study(direction=single, directions=directions, **kwargs)

    setattr(trainer, _UNIT_ATTRIBUTE, report_unit)
    try:
        study = optimize(create_study, lambda trial: _objective(trainer, trial), n_trials=n_trials,
                         control_timeout=control_timeout, **optimize_kwargs)

        def best_runs() -> BestRun | list[BestRun]:
            if not study._is_multi_objective():
                best = study.best_trial
                return BestRun(str(best.number), best.value, best.params)
            return [BestRun(str(best.number), best.values, best.params) for best in study.best_trials]

        return run_on_root(Channel(None, control_timeout), best_runs)
    finally:
        delattr(trainer, _UNIT_ATTRIBUTE)


def _objective(trainer: Any, trial: DistributedTrial) -> Any:
    from accelerate.utils.memory import release_memory

    trainer.objective = None
    try:
        # Sample the space first, as upstream does, so a model_init(trial) can read trial.params.
        trainer.hp_space(trial)
        trainer.train(resume_from_checkpoint=None, trial=trial)
        # If there has been no evaluation during training.
        if getattr(trainer, "objective", None) is None:
            metrics = trainer.evaluate()
            trainer.objective = trainer.compute_objective(metrics)
        return trainer.objective
    finally:
        # Free accelerator memory on every exit, pruned and failed trials included.
        trainer.model_wrapped, trainer.model = release_memory(trainer.model_wrapped, trainer.model)
        trainer.accelerator.clear()


def report_to_hp_search(trainer: Any, trial: DistributedTrial, step: int, metrics: dict[str, float]) -> None:
    """The Optuna branch of ``Trainer._report_to_hp_search`` for a ``DistributedTrial``: every rank computes the
    objective, rank 0 reports it at a fixed-unit step, and every rank raises ``TrialPruned`` at the same report."""
    import optuna

    trainer.objective = trainer.compute_objective(metrics.copy())
    if trial.multi_objective:  # Optuna cannot prune multi-objective studies (as upstream)
        return
    trial.report(trainer.objective, report_step(trainer, step))
    if trial.should_prune():
        trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
        raise optuna.TrialPruned()


def report_step(trainer: Any, optimizer_steps: int) -> int:
    """The step to report at, in the unit the search was started with (default: training examples seen)."""
    unit: str | Callable[[Any], int] = getattr(trainer, _UNIT_ATTRIBUTE, "examples")
    if callable(unit):
        return int(unit(trainer))
    if unit == "steps":
        return optimizer_steps
    if unit == "epochs":
        return int(round(trainer.state.epoch or 0))
    return optimizer_steps * trainer.get_total_train_batch_size(trainer.args)
