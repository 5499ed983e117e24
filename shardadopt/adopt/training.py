"""Gradient accumulation and clipping on adopted models: FSDP2's ``no_sync`` and a norm over every mesh at once.

accelerate's ``no_sync`` and ``clip_grad_norm_`` assume the model it wrapped itself (DDP, its FSDP plugin); an adopted
model keeps FSDP2 units and DTensor/plain shards of its own, which these drive directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shardadopt.adopt.record import adopted


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip FSDP2 gradient reduction (reduce-scatter and HSDP all-reduce) inside the block; gradients accumulate
    unsharded locally and the next synchronised backward reduces the sum.

    Args:
        model: the adopted model; its ``FSDPModule`` units are switched (none: nothing happens).

    Returns:
        A context manager; it yields None.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def clip_grad_norm_(accelerator: Any, parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients of adopted models over every mesh at once (``shardadopt.gradnorm``), with plain tensors
    counted by how many ranks hold them (``Topology.plain_replication``). Collective.

    Args:
        accelerator: the ``Accelerator`` (its gradients are unscaled first, as accelerate does).
        parameters: the parameters whose gradients are clipped.
        max_norm: the largest total norm kept.
        norm_type: the norm's order.

    Returns:
        The total norm before clipping, the same on every rank.
    """
    from shardadopt.gradnorm import clip_grad_norm_ as clip

    parameters = list(parameters)
    accelerator.unscale_gradients()
    state = adopted(accelerator)
    maps = [t.grad_replication(parameters) for t in state.topologies.values()] if state else []
    world = accelerator.num_processes

    def replication(grad: torch.Tensor) -> int:
        for counts in maps:
            found = counts(grad)
            if found != world:
                return found
        return world

    return clip(parameters, max_norm, norm_type, plain_replication=replication)
