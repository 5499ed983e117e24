"""Which load-time layouts context parallelism (``ParallelismConfig(cp_size=N)``) trains correctly, and why not others.

Under CP each rank of a CP group holds a chunk of the same rows, so its gradients must be averaged over the CP
group as over data-parallel ranks: the ranks of the model's data-parallel groups (``dp_replicate x fsdp``) must be
accelerate's data-parallel ranks times its CP ranks. Then accelerate's own loader split (by its data-parallel ranks,
the CP ranks of a group taking the same batch) is the right one, and the model's FSDP reduce-scatter (and HSDP
all-reduce) averages every gradient over data and CP ranks exactly once: ``fsdp_size=2`` with ``cp_size=2`` on 2
ranks, ``fsdp_size=4`` or ``dp_replicate_size=2 x fsdp_size=2`` with ``dp_shard_size=2 x cp_size=2`` on 4.

Refused by name, with the reason (:func:`refuse_untested_layout`):

- ``tp_size``: no tested path averages the replicated (norm) parameters' gradients over a CP group inside a TP
  layout, and accelerate's mesh orders CP and TP ranks its own way, which must equal the model's TP groups;
- ``ep_size``: transformers' expert parallelism sums the expert outputs of the ranks of an EP group, which must
  hold the same tokens; the ranks of a CP group hold different chunks, so the sum would mix tokens of different
  positions wherever the two groups meet.
"""

from __future__ import annotations

from typing import Any

from shardadopt.adopt.record import AdoptionError
from shardadopt.topology import Topology

__all__ = ["check_data_parallel_layout", "refuse_untested_layout"]


def _accelerate_dp_size(config: Any) -> int:
    return config.dp_replicate_size * config.dp_shard_size


def check_data_parallel_layout(config: Any, layout: Topology) -> None:
    """Refuse a model whose data-parallel ranks are not accelerate's data-parallel x CP ranks.

    Args:
        config: accelerate's ``ParallelismConfig`` with ``cp_size > 1``.
        layout: the adopted model's :class:`~shardadopt.topology.Topology`.

    Raises:
        AdoptionError: ``layout.dp_size != (dp_replicate_size x dp_shard_size) x cp_size``, naming both fixes.
    """
    cp_size, accelerate_dp = config.cp_size, _accelerate_dp_size(config)
    if layout.dp_size == accelerate_dp * cp_size:
        return
    want_shard = layout.dp_size // cp_size
    accelerate_fix = (f"ParallelismConfig(dp_shard_size={want_shard}, cp_size={cp_size}) on {layout.dp_size} "
                      f"processes" if want_shard >= 1 and layout.dp_size % cp_size == 0 else None)
    raise AdoptionError(
        f"context parallelism (ParallelismConfig(cp_size={cp_size}, dp_replicate_size="
        f"{config.dp_replicate_size}, dp_shard_size={config.dp_shard_size})) on a model with {layout.dp_size} "
        f"data-parallel ranks (DistributedConfig dp_replicate_size x fsdp_size): the CP ranks hold chunks of the "
        f"same rows and their gradients are averaged with the data-parallel ones, so the model's data-parallel "
        f"ranks must be accelerate's data-parallel ranks ({accelerate_dp}) x cp_size ({cp_size}) = "
        f"{accelerate_dp * cp_size}. Load with DistributedConfig(fsdp_size={accelerate_dp * cp_size})"
        + (f", or use {accelerate_fix}" if accelerate_fix else ""))


def refuse_untested_layout(config: Any, layout: Topology) -> None:
    """Refuse tensor- or expert-parallel models under context parallelism, with the reason and the fix.

    Args:
        config: accelerate's ``ParallelismConfig`` with ``cp_size > 1``.
        layout: the adopted model's :class:`~shardadopt.topology.Topology`.

    Raises:
        AdoptionError: ``layout.tp_size > 1`` or ``layout.ep_size > 1``.
    """
    cp = f"context parallelism (ParallelismConfig(cp_size={config.cp_size}))"
    if layout.ep_size > 1:
        raise AdoptionError(
            f"{cp} on a model loaded with DistributedConfig(ep_size={layout.ep_size}) is not supported: expert "
            f"parallelism sums the expert outputs of the ranks of an EP group, which must hold the same tokens, and "
            f"the ranks of a CP group hold different chunks of the sequence, so the sum would mix tokens of "
            f"different positions. Load the MoE model with fsdp_size only (experts sharded by FSDP), or train "
            f"without cp_size")
    if layout.tp_size > 1:
        raise AdoptionError(
            f"{cp} on a model loaded with DistributedConfig(tp_size={layout.tp_size}) is not supported yet: ring "
            f"attention over a CP group with the heads split by TP is untested (the CP groups must be the model's "
            f"data-parallel groups, orthogonal to its TP groups, and the replicated parameters' gradients averaged "
            f"over them once). Load with fsdp_size only (DistributedConfig(fsdp_size=...) with "
            f"ParallelismConfig(dp_shard_size=..., cp_size={config.cp_size})), or train without cp_size")
