"""Adapter gradients averaged over the data-parallel ranks after each backward.

Factors (and DoRA magnitudes, ``modules_to_save`` copies) are replicated over the data-parallel ranks (they are
small; DDP does the same); a post-accumulate-grad hook averages their gradients over exactly that group (the ranks
with this rank's tp coordinate). Under FSDP2 ``no_sync`` (accelerate's ``accumulate()``) the reduction waits for the
synchronised backward, like FSDP's own (averaging an accumulated gradient again would be exact too: the part every
rank shares averages to itself). TP factors get their TP reductions from DTensor. Every adapter is hooked when laid
out, an inactive one too: ``set_adapter`` makes it trainable later, after ``prepare``. The Trainer of transformers
5.25+ averages trainable plain parameters over all ranks itself; every laid-out parameter is left out of that, so
exactly one average acts on it (the Trainer's would be a second collective on the same gradient every step, and one
on a pure TP layout, which needs none). The hooks only collect: once the backward has finished, the gradients
of each group are averaged with one ``all_reduce`` over a flat buffer (:func:`average_gradients`), not one per
factor.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardadopt import upstream
from shardadopt.adapters.peft_layers import adapter_modules, is_laid_out
from shardadopt.parallel.topology import Topology

_HOOKED = "_shardadopt_dp_average"  # on a factor parameter: the dp-averaging hook handle
_DP = "_shardadopt_dp"  # on a LoRA layer or copy: (dp group, dp size, FSDP modules telling whether gradients sync)

_groups: dict[tuple, Any] = {}
_FLAT = "_shardadopt_averaged"  # on a flat buffer average_gradients reduced: the gradients it holds


def average_gradients(sets: Iterable[tuple[Sequence[torch.Tensor], Any]]) -> int:
    """Average the gradients of each set of parameters over its process group with one ``all_reduce`` per set (one
    per dtype within a set): the gradients are copied into one flat buffer, reduced, divided by the group's size and
    copied back. Collective: every rank of each group, with the same sets in the same order.

    Args:
        sets: ``(parameters, group)`` pairs, ``group`` a process group or None for the whole world. Parameters
            without a gradient are skipped (every rank of the group must skip the same ones); a DTensor gradient is
            averaged on its local shard.

    Returns:
        The number of ``all_reduce`` calls issued.
    """
    calls = 0
    for params, group in sets:
        calls += _average(params, group, dist.get_world_size(group))
    return calls


def covered_gradients(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The gradients (local shards) whose values the flat buffer ``tensor`` held when :func:`average_gradients` (or
    the hooks) reduced it; empty for any other tensor. What tests counting reductions per parameter read."""
    return list(getattr(tensor, _FLAT, ()))


def _average(params: Sequence[torch.Tensor], group: Any, size: int) -> int:
    from torch.distributed.tensor import DTensor

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            grad = upstream.dtensor_local(param.grad) if isinstance(param.grad, DTensor) else param.grad
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        setattr(flat, _FLAT, grads)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        with torch.no_grad():
            for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(piece.view_as(grad))
    return len(by_dtype)


class _Pending:
    """The parameters whose synchronised gradient arrived in a running backward, per backward (graph task: a
    reentrant checkpoint's inner backward is one of its own) and (group, size), in hook registration order (the same
    on every rank), averaged together once that backward has finished. Parameters are held weakly: the entries of a
    backward that failed before its end (its callback never runs) keep no model alive and are pruned."""

    def __init__(self) -> None:
        self.tasks: dict[int, dict[tuple[int, int], tuple[Any, int, dict[int, weakref.ref]]]] = {}

    def add(self, param: torch.Tensor, order: int, group: Any, size: int) -> None:
        task = upstream.current_graph_task_id()
        sets = self.tasks.get(task)
        if sets is None:
            self.tasks = {t: s for t, s in self.tasks.items() if _alive(s)}
            sets = self.tasks[task] = {}
            upstream.queue_backward_callback(lambda: self.flush(task))
        sets.setdefault((id(group), size), (group, size, {}))[2][order] = weakref.ref(param)

    def flush(self, task: int) -> None:
        for group, size, params in self.tasks.pop(task, {}).values():
            _average([p for p in (params[i]() for i in sorted(params)) if p is not None], group, size)


