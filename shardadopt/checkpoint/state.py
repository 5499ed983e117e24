"""Model and optimizer state: ``torch.distributed.checkpoint`` per rank, resharding, the layout check.

DCP stores every DTensor as pieces of its global tensor, so a checkpoint loads into any layout whose global shapes
match (fsdp 2 -> tp 2, fsdp 2 -> one process, ...). ``load`` compares the saved world size and layout with the
target's, checks the global shapes, and says what it does: same layout -> exact resume (RNG included); different
layout -> weights and optimizer resharded, per-rank RNG not restored (a warning says so), or
``CheckpointMismatchError`` when ``reshard=False`` or a shape differs. DCP's ``.metadata`` is read through
``shardadopt.checkpoint.safeload`` (DCP's metadata classes only); ``save``/``load`` themselves are in ``resume``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from shardadopt.checkpoint.errors import CheckpointError, CheckpointMismatchError
from shardadopt.checkpoint.integrity import mark_agreed
from shardadopt.checkpoint.publish import STATE_DIR, CheckpointInfo
from shardadopt.checkpoint.safeload import damaged, safe_reader, saved_metadata
from shardadopt.checkpoint.sharding import layout, rank_local
from shardadopt.fence import gathered_error, progress
from shardadopt.fence.errors import HangError, PeerFailedError, is_hang, summary
from shardadopt.parallel.topology import rank_and_world_size


def as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _pairs(models: list[torch.nn.Module], optimizers: list) -> list[tuple[torch.nn.Module, list]]:
    """Each model with the optimizers over its parameters: one per model, or all of them for a single model."""
    if not optimizers:
        return [(m, []) for m in models]
    if len(models) == 1:
        return [(models[0], optimizers)]
    if len(optimizers) == len(models):
        return [(m, [o]) for m, o in zip(models, optimizers)]
    raise ValueError(f"got {len(models)} models and {len(optimizers)} optimizers; pass one optimizer per model "
                     f"(in the same order) or a single model")


def _key(kind: str, i: int, model: torch.nn.Module) -> str:
    key = kind if i == 0 else f"{kind}_{i}"
    # rank-local shards share their names across ranks: a per-rank key keeps DCP from deduplicating them
    return f"{key}@rank{rank_and_world_size()[1]}" if rank_local(model) else key


def _options(frozen: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # without the frozen base the model state is partial: loading it must leave the base as it is
    return StateDictOptions(strict=frozen)


def frozen_base(model: torch.nn.Module) -> set[str]:
    """Every name (tied aliases included) of the parameters of ``model`` that do not require gradients and belong to
    no PEFT adapter: the frozen base an adapter run loads from its own checkpoint. An inactive adapter is frozen
    too, but trained at another time (``set_adapter``): it is not part of the base."""
    from shardadopt.adapters import adapter_parameters

    adapters = adapter_parameters(model)
    return {n for n, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad and id(p) not in adapters}


def is_adapter_model(model: Any) -> bool:
    """A PEFT model (adapters on a frozen base), whose checkpoints leave the frozen base out."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _per_model(frozen: bool | Sequence[bool], count: int) -> list[bool]:
    flags = [frozen] * count if isinstance(frozen, bool) else list(frozen)
    if len(flags) != count:
        raise ValueError(f"frozen: one flag per model, got {len(flags)} for {count} models")
    return flags


def _state_dicts(models: list[torch.nn.Module], optimizers: list,
                 frozen: bool | Sequence[bool] = True) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state: dict[str, Any] = {}
    flags = _per_model(frozen, len(models))
    for i, (model, opts) in enumerate(_pairs(models, optimizers)):
        model_sd, optim_sd = get_state_dict(model, opts, options=_options(flags[i]))
        if not flags[i]:
            base = frozen_base(model)
            model_sd = {k: v for k, v in model_sd.items() if k not in base}
        state[_key("model", i, model)] = model_sd
        if opts:
            state[_key("optimizer", i, model)] = optim_sd
    return state


def save_sharded_state(directory: str, models: Sequence[torch.nn.Module] | torch.nn.Module,
                       optimizers: Sequence[Any] | Any = None, *, frozen: bool | Sequence[bool] = True) -> None:
    """Write models' and optimizers' (sharded) state into ``directory/state`` with DCP. A collective.

    ``frozen=False`` (or one flag per model) leaves out the frozen base (:func:`frozen_base`: an adapter run's base
    weights, which the model loads from its own checkpoint; every adapter is kept, active or not): what upstream's
    Trainer leaves out of a PEFT model's checkpoint.

    Args:
        directory: the checkpoint directory (usually a staging one, see :func:`staged`).
        models: the model, or several.
        optimizers: their optimizers (none, one, or a list).
        frozen: whether to keep each model's frozen base (one flag for all, or one per model).
    """
    import torch.distributed.checkpoint as dcp

    from shardadopt.adapters.experts import checkpoint_views

    path = os.path.join(directory, STATE_DIR)
    state = _state_dicts(as_list(models), as_list(optimizers), frozen)
    progress()  # this rank's state is collected: a peer still collecting (or hung doing it) is behind
    with _own_errors():
        with checkpoint_views(state):  # expert LoRA's strided shards as contiguous views
            dcp.save(state, storage_writer=_progress_writer()(path), checkpoint_id=path)


