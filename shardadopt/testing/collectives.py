"""Counting the gradient reductions a training run issues, per parameter.

A test asserts that exactly one mechanism reduces each parameter's gradient (shardadopt's data-parallel average, not
also the Trainer's own): it counts the ``torch.distributed.all_reduce`` calls whose tensor is that parameter's
gradient (its local shard for a DTensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn


@contextmanager
def counted_grad_reductions(model: nn.Module, select: Callable[[str], bool]) -> Iterator[dict[str, int]]:
    """Count, while the block runs, the ``all_reduce`` calls on the gradient of each parameter of ``model`` whose
    name ``select`` picks and that requires grad.

    Args:
        model: the model being trained.
        select: picks parameter names (e.g. the LoRA factors).

    Returns:
        (yields) ``{name: calls}``, every selected parameter included (0 when never reduced), filled as the block
        runs.
    """
    from torch.distributed.tensor import DTensor

    params = [(n, p) for n, p in model.named_parameters() if select(n) and p.requires_grad]
    counts = {name: 0 for name, _ in params}
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        for name, param in params:
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local is not None and local.data_ptr() == tensor.data_ptr() and local.numel() == tensor.numel():
                counts[name] += 1
                break
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield counts
    finally:
        dist.all_reduce = original