def _alive(sets: dict) -> bool:
    return any(ref() is not None for _, _, params in sets.values() for ref in params.values())


_pending = _Pending()
_order = [0]  # registration counter: the order gradients are averaged in within a flat buffer


def dp_group(topo: Topology) -> Any:
    """The process group of this rank's data-parallel peers (same tp rank), None for the whole world. Collective the
    first time for a layout (the groups are cached per default group)."""
    if topo.tp_size == 1:
        return None
    tp_ranks: list[int] = [0] * topo.world_size
    dist.all_gather_object(tp_ranks, topo.tp_rank)
    members = tuple(tuple(r for r, t in enumerate(tp_ranks) if t == tp) for tp in range(topo.tp_size))
    key = (id(upstream.default_group()), members)
    if key not in _groups:
        _groups[key] = dist.new_subgroups_by_enumeration([list(m) for m in members])[0]
    return _groups[key]


def attach_dp(module: nn.Module, group: Any, dp_size: int, fsdp_modules: list[nn.Module]) -> None:
    """Record on ``module`` (a LoRA layer or a ``modules_to_save`` copy) the data-parallel ``group`` (None: the
    world) of ``dp_size`` ranks its gradients are averaged over, and the FSDP modules telling whether they sync."""
    module.__dict__[_DP] = (group, dp_size, fsdp_modules)


def _sync_probe(fsdp_modules: list[nn.Module]) -> Any:
    """The first FSDP2 parameter group in ``fsdp_modules`` or below them (a root unit that holds no weights of its own,
    as transformers' FSDP plan makes, has none), which does not sync gradients inside FSDP2 ``no_sync``
    (``set_requires_gradient_sync(False)``), where reductions wait; None without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for module in fsdp_modules:
        for unit in module.modules():
            groups = upstream.fsdp_param_groups(unit) if isinstance(unit, FSDPModule) else []
            if groups:
                return groups[0]
    return None


def _average_over_dp(param: nn.Parameter, group: Any, dp_size: int, fsdp_modules: list[nn.Module]) -> None:
    if getattr(param, _HOOKED, None) is not None:
        return
    order = _order[0]
    _order[0] += 1
    probe: list[Any] = []  # found at the first gradient, then kept

    def collect(p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if not probe:
            probe.append(_sync_probe(fsdp_modules))
        if probe[0] is None or upstream.fsdp_group_syncs_gradients(probe[0]):
            _pending.add(p, order, group, dp_size)

    # Frozen factors too (an inactive adapter: set_adapter makes it trainable later, after prepare): torch hooks
    # only parameters that require grad, and the hook stays registered while the flag changes.
    frozen = not param.requires_grad
    param.requires_grad_(True)
    try:
        setattr(param, _HOOKED, param.register_post_accumulate_grad_hook(collect))
    finally:
        param.requires_grad_(not frozen)


def hook_copy(copied: nn.Module) -> None:
    """Average the gradients of a trainable ``modules_to_save`` copy over its data-parallel group (:func:`attach_dp`;
    nothing without one). Parameters already hooked are left as they are."""
    dp = copied.__dict__.get(_DP)
    for param in copied.parameters():
        upstream.leave_out_of_trainer_replicated_sync(param)
        if dp is not None:
            _average_over_dp(param, *dp)


def hook_trainable(layer: Any) -> None:
    """Average the gradients of ``layer``'s laid-out LoRA factors over its data-parallel group (:func:`attach_dp`),
    frozen ones included (an inactive adapter that ``set_adapter`` makes trainable later; a hook fires only when a
    gradient arrives). Parameters already hooked are left as they are."""
    dp = layer.__dict__.get(_DP)
    for adapter in [a for a in layer.lora_A if is_laid_out(layer, a)]:
        for factor in adapter_modules(layer, adapter):
            for param in factor.parameters():
                upstream.leave_out_of_trainer_replicated_sync(param)
                if dp is not None:
                    _average_over_dp(param, *dp)
