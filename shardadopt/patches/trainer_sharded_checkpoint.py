"""Resumable, atomic Trainer checkpoints for models sharded at load time (transformers 5.15 .. 5.24).

Upstream (``transformers/trainer.py``): 5.18 .. 5.24 refuse in ``Trainer.__init__``, after resolving the model
(``model = self.call_model_init()`` when only ``model_init`` is given)::

    if self.is_distributed_loading_by_transformers and args.save_strategy != SaveStrategy.NO
            and not args.save_only_model:
        raise ValueError("Resuming is not supported for models sharded at load time ...")

and every release writes a checkpoint as ``self.save_model(output_dir, _internal_call=True)`` plus
``torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))`` on the main process only:
the optimizer of a sharded model is a set of per-rank DTensor shards, so that file holds rank 0's shard (or
fails), and nothing is written atomically (a crash leaves a ``checkpoint-N`` that ``resume_from_checkpoint=True``
picks up). 5.15 .. 5.23 also gather a sharded model in ``save_model`` on the main process only (a hang).

The fix, only for a model whose parameters are DTensors / FSDP2 modules outside accelerate's own FSDP and
DeepSpeed plugins (every other model keeps upstream's exact path):

- ``__init__`` accepts ``save_strategy != "no"`` without ``save_only_model``, for a sharded ``model=`` and for a
  ``model_init=`` that shards while loading (the way ``hyperparameter_search`` needs the Trainer built):
  ``__init__`` calls ``self.call_model_init()`` itself before the refusal, so the refusal is lifted once that call
  returns a sharded model.
- ``_save_checkpoint`` writes ``checkpoint-N`` through ``shardadopt.checkpoint``: model and optimizer with
  ``torch.distributed.checkpoint`` (each rank its shards), scheduler, scaler, per-rank RNG (Trainer's own files),
  ``trainer_state.json``, the config, into a staging directory published (renamed) once every rank has finished,
  with a completion marker. Best-model tracking and ``save_total_limit`` rotation as upstream.
- ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler`` / ``_load_best_model`` read such a checkpoint
  (refusing a partial one with a clear message; resharding when the layout differs, with a warning).
- ``save_model`` (the final export) streams consolidated safetensors with ``shardadopt.checkpoint.save_full`` on
  every rank, plus the processing class and training arguments.
"""

from __future__ import annotations

import ast
import contextvars
import os
import warnings
from typing import Any

from shardadopt.registry import Patch, Probe, Target
from shardadopt.versions import supported

PATCH_ID = "trainer-sharded-checkpoint"
_MODULE = "transformers.trainer"


def _ours(trainer: Any) -> bool:
    """A model sharded (DTensor/FSDP2) outside accelerate's FSDP and DeepSpeed plugins."""
    from shardadopt.checkpoint import is_sharded

    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return False
    return is_sharded(trainer.model)


def _model_is_sharded(model: Any) -> bool:
    from shardadopt.checkpoint import is_sharded

    return model is not None and is_sharded(model)


class _Lift:
    """Lets one ``Trainer.__init__`` pass the refusal for a sharded model, then restores the user's flag.

    The refusal reads ``args.save_strategy`` and ``args.save_only_model`` after the model is resolved: for
    ``model=`` the flag is set before ``__init__``; for ``model_init=`` (called inside ``__init__``, after the
    accelerator's own ``save_only_model`` checks) once ``call_model_init`` has returned a sharded model.
    """

    def __init__(self, trainer: Any):
        self.trainer, self.training_args = trainer, None

    def engage(self, training_args: Any, model: Any) -> None:
        from transformers.trainer_utils import SaveStrategy

        if (self.training_args is None and training_args is not None and _model_is_sharded(model)
                and not training_args.save_only_model and training_args.save_strategy != SaveStrategy.NO):
            self.training_args = training_args
            training_args.save_only_model = True

    def release(self) -> None:
        if self.training_args is not None:
            self.training_args.save_only_model = False
            self.training_args = None


# The Trainer whose __init__ is running in this context (model_init may itself build a Trainer).
_INIT: contextvars.ContextVar[_Lift | None] = contextvars.ContextVar("shardadopt_trainer_init", default=None)


def init(wrapped, instance, args, kwargs):
    lift = _Lift(instance)
    lift.engage(kwargs.get("args", args[1] if len(args) > 1 else None),
                kwargs.get("model", args[0] if args else None))
    token = _INIT.set(lift)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _INIT.reset(token)
        lift.release()


