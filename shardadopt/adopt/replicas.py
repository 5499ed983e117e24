"""The plain parameters of a tensor-parallel load are one replica: rank 0's values on every rank, as DDP makes them.

transformers' TP plan shards what it names; every other parameter (a classification ``score`` head, the norms, a
vision tower without a plan) stays a plain tensor, whole on every rank. A weight missing from the checkpoint (the
``score`` of ``AutoModelForSequenceClassification`` loaded from a causal LM, as TRL's reward-model docs do) is
initialised by each rank from its own RNG: ranks seeded differently (``set_seed(seed, device_specific=True)``) hold
different copies, and the TP group trains two models mixed into one, silently. DDP broadcasts rank 0's parameters
when it wraps a model, and transformers 5.19+'s Trainer broadcasts rank 0's trainable plain parameters of a model
sharded at load time (``Trainer._sync_replicated_trainable_parameters``); adoption does the same for the accelerate
loop (and the Trainer of older releases). Copies that already agree stay bit for bit as loaded.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from shardadopt.parallel.topology import Topology


def broadcast_plain_replicas(model: nn.Module, topo: Topology) -> list[str]:
    """Copy global rank 0's value of every plain parameter held whole on every rank into the other ranks' copies,
    on a model with tensor parallelism (a collective over the world). Plain TP or expert shards (transformers 5.15)
    are left alone. Warns naming the parameters whose copies differed.

    Args:
        model: the sharded model (every rank calls this with its own).
        topo: its topology (``shardadopt.parallel.topology``).

    Returns:
        The names of the parameters that differed from rank 0's on this rank (empty on rank 0).
    """
    from torch.distributed.tensor import DTensor

    if topo.tp_size == 1 or topo.world_size == 1 or not dist.is_initialized():
        return []
    replicas = [(name, p) for name, p in model.named_parameters()
                if not isinstance(p, DTensor) and topo.plain_replication(p) == topo.world_size]
    differed = []
    with torch.no_grad():
        for name, param in replicas:
            value = param.detach().clone()
            dist.broadcast(value, src=0)
            if not torch.equal(value, param):
                param.copy_(value)
                differed.append(name)
    if differed:
        warnings.warn(f"shardadopt: rank {topo.rank}'s copies of {len(differed)} parameters held whole on every "
                      f"tensor-parallel rank differed from rank 0's ({', '.join(differed[:3])}"
                      f"{', ...' if len(differed) > 3 else ''}): weights missing from the checkpoint are initialised "
                      f"by each rank's RNG. Rank 0's values are used, as DDP does; seed every rank alike before "
                      f"from_pretrained to start from the same values everywhere.", stacklevel=2)
    return differed
