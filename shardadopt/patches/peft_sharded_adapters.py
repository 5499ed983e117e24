"""PEFT LoRA adapters on models sharded at load time train like one process (``shardadopt.adapters``).

Upstream (peft 0.21.2, ``peft/tuners/tuners_utils.py``) sizes a LoRA factor on a tensor-parallel base by the local
shard, and nothing reduces adapter gradients over the data-parallel ranks::

    mesh_dim_names = module.weight.device_mesh.mesh_dim_names or ()
    if set(mesh_dim_names) <= {"fsdp"}:
        in_features, out_features = module.in_features, module.out_features
    else:
        out_features, in_features = module.weight.to_local().shape

On ``fsdp_size=N`` each rank trains its own adapter, silently (transformers #48792 / #48873); on ``tp_size=N``,
fsdp x tp and EP the first forward crashes (a row-parallel ``lora_A`` declares its local ``in_features``). peft 0.22
sizes a base with a transformers TP plan (``_hf_tp_plan``, stamped from ``get_tp_plan_and_mesh``) at full size and
shards the factors itself; it still reduces no adapter gradient, so the probe answers "needed" from that half alone
there. Inside the injection this patch gives peft no plan, so peft neither stamps nor shards (no double sharding):
the factors are sized globally and laid out once, by shardadopt, on both releases. This patch wraps:

- ``BaseTuner.inject_adapter`` (what ``get_peft_model``, ``PeftModel.from_pretrained``, ``add_adapter`` and
  ``load_adapter`` go through): factors are sized by the base layer's global shape while peft injects, then
  :func:`shardadopt.adapters.lay_out_adapters` lays them out and hooks their data-parallel averaging, or refuses;
- ``LoraLayer._get_in_out_features``: the global shape, inside that injection only; ``get_tp_plan_and_mesh``: no
  plan there, so peft leaves the factors whole (each rank's own init) for shardadopt to broadcast and shard;
- ``DoraLinearLayer.get_weight_norm``: inside that injection, on the whole base weight (DoRA's initial magnitude;
  peft would add a DTensor shard and a plain tensor);
- ``ModulesToSaveWrapper.update``: inside that injection, the trainable copy of a sharded module is made whole
  (:func:`shardadopt.adapters.whole_copy`; peft's ``deepcopy`` of FSDP/TP shards fails);
- ``PeftModel.save_pretrained``: full tensors, written by global rank 0 only, every rank leaving after it wrote;
- ``BaseTuner.merge_and_unload`` / ``merge_adapter``: refused on sharded models (:data:`adapters.MERGE_REFUSAL`);
- ``LoraModel.add_weighted_adapter``: refused on tensor-parallel loads (:data:`adapters.WEIGHTED_REFUSAL`: peft
  combines whole factors); on data-parallel loads the factors are whole and equal on every rank, peft's path.

Models that are not sharded take peft's exact path.
"""

from __future__ import annotations

import ast

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

_TUNERS = "peft.tuners.tuners_utils"
_PEFT_MODEL = "peft.peft_model"
_REDUCTIONS = {"all_reduce", "register_post_accumulate_grad_hook", "fully_shard", "lay_out_adapters"}


def _inject_adapter(wrapped, instance, args, kwargs):
    from shardadopt.adapters import (
        check_config,
        global_adapter_shapes,
        is_sharded_base,
        lay_out_adapters,
    )

    model = args[0] if args else kwargs.get("model")
    if not is_sharded_base(model):
        return wrapped(*args, **kwargs)
    adapter_name = args[1] if len(args) > 1 else kwargs.get("adapter_name")
    check_config(instance.peft_config.get(adapter_name))  # before peft runs a weight-based init on shards
    with global_adapter_shapes():
        result = wrapped(*args, **kwargs)
    lay_out_adapters(instance)
    return result


def _in_out_features(wrapped, instance, args, kwargs):
    from shardadopt.adapters.shapes import global_in_out_features, global_shape_requested

    if global_shape_requested():
        found = global_in_out_features(args[0] if args else kwargs["module"])
        if found is not None:
            return found
    return wrapped(*args, **kwargs)


def _tp_plan_and_mesh(wrapped, instance, args, kwargs):
    from shardadopt.adapters.shapes import global_shape_requested

    # shardadopt.adapters lays the factors out itself, after rank 0's values are everywhere
    return (None, None) if global_shape_requested() else wrapped(*args, **kwargs)


def _dora_weight_norm(wrapped, instance, args, kwargs):
    from shardadopt.adapters.shapes import global_shape_requested, whole_weight

    if global_shape_requested():  # DoRA's initial magnitude: the norm of the whole base weight, not of a shard
        names = ("weight", "lora_weight", "scaling", "adapter_name")
        kwargs = {**dict(zip(names, args)), **kwargs}
        kwargs["weight"] = whole_weight(kwargs["weight"])
        return wrapped(**kwargs)
    return wrapped(*args, **kwargs)


