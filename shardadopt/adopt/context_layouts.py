"""Which load-time layouts context parallelism (``ParallelismConfig(cp_size=N)``) trains correctly; others refused.

Under CP each rank of a CP group holds a chunk of the same rows, so its gradients must be averaged over the CP
group as over data-parallel ranks, and the ranks that must see the same tokens (a TP group) must hold the same
chunk. Both hold when

- the model's data-parallel ranks (``dp_replicate x fsdp``) are accelerate's data-parallel ranks times its CP ranks:
  accelerate's own loader split (by its data-parallel ranks, the ranks of a CP group taking the same rows) is then
  the right one, and the model's FSDP reduce-scatter (and HSDP all-reduce) averages every gradient over the data and
  CP ranks exactly once (``fsdp_size=2`` with ``cp_size=2`` on 2 ranks; ``fsdp_size=4`` or ``dp_replicate_size=2 x
  fsdp_size=2`` with ``dp_shard_size=2 x cp_size=2`` on 4);
- accelerate's TP groups are the model's (``fsdp_size=2 x tp_size=2`` with ``cp_size=2 x tp_size=2``: accelerate
  puts ``tp`` last in its mesh, as transformers does), so the heads split by TP see the same chunk and ring attention
  runs over a CP group with TP-local heads.

Expert parallelism that exchanges tokens (transformers' ``all_to_all`` EP inside the data-parallel ranks) needs
nothing more: each rank's tokens go to their experts and come back. EP on a TP group (transformers before 5.21, or
``ep_implementation="all_reduce"``) is a TP group above.
"""

from __future__ import annotations

from typing import Any

from shardadopt.adopt.record import AdoptionError
from shardadopt.topology import Topology

__all__ = ["check_layout"]


def check_layout(config: Any, layout: Topology) -> None:
    """Refuse, by name and with the fix, a model whose layout context parallelism would train wrongly.

    Args:
        config: accelerate's ``ParallelismConfig`` with ``cp_size > 1``.
        layout: the adopted model's :class:`~shardadopt.topology.Topology`.

    Raises:
        AdoptionError: the model's data-parallel ranks are not accelerate's data-parallel x CP ranks, or its TP
            groups are not accelerate's.
    """
    cp_size, tp_size = config.cp_size, layout.tp_size
    accelerate_dp = config.dp_replicate_size * config.dp_shard_size
    spelled = (f"ParallelismConfig(dp_replicate_size={config.dp_replicate_size}, dp_shard_size="
               f"{config.dp_shard_size}, cp_size={cp_size}, tp_size={config.tp_size})")
    if layout.dp_size != accelerate_dp * cp_size:
        fixes = [f"DistributedConfig(fsdp_size={accelerate_dp * cp_size})"] if tp_size == 1 else []
        if layout.dp_size % cp_size == 0:
            shard = layout.dp_size // cp_size
            fixes.append(f"ParallelismConfig({f'dp_shard_size={shard}, ' if shard > 1 else ''}cp_size={cp_size}"
                         f"{f', tp_size={tp_size}' if tp_size > 1 else ''})")
        raise AdoptionError(
            f"context parallelism ({spelled}) on a model with {layout.dp_size} data-parallel rank(s) "
            f"(DistributedConfig dp_replicate_size x fsdp_size) and tp_size={tp_size}: the ranks of a CP group hold "
            f"chunks of the same rows and their gradients must be averaged like data-parallel ones, so the model's "
            f"data-parallel ranks must be accelerate's data-parallel ranks ({accelerate_dp}) x cp_size ({cp_size}). "
            f"Use {' or '.join(fixes) or f'a model with a multiple of {cp_size} data-parallel ranks'}")
    if tp_size > 1 and (config.tp_size != tp_size or layout.tp_rank != layout.rank % tp_size):
        raise AdoptionError(
            f"context parallelism ({spelled}) on a model loaded with tp_size={tp_size}: the ranks of a TP group "
            f"must hold the same chunk of the sequence, so accelerate's TP groups (tp_size={config.tp_size}, "
            f"consecutive ranks) must be the model's (rank {layout.rank} is TP rank {layout.tp_rank} of "
            f"{tp_size}). Pass ParallelismConfig(tp_size={tp_size}, cp_size={cp_size}, ...) and load with tp last "
            f"in the mesh, as DistributedConfig does")
