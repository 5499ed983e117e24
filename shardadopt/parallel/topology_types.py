"""``Topology``: one rank's place in a model's sharding (sizes and coordinates of data, tensor and expert parallel,
the meshes, how many ranks hold each plain parameter) and the questions asked of it; ``TopologyError``; and the
world size and rank. Apart from ``topology.py`` (which finds the topology of a model) so that the mesh readers in
``topology_meshes.py`` can build one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


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
    plain_counts: Mapping[int, int] = field(default_factory=dict, repr=False)

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
        return self.plain_counts.get(id(parameter), self.world_size)

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
        if not self.plain_counts:
            return lambda grad: world
        counts = {id(p.grad): self.plain_counts[id(p)] for p in parameters
                  if p.grad is not None and id(p) in self.plain_counts}
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
