"""``Trainer.hyperparameter_search(backend="optuna")`` on every rank of a torch.distributed job.

Upstream (every transformers 5.x) runs ``study.optimize`` on rank 0 and hands the other ranks an
``optuna.trial.FixedTrial`` per trial, looping a fixed ``n_trials``: their ``should_prune()`` is always False, so
the first pruned trial leaves them training alone and the job hangs; so do ``timeout=``, ``study.stop()`` and an
exception on one rank. Here every rank runs the same trials through ``shardadopt.hpo.optimize`` with a
``DistributedTrial``, and the prune path of ``Trainer._report_to_hp_search`` asks it (one collective per report).

Extra keyword arguments of ``hyperparameter_search`` understood here (the rest go to ``optuna.create_study`` on
rank 0, as upstream): ``timeout``, ``n_jobs``, ``gc_after_trial``, ``catch`` (as upstream), ``callbacks`` and
``show_progress_bar`` (passed to ``study.optimize`` on rank 0), ``report_unit``, ``control_timeout`` and
``hang_timeout`` (seconds a rank may go without progress in a trial, default ``$SHARDADOPT_HANG_TIMEOUT`` or 900:
the trial fails as ``hang``, see ``shardadopt.fence``; progress is each forward call, optimizer step, control
round and Trainer step or evaluation event).

Durable, multi-job searches (see ``shardadopt.hpo.optimize``): ``storage`` (URL or Optuna storage; default a
journal file under ``args.output_dir``), ``study_name``, ``load_if_exists`` (default True: every torchrun job with
the same study name attaches as a worker), ``sampler`` (default ``default_sampler()``), ``space_version`` (default:
a hash of ``hp_space``'s source), ``allow_space_mismatch``, ``data_snapshot``, ``heartbeat_interval``,
``unpruned_trials``, ``warm_start_from``, ``warm_start_top`` (see ``DurabilityOptions``). A re-run enqueued by
``shardadopt hpo reseed`` (``seed`` user attribute) trains with ``TrainingArguments.seed`` (and ``data_seed``, when
set) replaced by its seed, so model initialisation and data order follow it. Each trial
writes its checkpoints into a directory of its own, ``output_dir/trial-<number>-<start time>`` (or ``hp_name``'s),
recorded on the trial as ``checkpoint_dir``; a retry enqueued by ``shardadopt hpo requeue`` resumes from the dead
trial's last complete checkpoint there and writes into its own directory. A non-finite logged loss or objective fails
the trial as ``nan_loss``; a ``ValueError``/``TypeError`` from ``hp_space`` or ``model_init`` (before training
starts) as ``config_error``.

``report_unit`` fixes the step at which intermediate values are reported, so trials stay comparable for the
pruner when batch size or accumulation is tuned: ``"examples"`` (default: training examples seen, optimizer
steps x total train batch size over data-parallel ranks), ``"epochs"`` (whole epochs, for ``eval_strategy=
"epoch"``), ``"steps"`` (optimizer steps, upstream's unit), or a function ``trainer -> int``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

from shardadopt import fence, upstream
from shardadopt.hpo import failures
from shardadopt.hpo.durability import ATTR_RESUME_FROM, checkpoint_name, record_checkpoint_dir
from shardadopt.hpo.reseed import ATTR_SEED
from shardadopt.hpo.trial import DistributedTrial

REPORT_UNITS = ("examples", "epochs", "steps")
_UNIT_ATTRIBUTE = "_shardadopt_hpo_report_unit"
_WATCH_ATTRIBUTE = "_shardadopt_hpo_watch"
# hyperparameter_search's flat keyword arguments that go into optimize's StudySpec / DurabilityOptions
_STUDY_KWARGS = ("storage", "study_name", "load_if_exists", "sampler", "pruner")
_DURABILITY_KWARGS = ("space_version", "allow_space_mismatch", "data_snapshot", "heartbeat_interval", "unpruned_trials",
                      "warm_start_from", "warm_start_top")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def run_hp_search_optuna(trainer: Any, n_trials: int, direction: str | list[str], **kwargs: Any) -> Any:
    """Drop-in for ``transformers.integrations.run_hp_search_optuna``; returns the ``BestRun`` (a list of them for
    several objectives) on every rank (upstream: rank 0 only).

    Args:
        trainer: the ``Trainer`` whose ``hyperparameter_search`` called it.
        n_trials: the number of trials of this job.
        direction: the direction, or one per objective.
        **kwargs: ``hyperparameter_search``'s extra arguments (Optuna's and shardadopt's, see ``docs/hpo.md``).

    Returns:
        The ``BestRun`` (a list for several objectives), on every rank.
    """
    import torch.distributed as dist
    from transformers.trainer_utils import BestRun

    from shardadopt.hpo.channel import Channel
    from shardadopt.hpo.loop import optimize, run_on_root
    from shardadopt.hpo.options import ControlOptions, DurabilityOptions, StudySpec

    report_unit = kwargs.pop("report_unit", "examples")
    control_timeout = kwargs.pop("control_timeout", None)
    hang_timeout = kwargs.pop("hang_timeout", None)
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
    study_kwargs = {name: kwargs.pop(name) for name in _STUDY_KWARGS if name in kwargs}
    durability_kwargs = {name: kwargs.pop(name) for name in _DURABILITY_KWARGS if name in kwargs}
    if kwargs:
        raise TypeError(f"hyperparameter_search(backend='optuna') got unexpected arguments {sorted(kwargs)}; see "
                        "shardadopt.hpo.trainer_backend for the ones understood")
    directions = direction if isinstance(direction, list) else None
    single = None if directions is not None else direction

    watch = _watch_class()()
    trainer.add_callback(watch)
    setattr(trainer, _WATCH_ATTRIBUTE, watch)
    own_hp_name = trainer.hp_name is None
    if own_hp_name:  # a directory per trial: trial numbers repeat across studies sharing output_dir
        trainer.hp_name = checkpoint_name
    setattr(trainer, _UNIT_ATTRIBUTE, report_unit)
    try:
        spec = StudySpec(direction=single, directions=directions, output_dir=trainer.args.output_dir, **study_kwargs)
        study = optimize(spec, lambda trial: _objective(trainer, trial), n_trials=n_trials, **optimize_kwargs,
                         durability=DurabilityOptions(hp_space=trainer.hp_space, **durability_kwargs),
                         control=ControlOptions(timeout=control_timeout, hang_timeout=hang_timeout))

        def best_runs() -> BestRun | list[BestRun]:
            if len(study.directions) == 1:
                best = study.best_trial
                return BestRun(str(best.number), best.value, best.params)
            return [BestRun(str(best.number), best.values, best.params) for best in study.best_trials]

        return run_on_root(Channel(None, control_timeout), best_runs)
    finally:
        delattr(trainer, _UNIT_ATTRIBUTE)
        delattr(trainer, _WATCH_ATTRIBUTE)
        trainer.remove_callback(watch)
        if own_hp_name:
            trainer.hp_name = None


def _watch_class() -> type:
    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        """Knows whether training started (errors before it are configuration errors), fails a trial whose
        logged loss is not finite (the logged loss is already averaged over ranks, so every rank raises), and
        counts Trainer's step and evaluation events as progress for hang detection (``shardadopt.fence``)."""

        started = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = True
            fence.progress()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            fence.progress()

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            fence.progress()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            fence.progress()

        def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            fence.progress()

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            fence.progress()

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            fence.progress()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            fence.progress()
            loss = (logs or {}).get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                failures.check_finite(float(loss), f"training loss at step {state.global_step}")

    return Watch


