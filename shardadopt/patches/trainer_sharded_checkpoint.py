"""Resumable, atomic Trainer checkpoints for models sharded at load time (transformers 5.15 .. 5.25).

Upstream (``transformers/trainer.py``): 5.18 .. 5.25 refuse in ``Trainer.__init__``, after resolving the model
(``model = self.call_model_init()`` when only ``model_init`` is given)::

    if self.is_distributed_loading_by_transformers and args.save_strategy != SaveStrategy.NO
            and not args.save_only_model:
        raise ValueError("Resuming is not supported for models sharded at load time ...")

and every release writes a checkpoint as ``self.save_model(output_dir, _internal_call=True)`` plus
``torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))`` on the main process only:
the optimizer of a sharded model is a set of per-rank DTensor shards, so that file holds rank 0's shard (or
fails), and nothing is written atomically (a crash leaves a ``checkpoint-N`` that ``resume_from_checkpoint=True``
picks up). 5.15 .. 5.23 also gather a sharded model in ``save_model`` on the main process only (a hang).

The fix (``shardadopt.checkpoint.trainer``), only for a model whose parameters are DTensors / FSDP2 modules
outside accelerate's own FSDP and DeepSpeed plugins (every other model keeps upstream's exact path):

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
- An adapter run (a ``PeftModel``): each checkpoint and the final ``save_model`` also hold (the final one: only) the
  PEFT adapter as upstream writes it (``save_pretrained`` on every rank, full tensors), and the checkpoint's DCP
  state leaves the frozen base weights out, as upstream's adapter checkpoints do.
"""

from __future__ import annotations

import ast
import os

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

_MODULE = upstream.TRAINER_MODULE


def init(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import trainer as core

    with core.refusal_lifted(instance, kwargs.get("args", args[1] if len(args) > 1 else None),
                             kwargs.get("model", args[0] if args else None)):
        return wrapped(*args, **kwargs)


def call_model_init(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import trainer as core

    model = wrapped(*args, **kwargs)
    core.model_resolved(instance, model)
    return model


def save_checkpoint(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import trainer as core

    if not core.manages(instance):
        return wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    trial = args[1] if len(args) > 1 else kwargs.get("trial")
    return core.save_checkpoint(instance, model, trial)


def load_from_checkpoint(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import trainer as core

    directory = args[0] if args else kwargs["resume_from_checkpoint"]
    if not (core.manages(instance) and core.is_sharded_checkpoint(directory)):
        return wrapped(*args, **kwargs)
    core.load_model(instance, directory)


def load_optimizer_and_scheduler(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import trainer as core

    directory = args[0] if args else kwargs.get("checkpoint")
    if directory is None or not (core.manages(instance) and core.is_sharded_checkpoint(directory)):
        return wrapped(*args, **kwargs)
    core.load_optimizer_and_scheduler(instance, directory)


def load_best_model(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import trainer as core

    best = instance.state.best_model_checkpoint
    if not (best and core.manages(instance) and core.is_sharded_checkpoint(best)):
        return wrapped(*args, **kwargs)
    core.load_model(instance, best)


def save_model(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import trainer as core

    if not core.manages(instance):
        return wrapped(*args, **kwargs)
    core.save_model(instance, kwargs.get("output_dir", args[0] if args else None),
                    internal=kwargs.get(upstream.SAVE_MODEL_INTERNAL_CALL, args[1] if len(args) > 1 else False))


# The names a Trainer.__init__ refusal of load-time-sharded models tests: the Trainer's flag or the model's mesh.
_SHARDED_MARKERS = {"is_distributed_loading_by_transformers", upstream.MODEL_DEVICE_MESH_ATTRIBUTE}


def _refuses_sharded_checkpoints(init) -> bool:
    """From ``Trainer.__init__``: whether it raises for a load-time-sharded model unless ``save_only_model`` (5.18+;
    ``init`` above lifts exactly that test). A refusal that does not test ``save_only_model`` is unknown."""
    from shardadopt.upstream.probing import if_chains, names, undecided

    for chain in if_chains(init):
        for test, body in chain:
            tested = names(test) if test is not None else set()
            if (_SHARDED_MARKERS & tested and "save_strategy" in tested
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

    from shardadopt.upstream.probing import source_tree, undecided, upstream_function

    where = "trainer-sharded-checkpoint probe"
    save = upstream.upstream_method(upstream.TRAINER_SAVE_OPTIMIZER_AND_SCHEDULER, where)
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
        raise undecided(upstream.TRAINER_SAVE_OPTIMIZER_AND_SCHEDULER.qualname, "the main process's local optimizer "
                        f"state dict saved as {trainer_module.OPTIMIZER_NAME} (this patch's broken shape) nor a known "
                        "sharded save")
    refuses = _refuses_sharded_checkpoints(source_tree(upstream_function(Trainer, "__init__", where)))
    return Probe(True, "Trainer " + ("refuses to checkpoint" if refuses else "cannot checkpoint")
                 + " load-time-sharded models resumably (optimizer state is rank 0's local shard)")


PATCH = Patch(
    id="trainer-sharded-checkpoint",
    summary="Trainer: resumable, atomic DCP checkpoints and streamed full export for load-time-sharded models",
    upstream="anticipates huggingface/transformers: lift 'Resuming is not supported for models sharded at load "
             "time' by checkpointing through torch.distributed.checkpoint",
    requires=supported("transformers", "accelerate"),
    wrappers={
        Target(_MODULE, "Trainer.__init__"): init,
        Target(_MODULE, "Trainer.call_model_init"): call_model_init,
        upstream.TRAINER_SAVE_CHECKPOINT: save_checkpoint,
        upstream.TRAINER_LOAD_FROM_CHECKPOINT: load_from_checkpoint,
        upstream.TRAINER_LOAD_OPTIMIZER_AND_SCHEDULER: load_optimizer_and_scheduler,
        upstream.TRAINER_LOAD_BEST_MODEL: load_best_model,
        Target(_MODULE, "Trainer.save_model"): save_model,
    },
    probe=probe,
)
