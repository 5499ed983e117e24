"""Resumable, atomic Trainer checkpoints and streamed full export for models sharded at load time.

What the ``trainer-sharded-checkpoint`` patch calls for a model whose parameters are DTensors / FSDP2 modules outside
accelerate's own FSDP and DeepSpeed plugins: ``checkpoint-N`` written through DCP into a directory published
atomically, read back (resharding when the layout differs), the final ``save_model`` streamed by ``save_full``, and
the lift of the Trainer's refusal to checkpoint such a model.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Iterator
from typing import Any

from shardadopt import upstream
from shardadopt.checkpoint.export import save_full
from shardadopt.checkpoint.integrity import agreement, read_agreed, verify
from shardadopt.checkpoint.publish import MARKER, STATE_DIR, read_info, staged
from shardadopt.checkpoint.safeload import load_file
from shardadopt.checkpoint.sharding import is_sharded
from shardadopt.checkpoint.state import check_compatible, is_adapter_model, load_sharded_state, save_sharded_state

# -- which trainers and checkpoints are ours -----------------------------------------------------------------------

def manages(trainer: Any) -> bool:
    """A model sharded (DTensor/FSDP2) outside accelerate's FSDP and DeepSpeed plugins."""
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return False
    return is_sharded(trainer.model)


def is_sharded_checkpoint(directory: str) -> bool:
    """A shardadopt checkpoint, complete or not (a partial one must be refused, not read as upstream's)."""
    return os.path.isfile(os.path.join(directory, MARKER)) or os.path.isdir(os.path.join(directory, STATE_DIR))


# -- lifting the refusal in Trainer.__init__ ------------------------------------------------------------------------

def _model_is_sharded(model: Any) -> bool:
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


@contextlib.contextmanager
def refusal_lifted(trainer: Any, training_args: Any, model: Any) -> Iterator[None]:
    """Around one ``Trainer.__init__(model, args, ...)``: its refusal to checkpoint a sharded model is lifted for a
    sharded ``model`` now, or for the model ``call_model_init`` returns inside it (see ``model_resolved``)."""
    lift = _Lift(trainer)
    lift.engage(training_args, model)
    token = _INIT.set(lift)
    try:
        yield
    finally:
        _INIT.reset(token)
        lift.release()


def model_resolved(trainer: Any, model: Any) -> None:
    """``trainer.call_model_init()`` returned ``model``: inside that trainer's ``__init__``, lift the refusal for a
    sharded one (``train()`` calls it again, outside ``__init__``: nothing to do then)."""
    lift = _INIT.get()
    if lift is not None and lift.trainer is trainer:
        lift.engage(trainer.args, model)


# -- save / load ---------------------------------------------------------------------------------------------------

def save_checkpoint(trainer: Any, model: Any, trial: Any) -> str:
    """Upstream's ``Trainer._save_checkpoint`` with the state written by DCP into an atomically published folder.

    Model and optimizer with ``torch.distributed.checkpoint`` (each rank its shards), scheduler, scaler, per-rank
    RNG (Trainer's own files), ``trainer_state.json`` and the config, published once every rank has finished, with
    a completion marker. Best-model tracking and ``save_total_limit`` rotation as upstream; the Hub push and the
    rotation run after publication inside the save's fence. Returns the folder.
    """
    import torch
    from transformers import trainer as trainer_module
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

    state, targs = trainer.state, trainer.args
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = upstream.trainer_output_dir(trainer, trial)
    output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    os.makedirs(run_dir, exist_ok=True)

    if targs.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best

    def after_publish() -> None:  # under the save's fence: rank 0 raising here makes every rank raise at once
        if targs.push_to_hub:
            upstream.trainer_push_from_checkpoint(trainer, output_dir)
        if targs.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=targs.save_total_limit,
                               best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)

    optimizers = [] if targs.save_only_model else [trainer.optimizer]
    with staged(output_dir, step=state.global_step, models=[trainer.model],
                metadata={"writer": "transformers.Trainer"}, after_publish=after_publish) as stage:
        adapters = is_adapter_model(trainer.model)
        # an adapter run's frozen base is what the model loads from its own checkpoint: left out, as upstream does
        save_sharded_state(stage, trainer.model, [getattr(o, "optimizer", o) for o in optimizers],
                           frozen=not adapters)
        if adapters:
            # what upstream's checkpoint holds, so PeftModel.from_pretrained(base, "checkpoint-N") works as there:
            # every rank calls it (peft-sharded-adapters gathers the factors), rank 0 writes full tensors
            trainer.model.save_pretrained(stage)
        if not targs.save_only_model:
            if targs.should_save and trainer.lr_scheduler is not None:
                with warnings.catch_warnings(record=True):
                    torch.save(trainer.lr_scheduler.state_dict(), os.path.join(stage, trainer_module.SCHEDULER_NAME))
            upstream.trainer_save_scaler(trainer, stage)
            upstream.trainer_save_rng_state(trainer, stage)
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
    return output_dir


