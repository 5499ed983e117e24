"""``Accelerator.save_state`` / ``load_state`` / ``get_state_dict`` / ``save_model`` for sharded models.

What the ``accelerate-sharded-checkpoint`` patch calls when a prepared model is sharded outside accelerate's own
FSDP/DeepSpeed/Megatron plugins: models and optimizers through DCP, the rest with accelerate's own writers, in one
directory published atomically; full tensors gathered one parameter at a time.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any

from shardadopt import upstream
from shardadopt.checkpoint.errors import IncompleteCheckpointError
from shardadopt.checkpoint.export import full_state_dict, save_full
from shardadopt.checkpoint.integrity import agreement, read_agreed, verify
from shardadopt.checkpoint.publish import STATE_DIR, is_complete, read_info, staged
from shardadopt.checkpoint.sharding import is_sharded
from shardadopt.checkpoint.state import check_compatible, is_adapter_model, load_sharded_state, save_sharded_state

# -- which models are ours -----------------------------------------------------------------------------------------

def _unwrapped(model: Any) -> Any:
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_torch_compile=False)


def _plugin_managed(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                            DistributedType.MEGATRON_LM)


def manages(accelerator: Any) -> bool:
    """Whether a prepared model is sharded outside accelerate's own FSDP/DeepSpeed/Megatron plugins."""
    return not _plugin_managed(accelerator) and any(is_sharded(_unwrapped(m))
                                                    for m in upstream.accelerator_models(accelerator))


def manages_model(accelerator: Any, model: Any) -> bool:
    """Whether ``model`` is sharded outside accelerate's own FSDP/DeepSpeed/Megatron plugins."""
    return not _plugin_managed(accelerator) and is_sharded(_unwrapped(model))


# -- save_state / load_state ---------------------------------------------------------------------------------------

def _number(folder: str) -> int:
    found = re.findall(r"(\d+)", os.path.basename(folder))
    return int(found[-1]) if found else -1


def _complete_folders(root: str) -> list[str]:
    names = [n for n in os.listdir(root) if not n.startswith(".")] if os.path.isdir(root) else []
    return sorted((os.path.join(root, n) for n in names if is_complete(os.path.join(root, n))), key=_number)


def _torch_optimizers(accelerator: Any) -> list:
    return [getattr(o, "optimizer", o) for o in upstream.accelerator_optimizers(accelerator)]


