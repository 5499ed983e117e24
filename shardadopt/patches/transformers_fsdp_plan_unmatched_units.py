"""FSDP at load time: the repeated blocks of a vision tower (and other sub-models) become FSDP units of their own.

Upstream: not reported yet (proposal, ``patches/transformers-fsdp-plan-unmatched-units.diff``). A model's FSDP plan
is merged from each sub-model's ``config.base_model_fsdp_plan``, which every config without one of its own inherits
as ``{"embed_tokens", "layers.*", "norm"}``. Vision towers name their blocks otherwise (Qwen2.5-VL ``blocks``,
SigLIP/CLIP ``encoder.layers``, Pixtral ``transformer.layers``), so on every release 5.15 .. 5.25 the rules meant
for them (``model.visual.layers.*``) match nothing (5.19+ warns that they "match nothing ... and will not be
applied"): the tower's blocks sit in the root FSDP unit and are gathered whole at every forward, the memory that
sharding at load time was meant to save. Training is right either way (the root unit's gradients are reduced like
any other), so a load is never refused for it.

The wrapper runs :func:`shardadopt.fsdpunits.complete_fsdp_plan` on the model ``maybe_distribute_model`` is about to
shard with FSDP: where rules match nothing and the model has uncovered lists of the blocks its ``_no_split_modules``
name, each list becomes ``"<list>.*": "free_full_weight"`` and the rules that match nothing are dropped. A plan
whose rules all match is left alone. The probe builds a small Qwen2.5-VL vision tower on the meta device with
upstream's own code: a plan that misses its ``blocks`` means ``needed``, one that covers them ``not-needed``.
"""

from __future__ import annotations

import logging

from shardadopt.registry import Patch, Probe, Target
from shardadopt.versions import supported

ID = "transformers-fsdp-plan-unmatched-units"
MODULE = "transformers.distributed.mixin"
PROBE_TYPE = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
_LOG = logging.getLogger("shardadopt")


def probe() -> Probe:
    import importlib

    import torch

    from shardadopt.fsdpunits import block_units, unmatched_rules
    from shardadopt.probing import undecided, upstream_function

    where = f"{PROBE_TYPE}.Qwen2_5_VisionTransformerPretrainedModel.fsdp_plan"
    modeling = importlib.import_module(PROBE_TYPE)
    tower = upstream_function(modeling, "Qwen2_5_VisionTransformerPretrainedModel", where)
    config = upstream_function(importlib.import_module(PROBE_TYPE.replace("modeling_", "configuration_")),
                               "Qwen2_5_VLVisionConfig", where)
    with torch.device("meta"):
        model = tower(config(depth=2, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16))
    plan = dict(getattr(model, "fsdp_plan", None) or {})
    change = block_units(model, plan)
    if change is not None and change[0]:
        return Probe(True, f"the FSDP plan of a vision tower ({sorted(plan)}) matches none of its modules: its "
                           f"blocks ({', '.join(change[0])}) stay in the root unit, gathered whole at every forward")
    if plan and not unmatched_rules(model, plan):
        return Probe(False, f"the FSDP plan of a vision tower names its blocks ({sorted(plan)})")
    raise undecided(where, "a plan that names the vision blocks (the fix) nor one whose rules match nothing while "
                           "the tower has a list of blocks (the gap)")


def _maybe_distribute_model(wrapped, instance, args, kwargs):
    from shardadopt.fsdpunits import complete_fsdp_plan

    bound = dict(zip(("model", "distributed_config", "mesh"), args)) | kwargs
    model, config = bound.get("model"), bound.get("distributed_config")
    shards = (getattr(config, "fsdp_size", None) or 1) * (getattr(config, "dp_replicate_size", None) or 1)
    if model is not None and shards > 1:
        added = complete_fsdp_plan(model)
        if added:
            _LOG.info("shardadopt: FSDP units of their own for %s (upstream's FSDP plan rules matched none of "
                      "their modules)", ", ".join(sorted(added)))
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id=ID,
    summary="FSDP at load time: the blocks of a vision tower (and of any sub-model whose FSDP plan rules match "
            "nothing) become FSDP units of their own instead of being gathered whole with the root at every forward",
    upstream="proposal for transformers main (not reported yet); patches/transformers-fsdp-plan-unmatched-units.diff",
    requires=supported("transformers"),
    wrappers={Target(MODULE, "DistributedMixin.maybe_distribute_model"): _maybe_distribute_model},
    probe_modules=("transformers.modeling_utils",),
    probe=probe,
)
