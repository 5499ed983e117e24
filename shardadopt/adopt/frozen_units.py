"""FSDP2 units whose parameters are all frozen (the base model under LoRA) kept unsharded for a whole optimizer step.

FSDP2 all-gathers a unit's weights before its forward, reshards them after it, all-gathers them again before its
backward (the input gradient needs the frozen weight too) and reshards them after it; under gradient accumulation
that happens in every micro-batch. Frozen weights get no gradient, and FSDP2 reduces only gradients that exist, so
no reduce-scatter is issued for them; the repeated all-gathers are what remains. With the option,
``reshard_after_forward=False`` on those units removes the backward's, and a forward pre-hook on each unit skips the
reshard after backward in the micro-batches that do not reduce gradients (FSDP2's ``set_reshard_after_backward`` for
accumulation, switched by the units' own sync state, so ``no_sync`` from accelerate, the Trainer or by hand all
count), so each unit is gathered once per optimizer step and resharded after the step's last backward (frozen
weights never change: the gathered copy stays valid). The cost is memory: at the peak the whole frozen model is
unsharded on every rank (:func:`keep_frozen_units_gathered` returns those bytes), and it stays so between the
micro-batches of a step. ``across_steps`` keeps them gathered after every backward: one all-gather per unit for the
whole run (the first forward; again only after something reshards them, such as a ``state_dict()``), the same peak,
held between steps too. Off unless asked for (``AdoptionKwargs(keep_frozen_units_gathered=True)``; Trainer: call the
function after adding the adapters): a model is usually sharded at load time because it does not fit unsharded.
Measured in ``benchmarks/adapter_step.py``; docs/adapters.md.
"""

from __future__ import annotations

from torch import nn

from shardadopt import upstream

# on every frozen FSDP unit under the option: (whether this module switched it to reshard_after_forward=False, or
# upstream already keeps it gathered after forward; the handle of its pre-forward hook keeping it across micro-batches,
# None when it is kept across steps)
_KEPT = "_shardadopt_kept_gathered"

__all__ = ["frozen_units", "keep_frozen_units_gathered"]


def frozen_units(model: nn.Module) -> list[nn.Module]:
    """The ``fully_shard`` units of ``model`` whose sharded parameters all have ``requires_grad=False`` (parameters
    added after sharding, such as LoRA factors, are not FSDP's and do not count).

    Args:
        model: any module (without FSDP2 units: an empty list).

    Returns:
        The units, in ``model.modules()`` order.
    """
    from torch.distributed.fsdp import FSDPModule

    units = []
    for module in model.modules():
        params = upstream.fsdp_managed_parameters(module) if isinstance(module, FSDPModule) else []
        if params and not any(p.requires_grad for p in params):
            units.append(module)
    return units


def _unsharded_bytes(unit: nn.Module) -> int:
    """The bytes of the unit's weights gathered over its FSDP shard group (on fsdp x tp: the TP shard)."""
    from torch.distributed.tensor import DTensor

    groups = upstream.fsdp_param_groups(unit)
    ranks = groups[0].mesh_info.shard_mesh_size if groups else 1
    total = 0
    for param in upstream.fsdp_managed_parameters(unit):
        if isinstance(param, DTensor):  # sharded (a gathered unit exposes its plain unsharded parameters)
            local = upstream.dtensor_local(param)
            total += local.numel() * local.element_size() * ranks
        else:
            total += param.numel() * param.element_size()
    return total


def keep_frozen_units_gathered(model: nn.Module, keep: bool = True, across_steps: bool = False) -> int:
    """Keep the all-frozen FSDP2 units of ``model`` (:func:`frozen_units`) unsharded after forward until their
    backward (``reshard_after_forward=False``), and after the backward of micro-batches that do not reduce gradients
    (under accumulation) too: one all-gather per unit per optimizer step instead of two per micro-batch; or, with
    ``keep=False``, give the units back their resharding. Call it after the adapters are added (what is frozen then
    decides), on every rank alike; no collective. The weights are resharded after each synchronised backward (the
    step's last); after a forward without backward (evaluation) they stay gathered until the next such backward or
    ``reshard()``. With ``across_steps`` they are not resharded after any backward: gathered once for the run, held
    between steps too (the step's peak does not change: it already holds them). Calling it again switches the mode.

    Args:
        model: a model sharded with FSDP2 (at load time or by hand), a peft model around one included.
        keep: True to keep the units gathered, False to undo.
        across_steps: keep them gathered from one optimizer step to the next too.

    Returns:
        The bytes per rank of the unsharded weights now held from forward to backward by the units this call
        switched (0 with ``keep=False``, or when no unit is all frozen): the memory the option costs at the step's
        peak. Units that upstream already keeps gathered after forward (FSDP2's root, transformers'
        norm-and-head unit) are only kept after backward (across micro-batches, or steps), and not counted (upstream
        holds them at the peak).
    """
    held, counted = 0, set()
    for unit in frozen_units(model):
        groups = upstream.fsdp_param_groups(unit)
        if _KEPT in unit.__dict__:  # kept already: undone first (then kept again in the mode asked for)
            switch, hook = unit.__dict__.pop(_KEPT)
            if hook is not None:
                hook.remove()
            unit.set_reshard_after_backward(True, recurse=False)
            if switch and not keep:
                unit.set_reshard_after_forward(True, recurse=False)
        elif keep:
            switch = all(g.post_forward_mesh_info is not None for g in groups)
            if switch:
                unit.set_reshard_after_forward(False, recurse=False)
        if keep:
            hook = None if across_steps else unit.register_forward_pre_hook(_reshard_after_synced_backward)
            if across_steps:
                unit.set_reshard_after_backward(False, recurse=False)
            unit.__dict__[_KEPT] = (switch, hook)
        # modules sharded together (fully_shard([norm, lm_head])) share their groups: counted once
        if keep and unit.__dict__[_KEPT][0] and not counted & {id(g) for g in groups}:
            counted.update(id(g) for g in groups)
            held += _unsharded_bytes(unit)
    return held


def _reshard_after_synced_backward(unit: nn.Module, args: object) -> None:
    """Before a kept unit's forward: reshard it after this micro-batch's backward only if that backward reduces
    gradients (the step's last); inside ``no_sync`` the next micro-batch needs the same weights."""
    syncs = all(upstream.fsdp_group_syncs_gradients(g) for g in upstream.fsdp_param_groups(unit))
    unit.set_reshard_after_backward(syncs, recurse=False)
