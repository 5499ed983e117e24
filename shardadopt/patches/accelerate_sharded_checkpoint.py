"""``Accelerator.save_state`` / ``load_state`` / ``get_state_dict`` / ``save_model`` for sharded models.

Upstream (every supported accelerate, ``accelerate/accelerator.py``): outside accelerate's own FSDP/DeepSpeed/Megatron
plugins, ``save_state`` saves each model as one local state dict::

    else:
        weights.append(self.get_state_dict(model, unwrap=False))

and ``get_state_dict`` returns ``model.state_dict()``. For a model sharded at load time (``from_pretrained(...,
distributed_config=...)``) or by hand (``fully_shard`` / ``parallelize_module``) those are DTensor shards: writing
them fails ("Attempted to access the data pointer on an invalid python storage"), the optimizer state is saved
per rank as if replicated, and ``save_model`` / ``get_state_dict`` give shards, not full tensors.

The fix, only when a prepared model is sharded and accelerate's own plugins do not manage it (plain models, and
FSDP/DeepSpeed plugin runs, keep upstream's exact path):

- ``save_state``: models and optimizers through ``torch.distributed.checkpoint`` (``shardadopt.checkpoint``), the
  rest (schedulers, dataloader/sampler state, RNG per process, scaler, custom objects, ``step``) with
  accelerate's own writers, all into a staging directory published atomically with a completion marker.
  ``automatic_checkpoint_naming`` and ``total_limit`` behave as upstream, counting complete checkpoints only.
- ``load_state``: refuses a partial checkpoint, states whether the layout matches (resharding through DCP when
  the world size or ``DistributedConfig`` differs), and restores everything ``save_state`` wrote.
- ``get_state_dict``: full CPU tensors on the main process (``{}`` elsewhere), gathered one parameter at a time,
  as accelerate's FSDP2 path does.
- ``save_model``: safetensors streamed one parameter at a time by ``shardadopt.checkpoint.save_full``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from shardadopt.registry import Patch, Probe, Target
from shardadopt.versions import supported

PATCH_ID = "accelerate-sharded-checkpoint"
_MODULE = "accelerate.accelerator"


def _unwrapped(model: Any) -> Any:
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_torch_compile=False)


def _ours(accelerator: Any) -> bool:
    """Whether a prepared model is sharded outside accelerate's own FSDP/DeepSpeed/Megatron plugins."""
    from accelerate.utils import DistributedType

    from shardadopt.checkpoint import is_sharded

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                        DistributedType.MEGATRON_LM):
        return False
    return any(is_sharded(_unwrapped(m)) for m in accelerator._models)


def _model_is_ours(accelerator: Any, model: Any) -> bool:
    from accelerate.utils import DistributedType

    from shardadopt.checkpoint import is_sharded

    return (accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                                 DistributedType.MEGATRON_LM)
            and is_sharded(_unwrapped(model)))


def _number(folder: str) -> int:
    found = re.findall(r"(\d+)", os.path.basename(folder))
    return int(found[-1]) if found else -1


def _complete_folders(root: str) -> list[str]:
    from shardadopt.checkpoint import is_complete

    names = [n for n in os.listdir(root) if not n.startswith(".")] if os.path.isdir(root) else []
    return sorted((os.path.join(root, n) for n in names if is_complete(os.path.join(root, n))), key=_number)


def _torch_optimizers(accelerator: Any) -> list:
    return [getattr(o, "optimizer", o) for o in accelerator._optimizers]


def save_state(wrapped, instance, args, kwargs):
    if not _ours(instance):
        return wrapped(*args, **kwargs)
    return save_sharded_state(instance, *args, **kwargs)


