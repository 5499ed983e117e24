"""How the model and the world are laid out: DTensor / rank-local TP detection and the marker's layout record."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from shardadopt.fence import progress
from shardadopt.parallel.topology import rank_and_world_size


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def rank_local(model: torch.nn.Module) -> bool:
    """Whether tensor parallelism left plain (non-DTensor) parameters that hold each rank's own shard.

    transformers 5.15 shards TP (and EP through TP) this way. Such tensors carry no placement, so DCP cannot tell
    them from replicas: they are checkpointed per rank, and load back only into the same world and layout.

    Args:
        model: the model.

    Returns:
        True when some parameter is a plain tensor holding this rank's TP shard.
    """
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    return (config is not None and getattr(config, "tp_size", 1) > 1
            and not any(is_dtensor(p) for p in model.parameters()))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter is a DTensor or a rank-local TP shard, or any submodule is an FSDP2 module.

    Args:
        model: the model.

    Returns:
        True when the model is sharded in any way shardadopt knows.
    """
    from torch.distributed.fsdp import FSDPModule

    return (any(is_dtensor(p) for p in model.parameters()) or any(isinstance(m, FSDPModule) for m in model.modules())
            or rank_local(model))


def layout(model: torch.nn.Module) -> dict[str, Any]:
    """A JSON-able description of how ``model`` is distributed: its ``DistributedConfig`` and its device meshes.

    Args:
        model: the model.

    Returns:
        A dict for the checkpoint's completion marker, compared at load time.
    """
    meshes = {}
    for p in model.parameters():
        if is_dtensor(p):
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


def barrier() -> None:
    if rank_and_world_size()[0] > 1:
        progress()  # arriving here is progress: the hang monitor tells this rank from one still writing
        dist.barrier()