def call_model_init(wrapped, instance, args, kwargs):
    model = wrapped(*args, **kwargs)
    lift = _INIT.get()
    if lift is not None and lift.trainer is instance:  # the model __init__ resolves (train() calls it again)
        lift.engage(instance.args, model)
    return model


def save_checkpoint(wrapped, instance, args, kwargs):
    if not _ours(instance):
        return wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    trial = args[1] if len(args) > 1 else kwargs.get("trial")
    return save_sharded_checkpoint(instance, model, trial)


def save_sharded_checkpoint(trainer: Any, model: Any, trial: Any) -> str:
    """Upstream's ``Trainer._save_checkpoint`` with the state written by DCP into an atomically published folder."""
    import torch
    import torch.distributed as dist
    from transformers import trainer as trainer_module
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

    from shardadopt import checkpoint

    state, targs = trainer.state, trainer.args
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = trainer._get_output_dir(trial=trial)
    output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    os.makedirs(run_dir, exist_ok=True)

    if targs.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best

    optimizers = [] if targs.save_only_model else [trainer.optimizer]
    with checkpoint.staged(output_dir, step=state.global_step, models=[trainer.model],
                           metadata={"writer": "transformers.Trainer"}) as stage:
        checkpoint.save_sharded_state(stage, trainer.model, [getattr(o, "optimizer", o) for o in optimizers])
        if not targs.save_only_model:
            if targs.should_save and trainer.lr_scheduler is not None:
                with warnings.catch_warnings(record=True):
                    torch.save(trainer.lr_scheduler.state_dict(), os.path.join(stage, trainer_module.SCHEDULER_NAME))
            trainer._save_scaler(stage)
            trainer._save_rng_state(stage)
        if targs.should_save:
            trainer.model.config.save_pretrained(stage)
            torch.save(targs, os.path.join(stage, trainer_module.TRAINING_ARGS_NAME))
            for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                       if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks[name], list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
            state.save_to_json(os.path.join(stage, trainer_module.TRAINER_STATE_NAME))
    if targs.push_to_hub:
        trainer._push_from_checkpoint(output_dir)
    if targs.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=targs.save_total_limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
    if dist.is_initialized():
        dist.barrier()  # no rank may read a rotated-away checkpoint
    return output_dir


def _our_checkpoint(directory: str) -> bool:
    """A shardadopt checkpoint, complete or not (a partial one must be refused, not read as upstream's)."""
    from shardadopt.checkpoint import MARKER

    return os.path.isfile(os.path.join(directory, MARKER)) or os.path.isdir(os.path.join(directory, "state"))


def _load_model(trainer: Any, directory: str) -> None:
    from shardadopt import checkpoint

    info = checkpoint.read_info(directory)  # refuses a partial checkpoint with a clear message
    if checkpoint.check_compatible(info, [trainer.model], reshard=True):
        warnings.warn(f"{directory} was saved with world size {info.world_size} and layouts {info.layouts}; the "
                      f"weights and optimizer state are resharded, the data order and RNG cannot continue exactly",
                      stacklevel=3)
    checkpoint.load_sharded_state(info.directory, trainer.model)


def load_from_checkpoint(wrapped, instance, args, kwargs):
    directory = args[0] if args else kwargs["resume_from_checkpoint"]
    if not (_ours(instance) and _our_checkpoint(directory)):
        return wrapped(*args, **kwargs)
    _load_model(instance, directory)


def load_optimizer_and_scheduler(wrapped, instance, args, kwargs):
    directory = args[0] if args else kwargs.get("checkpoint")
    if directory is None or not (_ours(instance) and _our_checkpoint(directory)):
        return wrapped(*args, **kwargs)
    import torch
    from transformers import trainer as trainer_module

    from shardadopt import checkpoint

    checkpoint.read_info(directory)
    checkpoint.load_sharded_state(directory, instance.model, [getattr(instance.optimizer, "optimizer",
                                                                      instance.optimizer)])
    scheduler_file = os.path.join(directory, trainer_module.SCHEDULER_NAME)
    if os.path.isfile(scheduler_file):
        with warnings.catch_warnings(record=True):
            instance.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def load_best_model(wrapped, instance, args, kwargs):
    best = instance.state.best_model_checkpoint
    if not (best and _ours(instance) and _our_checkpoint(best)):
        return wrapped(*args, **kwargs)
    _load_model(instance, best)


