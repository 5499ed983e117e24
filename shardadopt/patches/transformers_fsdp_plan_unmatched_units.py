"""FSDP at load time: the repeated blocks of a vision tower (and other sub-models) become FSDP units of their own.

Upstream: not reported yet (proposal, ``upstream-fixes/transformers-fsdp-plan-unmatched-units@*.diff``). A model's FSDP
plan is merged from each sub-model's ``config.base_model_fsdp_plan``, which every config without one of its own inherits
as ``{"embed_tokens", "layers.*", "norm"}``. Vision towers name their blocks otherwise (Qwen2.5-VL ``blocks``,
SigLIP/CLIP ``encoder.layers``, Pixtral ``transformer.layers``), so on every release 5.15 .. 5.25 the rules meant
for them (``model.visual.layers.*``) match nothing (5.19+ warns that they "match nothing ... and will not be
applied"): the tower's blocks sit in the root FSDP unit and are gathered whole at every forward, the memory that
sharding at load time was meant to save. Training is right either way (the root unit's gradients are reduced like
any other), so a load is never refused for it.

The wrapper runs :func:`shardadopt.parallel.fsdpunits.complete_fsdp_plan` on the model ``maybe_distribute_model`` is
about to
shard with FSDP: where rules match nothing and the model has uncovered lists of the blocks its ``_no_split_modules``
name, each list becomes ``"<list>.*": "free_full_weight"`` and the rules that match nothing are dropped. A plan
whose rules all match is left alone. The probe builds a vision-tower-shaped model (a config without a plan, blocks
named ``blocks``) on the meta device with upstream's own code: a plan that misses its blocks means ``needed``; one
that covers them, or a Qwen2.5-VL vision config that declares ``blocks.*``, ``not-needed``.
"""

from __future__ import annotations

import logging

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported

QWEN_CONFIG = "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl"
_LOG = logging.getLogger("shardadopt")


def _probe_tower() -> object:
    """A vision-tower-shaped transformers model built with upstream's own code on the meta device: a config that
    declares no FSDP plan (as Qwen2.5-VL's, SigLIP's and CLIP's vision configs) and two blocks named ``blocks``.
    Defined here, not imported from a model type: the probe runs while transformers imports the modeling module
    of whichever model is being loaded, which may be half-initialised then."""
    import torch
    from transformers import PreTrainedConfig, PreTrainedModel

    class ProbeTowerConfig(PreTrainedConfig):
        model_type = "shardadopt_probe_tower"

    class ProbeBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    class ProbeTower(PreTrainedModel):
        config_class = ProbeTowerConfig
        _no_split_modules = ["ProbeBlock"]

        def __init__(self, config: ProbeTowerConfig) -> None:
            super().__init__(config)
            self.blocks = torch.nn.ModuleList([ProbeBlock(), ProbeBlock()])
            self.post_init()

    with torch.device("meta"):
        return ProbeTower(ProbeTowerConfig())


def probe() -> Probe:
    import importlib

    from shardadopt.parallel.fsdpunits import block_units, unmatched_rules
    from shardadopt.upstream.probing import undecided, upstream_function

    where = "PreTrainedModel.fsdp_plan of a vision tower whose config declares no FSDP plan"
    model = _probe_tower()
    plan = dict(getattr(model, "fsdp_plan", None) or {})
    if plan and not unmatched_rules(model, plan) and "blocks.*" in plan:
        return Probe(False, "the FSDP plan of a sub-model whose config declares none names its blocks")
    # upstream may instead declare the plan in the vision configs: the one the sweep's sample checks (Qwen2.5-VL)
    qwen = upstream_function(importlib.import_module(QWEN_CONFIG), "Qwen2_5_VLVisionConfig", QWEN_CONFIG)
    qwen_plan = getattr(qwen, "base_model_fsdp_plan", None) or {}
    if "blocks.*" in qwen_plan:
        return Probe(False, f"Qwen2.5-VL's vision config names its blocks in its FSDP plan ({sorted(qwen_plan)})")
    change = block_units(model, plan)
    if change is not None and change[0]:
        return Probe(True, f"a sub-model whose config declares no FSDP plan gets the default rules {sorted(plan)}, "
                           "which match none of its modules in a vision tower (Qwen2.5-VL visual.blocks, SigLIP "
                           "encoder.layers): its blocks stay in the root unit, gathered whole at every forward")
    raise undecided(where, "a plan that names the blocks (the fix) nor default rules that match nothing (the gap)")


def _maybe_distribute_model(wrapped, instance, args, kwargs):
    from shardadopt.parallel.fsdpunits import complete_fsdp_plan

    call = upstream.bind_maybe_distribute_model(wrapped, args, kwargs)
    model, config = call.model, call.distributed_config
    shards = (getattr(config, "fsdp_size", None) or 1) * (getattr(config, "dp_replicate_size", None) or 1)
    if model is not None and shards > 1:
        added = complete_fsdp_plan(model)
        if added:
            _LOG.info("shardadopt: FSDP units of their own for %s (upstream's FSDP plan rules matched none of "
                      "their modules)", ", ".join(sorted(added)))
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-fsdp-plan-unmatched-units",
    summary="FSDP at load time: the blocks of a vision tower (and of any sub-model whose FSDP plan rules match "
            "nothing) become FSDP units of their own instead of being gathered whole with the root at every forward",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers"),
    wrappers={upstream.MAYBE_DISTRIBUTE_MODEL: _maybe_distribute_model},
    probe_modules=("transformers.modeling_utils",),
    probe=probe,
    # the heads refusal checks the model as the load will shard it: after this patch completed its plans
    wraps_around=("transformers-tp-heads-refused",),
)
