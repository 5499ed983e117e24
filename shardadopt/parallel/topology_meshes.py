"""Reading a model's sharding from its device meshes: a model transformers sharded while loading (its
``DistributedConfig`` and meshes, which changed shape across 5.15 .. 5.21) and a model sharded by hand (the meshes
of its ``FSDPModule`` parameter groups and DTensor parameters), and how many ranks hold each plain parameter of old
releases' TP/EP loads. ``shardadopt.parallel.topology`` decides which reader applies.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardadopt import upstream
from shardadopt.parallel.topology_types import Topology, TopologyError, rank_and_world_size

# -- transformers ------------------------------------------------------------------------------------------------

def from_transformers(model: nn.Module, config: Any) -> Topology:
    world, rank = rank_and_world_size()
    pp = int(getattr(config, "pp_size", 1) or 1)
    if pp > 1:
        raise TopologyError(f"DistributedConfig(pp_size={pp}): pipeline parallelism is not supported (accelerate's "
                            f"loop and the Trainer run the whole model on every rank). Supported: fsdp_size, "
                            f"tp_size, ep_size and dp_replicate_size as the installed transformers combines them; "
                            f"load with pp_size=1")
    tp = int(getattr(config, "tp_size", 1) or 1)
    fsdp = int(getattr(config, "fsdp_size", 1) or 1)
    replicate = int(getattr(config, "dp_replicate_size", 1) or 1)
    ep = int(getattr(config, "ep_size", 0) or 0)
    if not ep:  # transformers <= 5.16: EP is the tp mesh with enable_expert_parallel
        ep = tp if getattr(config, "enable_expert_parallel", False) else 1
    check_product(replicate * fsdp * tp, world,
                  f"the model's DistributedConfig (dp_replicate_size={replicate} x fsdp_size={fsdp} x tp_size={tp})",
                  "launch as many processes as the DistributedConfig covers, or load with sizes that multiply to "
                  "the world size")
    manager = upstream.model_mesh_manager(model)
    meshes = list(param_meshes(model))
    if manager is not None:  # dense (pp, [dp_replicate,] fsdp, tp), expert (pp, [dp_replicate,] efsdp, ep)
        dense, expert = upstream.mesh_manager_meshes(manager)
        _check_covers(dense, world, "the model's device mesh")
        ranks = {name: _named_rank(dense, name, size)
                 for name, size in (("dp_replicate", replicate), ("fsdp", fsdp), ("tp", tp))}
        ranks["ep"] = _named_rank(expert, "ep", ep)
        meshes[:0] = [dense, expert]
    elif upstream.model_device_mesh(model).ndim > 1:  # 5.18: one mesh of the named dims > 1, e.g. (fsdp, tp)
        mesh = upstream.model_device_mesh(model)
        _check_covers(mesh, world, "the model's device mesh")
        ranks = {name: _named_rank(mesh, name, size)
                 for name, size in (("dp_replicate", replicate), ("fsdp", fsdp), ("tp", tp))}
        ranks["ep"] = ranks["tp"] if ep > 1 else 0  # EP on the TP mesh (enable_expert_parallel)
        meshes.insert(0, mesh)
    else:  # one 1-D mesh, tp or fsdp (never both)
        mesh = upstream.model_device_mesh(model)
        _check_covers(mesh, world, "the model's device mesh")
        local = mesh.get_local_rank(mesh.ndim - 1) if tp > 1 else 0
        ranks = {"dp_replicate": 0, "fsdp": mesh.get_local_rank(mesh.ndim - 1) if fsdp > 1 else 0, "tp": local,
                 "ep": local if ep > 1 else 0}
        meshes.insert(0, mesh)
    return Topology("transformers", world, rank, replicate, ranks["dp_replicate"], fsdp, ranks["fsdp"], tp,
                    ranks["tp"], ep, ranks["ep"], meshes=_distinct(meshes),
                    plain_counts=plain_shard_counts(model, world))


def _named_rank(mesh: Any, name: str, size: int) -> int:
    """This rank's coordinate along the mesh dim called ``name``, which the DistributedConfig sizes ``size``. A
    release whose mesh has no such dim (no ``dp_replicate`` before 5.21) can only mean size 1."""
    names = tuple(mesh.mesh_dim_names or ())
    if name in names:
        found = mesh.size(names.index(name))
        if found != size:
            raise TopologyError(f"the model's device mesh {names} has {name}={found}, but its DistributedConfig says "
                                f"{name} size {size}; pass an explicit topology override "
                                f"(shardadopt.AdoptionKwargs(topology=...)).")
        return mesh.get_local_rank(name)
    if size > 1:
        raise TopologyError(f"the model's DistributedConfig asks for {name} size {size}, but its device mesh has no "
                            f"{name!r} dim (dims {names}); this transformers cannot load that layout: load with "
                            f"{name} size 1 or pass an explicit topology override.")
    return 0


def plain_shard_counts(model: nn.Module, world: int) -> dict[int, int]:
    """For plain parameters that hold 1/k of the full tensor (a TP shard or a slice of experts), the number of
    ranks holding that same piece: world / k. Full shapes come from the model class instantiated on the meta
    device (nothing is allocated)."""
    from torch.distributed.tensor import DTensor

    plain = [(n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    from_config = upstream.from_config_constructor(type(model))
    if not plain or world == 1 or from_config is None:
        return {}
    config = copy.deepcopy(model.config)
    if hasattr(config, "distributed_config"):
        del config.distributed_config
    with torch.device("meta"):
        reference = from_config(config)
    full = {n: p.numel() for n, p in reference.named_parameters()}
    counts = {}
    for name, param in plain:
        whole = full.get(name)
        if whole is None or param.numel() == whole:
            continue
        pieces = round(whole / max(param.numel(), 1))
        if pieces < 1 or world % pieces:
            raise TopologyError(f"plain parameter {name} holds {param.numel()} of {whole} elements (1/{pieces}), "
                                f"which does not divide the world of {world} ranks; pass an explicit topology "
                                f"override (shardadopt.AdoptionKwargs(topology=...)).")
        counts[id(param)] = world // pieces
    return counts


# -- hand-sharded ------------------------------------------------------------------------------------------------

def _fsdp_mesh_infos(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    infos = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in upstream.fsdp_param_groups(module):
                infos.append(group.mesh_info)
    return infos


def from_hand_sharding(model: nn.Module) -> Topology:
    from torch.distributed.tensor import DTensor

    world, rank = rank_and_world_size()
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    infos = _fsdp_mesh_infos(model)
    if not params and not infos:
        return Topology("plain", world, rank)
    replicate_size = shard_size = 1
    replicate_rank = shard_rank = 0
    dp_dims: set[int] = set()  # dims of the FSDP mesh used for data parallelism
    dp_names: set[str] = set()
    if infos:
        layouts = {(_mesh_key(i.mesh), i.shard_mesh_dim, i.replicate_mesh_dim) for i in infos}
        if len(layouts) > 1:
            raise TopologyError(
                f"FSDP parameter groups of this model use {len(layouts)} different meshes or mesh dims; which one "
                f"is the data-parallel dimension is ambiguous. Pass an explicit topology override, e.g. "
                f"Accelerator(kwargs_handlers=[shardadopt.AdoptionKwargs(topology={{'dp_shard': N, 'tp': M}})]).")
        info = infos[0]
        if info.shard_mesh_dim is not None:
            shard_size = info.mesh.size(info.shard_mesh_dim)
            shard_rank = info.mesh.get_local_rank(info.shard_mesh_dim)
        if info.replicate_mesh_dim is not None:
            replicate_size = info.mesh.size(info.replicate_mesh_dim)
            replicate_rank = info.mesh.get_local_rank(info.replicate_mesh_dim)
        names = info.mesh.mesh_dim_names or ()
        dp_dims = {i for i in (info.shard_mesh_dim, info.replicate_mesh_dim) if i is not None}
        dp_names = {names[i] for i in dp_dims if names}
    # Tensor-parallel dims: any DTensor mesh dim that is not an FSDP dim.
    tp_dims: dict[tuple, tuple[int, int]] = {}  # (dim name, size) -> (size, this rank's coordinate)
    for p in params:
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or ()
        for dim in range(mesh.ndim):
            name = names[dim] if names else None
            if name is not None and name in dp_names:
                continue
            if name is None and infos and _mesh_key(mesh) == _mesh_key(infos[0].mesh) and dim in dp_dims:
                continue
            tp_dims[(name, mesh.size(dim))] = (mesh.size(dim), mesh.get_local_rank(dim))
    if len(tp_dims) > 1:
        raise TopologyError(
            f"DTensor parameters of this model are sharded over several non-FSDP mesh dims {sorted(map(str, tp_dims))}"
            f"; which is tensor parallel is ambiguous. Pass an explicit topology override, e.g. "
            f"Accelerator(kwargs_handlers=[shardadopt.AdoptionKwargs(topology={{'dp_shard': N, 'tp': M}})]).")
    tp_size, tp_rank = next(iter(tp_dims.values())) if tp_dims else (1, 0)
    if replicate_size * shard_size * tp_size != world:
        raise TopologyError(
            f"the model's meshes cover dp_replicate {replicate_size} x dp_shard {shard_size} x tp {tp_size} = "
            f"{replicate_size * shard_size * tp_size} ranks, but the world has {world}: ranks outside the meshes "
            f"would train on their own. Shard over meshes that cover the world (init_device_mesh over all ranks), "
            f"or pass an explicit topology override.")
    return Topology("hand-sharded", world, rank, replicate_size, replicate_rank, shard_size, shard_rank, tp_size,
                    tp_rank, 1, 0, meshes=_distinct([i.mesh for i in infos] + [p.device_mesh for p in params]))


# -- helpers -----------------------------------------------------------------------------------------------------

def _mesh_key(mesh: Any) -> tuple:
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names)


def _distinct(meshes: Iterable[Any]) -> tuple[Any, ...]:
    seen: dict[tuple, Any] = {}
    for mesh in meshes:
        seen.setdefault(_mesh_key(mesh), mesh)
    return tuple(seen.values())


def param_meshes(model: nn.Module) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    return _distinct(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))


def check_product(product: int, world: int, what: str, fix: str) -> None:
    if product != world:
        raise TopologyError(f"{what} multiplies to {product} ranks, but the world has {world} processes; {fix}.")


def _check_covers(mesh: Any, world: int, what: str) -> None:
    size = math.prod(mesh.mesh.shape)
    if size != world:
        raise TopologyError(
            f"{what} covers {size} of the {world} ranks of the world: the ranks outside it would train on their own. "
            f"Load the model with a DistributedConfig whose sizes multiply to the world size "
            f"(or launch {size} processes).")