@contextlib.contextmanager
def _own_errors(loading: str | None = None) -> Iterator[None]:
    """Around a DCP call: raise what the fence raises instead of DCP's ``CheckpointException`` (see
    :func:`shardadopt.fence.gathered_error`); around a load from checkpoint ``loading``, a read that failed on some
    rank (DCP hands every rank all of them) is ``DamagedCheckpointError``, alike on every rank."""
    try:
        yield
    except BaseException as exc:
        failures = _read_failures(exc) if loading is not None else None
        if failures:
            rank, error = min(failures.items())
            raise mark_agreed(damaged(loading, f"{STATE_DIR}/ (a shard rank {rank} read)", summary(error))) from exc
        own = gathered_error(exc, rank_and_world_size()[1])
        if own is exc:
            raise
        raise own from exc


def _read_failures(exc: BaseException) -> dict[int, BaseException] | None:
    """Every rank's error in DCP's ``CheckpointException`` (the same on every rank), unless one follows from a
    fence (a hang, a peer's failure): what failed reading the files."""
    from torch.distributed.checkpoint import CheckpointException

    if not isinstance(exc, CheckpointException):
        return None
    failures = {r: f[0] if isinstance(f, tuple) else f for r, f in exc.failures.items()}
    if any(is_hang(e) or isinstance(e, (PeerFailedError, HangError)) for e in failures.values()):
        return None
    return failures


@functools.cache
def _progress_writer() -> type:
    """DCP's file writer, counting progress once this rank's files are written, so the hang monitor tells a rank
    waiting in DCP's closing collectives from one blocked in its writes (a filesystem that stopped answering)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class ProgressWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)
            progress()
            return written

    return ProgressWriter


def _saved_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:  # DCP's metadata classes only: nothing else is unpickled
        metadata = saved_metadata(directory, STATE_DIR)
    except CheckpointError as exc:  # every rank reads the same file
        raise mark_agreed(exc) from exc.__cause__
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _flat_shapes(state: dict[str, Any], prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a nested state dict, keyed the way DCP flattens them (dots between levels)."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = tuple(v.shape)
        elif isinstance(v, dict):
            out.update(_flat_shapes(v, key + "."))
    return out


@contextlib.contextmanager
def _adapters_trainable(model: torch.nn.Module) -> Iterator[None]:
    """Every adapter of ``model`` trainable while its state is loaded: torch builds and loads optimizer state for
    trainable parameters only, and an adapter inactive now (``set_adapter``) may have been trained before the
    save."""
    from shardadopt.adapters import adapter_parameters

    adapters = adapter_parameters(model)
    frozen = [p for p in model.parameters() if id(p) in adapters and not p.requires_grad]
    for param in frozen:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(False)


def _drop_untrained_adapter_state(optim_state: dict | None, key: str, model: torch.nn.Module,
                                  saved: dict[str, tuple[int, ...]]) -> None:
    """Leave out of ``optim_state`` (the state to load, as :func:`_adapters_trainable` built it) the adapter
    parameters the checkpoint holds no optimizer state for: not trained before the save, so fresh after loading
    too (the optimizer's ``load_state_dict`` leaves them without state), as in the uninterrupted run."""
    from shardadopt.adapters import adapter_parameters

    if not optim_state:
        return
    adapters = adapter_parameters(model)
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in adapters}
    per_param = optim_state.get("state", {})
    for fqn in [f for f in per_param if f in names]:
        tensors = [k for k, v in per_param[fqn].items() if isinstance(v, torch.Tensor)]
        if tensors and not any(f"{key}.state.{fqn}.{k}" in saved for k in tensors):
            del per_param[fqn]


