"""Adapter gradients averaged over the data-parallel ranks after each backward.

Factors (and DoRA magnitudes, ``modules_to_save`` copies) are replicated over the data-parallel ranks (they are
small; DDP does the same); a post-accumulate-grad hook averages their gradients over exactly that group (the ranks
with this rank's tp coordinate). Under FSDP2 ``no_sync`` (accelerate's ``accumulate()``) the reduction waits for the
synchronised backward, like FSDP's own (averaging an accumulated gradient again would be exact too: the part every
rank shares averages to itself). TP factors get their TP reductions from DTensor. Every adapter is hooked when laid
out, an inactive one too: ``set_adapter`` makes it trainable later, after ``prepare``. The Trainer of transformers
5.25+ averages trainable plain parameters over all ranks itself; every laid-out parameter is left out of that, so
exactly one average acts on it (the Trainer's would be a second collective on the same gradient every step, and one
on a pure TP layout, which needs none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardadopt import upstream
from shardadopt.adapters.peft_layers import adapter_modules, is_laid_out
from shardadopt.topology import Topology

_HOOKED = "_shardadopt_dp_average"  # on a factor parameter: the dp-averaging hook handle
_DP = "_shardadopt_dp"  # on a LoRA layer or copy: (dp group, dp size, FSDP modules telling whether gradients sync)

_groups: dict[tuple, Any] = {}


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


def _fsdp_syncing(fsdp_modules: list[nn.Module]) -> bool:
    """False inside FSDP2 ``no_sync`` (``set_requires_gradient_sync(False)``), where reductions wait."""
    for module in fsdp_modules:
        for group in upstream.fsdp_param_groups(module):
            return bool(group.reduce_grads)
    return True


def _average_over_dp(param: nn.Parameter, group: Any, dp_size: int, fsdp_modules: list[nn.Module]) -> None:
    from torch.distributed.tensor import DTensor

    if getattr(param, _HOOKED, None) is not None:
        return

    def average(p: torch.Tensor) -> None:
        if p.grad is None or not _fsdp_syncing(fsdp_modules):
            return
        grad = upstream.dtensor_local(p.grad) if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=group)
        grad.div_(dp_size)

    # Frozen factors too (an inactive adapter: set_adapter makes it trainable later, after prepare): torch hooks
    # only parameters that require grad, and the hook stays registered while the flag changes.
    frozen = not param.requires_grad
    param.requires_grad_(True)
    try:
        setattr(param, _HOOKED, param.register_post_accumulate_grad_hook(average))
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
