"""Resumable distributed checkpoints and full-weight export for models sharded at load time (or by hand).

    from shardadopt import checkpoint
    checkpoint.save("out/step-200", model, optimizer, scheduler, step=200)        # every rank calls it
    info = checkpoint.load(checkpoint.latest("out"), model, optimizer, scheduler)  # in a fresh run
    checkpoint.save_full(model, "out/final")                                      # plain from_pretrained loads it

A checkpoint is one directory: model and optimizer state written by ``torch.distributed.checkpoint`` (each rank
writes its own shards), the schedulers and ``extra`` from rank 0, one RNG file per rank (python, numpy, torch),
and a completion marker ``shardadopt_checkpoint.json`` (world size, each model's layout, versions, step).

Atomic: everything is written into a hidden staging directory next to the target; only after every rank has
finished (a barrier) does rank 0 write the marker and rename the staging directory into place. A crash mid-save
leaves a staging directory, never a directory that loads as complete: ``load`` refuses a directory without the
marker, and ``latest`` skips it. ``save_full`` stages its files the same way and moves them into place only after
every rank took part in every gather.

One rank raising inside a save (a ``state_dict`` that raises, a full disk, a path in the way): the save runs under
a fault fence (``shardadopt.fence``), so the other ranks, blocked in DCP's collectives, a gather or a barrier, are
broken out at once and raise ``PeerFailedError`` naming that rank, instead of waiting out the process group
timeout. Nothing is published and the previous complete checkpoint still loads (in a new job, or after
``shardadopt.fence.rebuild_world()``: the fence leaves the process groups unusable).

Resharding: DCP stores every DTensor as pieces of its global tensor, so a checkpoint loads into any layout whose
global shapes match (fsdp 2 -> tp 2, fsdp 2 -> one process, ...). ``load`` compares the saved world size and
layout with the target's, checks the global shapes, and says what it does: same layout -> exact resume (RNG
included); different layout -> weights and optimizer resharded, per-rank RNG not restored (a warning says so), or
``CheckpointMismatchError`` when ``reshard=False`` or a shape differs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import struct
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardadopt.fence import PeerFailedError, fenced

__all__ = ["save", "load", "latest", "read_info", "is_complete", "is_sharded", "rank_local", "layout", "save_full",
           "full_state_dict", "staged", "save_sharded_state", "load_sharded_state",
           "save_rng_state", "load_rng_state", "check_compatible", "CheckpointInfo", "CheckpointError",
           "IncompleteCheckpointError", "CheckpointMismatchError", "PeerFailedError", "MARKER", "FORMAT"]

MARKER = "shardadopt_checkpoint.json"
FORMAT = 1
_STATE_DIR = "state"  # the DCP files
_SCHEDULERS = "schedulers.pt"
_EXTRA = "extra.pt"
_STAGING_SUFFIX = ".partial"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used as asked."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a completely written checkpoint (a save was interrupted, or it is not one)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was saved with a layout that cannot be loaded into the target as asked."""


@dataclass
class CheckpointInfo:
    """What a checkpoint's completion marker records, plus what ``load`` did."""

    directory: str
    step: int | None
    world_size: int
    layouts: list[dict[str, Any]]
    versions: dict[str, str]
    metadata: dict[str, Any] = field(default_factory=dict)
    extra: Any = None
    resharded: bool = False
    rng_restored: bool = False


# -- layout --------------------------------------------------------------------------------------------------------

def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def rank_local(model: torch.nn.Module) -> bool:
    """Whether tensor parallelism left plain (non-DTensor) parameters that hold each rank's own shard.

    transformers 5.15 shards TP (and EP through TP) this way. Such tensors carry no placement, so DCP cannot tell
    them from replicas: they are checkpointed per rank, and load back only into the same world and layout.
    """
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    return (config is not None and getattr(config, "tp_size", 1) > 1
            and not any(_is_dtensor(p) for p in model.parameters()))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter is a DTensor or a rank-local TP shard, or any submodule is an FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    return (any(_is_dtensor(p) for p in model.parameters()) or any(isinstance(m, FSDPModule) for m in model.modules())
            or rank_local(model))


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def layout(model: torch.nn.Module) -> dict[str, Any]:
    """A JSON-able description of how ``model`` is distributed: its ``DistributedConfig`` and its device meshes."""
    meshes = {}
    for p in model.parameters():
        if _is_dtensor(p):
            mesh = p.device_mesh
            names = list(mesh.mesh_dim_names or [])
            meshes[json.dumps([names, list(mesh.mesh.shape)])] = {"dims": names, "shape": list(mesh.mesh.shape)}
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if config is not None:
        fields = ("dp_replicate_size", "fsdp_size", "tp_size", "ep_size", "pp_size", "cp_size",
                  "enable_expert_parallel")
        config = {name: getattr(config, name) for name in fields if hasattr(config, name)}
    return {"distributed_config": config, "meshes": sorted(meshes.values(), key=json.dumps),
            "rank_local": rank_local(model)}