def last_complete_checkpoint(run_dir: str) -> str | None:
    """The newest ``checkpoint-N`` under ``run_dir`` that was completely written (``get_last_checkpoint`` takes
    the highest N even when its save was interrupted): a shardadopt checkpoint with its completion marker, or an
    upstream one whose ``trainer_state.json`` (written last) exists."""
    from shardadopt.checkpoint import MARKER, is_complete

    if not os.path.isdir(run_dir):
        return None
    numbered = sorted(((int(m.group(1)), name) for name in os.listdir(run_dir)
                       if (m := _CHECKPOINT_DIR.match(name)) and os.path.isdir(os.path.join(run_dir, name))),
                      reverse=True)
    for _, name in numbered:
        path = os.path.join(run_dir, name)
        ours = os.path.isfile(os.path.join(path, MARKER)) or os.path.isdir(os.path.join(path, "state"))
        if is_complete(path) if ours else os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
    return None


def _objective(trainer: Any, trial: DistributedTrial) -> Any:
    import optuna

    trainer.objective = None
    watch = getattr(trainer, _WATCH_ATTRIBUTE)
    watch.started = False
    seeds = (trainer.args.seed, trainer.args.data_seed)
    try:
        if (seed := trial.user_attrs.get(ATTR_SEED)) is not None:  # a re-run: model init and data order follow it
            trainer.args.seed = int(seed)
            if trainer.args.data_seed is not None:
                trainer.args.data_seed = int(seed)
        # Sample the space first, as upstream does, so a model_init(trial) can read trial.params.
        trainer.hp_space(trial)
        output_dir = trainer.args.output_dir
        record_checkpoint_dir(trial, os.path.relpath(upstream.trainer_output_dir(trainer, trial), output_dir))
        # A retry (shardadopt hpo requeue) resumes from the dead trial's last complete checkpoint.
        dead = trial.user_attrs.get(ATTR_RESUME_FROM)
        resume = last_complete_checkpoint(os.path.join(output_dir, dead)) if dead else None
        # train() builds this trial's model with model_init while the Trainer still holds the model it built at
        # construction (the first trial): drop it first, so one model at a time is alive.
        _release_trial(trainer)
        trainer.train(resume_from_checkpoint=resume, trial=trial)
        # If there has been no evaluation during training.
        if getattr(trainer, "objective", None) is None:
            metrics = trainer.evaluate()
            trainer.objective = trainer.compute_objective(metrics)
        return trainer.objective
    except Exception as exc:
        if not watch.started and not isinstance(exc, optuna.TrialPruned) and \
                failures.classify(exc, before_training=True) == failures.CONFIG_ERROR:
            failures.mark(exc, failures.CONFIG_ERROR)
        raise
    finally:
        trainer.args.seed, trainer.args.data_seed = seeds
        # Free the trial's memory on every exit, pruned and failed trials included.
        _release_trial(trainer)


