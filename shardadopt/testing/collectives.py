"""Counting and recording the collectives a training run issues.

A test asserts that exactly one mechanism reduces each parameter's gradient (shardadopt's data-parallel average, not
also the Trainer's own): it counts the ``torch.distributed.all_reduce`` calls whose tensor is that parameter's
gradient (its local shard for a DTensor), or whose flat buffer holds that gradient (``shardadopt.adapters``
averages every factor of a group in one ``all_reduce`` over a flat buffer:
``shardadopt.adapters.data_parallel.covered_gradients``). Tests and benchmarks count a step's collectives by kind
(``counted_collectives``); ``benchmarks/adapter_step.py`` records them with their sizes and replays them alone on
dummy buffers (``recorded_collectives``, ``replay_collectives``), to tell the collectives' share of a step's time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


def _is_collective(func: Any) -> bool:
    """Whether a dispatched op is a collective (not one of the namespaces' helpers)."""
    from shardadopt import upstream

    if func.namespace not in upstream.COLLECTIVE_OP_NAMESPACES:
        return False
    return collective_kind(func) != "other" or any(part in func.__name__ for part in _OTHER_COLLECTIVES)


@contextmanager
def _seen_collectives(seen: Callable[[Any, tuple, dict, Any], None]) -> Iterator[None]:
    """Call ``seen(op, args, kwargs, result)`` for every collective issued on this rank while the block runs."""
    from torch.distributed.tensor import DTensor

    from shardadopt import upstream

    class Seeing(upstream.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented  # DTensor unwraps first; its local ops come back here
            result = func(*args, **(kwargs or {}))
            if _is_collective(func):
                seen(func, args, kwargs or {}, result)
            return result

    with Seeing():
        yield


@contextmanager
def counted_collectives() -> Iterator[dict[str, int]]:
    """Count, while the block runs on this rank, the collectives issued (``torch.distributed`` calls and DTensor's
    functional collectives alike: the c10d ops ``CommDebugMode`` counts, by a dispatch mode of the same kind, without
    its module tracking, which fails on peft modules under torch 2.13), by kind. The mode sees every op: count
    outside timed code.

    Returns:
        (yields) ``{kind: calls}`` for every kind of :data:`COLLECTIVE_KINDS`, filled as the block runs.
    """
    counts = dict.fromkeys(COLLECTIVE_KINDS, 0)

    def seen(func, args, kwargs, result) -> None:
        counts[collective_kind(func)] += 1

    with _seen_collectives(seen):
        yield counts


@dataclass
class Collective:
    """One collective as issued: its c10d op and arguments with every tensor replaced by a zero buffer of the same
    shape and dtype (the process group and options kept), its kind and the bytes of its largest tensor (an
    all-gather's output, a reduce-scatter's input, an all-reduce's buffer)."""

    op: Any
    args: tuple
    kwargs: dict
    kind: str
    nbytes: int


@contextmanager
def recorded_collectives() -> Iterator[list[Collective]]:
    """Record, while the block runs on this rank, the collectives issued (as :func:`counted_collectives` sees them),
    in order, for :func:`replay_collectives`. Outside timed code.

    Returns:
        (yields) the list of :class:`Collective`, filled as the block runs.
    """
    import torch

    from shardadopt import upstream

    recorded: list[Collective] = []

    def seen(func, args, kwargs, result) -> None:
        flat, spec = upstream.pytree_flatten((args, kwargs))
        dummy = [torch.zeros_like(x) if isinstance(x, torch.Tensor) else x for x in flat]
        tensors = [x for x in flat + upstream.pytree_flatten(result)[0] if isinstance(x, torch.Tensor)]
        nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        args, kwargs = spec.unflatten(dummy)
        recorded.append(Collective(func, args, kwargs, collective_kind(func), nbytes))

    with _seen_collectives(seen):
        yield recorded


def replay_collectives(collectives: list[Collective]) -> None:
    """Issue ``collectives`` (:func:`recorded_collectives`) again on their zero buffers, one after the other, each
    waited for before the next (their cost without compute to hide behind). Collective: every rank replays its own
    record of the same run, so the ranks issue matching calls.

    Args:
        collectives: what :func:`recorded_collectives` recorded on this rank.
    """
    import torch

    from shardadopt import upstream

    for collective in collectives:
        result = collective.op(*collective.args, **collective.kwargs)
        for item in upstream.pytree_flatten(result)[0]:
            if isinstance(item, torch.Tensor):
                if collective.op.namespace != "c10d":  # functional collectives: an async tensor
                    upstream.wait_functional_collective(item)
            elif hasattr(item, "wait"):  # c10d ops: their Work
                item.wait()