def _versions() -> dict[str, str]:
    import importlib.metadata

    out = {}
    for name in ("torch", "transformers", "accelerate", "shardadopt"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# -- atomic publication --------------------------------------------------------------------------------------------

def _barrier() -> None:
    if _world()[0] > 1:
        dist.barrier()


def _staging_path(directory: str) -> str:
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}{_STAGING_SUFFIX}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged(directory: str | os.PathLike, *, step: int | None = None, models: Sequence[torch.nn.Module] = (),
           metadata: dict[str, Any] | None = None) -> Iterator[str]:
    """Yield a staging directory to write a checkpoint into; publish it as ``directory`` once every rank is done.

    Every rank must enter and leave the block. On normal exit: a barrier (all ranks finished writing), then rank 0
    writes the completion marker and renames the staging directory to ``directory`` (replacing an older one of the
    same name), then a barrier so no rank reads before publication. If the block raises, nothing is published.
    """
    directory = os.path.abspath(os.fspath(directory))
    with fenced(f"the checkpoint save into {directory}"):  # a rank raising anywhere in here: every rank raises
        staging = _staging_path(directory)
        world_size, rank = _world()
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left by an earlier crash
            os.makedirs(staging)
        _barrier()
        yield staging
        _barrier()
        if rank == 0:
            _publish(staging, directory, step, world_size, models, metadata)
        _barrier()


def _publish(staging: str, directory: str, step: int | None, world_size: int, models: Sequence[torch.nn.Module],
             metadata: dict[str, Any] | None) -> None:
    """Rank 0, once every rank wrote its part: the completion marker, then one rename into place."""
    marker = {"format": FORMAT, "complete": True, "step": step, "world_size": world_size,
              "layouts": [layout(m) for m in models], "versions": _versions(), "time": time.time(),
              "metadata": metadata or {}}
    path = os.path.join(staging, MARKER)
    with open(path, "w") as f:
        json.dump(marker, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)
    old = None
    if os.path.exists(directory):  # re-saving the same name: move the old one aside, then drop it
        old = f"{staging}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(directory, old)
    os.rename(staging, directory)
    _fsync_dir(os.path.dirname(directory))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_complete(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a completely written shardadopt checkpoint."""
    return os.path.isfile(os.path.join(os.fspath(directory), MARKER))


def read_info(directory: str | os.PathLike) -> CheckpointInfo:
    """The completion marker of ``directory``; ``IncompleteCheckpointError`` when it is missing."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"checkpoint directory {directory} does not exist")
    path = os.path.join(directory, MARKER)
    if not os.path.isfile(path):
        partial = os.path.basename(directory).endswith(_STAGING_SUFFIX) or os.path.isdir(
            os.path.join(directory, _STATE_DIR))
        what = ("a save into it was interrupted before every rank finished" if partial
                else "it was not written by shardadopt.checkpoint")
        root = os.path.dirname(directory)
        found = latest(root)
        hint = (f"the latest complete checkpoint under {root} is {found}" if found
                else f"there is no complete checkpoint under {root}")
        raise IncompleteCheckpointError(
            f"{directory} is not a complete checkpoint (no completion marker {MARKER}): {what}. "
            f"Resume from a complete one instead ({hint}; shardadopt.checkpoint.latest(root) finds it).")
    with open(path) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"{directory} has checkpoint format {marker.get('format')}, this shardadopt reads "
                              f"format {FORMAT}; load it with the shardadopt version that wrote it "
                              f"({marker.get('versions', {}).get('shardadopt', 'unknown')})")
    return CheckpointInfo(directory=directory, step=marker.get("step"), world_size=marker["world_size"],
                          layouts=marker.get("layouts", []), versions=marker.get("versions", {}),
                          metadata=marker.get("metadata", {}))


