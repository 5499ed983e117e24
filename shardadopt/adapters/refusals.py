"""What cannot be laid out on a sharded model is refused, naming the layer or option and the way out.

Refused before peft touches a shard where possible (:func:`check_config`, on the ``LoraConfig``), else per LoRA
layer when it is laid out (:func:`check_layer`): initialisations computed from the base weight, ``use_dora`` /
``lora_bias`` with ``target_parameters`` (the parameters themselves: ``experts.check_expert_layer``), base layers on
the expert mesh or with a TP plan other than colwise/rowwise, LoRA on sharded non-Linear layers, ``lora_bias`` on a
rowwise base, and tensor parallelism on transformers without DTensor TP (before 5.17).
Merging and (on TP loads) weighted combinations have refusal messages of their own.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from shardadopt.adapters.peft_layers import unwrap_peft
from shardadopt.parallel.topology import Topology, topology

# init_lora_weights values whose result does not depend on the base weight ("nora", peft 0.22: the default factors
# with lora_A's columns normalised, per expert on a ParamWrapper; peft 0.21 raises its own "Unknown initialization")
_WEIGHT_FREE_INITS = (True, False, "gaussian", "nora")
# why an initialisation is refused, where more than "computed from the whole base weight"
_WEIGHT_BASED = {
    "astra": "computed from the whole base weight and the activations preprocess_astra recorded, and it rewrites "
             "the base weight into the residual W - scaling * B @ A: on shards, from one rank's slice",
}

MERGE_REFUSAL = (
    "merging LoRA adapters into a model sharded at load time is not supported: the merged weights would be written "
    "into this rank's shard only. Export the adapter with model.save_pretrained(dir) (every rank), then merge in "
    "one process: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir).merge_and_unload().")

WEIGHTED_REFUSAL = (
    "add_weighted_adapter on a tensor-parallel load ({layout}) is not supported by shardadopt: peft combines the "
    "factors as whole tensors, and here they are sharded (the combination would crash or hold one rank's slice). "
    "Export the adapters with model.save_pretrained(dir) (every rank), combine them in one process "
    "(PeftModel.from_pretrained(base, dir), load_adapter, add_weighted_adapter, save_pretrained), and load the result "
    "onto the sharded model with load_adapter; on fsdp_size loads add_weighted_adapter works as in one process.")


class AdapterLayoutError(ValueError):
    """A PEFT adapter on a sharded model that shardadopt cannot make train like one process."""


def refusal(name: str | None, what: str, fix: str) -> AdapterLayoutError:
    """The error for ``what`` on LoRA layer ``name`` (None: a ``LoraConfig`` refused before peft injects), with
    ``fix``, the way out."""
    subject = f"LoRA adapter on {name}" if name else "LoraConfig"
    return AdapterLayoutError(f"{subject}: {what} on a model sharded at load time is not supported by shardadopt "
                              f"(it would train wrong or crash). {fix}")


def refuse_weighted_adapter(model: nn.Module) -> None:
    """Refuse ``add_weighted_adapter`` on a tensor-parallel load (:data:`WEIGHTED_REFUSAL`); data-parallel loads
    hold every factor whole and identical on every rank, where peft's combination runs as in one process.

    Args:
        model: the peft model (or the transformers model under it) the adapters would be combined on.

    Raises:
        AdapterLayoutError: when the model is tensor parallel.
    """
    topo = topology(unwrap_peft(model))
    if topo.tp_size > 1:
        raise AdapterLayoutError(WEIGHTED_REFUSAL.format(layout=f"tp_size={topo.tp_size}"))


def dtensor_tensor_parallel() -> bool:
    """Whether the installed transformers shards TP layers as DTensors with per-style forwards, which adapters are
    laid out with.

    Returns:
        True on transformers 5.17+ (the module ``transformers.distributed.tensor_parallel``, its style registry and
        ``apply_tensor_parallelism``: what peft checks too).
    """
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism  # noqa: F401
    except ImportError:
        return False
    return True


def check_config(config: Any) -> None:
    """Refuse, before peft injects anything, a ``LoraConfig`` whose options cannot be laid out on a sharded model
    (peft would run them on shards: weight-based initialisations read the whole base weight).

    Args:
        config: a peft ``LoraConfig`` (or None: nothing to check).

    Raises:
        AdapterLayoutError: for ``init_lora_weights`` computed from the base weight (PiSSA, OLoRA, LoftQ, EVA,
            CorDA, LoRA-GA; Astra, which rewrites the base weight too) and for ``use_dora`` / ``lora_bias`` with
            ``target_parameters``.
    """
    init = getattr(config, "init_lora_weights", True)
    if init not in _WEIGHT_FREE_INITS:
        why = _WEIGHT_BASED.get(str(init).lower(), "computed from the whole base weight")
        raise refusal(None, f"init_lora_weights={init!r} ({why})",
                      "Use init_lora_weights=True, \"gaussian\" or \"nora\", or initialise in one process, save it "
                      "(for an initialisation that rewrites the base weight, with save_pretrained's "
                      "path_initial_model_for_weight_conversion: a LoRA adapter on the unchanged base), and load it "
                      "onto the sharded model with PeftModel.from_pretrained.")
    if getattr(config, "target_parameters", None) and (getattr(config, "use_dora", False)
                                                       or getattr(config, "lora_bias", False)):
        raise refusal(None, f"use_dora / lora_bias with target_parameters={config.target_parameters!r} (peft's "
                      "ParamWrapper on fused expert tensors has neither; peft also lands here when a target_modules "
                      "name matches an experts module's parameter)", "Use use_dora=False and lora_bias=False, or "
                      "leave the experts out of target_modules.")


def tp_plan_entry(base_model: nn.Module, name: str) -> str | None:
    """The model's TP plan entry for module ``name`` (layer numbers as ``*``), as transformers applied it."""
    plan = getattr(base_model, "tp_plan", None) or {}
    return plan.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name))


