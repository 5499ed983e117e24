"""Sampling that agrees inside a model-parallel group: the ranks holding one model replica draw the same numbers.

The ranks of a tensor-parallel group run one replica: each computes the same logits, and each must sample the same
tokens, or the next forward (and TRL's loss) mixes several batches, a silently wrong gradient. Random streams are
seeded per process (TRL: ``set_seed(args.seed, device_specific=True)``, a user loop: ``torch.manual_seed(rank)``), so
the TP ranks' streams differ. :func:`agree_sampling_rng` makes them agree: the TP group's first rank sends its CPU
generator state (and its accelerator's, for a model on one) to the other ranks of its group. Data-parallel ranks
keep distinct streams: each TP group takes its own first rank's. From then on the TP ranks draw the same numbers as
long as they make the same random calls, which one replica's generate and forward do (dropout included).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardadopt.parallel.topology import topology

__all__ = ["agree_sampling_rng"]


def _accelerator_device(model: nn.Module) -> torch.device | None:
    """The accelerator device ``model``'s parameters live on (None on CPU): its generator samples their tokens."""
    for parameter in model.parameters():
        device = parameter.device
        return None if device.type in ("cpu", "meta") else device
    return None


def agree_sampling_rng(model: nn.Module) -> bool:
    """Give every rank of ``model``'s tensor-parallel group the random state of the group's first rank.

    Call it on every rank of the group before sampling from a tensor-parallel model (``shardadopt.enable()`` does
    it at every ``generate``). A collective over the TP group (two small broadcasts); nothing happens for a model
    without tensor parallelism.

    Args:
        model: a model sharded at load time (``DistributedConfig``) or by hand.

    Returns:
        True when the states were made to agree, False for a model without tensor parallelism (or outside a
        process group).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    layout = topology(model)
    group = layout.tp_group()
    if group is None:
        return False
    device = _accelerator_device(model)
    module = torch.get_device_module(device) if device is not None else None
    states = [torch.get_rng_state(), module.get_rng_state(device) if module is not None else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group, device=device)
    torch.set_rng_state(states[0])
    if module is not None:
        module.set_rng_state(states[1], device)
    return True