def _release_trial(trainer: Any) -> None:
    """Drop the Trainer's references to the last trial's model, optimizer and scheduler (its callback handler's
    too, which upstream keeps until the next trial's ``train()`` replaces them: after ``model_init`` built the next
    model, so two trials' models and the old optimizer state were alive at once) and the accelerator's."""
    from accelerate.utils.memory import release_memory

    trainer.model_wrapped, trainer.model = release_memory(trainer.model_wrapped, trainer.model)
    trainer.optimizer = trainer.lr_scheduler = None
    for attr in ("model", "optimizer", "lr_scheduler"):
        setattr(trainer.callback_handler, attr, None)
    trainer.accelerator.clear()


def report_to_hp_search(trainer: Any, trial: DistributedTrial, step: int, metrics: dict[str, float]) -> None:
    """The Optuna branch of ``Trainer._report_to_hp_search`` for a ``DistributedTrial``: every rank computes the
    objective, rank 0 reports it at a fixed-unit step, and every rank raises ``TrialPruned`` at the same report."""
    import optuna

    trainer.objective = trainer.compute_objective(metrics.copy())
    for value in trainer.objective if isinstance(trainer.objective, (list, tuple)) else (trainer.objective,):
        failures.check_finite(value)  # every rank computed it from the same gathered metrics
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