def _tp_style(weight: Any, topo: Topology) -> str:
    """How a base layer's weight is laid out over tensor parallelism: "none", "colwise", "rowwise", or a
    description of anything else."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if topo.tp_size == 1:
        return "none"
    if not isinstance(weight, DTensor):
        return "plain (not a DTensor: transformers before 5.17 keeps TP shards as plain tensors)"
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return "none" if not {"ep", "efsdp"} & set(names) else f"expert mesh {names}"
    placement = weight.placements[names.index("tp")]
    if isinstance(placement, Replicate):
        return "none"
    if isinstance(placement, Shard) and placement.dim == 0:
        return "colwise"
    if isinstance(placement, Shard) and placement.dim == 1:
        return "rowwise"
    return f"placement {placement} on the tp mesh"


def _placement_name(param: Any) -> str:
    """How peft laid out a factor: "replicated" (a plain tensor), "colwise", "rowwise", or the placements."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return "replicated"
    names = param.device_mesh.mesh_dim_names or ()
    if names != ("tp",) or len(param.placements) != 1 or not isinstance(param.placements[0], Shard):
        return f"{param.placements} on {names}"
    return "colwise" if param.placements[0].dim == 0 else "rowwise"


def check_layer(name: str, layer: Any, adapter: str, topo: Topology, base_model: nn.Module) -> str:
    """Refuse what cannot be laid out of ``adapter`` on the LoRA layer ``name``.

    Args:
        name: the layer's name in ``base_model`` (for its TP plan entry and the message).
        layer: peft's LoRA layer.
        adapter: the adapter's name on it.
        topo: the model's topology.
        base_model: the transformers model (its ``tp_plan``).

    Returns:
        The base layer's TP style: "none", "colwise" or "rowwise" (peft's ``ParamWrapper``, LoRA on a parameter,
        is checked by ``shardadopt.adapters.experts.check_expert_layer``).

    Raises:
        AdapterLayoutError: naming the layer and the way out.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper

    if isinstance(layer, ParamWrapper):  # callers check these with experts.check_expert_layer
        raise refusal(name, "adapters on parameters (target_parameters) checked as a module layer",
                      "Lay the model out with shardadopt.adapters.lay_out_adapters.")
    base = layer.get_base_layer()
    if topo.tp_size > 1 and not dtensor_tensor_parallel():
        raise refusal(name, "tensor parallelism on transformers before 5.17 (TP shards are plain tensors there)",
                      "Upgrade transformers to 5.17 or newer, or load with fsdp_size instead of tp_size.")
    names = tuple(getattr(getattr(getattr(base, "weight", None), "device_mesh", None), "mesh_dim_names", None) or ())
    if {"ep", "efsdp"} & set(names):
        raise refusal(name, f"a base layer held by the expert mesh {names}", "Leave expert modules out of "
                      "target_modules.")
    if not isinstance(layer, LoraLinear):
        if topo.tp_size == 1 and not any(getattr(p, "device_mesh", None) is not None for p in base.parameters()):
            return "none"
        raise refusal(name, f"LoRA on a sharded {type(base).__name__} (only nn.Linear bases are laid out)",
                      "Target Linear projections only (target_modules=[\"q_proj\", ...]).")
    style = _tp_style(base.weight, topo)
    plan = tp_plan_entry(base_model, name) if topo.tp_size > 1 else None
    if plan is not None and plan not in ("colwise", "rowwise"):
        raise refusal(name, f"a base layer with tensor-parallel plan {plan!r}", "Only \"colwise\" and "
                      "\"rowwise\" plans are supported: leave this module out of target_modules, or load with "
                      "fsdp_size instead of tp_size.")
    if style not in ("none", "colwise", "rowwise") or (plan or "none") != style:
        raise refusal(name, f"a tensor-parallel base layer laid out as {style} (plan {plan!r})",
                      "Only colwise and rowwise TP plans are supported: leave this module out of target_modules, "
                      "or load with fsdp_size instead of tp_size.")
    if style == "rowwise" and layer.lora_bias.get(adapter, False):
        raise refusal(name, "lora_bias=True on a rowwise base", "Use lora_bias=False.")
    found = (_placement_name(layer.lora_A[adapter].weight), _placement_name(layer.lora_B[adapter].weight))
    whole = (layer.lora_A[adapter].weight.shape == (layer.r[adapter], layer.in_features)
             and layer.lora_B[adapter].weight.shape == (layer.out_features, layer.r[adapter])
             and (layer.in_features, layer.out_features) == (base.weight.shape[1], base.weight.shape[0]))
    if found != ("replicated", "replicated") or not whole:
        raise refusal(name, f"factors peft already laid out (lora_A {found[0]}, lora_B {found[1]}, sized "
                      f"{layer.in_features}x{layer.out_features} for a {tuple(base.weight.shape)} base)",
                      "Add adapters after shardadopt.enable(), or inside shardadopt.adapters.global_adapter_shapes() "
                      "followed by lay_out_adapters(model).")
    return style