def load_sharded_state(directory: str, models: Sequence[torch.nn.Module] | torch.nn.Module,
                       optimizers: Sequence[Any] | Any = None, *, weights: bool = True,
                       frozen: bool | Sequence[bool] = True) -> None:
    """Read models' and optimizers' state written by ``save_sharded_state`` into them, resharding as needed.

    ``weights=False`` reads the optimizers' state only (the models' weights were loaded already: the Trainer loads
    the model, then the optimizer). ``frozen=False`` (or one flag per model) reads all but the frozen base (which
    keeps what the model holds), from a checkpoint written either way.

    Args:
        directory: a checkpoint directory written by :func:`save_sharded_state`.
        models: the model, or several, in the order they were saved.
        optimizers: their optimizers, in the order they were saved.
        weights: whether to read the models' weights too.
        frozen: whether to read each model's frozen base (one flag for all, or one per model).
    """
    models, optimizers = as_list(models), as_list(optimizers)
    flags = _per_model(frozen, len(models))
    with contextlib.ExitStack() as stack:
        for model, flag in zip(models, flags):
            if not flag:  # torch builds and loads optimizer state for trainable parameters only
                stack.enter_context(_adapters_trainable(model))
        _load(directory, models, optimizers, flags, weights)


def _load(directory: str, models: list[torch.nn.Module], optimizers: list, flags: list[bool], weights: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict

    from shardadopt.adapters.experts import checkpoint_views

    state = _state_dicts(models, optimizers, flags)
    if not weights:
        state = {key: value for key, value in state.items() if not key.startswith("model")}
    saved = _saved_shapes(directory)
    for i, (model, _) in enumerate(_pairs(models, optimizers)):
        if not flags[i]:
            _drop_untrained_adapter_state(state.get(_key("optimizer", i, model)), _key("optimizer", i, model),
                                          model, saved)
    with checkpoint_views(state):  # expert LoRA's strided shards as contiguous views, as they were saved
        wanted = {k: v for k, v in _flat_shapes(state).items() if ".param_groups." not in k}
        missing = sorted(k for k in wanted if k not in saved)
        differ = sorted(k for k in wanted if k in saved and saved[k] != wanted[k])
        if missing or differ:
            detail = "; ".join(filter(None, [
                f"{len(missing)} entries missing from the checkpoint (e.g. {missing[:3]})" if missing else "",
                f"{len(differ)} global shapes differ (e.g. {[(k, saved[k], wanted[k]) for k in differ[:3]]})"
                if differ else ""]))
            raise mark_agreed(CheckpointMismatchError(  # global shapes: the same on every rank
                f"{directory} does not fit the model/optimizer being loaded: {detail}. It was saved from a different "
                f"model or optimizer (or a different set of trainable parameters); load it into the same "
                f"architecture."))
        with _own_errors(directory):  # into state
            path = os.path.join(directory, STATE_DIR)
            dcp.load(state, storage_reader=safe_reader()(path), checkpoint_id=path)
    for i, (model, opts) in enumerate(_pairs(models, optimizers)):
        if weights:
            set_state_dict(model, opts, model_state_dict=state[_key("model", i, model)],
                           optim_state_dict=state.get(_key("optimizer", i, model), {}), options=_options(flags[i]))
        elif opts:
            set_optimizer_state_dict(model, opts, optim_state_dict=state[_key("optimizer", i, model)],
                                     options=_options(flags[i]))



def check_compatible(info: CheckpointInfo, models: Sequence[torch.nn.Module], *, reshard: bool = True) -> bool:
    """Whether loading ``info`` into ``models`` on this world reshards (True) or resumes the same layout (False).

    Raises ``CheckpointMismatchError`` when the layouts differ and ``reshard`` is False, or when the number of
    models differs. Global shapes are checked when the state is read.

    Args:
        info: the checkpoint's completion marker (:func:`read_info`).
        models: the models it is about to be loaded into.
        reshard: whether a different layout may be resharded.

    Returns:
        True when the load reshards, False when it resumes the layout it was saved with.
    """
    world_size = rank_and_world_size()[0]
    current = [layout(m) for m in models]
    if info.layouts and len(info.layouts) != len(current):
        raise CheckpointMismatchError(f"{info.directory} holds {len(info.layouts)} model(s), {len(current)} given")
    same = info.world_size == world_size and (not info.layouts or info.layouts == current)
    if same:
        return False
    description = (f"saved with world size {info.world_size} and layout {info.layouts}, loading with world size "
                   f"{world_size} and layout {current}")
    if any(lay.get("rank_local") for lay in info.layouts + current):
        raise CheckpointMismatchError(
            f"{info.directory} was {description}. Tensor-parallel parameters that are plain per-rank shards "
            f"(transformers releases whose TP does not use DTensor) carry no placement, so they cannot be "
            f"resharded: load with the same DistributedConfig and number of processes.")
    if not reshard:
        raise CheckpointMismatchError(
            f"{info.directory} was {description}. Load it with the same DistributedConfig and number of processes, "
            f"or pass reshard=True to let torch.distributed.checkpoint reshard the weights and optimizer state "
            f"(the per-rank RNG and data order of the original run are then not restored).")
    return True