def latest(root: str | os.PathLike) -> str | None:
    """The complete checkpoint directly under ``root`` with the highest step (then the newest); None if none.

    Staging directories of interrupted saves and directories without a completion marker are skipped.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".") or not is_complete(path):
            continue
        info = read_info(path)
        found.append((info.step if info.step is not None else -1, os.path.getmtime(os.path.join(path, MARKER)),
                      path))
    return max(found)[2] if found else None


# -- model and optimizer state through DCP -------------------------------------------------------------------------

def _as_list(x: Any) -> list:
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
    return f"{key}@rank{_world()[1]}" if rank_local(model) else key


def _state_dicts(models: list[torch.nn.Module], optimizers: list) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state: dict[str, Any] = {}
    for i, (model, opts) in enumerate(_pairs(models, optimizers)):
        model_sd, optim_sd = get_state_dict(model, opts)
        state[_key("model", i, model)] = model_sd
        if opts:
            state[_key("optimizer", i, model)] = optim_sd
    return state


def save_sharded_state(directory: str, models: Sequence[torch.nn.Module] | torch.nn.Module,
                       optimizers: Sequence[Any] | Any = None) -> None:
    """Write models' and optimizers' (sharded) state into ``directory/state`` with DCP. A collective."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state_dicts(_as_list(models), _as_list(optimizers)),
             checkpoint_id=os.path.join(directory, _STATE_DIR))


def _saved_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(os.path.join(directory, _STATE_DIR)).read_metadata()
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


def load_sharded_state(directory: str, models: Sequence[torch.nn.Module] | torch.nn.Module,
                       optimizers: Sequence[Any] | Any = None) -> None:
    """Read models' and optimizers' state written by ``save_sharded_state`` into them, resharding as needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    models, optimizers = _as_list(models), _as_list(optimizers)
    state = _state_dicts(models, optimizers)
    saved = _saved_shapes(directory)
    wanted = {k: v for k, v in _flat_shapes(state).items() if ".param_groups." not in k}
    missing = sorted(k for k in wanted if k not in saved)
    differ = sorted(k for k in wanted if k in saved and saved[k] != wanted[k])
    if missing or differ:
        detail = "; ".join(filter(None, [
            f"{len(missing)} entries missing from the checkpoint (e.g. {missing[:3]})" if missing else "",
            f"{len(differ)} global shapes differ (e.g. {[(k, saved[k], wanted[k]) for k in differ[:3]]})"
            if differ else ""]))
        raise CheckpointMismatchError(
            f"{directory} does not fit the model/optimizer being loaded: {detail}. It was saved from a different "
            f"model or optimizer (or a different set of trainable parameters); load it into the same architecture.")
    dcp.load(state, checkpoint_id=os.path.join(directory, _STATE_DIR))
    for i, (model, opts) in enumerate(_pairs(models, optimizers)):
        set_state_dict(model, opts, model_state_dict=state[_key("model", i, model)],
                       optim_state_dict=state.get(_key("optimizer", i, model), {}))


# -- RNG -----------------------------------------------------------------------------------------------------------

def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rng_state_{rank}.pt")


def save_rng_state(directory: str) -> None:
    """This rank's python, numpy and torch (CPU and current accelerator) RNG states."""
    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, _rng_file(directory, _world()[1]))


