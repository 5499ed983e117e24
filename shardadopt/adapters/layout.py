"""The converter: every LoRA adapter of a sharded model laid out to train like one process, or refused.

:func:`lay_out_adapters` runs when peft injects adapters (the ``peft-sharded-adapters`` patch, or by hand after
``global_adapter_shapes``): per adapter it checks the layer (``refusals``), makes the factors rank 0's values and
shards them like the base (``placement``, ``dora``; fused expert tensors: ``experts``), and hooks the data-parallel
averaging (``data_parallel``); ``modules_to_save`` copies are checked and hooked too. :func:`check_adapters` is what
``accelerator.prepare``
(``shardadopt.adopt.adopt_model``) calls: adapters added before ``shardadopt.enable()`` are refused, and factors
made trainable after injection get their hooks.
"""

from __future__ import annotations

from torch import nn

from shardadopt.adapters.data_parallel import attach_dp, dp_group, hook_copy, hook_trainable
from shardadopt.adapters.dora import lay_out_dora
from shardadopt.adapters.experts import (
    EXPERTS,
    check_expert_layer,
    expert_dp_group,
    expert_replicas,
    is_expert_layer,
    lay_out_expert_factors,
    linear_target_modules,
)
from shardadopt.adapters.modules_to_save import trainable_copies
from shardadopt.adapters.peft_layers import (
    adapter_modules,
    is_laid_out,
    lora_layers,
    mark_laid_out,
    peft_configs,
    unwrap_peft,
)
from shardadopt.adapters.placement import set_from_rank0, shard_factor, tp_mesh
from shardadopt.adapters.refusals import AdapterLayoutError, check_config, check_layer, refusal
from shardadopt.parallel.topology import topology


def lay_out_adapters(model: nn.Module) -> int:
    """Lay out every LoRA adapter of ``model`` that is not laid out yet. Collective: every rank, in the same order.

    Args:
        model: a ``PeftModel``, peft tuner or transformers model holding LoRA layers. A model that is not sharded is
            left alone.

    Returns:
        The number of (layer, adapter) pairs laid out (0 for a model that is not sharded).

    Raises:
        AdapterLayoutError: for an option, layer or ``modules_to_save`` that cannot be laid out.
    """
    from torch.distributed.fsdp import FSDPModule

    base = unwrap_peft(model)
    topo = topology(base)
    if not topo.is_sharded:
        return 0
    copies = trainable_copies(topo, base)
    configs = peft_configs(model)
    for config in configs.values():
        check_config(config)
    group = dp_group(topo) if topo.dp_size > 1 else None
    fsdp_modules = [m for m in base.modules() if isinstance(m, FSDPModule)][:1]
    done = 0
    for name, layer in lora_layers(base):
        for adapter in [a for a in layer.lora_A if not is_laid_out(layer, a)]:
            expert = is_expert_layer(layer)  # LoRA on a fused expert tensor (experts.py)
            style = (check_expert_layer(name, layer, linear_target_modules(base, configs.get(adapter))) if expert
                     else check_layer(name, layer, adapter, topo, base))
            for factor in adapter_modules(layer, adapter):
                for param in factor.parameters():
                    if param.is_meta:
                        raise refusal(name, "adapters created on the meta device (low_cpu_mem_usage=True)",
                                      "Load the adapter with low_cpu_mem_usage=False.")
                    set_from_rank0(param)
            if style == EXPERTS:
                lay_out_expert_factors(layer, adapter, topo.dp_size)
            elif style != "none":
                mesh = tp_mesh(layer.get_base_layer().weight)
                shard_factor(layer.lora_B[adapter] if style == "colwise" else layer.lora_A[adapter], style, mesh)
                if adapter in layer.lora_magnitude_vector:
                    lay_out_dora(layer.lora_magnitude_vector[adapter], style, mesh)
            mark_laid_out(layer, adapter)
            done += 1
        if is_expert_layer(layer):  # averaged over the replicas of the same experts (experts.py)
            if expert_replicas(layer) > 1:
                attach_dp(layer, expert_dp_group(layer), expert_replicas(layer), fsdp_modules)
        elif topo.dp_size > 1:
            attach_dp(layer, group, topo.dp_size, fsdp_modules)
        hook_trainable(layer)
    for copied in copies:
        if topo.dp_size > 1:
            attach_dp(copied, group, topo.dp_size, fsdp_modules)
        hook_copy(copied)
    return done


def check_adapters(model: nn.Module) -> None:
    """Refuse a sharded model holding LoRA adapters that :func:`lay_out_adapters` did not lay out, or
    ``modules_to_save`` of sharded modules; hook the data-parallel averaging of factor parameters that have none
    (replaced after they were laid out). Local: no collective.

    Args:
        model: the model handed to ``accelerator.prepare`` (a peft model or a transformers model). Without peft, or
            not sharded, nothing happens.

    Raises:
        AdapterLayoutError: naming the layer and how to add adapters so that they are laid out.
    """
    try:
        from peft.tuners.lora import LoraLayer  # noqa: F401
    except ImportError:
        return
    base = unwrap_peft(model)
    topo = topology(base)
    if not topo.is_sharded:
        return
    for copied in trainable_copies(topo, base):
        hook_copy(copied)
    for name, layer in lora_layers(base):
        missing = [a for a in layer.lora_A if not is_laid_out(layer, a)]
        if missing:
            raise AdapterLayoutError(
                f"LoRA adapter(s) {missing} on {name} of a model sharded at load time were added without shardadopt "
                f"laying them out ({topo.describe()}): their gradients would not be reduced over the data-parallel "
                f"ranks, or the first forward would crash. Call shardadopt.enable() before get_peft_model / "
                f"PeftModel.from_pretrained / add_adapter, or call shardadopt.adapters.lay_out_adapters(model) on "
                f"every rank right after adding them.")
        hook_trainable(layer)