def _modules_to_save_update(wrapped, instance, args, kwargs):
    from shardadopt.adapters.modules_to_save import refuse_fsdp_unit_copy, whole_copy
    from shardadopt.adapters.shapes import global_shape_requested

    adapter_name = args[0] if args else kwargs["adapter_name"]
    sharded = any(getattr(p, "device_mesh", None) is not None for p in instance.original_module.parameters())
    if global_shape_requested() and sharded and adapter_name not in instance.modules_to_save:
        refuse_fsdp_unit_copy(instance.original_module)
        # peft then skips its deepcopy; a copy tied to a sharded module (ensure_weight_tying) is refused after
        if kwargs.get("tied_module") is None and len(args) < 2:
            instance.modules_to_save[adapter_name] = whole_copy(instance.original_module)
    return wrapped(*args, **kwargs)


def _save_pretrained(wrapped, instance, args, kwargs):
    import torch.distributed as dist

    from shardadopt.adapters import full_adapter_tensors, is_sharded_base
    from shardadopt.fence import fenced

    if not is_sharded_base(instance):
        return wrapped(*args, **kwargs)
    # every rank gathers (collective), rank 0 writes; one rank raising makes every rank raise, not wait
    with fenced("PeftModel.save_pretrained"):
        kwargs = {"state_dict": full_adapter_tensors(instance), "is_main_process": dist.get_rank() == 0, **kwargs}
        result = wrapped(*args, **kwargs)
        dist.barrier()
    return result


def _refuse_merge(wrapped, instance, args, kwargs):
    from shardadopt.adapters import MERGE_REFUSAL, AdapterLayoutError, is_sharded_base

    if is_sharded_base(instance.model):
        raise AdapterLayoutError(MERGE_REFUSAL)
    return wrapped(*args, **kwargs)


def _refuse_weighted(wrapped, instance, args, kwargs):
    from shardadopt.adapters import is_sharded_base, refuse_weighted_adapter

    if is_sharded_base(instance.model):
        refuse_weighted_adapter(instance.model)  # before peft adds the new adapter's config
    return wrapped(*args, **kwargs)


def _sizes_tp_bases_locally(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``_get_in_out_features`` sizes a transformers-TP base by its local shard: a ``to_local()`` call not
    gated on the base's transformers TP plan (``upstream.PEFT_TP_PLAN_ATTRIBUTE``). peft 0.21 reads the local shape
    on every non-fsdp mesh; 0.22 only on a TP mesh without that plan (a layout peft shards itself)."""
    from shardadopt.upstream.probing import calls, enclosing_tests, names

    return any(not any(upstream.PEFT_TP_PLAN_ATTRIBUTE in names(test) for test in enclosing_tests(function, call))
               for call in calls(function, "to_local"))


def probe() -> Probe:
    """Read peft: ``_get_in_out_features`` sizing transformers-TP bases by ``to_local()`` (peft 0.21; 0.22 gates that
    on ``_hf_tp_plan`` being unset) and ``inject_adapter`` reducing no adapter gradient (both releases) are the broken
    shapes; the reason names the halves this release needs."""
    from peft.tuners.tuners_utils import BaseTuner

    from shardadopt.upstream.probing import names, source_tree, upstream_function

    sizes_local = _sizes_tp_bases_locally(source_tree(upstream.peft_in_out_features()))
    reduces = bool(_REDUCTIONS & names(source_tree(upstream_function(BaseTuner, "inject_adapter", PATCH.id))))
    if reduces and not sizes_local:
        return Probe(False, "peft sizes adapters by the global shape and reduces their gradients")
    why = ["sizes LoRA factors of a tensor-parallel base by its local shard"] if sizes_local else []
    why += [] if reduces else ["reduces no adapter gradient over the data-parallel ranks"]
    if not sizes_local:
        why[-1] += " (it sizes tensor-parallel bases at full size itself)"
    return Probe(True, "peft " + " and ".join(why))


PATCH = Patch(
    id="peft-sharded-adapters",
    summary="PEFT LoRA on sharded models: adapters laid out like their base layers, dp-averaged, exported whole",
    upstream="anticipates huggingface/peft (DTensor TP since #3079 sizes by the local shard); "
             "huggingface/transformers#48792 / #48873 (FSDP adapters never reduced)",
    requires=supported("peft", "transformers", "torch"),
    wrappers={Target(_TUNERS, "BaseTuner.inject_adapter"): _inject_adapter,
              upstream.PEFT_LORA_IN_OUT_FEATURES: _in_out_features,
              Target("peft.tuners.lora.model", "get_tp_plan_and_mesh"): _tp_plan_and_mesh,
              Target("peft.tuners.lora.dora", "DoraLinearLayer.get_weight_norm"): _dora_weight_norm,
              Target("peft.utils.other", "ModulesToSaveWrapper.update"): _modules_to_save_update,
              Target(_PEFT_MODEL, "PeftModel.save_pretrained"): _save_pretrained,
              Target(_TUNERS, "BaseTuner.merge_and_unload"): _refuse_merge,
              Target(_TUNERS, "BaseTuner.merge_adapter"): _refuse_merge,
              Target("peft.tuners.lora.model", "LoraModel.add_weighted_adapter"): _refuse_weighted},
    probe=probe,
)
