"""What a model's sharding is: world, data parallel (replicate x shard), tensor and expert parallel, meshes, ranks.

``topology(model)`` reads, in this order:

1. an explicit ``override`` (sizes; ranks laid out row-major over ``(dp_replicate, dp_shard, tp)`` like
   ``init_device_mesh`` does), for layouts nothing below can tell apart;
2. a model that transformers sharded while loading (``from_pretrained(..., distributed_config=...)``): its
   ``config.distributed_config`` sizes and its device meshes (``model._mesh_manager``, a dense and an expert mesh,
   from transformers 5.19/5.20, dense dims ``(pp, fsdp, tp)`` there and ``(pp, dp_replicate, fsdp, tp)`` later;
   ``model._device_mesh`` before: one mesh of the dims larger than 1, named, on 5.18, an unnamed or 1-D mesh on
   5.15 .. 5.17). Dims are looked up by name; a missing one must be of size 1;
3. a model sharded by hand (``fully_shard`` / ``parallelize_module``): the meshes of ``FSDPModule`` parameter
   groups (their shard / replicate dims are the data-parallel dims) and of the other DTensor parameters (their
   remaining dims are tensor parallel);
4. anything else is ``plain`` (every rank holds everything; the ordinary DDP picture).

It also answers how many ranks hold each plain (non-DTensor) parameter: transformers 5.15/5.16 keep TP shards and
EP experts as plain local tensors, which a norm or a checkpoint must not count as replicated.
"""

from __future__ import annotations

import copy
import math
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardadopt import upstream

__all__ = ["Topology", "TopologyError", "topology", "OVERRIDE_KEYS"]

OVERRIDE_KEYS = ("dp_replicate", "dp_shard", "tp", "ep")
_CACHE_ATTR = "_shardadopt_topology"


class TopologyError(ValueError):
    """The model's sharding does not match the world, or cannot be told apart without an override."""


@dataclass(frozen=True, eq=False)
class Topology:
    """One rank's view of how a model is laid out over the world.

    ``dp_size = dp_replicate_size * dp_shard_size`` ranks see distinct batches; the ``tp_size`` ranks of a TP group
    see the same batch. Experts are spread over ``ep_size`` ranks inside the data-parallel x tp world (EP does not
    change the data split).
    """

    source: str  # "transformers", "hand-sharded", "override" or "plain"
    world_size: int
    rank: int
    dp_replicate_size: int = 1
    dp_replicate_rank: int = 0
    dp_shard_size: int = 1
    dp_shard_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    # Every distinct device mesh the model's DTensor parameters live on (plus the model's own world mesh).
    meshes: tuple[Any, ...] = ()
    # id(parameter) -> number of ranks holding an identical copy, for plain parameters that are not replicated
    # on every rank (local TP shards / EP experts of old transformers). Missing: held by every rank.
    _plain_counts: Mapping[int, int] = field(default_factory=dict, repr=False)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def dp_rank(self) -> int:
        return self.dp_replicate_rank * self.dp_shard_size + self.dp_shard_rank

    @property
    def is_sharded(self) -> bool:
        """True when the model was sharded (by transformers, by hand or per the override), not plain."""
        return self.source != "plain"

    def plain_replication(self, parameter: torch.Tensor) -> int:
        """How many ranks hold an identical copy of the plain parameter ``parameter``.

        Args:
            parameter: a plain (non-DTensor) parameter of the model.

        Returns:
            The number of ranks holding the same values (the world size for a parameter the topology did not
            record).
        """
        return self._plain_counts.get(id(parameter), self.world_size)

    def tp_group(self) -> Any:
        """The process group of this rank's tensor-parallel group (the model's mesh's ``tp`` dim, or its only dim
        for a TP-only load); None without tensor parallelism."""
        if self.tp_size == 1 or not self.meshes:
            return None
        mesh = self.meshes[0]
        names = tuple(mesh.mesh_dim_names or ())
        return mesh.get_group("tp") if "tp" in names else mesh.get_group(mesh.ndim - 1)

    def grad_replication(self, parameters: Iterable[torch.Tensor]) -> Callable[[torch.Tensor], int]:
        """``plain_replication`` for the current gradients of ``parameters`` (what ``shardadopt.gradnorm`` asks
        about): gradients are new tensors every step, so the map is built per call; a model without plain shards
        (every release from transformers 5.16 on) needs none, and its answer takes no pass over ``parameters``.

        Args:
            parameters: the model's parameters, whose ``.grad`` the returned function is asked about.

        Returns:
            A function from a gradient tensor to the number of ranks holding an identical copy of it (the world size
            for a tensor it does not know).
        """
        world = self.world_size
        if not self._plain_counts:
            return lambda grad: world
        counts = {id(p.grad): self._plain_counts[id(p)] for p in parameters
                  if p.grad is not None and id(p) in self._plain_counts}
        return lambda grad: counts.get(id(grad), world)

    def describe(self) -> str:
        """One line for logs and errors: where the layout was read from, the sizes and this rank's coordinates."""
        return (f"{self.source}: world {self.world_size} = dp_replicate {self.dp_replicate_size} x dp_shard "
                f"{self.dp_shard_size} x tp {self.tp_size} (ep {self.ep_size}); rank {self.rank} -> dp rank "
                f"{self.dp_rank}, tp rank {self.tp_rank}, ep rank {self.ep_rank}")


def rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module under accelerate/DDP/compile wrappers."""
    while True:
        inner = upstream.compiled_original(model) or (model.module if isinstance(
            model, nn.parallel.DistributedDataParallel) else None)
        if inner is None:
            return model
        model = inner


def topology(model: nn.Module, override: Mapping[str, int] | None = None) -> Topology:
    """The sharding of ``model`` as seen from this rank; cached on the model (per override).

    ``override`` maps any of ``dp_replicate``, ``dp_shard``, ``tp``, ``ep`` to a size (missing: 1; their product
    must be the world size). Raises :class:`TopologyError` naming the fix when the model's meshes do not match the
    world or a hand-sharded layout is ambiguous.

    Args:
        model: a model sharded at load time (``DistributedConfig``) or by hand (FSDP2, DTensor).
        override: sizes for layouts the meshes cannot tell apart.

    Returns:
        The :class:`Topology` of ``model`` on this rank.
    """
    model = _unwrap(model)
    key = tuple(sorted(override.items())) if override else None
    cached = model.__dict__.get(_CACHE_ATTR)
    if cached is not None and cached[0] == key:
        return cached[1]
    found = _from_override(model, override) if override else _detect(model)
    if found.is_sharded:  # plain models are left exactly as they are
        model.__dict__[_CACHE_ATTR] = (key, found)
    return found


def _detect(model: nn.Module) -> Topology:
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if distributed_config is not None and (upstream.model_device_mesh(model) is not None
                                           or upstream.model_mesh_manager(model) is not None):
        return _from_transformers(model, distributed_config)
    return _from_hand_sharding(model)


# -- override ----------------------------------------------------------------------------------------------------

def _from_override(model: nn.Module, override: Mapping[str, int]) -> Topology:
    unknown = set(override) - set(OVERRIDE_KEYS)
    if unknown:
        raise TopologyError(f"unknown topology override key(s) {sorted(unknown)}; valid keys: {list(OVERRIDE_KEYS)}")
    sizes = {k: int(override.get(k, 1)) for k in OVERRIDE_KEYS}
    if any(v < 1 for v in sizes.values()):
        raise TopologyError(f"topology override sizes must be >= 1, got {sizes}")
    world, rank = rank_and_world_size()
    _check_product(sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"], world,
                   "override dp_replicate x dp_shard x tp", "fix the sizes in the override")
    if (sizes["dp_shard"] * sizes["tp"]) % sizes["ep"]:
        raise TopologyError(f"override ep={sizes['ep']} must divide dp_shard x tp = {sizes['dp_shard'] * sizes['tp']}")
    tp_rank = rank % sizes["tp"]
    dp_shard_rank = (rank // sizes["tp"]) % sizes["dp_shard"]
    dp_replicate_rank = rank // (sizes["tp"] * sizes["dp_shard"])
    return Topology("override", world, rank, sizes["dp_replicate"], dp_replicate_rank, sizes["dp_shard"],
                    dp_shard_rank, sizes["tp"], tp_rank, sizes["ep"], rank % sizes["ep"],
                    meshes=_param_meshes(model), _plain_counts=_plain_shard_counts(model, world))


# -- transformers ------------------------------------------------------------------------------------------------

def _from_transformers(model: nn.Module, config: Any) -> Topology:
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
    _check_product(replicate * fsdp * tp, world,
                   f"the model's DistributedConfig (dp_replicate_size={replicate} x fsdp_size={fsdp} x tp_size={tp})",
                   "launch as many processes as the DistributedConfig covers, or load with sizes that multiply to "
                   "the world size")
    manager = upstream.model_mesh_manager(model)
    meshes = list(_param_meshes(model))
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
                    _plain_counts=_plain_shard_counts(model, world))


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


def _plain_shard_counts(model: nn.Module, world: int) -> dict[int, int]:
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


def _from_hand_sharding(model: nn.Module) -> Topology:
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


def _param_meshes(model: nn.Module) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    return _distinct(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))


def _check_product(product: int, world: int, what: str, fix: str) -> None:
    if product != world:
        raise TopologyError(f"{what} multiplies to {product} ranks, but the world has {world} processes; {fix}.")


def _check_covers(mesh: Any, world: int, what: str) -> None:
    size = math.prod(mesh.mesh.shape)
    if size != world:
        raise TopologyError(
            f"{what} covers {size} of the {world} ranks of the world: the ranks outside it would train on their own. "
            f"Load the model with a DistributedConfig whose sizes multiply to the world size "
            f"(or launch {size} processes).")


class _CallableModule(types.ModuleType):
    """``shardadopt.parallel.topology`` names both this module and the function: once the module is imported, Python
    binds the package attribute to the module, so the module itself must answer ``shardadopt.topology(model)``."""

    def __call__(self, model: nn.Module, override: Mapping[str, int] | None = None) -> Topology:
        return topology(model, override)


sys.modules[__name__].__class__ = _CallableModule
