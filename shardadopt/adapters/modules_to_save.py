"""peft's ``modules_to_save`` on a sharded model: the trainable copy is whole, plain and replicated, like the factors.

peft's own ``copy.deepcopy`` cannot copy FSDP's and TP's shards, and a copied TP forward would still run the original
module: :func:`whole_copy` gathers the shards (collective) and drops transformers' TP forwards. Allowed: modules inside
a larger FSDP unit whose TP plan leaves their output whole (none, or ``lm_head``'s ``colwise_gather_output``);
refused: a module that is an FSDP unit of its own (an untied ``lm_head``: the FSDP plan's norm-and-head unit) or has
another TP plan. The copies' gradients are averaged over the data-parallel group (``data_parallel.hook_copy``).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from shardadopt.adapters.refusals import refusal, tp_plan_entry
from shardadopt.adapters.shapes import whole_tensor
from shardadopt.parallel.topology import Topology

# TP plans under which a module computes what its plain copy computes from the same (replicated) input
_WHOLE_OUTPUT_PLANS = (None, "colwise_gather_output")


def whole_copy(module: nn.Module) -> nn.Module:
    """What the patch gives peft as the ``modules_to_save`` copy of a sharded module (collective).

    Args:
        module: the original module, its parameters possibly FSDP or TP shards.

    Returns:
        A copy with every sharded parameter whole and plain and without transformers' TP forwards: a replicated
        trainable module, like the LoRA factors.
    """
    memo: dict[int, Any] = {id(p): nn.Parameter(whole_tensor(p).clone(), requires_grad=p.requires_grad)
                            for p in module.parameters() if getattr(p, "device_mesh", None) is not None}
    whole = copy.deepcopy(module, memo)
    for sub in whole.modules():
        sub.__dict__.pop("forward", None)  # transformers installs TP forwards as instance attributes
    return whole


def refuse_fsdp_unit_copy(module: nn.Module) -> None:
    """Refuse ``modules_to_save`` of a ``module`` that is (or holds) an FSDP unit of its own: FSDP refuses to be
    copied, and the copy would have to leave FSDP. Raises :class:`AdapterLayoutError`."""
    from torch.distributed.fsdp import FSDPModule

    units = [n or type(module).__name__ for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    if units:
        raise refusal(None, f"modules_to_save of a module that is an FSDP unit of its own ({units})", "Save only "
                      "modules inside a larger FSDP unit (lm_head, a score head), or target this module's Linear "
                      "layers with LoRA instead.")


def trainable_copies(topo: Topology, base_model: nn.Module) -> list[nn.Module]:
    """The trainable copies of ``modules_to_save`` in ``base_model`` (laid out as ``topo``), after refusing
    (:class:`AdapterLayoutError`) those that are not whole copies or whose TP plan changes what the module
    outputs."""
    from peft.utils.other import ModulesToSaveWrapper

    copies = []
    for name, wrapper in base_model.named_modules():
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        for sub, _ in wrapper.original_module.named_modules():
            plan = tp_plan_entry(base_model, f"{name}.{sub}".rstrip(".")) if topo.tp_size > 1 else None
            if plan not in _WHOLE_OUTPUT_PLANS:
                raise refusal(name, f"modules_to_save of a module with tensor-parallel plan {plan!r} (its copy "
                              "would compute on whole weights what the model expects sharded)", "Save only "
                              "modules that are not tensor parallel or gather their output (lm_head, a score "
                              "head), or target this module's Linear layers with LoRA instead.")
        for adapter, copied in wrapper.modules_to_save.items():
            sharded = [n for n, p in copied.named_parameters() if getattr(p, "device_mesh", None) is not None]
            if sharded:
                raise refusal(name, f"modules_to_save copy {adapter!r} holding shards ({sharded})", "Add "
                              "adapters after shardadopt.enable() (peft's copy of a sharded module is not whole).")
            copies.append(copied)
    return copies
