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

The mesh readers (2, 3) are in ``topology_meshes.py``; the ``Topology`` record in ``topology_types.py``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping

from torch import nn

from shardadopt import upstream
from shardadopt.parallel.topology_meshes import (
    check_product,
    from_hand_sharding,
    from_transformers,
    param_meshes,
    plain_shard_counts,
)
from shardadopt.parallel.topology_types import Topology, TopologyError, rank_and_world_size

__all__ = ["Topology", "TopologyError", "topology", "OVERRIDE_KEYS"]

OVERRIDE_KEYS = ("dp_replicate", "dp_shard", "tp", "ep")
_CACHE_ATTR = "_shardadopt_topology"


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
        return from_transformers(model, distributed_config)
    return from_hand_sharding(model)


# -- override ----------------------------------------------------------------------------------------------------

def _from_override(model: nn.Module, override: Mapping[str, int]) -> Topology:
    unknown = set(override) - set(OVERRIDE_KEYS)
    if unknown:
        raise TopologyError(f"unknown topology override key(s) {sorted(unknown)}; valid keys: {list(OVERRIDE_KEYS)}")
    sizes = {k: int(override.get(k, 1)) for k in OVERRIDE_KEYS}
    if any(v < 1 for v in sizes.values()):
        raise TopologyError(f"topology override sizes must be >= 1, got {sizes}")
    world, rank = rank_and_world_size()
    check_product(sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"], world,
                  "override dp_replicate x dp_shard x tp", "fix the sizes in the override")
    if (sizes["dp_shard"] * sizes["tp"]) % sizes["ep"]:
        raise TopologyError(f"override ep={sizes['ep']} must divide dp_shard x tp = {sizes['dp_shard'] * sizes['tp']}")
    tp_rank = rank % sizes["tp"]
    dp_shard_rank = (rank // sizes["tp"]) % sizes["dp_shard"]
    dp_replicate_rank = rank // (sizes["tp"] * sizes["dp_shard"])
    return Topology("override", world, rank, sizes["dp_replicate"], dp_replicate_rank, sizes["dp_shard"],
                    dp_shard_rank, sizes["tp"], tp_rank, sizes["ep"], rank % sizes["ep"],
                    meshes=param_meshes(model), plain_counts=plain_shard_counts(model, world))


class _CallableModule(types.ModuleType):
    """``shardadopt.parallel.topology`` names both this module and the function: once the module is imported, Python
    binds the package attribute to the module, so the module itself must answer ``shardadopt.topology(model)``."""

    def __call__(self, model: nn.Module, override: Mapping[str, int] | None = None) -> Topology:
        return topology(model, override)


sys.modules[__name__].__class__ = _CallableModule