def save_model(wrapped, instance, args, kwargs):
    if not _ours(instance):
        return wrapped(*args, **kwargs)
    output_dir = kwargs.get("output_dir", args[0] if args else None) or instance.args.output_dir
    internal = kwargs.get("_internal_call", args[1] if len(args) > 1 else False)
    export_full_model(instance, output_dir)
    if instance.args.push_to_hub and not internal:
        instance.push_to_hub(commit_message="Model save", revision=instance.args.hub_revision)


def export_full_model(trainer: Any, output_dir: str) -> None:
    """Consolidated safetensors + config, processing class and training args; every rank must call it."""
    import torch
    from transformers import trainer as trainer_module

    from shardadopt.checkpoint import save_full

    save_full(trainer.model, output_dir)
    if trainer.args.should_save:
        tokenizer = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, trainer_module.TRAINING_ARGS_NAME))


def _refuses_sharded_checkpoints(init) -> bool:
    """From ``Trainer.__init__``: whether it raises for a load-time-sharded model unless ``save_only_model`` (5.18+;
    ``init`` above lifts exactly that test). A refusal that does not test ``save_only_model`` is unknown."""
    from shardadopt.probing import if_chains, names, undecided

    for chain in if_chains(init):
        for test, body in chain:
            tested = names(test) if test is not None else set()
            if ({"is_distributed_loading_by_transformers", "_device_mesh"} & tested and "save_strategy" in tested
                    and any(isinstance(s, ast.Raise) for s in body)):
                if "save_only_model" not in tested:
                    raise undecided("Trainer.__init__", "a refusal of sharded checkpoints that save_only_model lifts")
                return True
    return False


def probe() -> Probe:
    """Run upstream's ``Trainer._save_optimizer_and_scheduler`` on the main process of a stand-in trainer holding a
    load-time-sharded model outside accelerate's plugins: the broken shape writes the process's local optimizer state
    dict as the one ``optimizer.pt`` (rank 0's shards only)."""
    import tempfile
    from types import SimpleNamespace

    import torch
    from transformers import trainer as trainer_module
    from transformers.trainer import Trainer

    from shardadopt.probing import source_tree, undecided, upstream_function

    where = "trainer-sharded-checkpoint probe"
    save = upstream_function(Trainer, "_save_optimizer_and_scheduler", where)
    local_state = {"state": {}, "param_groups": [{"lr": 0.5, "params": [0]}]}
    stub = SimpleNamespace(state_dict=lambda: local_state)
    trainer = SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=False, is_fsdp_xla_v1_enabled=False,
                              is_distributed_loading_by_transformers=True, optimizer=stub, lr_scheduler=stub,
                              model=torch.nn.Linear(1, 1), args=SimpleNamespace(should_save=True, process_index=0,
                                                                                 world_size=2))
    with tempfile.TemporaryDirectory() as directory:
        save(trainer, directory)
        path = os.path.join(directory, trainer_module.OPTIMIZER_NAME)
        local = os.path.isfile(path) and torch.load(path, weights_only=True) == local_state
    if not local:
        raise undecided("Trainer._save_optimizer_and_scheduler", "the main process's local optimizer state dict "
                        f"saved as {trainer_module.OPTIMIZER_NAME} (this patch's broken shape) nor a known sharded "
                        "save")
    refuses = _refuses_sharded_checkpoints(source_tree(upstream_function(Trainer, "__init__", where)))
    return Probe(True, "Trainer " + ("refuses to checkpoint" if refuses else "cannot checkpoint")
                 + " load-time-sharded models resumably (optimizer state is rank 0's local shard)")


PATCH = Patch(
    id=PATCH_ID,
    summary="Trainer: resumable, atomic DCP checkpoints and streamed full export for load-time-sharded models",
    upstream="anticipates huggingface/transformers: lift 'Resuming is not supported for models sharded at load "
             "time' by checkpointing through torch.distributed.checkpoint",
    requires=supported("transformers", "accelerate"),
    wrappers={
        Target(_MODULE, "Trainer.__init__"): init,
        Target(_MODULE, "Trainer.call_model_init"): call_model_init,
        Target(_MODULE, "Trainer._save_checkpoint"): save_checkpoint,
        Target(_MODULE, "Trainer._load_from_checkpoint"): load_from_checkpoint,
        Target(_MODULE, "Trainer._load_optimizer_and_scheduler"): load_optimizer_and_scheduler,
        Target(_MODULE, "Trainer._load_best_model"): load_best_model,
        Target(_MODULE, "Trainer.save_model"): save_model,
    },
    probe=probe,
)