def load_rng_state(directory: str) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has no file for this rank."""
    import numpy as np

    path = _rng_file(directory, _world()[1])
    if not os.path.isfile(path):
        return False
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])  # the current device's, as saved
        else:
            warnings.warn(f"{path} holds a CUDA RNG state, but CUDA is not available here: the CPU, python and "
                          f"numpy RNG states are restored, CUDA random streams are not", stacklevel=3)
    return True


# -- compatibility -------------------------------------------------------------------------------------------------

def check_compatible(info: CheckpointInfo, models: Sequence[torch.nn.Module], *, reshard: bool = True) -> bool:
    """Whether loading ``info`` into ``models`` on this world reshards (True) or resumes the same layout (False).

    Raises ``CheckpointMismatchError`` when the layouts differ and ``reshard`` is False, or when the number of
    models differs. Global shapes are checked when the state is read.
    """
    world_size = _world()[0]
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


# -- save / load ---------------------------------------------------------------------------------------------------

def save(directory: str | os.PathLike, model: torch.nn.Module | Sequence[torch.nn.Module],
         optimizer: Any = None, scheduler: Any = None, *, step: int | None = None, extra: Any = None,
         rng: bool = True, metadata: dict[str, Any] | None = None) -> str:
    """Save a resumable checkpoint into ``directory`` atomically; every rank must call it. Returns the directory.

    ``model``/``optimizer``/``scheduler`` may be lists (one optimizer per model, or several for one model).
    ``extra`` is any picklable object (dataloader position, counters), saved from rank 0. ``metadata`` (JSON-able)
    goes into the completion marker.
    """
    models = _as_list(model)
    with staged(directory, step=step, models=models, metadata=metadata) as stage:
        save_sharded_state(stage, models, optimizer)
        if _world()[1] == 0:
            schedulers = _as_list(scheduler)
            if schedulers:
                torch.save([s.state_dict() for s in schedulers], os.path.join(stage, _SCHEDULERS))
            if extra is not None:
                torch.save(extra, os.path.join(stage, _EXTRA))
        if rng:
            save_rng_state(stage)
    return os.path.abspath(os.fspath(directory))


def load(directory: str | os.PathLike, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any = None,
         scheduler: Any = None, *, rng: bool = True, reshard: bool = True) -> CheckpointInfo:
    """Load a checkpoint written by ``save`` into the given objects; every rank must call it.

    Refuses an incomplete checkpoint (``IncompleteCheckpointError``). With the same world size and layout it
    restores everything, per-rank RNG included. With a different layout it reshards the weights and optimizer
    state through DCP (``info.resharded``) and leaves the RNG alone, with a warning; ``reshard=False`` refuses
    instead (``CheckpointMismatchError``).
    """
    info = read_info(directory)
    models = _as_list(model)
    info.resharded = check_compatible(info, models, reshard=reshard)
    load_sharded_state(info.directory, models, optimizer)
    schedulers = _as_list(scheduler)
    if schedulers:
        states = torch.load(os.path.join(info.directory, _SCHEDULERS), weights_only=False)
        if len(states) != len(schedulers):
            raise CheckpointMismatchError(f"{info.directory} holds {len(states)} scheduler(s), {len(schedulers)} given")
        for s, state in zip(schedulers, states):
            s.load_state_dict(state)
    extra_path = os.path.join(info.directory, _EXTRA)
    if os.path.isfile(extra_path):
        info.extra = torch.load(extra_path, weights_only=False)
    if rng and not info.resharded:
        info.rng_restored = load_rng_state(info.directory)
    elif rng:
        warnings.warn(f"{info.directory} was saved with world size {info.world_size} and a different layout: the "
                      f"weights and optimizer state were resharded, the per-rank RNG states were not restored",
                      stacklevel=2)
    return info


# -- full-weight export --------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _unique_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's state dict entries in order, each tensor once (tied weights keep their first name)."""
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


def _reverter(model: torch.nn.Module, original_format: bool):
    """A function mapping one in-memory (name, tensor) to the checkpoint-format tensors transformers would save."""
    if not original_format or not hasattr(model, "config"):
        return lambda name, tensor: {name: tensor}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return lambda name, tensor: {name: tensor}

    def revert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        try:
            return revert_weight_conversion(model, {name: tensor})
        except Exception as exc:
            raise CheckpointError(
                f"could not convert {name} back to the checkpoint format on its own ({type(exc).__name__}: {exc}); "
                f"export with original_format=False (from_pretrained loads the in-memory names too)") from exc

    return revert


