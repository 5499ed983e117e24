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

Rows that pack several sequences (position ids restarting inside a row) are refused at the step's forward
(:func:`check_first_forward`): CP drops the attention mask for ``is_causal=True``, so they would attend to each other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardadopt.adopt.record import AdoptionError
from shardadopt.parallel.topology import Topology

__all__ = ["check_first_forward", "check_layout"]


def check_layout(config: Any, layout: Topology) -> None:
    """Refuse, by name and with the fix, a model whose layout context parallelism would train wrongly.

    Args:
        config: accelerate's ``ParallelismConfig`` with ``cp_size > 1``.
        layout: the adopted model's :class:`~shardadopt.parallel.topology.Topology`.

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


_PACKED_CHECK_ATTR = "_shardadopt_cp_packed_rows_check"


def _refuse_packed_rows(position_ids: torch.Tensor, group: dist.ProcessGroup, cp_size: int) -> None:
    # the CP group's chunks of every row, gathered: one sequence is one run of consecutive positions; packed rows
    # (position ids restarting inside a row) repeat positions. Every rank reads the same gather, so all raise.
    # (runs after the step's own checks: the chunks are of equal length, the position ids are the whole sequence's)
    chunks = position_ids.reshape(-1, position_ids.shape[-1]).contiguous()
    gathered = [torch.empty_like(chunks) for _ in range(cp_size)]
    dist.all_gather(gathered, chunks, group=group)
    rows = torch.cat(gathered, dim=-1).sort(dim=-1).values
    if bool(rows.diff(dim=-1).ne(1).any()):
        raise AdoptionError(
            "context parallelism on rows that pack several sequences (position ids restart inside a row: TRL's "
            "padding_free=True or packing, or packed batches): context parallelism drops the attention mask for "
            "is_causal=True, so the packed sequences would attend to each other. Train with padding_free=False and "
            "packing=False (rows padded on the right, pad_to_multiple_of=2 x cp_size), or without cp_size")


def check_first_forward(model: nn.Module, group: dist.ProcessGroup, cp_size: int) -> None:
    """Refuse, at the next forward of ``model`` (the step's, inside ``maybe_context_parallel``), rows that pack
    several sequences; the check is a collective over the CP group and removes itself after that forward.

    Args:
        model: an adopted model about to run under context parallelism.
        group: the CP process group.
        cp_size: its size.
    """
    stale = getattr(model, _PACKED_CHECK_ATTR, None)
    if stale is not None:  # a context entered without a forward
        stale.remove()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        getattr(module, _PACKED_CHECK_ATTR).remove()
        setattr(module, _PACKED_CHECK_ATTR, None)
        if kwargs.get("position_ids") is not None:
            _refuse_packed_rows(kwargs["position_ids"], group, cp_size)

    setattr(model, _PACKED_CHECK_ATTR, model.register_forward_pre_hook(hook, with_kwargs=True))