def save_sharded_state(accelerator: Any, output_dir: str | None = None, safe_serialization: bool = True,
                       **save_model_func_kwargs: Any) -> str:
    """``Accelerator.save_state`` for sharded models (see the module docstring); a public entry point too."""
    import shutil

    from accelerate.checkpointing import save_accelerator_state, save_custom_state

    from shardadopt import checkpoint

    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        root = os.path.join(accelerator.project_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        folders = _complete_folders(root)
        if config.total_limit is not None and len(folders) + 1 > config.total_limit and accelerator.is_main_process:
            for folder in folders[: len(folders) + 1 - config.total_limit]:
                shutil.rmtree(folder)
        output_dir = os.path.join(root, f"checkpoint_{accelerator.save_iteration}")
        if os.path.exists(output_dir):
            raise ValueError(f"Checkpoint directory {output_dir} ({accelerator.save_iteration}) already exists. "
                             f"Please manually override `self.save_iteration` with what iteration to start with.")
        accelerator.wait_for_everyone()
    if output_dir is None:
        raise ValueError("save_state needs an output_dir when automatic checkpoint naming is disabled")
    output_dir = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
    os.makedirs(os.path.dirname(output_dir), exist_ok=True)
    models = [_unwrapped(m) for m in accelerator._models]
    with checkpoint.staged(output_dir, step=accelerator.step, models=models,
                           metadata={"writer": "accelerate", "save_iteration": accelerator.save_iteration}) as stage:
        checkpoint.save_sharded_state(stage, models, _torch_optimizers(accelerator))
        # The state dicts are already written; hooks see no weights to edit, as with accelerate's FSDP path.
        for hook in accelerator._save_model_state_pre_hook.values():
            hook(accelerator._models, [], stage)
        save_accelerator_state(stage, [], [], accelerator._schedulers, accelerator._dataloaders,
                               accelerator.state.process_index, accelerator.step, accelerator.scaler,
                               save_on_each_node=config.save_on_each_node, safe_serialization=safe_serialization)
        for i, obj in enumerate(accelerator._custom_objects):
            save_custom_state(obj, stage, i, save_on_each_node=config.save_on_each_node)
    config.iteration += 1
    return output_dir


def load_state(wrapped, instance, args, kwargs):
    if not _ours(instance):
        return wrapped(*args, **kwargs)
    return load_sharded_state(instance, *args, **kwargs)


def load_sharded_state(accelerator: Any, input_dir: str | None = None, load_kwargs: dict | None = None,
                       **load_model_func_kwargs: Any) -> None:
    """``Accelerator.load_state`` for sharded models (see the module docstring); a public entry point too."""
    from accelerate.checkpointing import load_accelerator_state, load_custom_state

    from shardadopt import checkpoint

    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
    elif accelerator.project_configuration.automatic_checkpoint_naming:
        root = os.path.join(accelerator.project_dir, "checkpoints")
        folders = _complete_folders(root)
        if not folders:
            raise checkpoint.IncompleteCheckpointError(f"no complete checkpoint under {root}")
        input_dir = folders[-1]
    else:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    info = checkpoint.read_info(input_dir)  # refuses a partial checkpoint
    models = [_unwrapped(m) for m in accelerator._models]
    from shardadopt.adopt import adoption_kwargs

    resharded = checkpoint.check_compatible(info, models, reshard=adoption_kwargs(accelerator).reshard_checkpoints)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(accelerator._models, input_dir)
    checkpoint.load_sharded_state(input_dir, models, _torch_optimizers(accelerator))
    load_model_func_kwargs.pop("map_location", None)
    override = load_accelerator_state(input_dir, [], [], accelerator._schedulers, accelerator._dataloaders,
                                      accelerator.state.process_index, accelerator.scaler, "cpu", load_kwargs)
    if resharded:
        import warnings

        warnings.warn(f"{input_dir} was saved with world size {info.world_size} and layouts {info.layouts}; the "
                      f"weights and optimizer state were resharded, per-process RNG states were not restored",
                      stacklevel=3)
    if "step" in override:
        accelerator.step = override["step"]
    custom = [f for f in os.listdir(input_dir) if re.search(r"^custom_checkpoint_\d+\.pkl$", f)]
    if len(custom) != len(accelerator._custom_objects):
        raise RuntimeError(f"Number of custom checkpoints in folder {input_dir} ({len(custom)}) does not match the "
                           f"number of registered objects ({len(accelerator._custom_objects)})")
    for index, obj in enumerate(accelerator._custom_objects):
        load_custom_state(obj, input_dir, index)


def get_state_dict(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs["model"]
    if not _model_is_ours(instance, model):
        return wrapped(*args, **kwargs)
    from shardadopt.checkpoint import full_state_dict

    return full_state_dict(_unwrapped(model), rank0_only=True)


def save_model(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs["model"]
    safe = kwargs.get("safe_serialization", args[3] if len(args) > 3 else True)
    if not _model_is_ours(instance, model) or not safe:
        # pickle format: upstream's writer over the (patched) full get_state_dict
        return wrapped(*args, **kwargs)
    from shardadopt.checkpoint import save_full

    directory = args[1] if len(args) > 1 else kwargs["save_directory"]
    max_shard_size = kwargs.get("max_shard_size", args[2] if len(args) > 2 else "10GB")
    if os.path.isfile(directory):
        raise ValueError(f"Provided path ({directory}) should be a directory, not a file")
    # accelerate's save_model writes the in-memory names and no config (load_checkpoint_in_model reads them back)
    save_full(_unwrapped(model), directory, max_shard_size=max_shard_size, original_format=False,
              write_config=False)


# The tests of the if-chains that pick accelerate's own FSDP/DeepSpeed/Megatron/XLA savers: the known broken shape
# (every supported release) is such a chain whose final `else` saves the model as a local state dict.
_PLUGIN_TEST = {"self", "distributed_type", "DistributedType", "DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "is_fsdp2"}


def _local_fallback(function, call: str, where: str) -> bool:
    """Whether ``function`` has an if-chain over accelerate's plugins only, whose ``else`` calls ``call``."""
    from accelerate.accelerator import Accelerator

    from shardadopt.probing import body_calls, if_chains, names, source_tree, upstream_function

    tree = source_tree(upstream_function(Accelerator, function, where))
    return any(chain[-1][0] is None and body_calls(chain[-1][1], call)
               and all(names(test) <= _PLUGIN_TEST for test, _ in chain[:-1]) for chain in if_chains(tree))


def probe() -> Probe:
    """Read ``Accelerator.get_state_dict`` and ``save_state``: outside the plugins, both take the local state dict."""
    from shardadopt.probing import undecided

    where = "accelerate-sharded-checkpoint probe"
    if _local_fallback("get_state_dict", "state_dict", where) and _local_fallback("save_state", "get_state_dict",
                                                                                   where):
        return Probe(True, "accelerate's save_state/get_state_dict treat a sharded model's DTensor shards as a local "
                           "state dict outside its FSDP plugin")
    raise undecided("Accelerator.get_state_dict / save_state", "the plain model.state_dict() fallback after the "
                    "FSDP/DeepSpeed/Megatron branches (this patch's broken shape) nor a known save path for models "
                    "sharded outside those plugins")


PATCH = Patch(
    id=PATCH_ID,
    summary="save_state/load_state (atomic, resumable DCP), get_state_dict/save_model (full tensors) for "
            "sharded models",
    upstream="anticipates huggingface/accelerate: DCP checkpoints for models sharded outside accelerate's plugins",
    requires=supported("accelerate", "transformers"),
    wrappers={
        Target(_MODULE, "Accelerator.save_state"): save_state,
        Target(_MODULE, "Accelerator.load_state"): load_state,
        Target(_MODULE, "Accelerator.get_state_dict"): get_state_dict,
        Target(_MODULE, "Accelerator.save_model"): save_model,
    },
    probe=probe,
    # A sharded model reaches save_state only adopted (prepare DDP-wraps it otherwise), and load_state reads the
    # AdoptionKwargs that only the adoption patch records.
    depends_on=("accelerate-adopt-sharded-model",),
)