def _full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor on CPU (a collective for a DTensor: every rank must call it in the same order)."""
    if _is_dtensor(tensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu")


def _pieces(tensor: Any) -> list[tuple[int, tuple[slice, ...]]] | None:
    """For a DTensor laid out with ``Shard``/``Replicate`` only on a mesh that holds rank 0: (global rank, the box
    of the global tensor it holds) for one holder of each distinct piece (coordinate 0 on replicated mesh dims),
    empty pieces left out. ``None`` when the layout needs ``full_tensor`` (``Partial``, strided shards, ...)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = tensor.placements
    ranks = tensor.device_mesh.mesh
    if not all(type(p) in (Shard, Replicate) for p in placements) or not (ranks == 0).any():
        return None
    out = []
    for coordinate in torch.cartesian_prod(*[torch.arange(n) for n in ranks.shape]).reshape(-1, ranks.dim()).tolist():
        if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coordinate)):
            continue
        shape, offset = _compute_local_shape_and_global_offset(tensor.shape, ranks.shape, coordinate, placements)
        if all(n > 0 for n in shape):
            out.append((int(ranks[tuple(coordinate)]), tuple(slice(o, o + n) for o, n in zip(offset, shape))))
    return out


# Device types each backend's send/recv take (torch.distributed's backend table): gloo's point-to-point hands the
# tensor's data pointer to its TCP transport, so CUDA tensors must not reach it; NCCL takes CUDA tensors only.
_P2P_DEVICE_TYPES = {"gloo": ("cpu",), "nccl": ("cuda",), "xccl": ("xpu",)}


def _p2p_device(local: torch.device) -> torch.device:
    """Where a tensor on ``local`` goes through ``dist.send``/``dist.recv`` on the default group: ``local`` when
    the backend serving that device type sends it (CUDA on NCCL, CPU on gloo, either on ``cpu:gloo,cuda:nccl``),
    else a device that backend does send (CPU shards under NCCL: the current GPU; CUDA shards under gloo: CPU)."""
    backend = str(dist.get_backend())
    if ":" in backend:  # one backend per device type, e.g. "cpu:gloo,cuda:nccl"
        served = [tuple(item.split(":", 1)) for item in backend.split(",")]
    else:
        served = [(kind, backend) for kind in dist.distributed_c10d._device_capability()]
    usable = [kind for kind, name in served if kind in _P2P_DEVICE_TYPES.get(name, (kind,))]
    if local.type in usable or not usable:
        return local
    kind = "cpu" if "cpu" in usable else usable[0]
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _gather_to_root(tensor: torch.Tensor) -> torch.Tensor | None:
    """The full tensor on CPU on global rank 0, ``None`` elsewhere; a collective in the same order on every rank.

    ``DTensor.full_tensor()`` all-gathers the whole tensor to every rank (plus the collective's own buffers). Here
    rank 0 preallocates the full tensor once and receives each other holder's local piece straight into its place
    (point-to-point), so the other ranks allocate nothing and rank 0 holds one full parameter.
    """
    rank = _world()[1]
    if not _is_dtensor(tensor):
        return tensor.detach().to("cpu") if rank == 0 else None
    pieces = _pieces(tensor)
    if pieces is None:
        value = _full_value(tensor)
        return value if rank == 0 else None
    local = tensor.to_local().detach()
    wire = _p2p_device(local.device)
    if rank != 0:
        if any(source == rank for source, _ in pieces):
            dist.send(local.to(wire).contiguous(), dst=0)
        return None
    full_value = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    for source, box in pieces:
        target = full_value[box]
        if source == 0:
            target.copy_(local)
        elif target.is_contiguous() and wire.type == "cpu":
            dist.recv(target, src=source)
        else:  # a non-contiguous box (a Shard(1) piece) or a device wire: through one piece-sized buffer
            buffer = torch.empty(target.shape, dtype=local.dtype, device=wire)
            dist.recv(buffer, src=source)
            target.copy_(buffer)
            del buffer
    return full_value