def save_state(accelerator: Any, output_dir: str | None = None, safe_serialization: bool = True,
               **save_model_func_kwargs: Any) -> str:
    """``Accelerator.save_state`` for sharded models; every process calls it. Returns the checkpoint directory.

    Models and optimizers through ``torch.distributed.checkpoint``, the rest (schedulers, dataloader/sampler
    state, RNG per process, scaler, custom objects, ``step``) with accelerate's own writers, all into a staging
    directory published atomically with a completion marker. ``automatic_checkpoint_naming`` and ``total_limit``
    behave as upstream, counting complete checkpoints only, except that the oldest are removed once the new one is
    published: a save that fails leaves every complete checkpoint in place.
    """
    from accelerate.checkpointing import save_accelerator_state, save_custom_state

    config = accelerator.project_configuration
    root = None
    if config.automatic_checkpoint_naming:
        root = os.path.join(accelerator.project_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        output_dir = os.path.join(root, f"checkpoint_{accelerator.save_iteration}")
        if os.path.exists(output_dir):
            raise ValueError(f"Checkpoint directory {output_dir} ({accelerator.save_iteration}) already exists. "
                             f"Please manually override `self.save_iteration` with what iteration to start with.")
    if output_dir is None:
        raise ValueError("save_state needs an output_dir when automatic checkpoint naming is disabled")
    output_dir = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
    os.makedirs(os.path.dirname(output_dir), exist_ok=True)
    prepared = upstream.accelerator_models(accelerator)
    models = [_unwrapped(m) for m in prepared]

    def rotate() -> None:  # once the new one is published, under the save's fence
        if root is not None and config.total_limit is not None and accelerator.is_main_process:
            folders = _complete_folders(root)
            for folder in folders[: max(0, len(folders) - config.total_limit)]:
                shutil.rmtree(folder)

    with staged(output_dir, step=accelerator.step, models=models, after_publish=rotate,
                metadata={"writer": "accelerate", "save_iteration": accelerator.save_iteration}) as stage:
        # an adapter model's frozen base is what it loads from its own checkpoint (as upstream's Trainer leaves it
        # out); every adapter, the optimizer and the rest are saved
        save_sharded_state(stage, models, _torch_optimizers(accelerator),
                           frozen=[not is_adapter_model(m) for m in models])
        # The state dicts are already written; hooks see no weights to edit, as with accelerate's FSDP path.
        for hook in list(upstream.accelerator_save_state_pre_hooks(accelerator).values()):
            hook(prepared, [], stage)
        save_accelerator_state(stage, [], [], upstream.accelerator_schedulers(accelerator),
                               upstream.accelerator_dataloaders(accelerator), accelerator.state.process_index,
                               accelerator.step, accelerator.scaler, save_on_each_node=config.save_on_each_node,
                               safe_serialization=safe_serialization)
        for i, obj in enumerate(upstream.accelerator_custom_objects(accelerator)):
            save_custom_state(obj, stage, i, save_on_each_node=config.save_on_each_node)
    config.iteration += 1
    return output_dir


def load_state(accelerator: Any, input_dir: str | None = None, load_kwargs: dict | None = None,
               **load_model_func_kwargs: Any) -> None:
    """``Accelerator.load_state`` for sharded models; every process calls it.

    Refuses a partial checkpoint, states whether the layout matches (resharding through DCP when the world size or
    ``DistributedConfig`` differs, unless ``AdoptionKwargs(reshard_checkpoints=False)``), and restores everything
    ``save_state`` wrote.
    """
    from accelerate.checkpointing import load_accelerator_state
    from accelerate.utils import RNG_STATE_NAME

    from shardadopt.adopt import adoption_kwargs

    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
    elif accelerator.project_configuration.automatic_checkpoint_naming:
        root = os.path.join(accelerator.project_dir, "checkpoints")
        folders = _complete_folders(root)
        if not folders:
            raise IncompleteCheckpointError(f"no complete checkpoint under {root}")
        input_dir = folders[-1]
    else:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    info = read_info(input_dir)  # refuses a partial checkpoint
    prepared = upstream.accelerator_models(accelerator)
    models = [_unwrapped(m) for m in prepared]
    resharded = check_compatible(info, models, reshard=adoption_kwargs(accelerator).reshard_checkpoints)
    with agreement(f"the checkpoint load from {info.directory}"):  # every file checked before anything is loaded
        verify(info.directory, info.files, STATE_DIR)
        # what accelerate's loaders read on this process, read first and agreed on (accelerate skips an RNG file it
        # cannot read, on that process alone): a file one process cannot read stops every process here
        reads = _upstream_reads(info.directory, accelerator.state.process_index)
        read = read_agreed(info.directory, reads, {name: _CUSTOM_HINT for name in reads if name.startswith("custom")})
    for hook in list(upstream.accelerator_load_state_pre_hooks(accelerator).values()):
        hook(prepared, input_dir)
    with agreement(f"the checkpoint load from {info.directory}"):
        load_sharded_state(input_dir, models, _torch_optimizers(accelerator),
                           frozen=[not is_adapter_model(m) for m in models])
    load_model_func_kwargs.pop("map_location", None)
    override = load_accelerator_state(input_dir, [], [], upstream.accelerator_schedulers(accelerator),
                                      upstream.accelerator_dataloaders(accelerator), accelerator.state.process_index,
                                      accelerator.scaler, "cpu", load_kwargs)
    if resharded:
        process = accelerator.state.process_index
        rng = (f"this process's RNG states were restored (from process {process} of the saved run)"
               if os.path.isfile(os.path.join(input_dir, f"{RNG_STATE_NAME}_{process}.pkl")) else
               f"this process's RNG states were not restored (the saved run had no process {process})")
        warnings.warn(f"{input_dir} was saved with world size {info.world_size} and layouts {info.layouts}; the "
                      f"weights and optimizer state were resharded, {rng}", stacklevel=3)
    # The marker's step, on every process: accelerate reads it from the RNG file, which a process beyond the saved
    # world does not have.
    step = info.step if info.step is not None else override.get("step")
    if step is not None:
        accelerator.step = step
    custom_objects = upstream.accelerator_custom_objects(accelerator)
    custom = [f for f in os.listdir(input_dir) if re.search(r"^custom_checkpoint_\d+\.pkl$", f)]
    if len(custom) != len(custom_objects):
        raise RuntimeError(f"Number of custom checkpoints in folder {input_dir} ({len(custom)}) does not match the "
                           f"number of registered objects ({len(custom_objects)})")
    for index, obj in enumerate(custom_objects):  # read with weights_only=True, where upstream unpickles anything
        obj.load_state_dict(read[f"custom_checkpoint_{index}.pkl"])


_CUSTOM_HINT = ("For a sharded model, registered objects' states load with weights_only=True: keep state_dict() to "
                "tensors, numbers, strings and containers of them, or allow your own types with "
                "torch.serialization.add_safe_globals if you trust whoever wrote the checkpoint.")


def _upstream_reads(directory: str, process: int) -> dict[str, str]:
    """The files of ``directory`` accelerate's loaders read on ``process`` with ``weights_only=True`` (schedulers,
    scaler, its RNG states) and the registered objects' states."""
    reads = {}
    for name in os.listdir(directory):
        if re.fullmatch(r"scheduler(_\d+)?\.bin|scaler\.pt", name):
            reads[name] = "a state accelerate saved"
        elif re.fullmatch(r"custom_checkpoint_\d+\.pkl", name):
            reads[name] = "a registered object's state (register_for_checkpointing)"
    reads[f"random_states_{process}.pkl"] = "this process's RNG states"
    return reads


# -- get_state_dict / save_model -----------------------------------------------------------------------------------

def get_state_dict(model: Any) -> dict:
    """Full CPU tensors of a sharded prepared ``model`` on the main process (``{}`` elsewhere), gathered one
    parameter at a time as accelerate's FSDP2 path does; every process calls it."""
    return full_state_dict(_unwrapped(model), rank0_only=True)


def save_model(model: Any, save_directory: str, max_shard_size: int | str = "10GB") -> None:
    """``Accelerator.save_model`` for a sharded prepared ``model``: safetensors streamed one parameter at a time by
    ``save_full``; every process calls it."""
    if os.path.isfile(save_directory):
        raise ValueError(f"Provided path ({save_directory}) should be a directory, not a file")
    # accelerate's save_model writes the in-memory names and no config (load_checkpoint_in_model reads them back)
    save_full(_unwrapped(model), save_directory, max_shard_size=max_shard_size, original_format=False,
              write_config=False)