def load_model(trainer: Any, directory: str) -> None:
    """The model's weights from a checkpoint ``save_checkpoint`` wrote (resharded, with a warning, when the layout
    differs); refuses a partial checkpoint with a clear message, and a damaged one (every file checked against the
    marker's checksums first) with ``DamagedCheckpointError`` on every rank. Every rank calls it."""
    info = read_info(directory)
    if check_compatible(info, [trainer.model], reshard=True):
        warnings.warn(f"{directory} was saved with world size {info.world_size} and layouts {info.layouts}; the "
                      f"weights and optimizer state are resharded, the data order and RNG cannot continue exactly",
                      stacklevel=3)
    rank = trainer.args.process_index
    with agreement(f"the checkpoint load from {info.directory}"):
        verify(info.directory, info.files, STATE_DIR)
        # what upstream reads on each rank after this (its RNG file: one rank only), read first and agreed on, so a
        # file one rank cannot read stops every rank here rather than that one rank alone later
        read_agreed(info.directory, {f"rng_state_{rank}.pth": "this process's RNG states",
                                     "rng_state.pth": "the RNG states", "scaler.pt": "the gradient scaler's state"})
        load_sharded_state(info.directory, trainer.model, frozen=not is_adapter_model(trainer.model))


def load_optimizer_and_scheduler(trainer: Any, directory: str) -> None:
    """The optimizer (through DCP; ``load_model`` read the weights already and checked the files) and the scheduler
    (``weights_only=True``) from a checkpoint ``save_checkpoint`` wrote."""
    from transformers import trainer as trainer_module

    read_info(directory)
    scheduler = None
    if os.path.isfile(os.path.join(directory, trainer_module.SCHEDULER_NAME)):  # read before anything is loaded
        scheduler = load_file(directory, trainer_module.SCHEDULER_NAME, "the scheduler's state")
    with agreement(f"the checkpoint load from {directory}"):
        load_sharded_state(directory, trainer.model, [getattr(trainer.optimizer, "optimizer", trainer.optimizer)],
                           weights=False, frozen=not is_adapter_model(trainer.model))
    if scheduler is not None:
        with warnings.catch_warnings(record=True):
            trainer.lr_scheduler.load_state_dict(scheduler)


# -- final export --------------------------------------------------------------------------------------------------

def export_full_model(trainer: Any, output_dir: str) -> None:
    """Consolidated safetensors + config (an adapter run: its PEFT adapter, as upstream's ``save_model`` writes it),
    processing class and training args; every rank must call it."""
    import torch
    from transformers import trainer as trainer_module

    if is_adapter_model(trainer.model):
        trainer.model.save_pretrained(output_dir)  # full adapter tensors, written by rank 0 (peft-sharded-adapters)
    else:
        save_full(trainer.model, output_dir)
    if trainer.args.should_save:
        tokenizer = trainer.processing_class or getattr(trainer.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, trainer_module.TRAINING_ARGS_NAME))


def save_model(trainer: Any, output_dir: str | None = None, internal: bool = False) -> None:
    """``Trainer.save_model`` for a sharded model: ``export_full_model`` on every rank, then the Hub push upstream
    does for a call from user code."""
    export_full_model(trainer, output_dir or trainer.args.output_dir)
    if trainer.args.push_to_hub and not internal:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)