def full_state_dict(model: torch.nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model``'s state, gathered one parameter at a time.

    A collective. With ``rank0_only`` the other ranks return ``{}``: each tensor is gathered to rank 0 only (see
    :func:`save_full`), so no other rank allocates anything and only rank 0 ever holds the whole model.
    """
    out = {}
    with fenced("a full_state_dict gather"):  # rank 0 failing to allocate must not leave the senders waiting
        for name, tensor in model.state_dict().items():
            value = _gather_to_root(tensor) if rank0_only else _full_value(tensor)
            if value is not None:
                out[name] = value
    return out


def _write_safetensors_header(f, entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset,
                                                                                                   offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    return offset


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def save_full(model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
              original_format: bool = True, write_config: bool = True) -> list[str]:
    """Write ``model``'s full weights as safetensors that a plain single-process ``from_pretrained`` loads.

    A collective over the model's ranks. Parameters are gathered one at a time to rank 0 only (into one
    preallocated tensor, point-to-point from the holders of each piece) and streamed into pre-planned safetensors
    files (the headers are written from the global shapes before any data), so rank 0 holds its own shard plus one
    full parameter and the other ranks nothing beyond their shards. With ``original_format`` the names and layout are
    converted back to the format transformers saves (e.g. fused MoE experts split per expert). Writes
    ``config.json`` (and ``generation_config.json``) with ``write_config``. Returns the weight files written
    (on rank 0; ``[]`` elsewhere).
    """
    from huggingface_hub import constants

    if rank_local(model):
        raise CheckpointError("save_full cannot gather tensor-parallel parameters that are plain per-rank shards "
                              "(this transformers release's TP does not use DTensor); use model.save_pretrained for "
                              "tensor parallelism alone (transformers 5.15 writes expert-parallel models with wrong "
                              "shapes: no consolidated export there)")
    directory = os.path.abspath(os.fspath(directory))
    rank = _world()[1]
    limit = _parse_size(max_shard_size)
    revert = _reverter(model, original_format)
    entries = _unique_state(model)

    # Plan on meta tensors: output names, dtypes, shapes, and which file each source tensor's outputs go to.
    plan: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = []
    for name, tensor in entries:
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        plan.append([(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in revert(name,
                                                                                                  meta).items()])
    files: list[list[int]] = [[]]
    size = 0
    for i, outputs in enumerate(plan):
        nbytes = sum(o[3] for o in outputs)
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    sharded = len(files) > 1
    names = ([f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))] if sharded
             else [constants.SAFETENSORS_SINGLE_FILE])

    with fenced(f"save_full into {directory}"):  # a rank raising anywhere in here: every rank raises
        staging = _staging_path(directory)
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left by an earlier crash
            os.makedirs(staging)
        for filename, members in zip(names, files):
            handle = open(os.path.join(staging, filename), "wb") if rank == 0 else contextlib.nullcontext()
            with handle as f:
                if rank == 0:
                    _write_safetensors_header(f, [o for i in members for o in plan[i]])
                for i in members:
                    name, tensor = entries[i]
                    value = _gather_to_root(tensor)  # every rank takes part; only rank 0 receives the full tensor
                    if rank == 0:
                        for (out_name, dtype, shape, _), (got_name, out) in zip(plan[i],
                                                                                  revert(name, value).items()):
                            if (got_name, out.dtype, tuple(out.shape)) != (out_name, dtype, shape):
                                raise CheckpointError(f"conversion of {name} gave {got_name} {tuple(out.shape)}, "
                                                      f"planned {out_name} {shape}")
                            f.write(_tensor_bytes(out))
                    del value
        if rank == 0:
            if sharded:
                index = {"metadata": {"total_size": sum(o[3] for outputs in plan for o in outputs)},
                         "weight_map": {o[0]: names[k] for k, members in enumerate(files) for i in members
                                        for o in plan[i]}}
                with open(os.path.join(staging, constants.SAFETENSORS_INDEX_FILE), "w") as f:
                    json.dump(index, f, indent=2, sort_keys=True)
            if write_config and hasattr(model, "config") and hasattr(model.config, "save_pretrained"):
                model.config.save_pretrained(staging)
                generation = getattr(model, "generation_config", None)
                if generation is not None and getattr(model, "can_generate", lambda: False)():
                    generation.save_pretrained(staging)
        _barrier()  # every rank took part in every gather: publish
        written = _publish_files(staging, directory, names) if rank == 0 else []
        _barrier()
    return written


def _publish_files(staging: str, directory: str, weights: list[str]) -> list[str]:
    """Move the finished files of ``save_full`` into ``directory``, each with one rename (weights before the index
    and config that name them), so a reader never sees a partly written file."""
    os.makedirs(directory, exist_ok=True)
    names = sorted(os.listdir(staging), key=lambda name: name not in weights)
    for name in names:
        os.replace(os.path.join(staging, name), os.path.join(directory, name))
    _fsync_dir(directory)
    shutil.rmtree(staging, ignore_errors=True)
    return [os.path.join(directory, name) for name in weights]
