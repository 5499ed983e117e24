"""Counting the gradient reductions a training run issues, per parameter.

A test asserts that exactly one mechanism reduces each parameter's gradient (shardadopt's data-parallel average, not
also the Trainer's own): it counts the ``torch.distributed.all_reduce`` calls whose tensor is that parameter's
gradient (its local shard for a DTensor), or whose flat buffer holds that gradient (``shardadopt.adapters``
averages every factor of a group in one ``all_reduce`` over a flat buffer:
``shardadopt.adapters.data_parallel.covered_gradients``).
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

    from shardadopt.adapters.data_parallel import covered_gradients

    params = [(n, p) for n, p in model.named_parameters() if select(n) and p.requires_grad]
    counts = {name: 0 for name, _ in params}
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        reduced = covered_gradients(tensor) or [tensor]
        for name, param in params:
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local is not None and any(
                local.data_ptr() == t.data_ptr() and local.numel() == t.numel() for t in reduced
            ):
                counts[name] += 1
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield counts
    finally:
        dist.all_reduce = original


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")


def collective_kind(op: object) -> str:
    """The kind (:data:`COLLECTIVE_KINDS`) of a c10d or functional collective op as ``CommDebugMode`` counts it."""
    name = str(op).replace("_", "")
    for kind in COLLECTIVE_KINDS[:3]:
        if kind.replace("_", "") in name:
            return kind
    return "other"


# the other collectives; the rest of these namespaces (wait_tensor, _wrap_tensor_autograd, ...) are helpers
_OTHER_COLLECTIVES = ("broadcast", "alltoall", "all_to_all", "gather", "scatter", "reduce", "barrier", "send", "recv")


@contextmanager
def counted_collectives() -> Iterator[dict[str, int]]:
    """Count, while the block runs on this rank, the collectives issued (``torch.distributed`` calls and DTensor's
    functional collectives alike: the c10d ops ``CommDebugMode`` counts, by a dispatch mode of the same kind, without
    its module tracking, which fails on peft modules under torch 2.13), by kind. The mode sees every op: count
    outside timed code.

    Returns:
        (yields) ``{kind: calls}`` for every kind of :data:`COLLECTIVE_KINDS`, filled as the block runs.
    """
    from torch.distributed.tensor import DTensor

    from shardadopt import upstream

    counts = dict.fromkeys(COLLECTIVE_KINDS, 0)

    class Counting(upstream.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented  # DTensor unwraps first; its local ops come back here
            if func.namespace in upstream.COLLECTIVE_OP_NAMESPACES:
                kind = collective_kind(func)
                if kind != "other" or any(part in func.__name__ for part in _OTHER_COLLECTIVES):
                    counts[kind] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        yield counts
