"""transformers-fsdp-plan-unmatched-units: a sub-model whose FSDP plan (the inherited default) names none of its
modules gets a unit per block of its block lists, so a vision tower's blocks are not gathered whole with the root."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import unittest

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.testing_utils import require_torch


@require_torch
class Qwen2_5_VLFsdpPlanTest(unittest.TestCase):
    def test_vision_blocks_are_fsdp_units(self):
        config = Qwen2_5_VLConfig(
            text_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 64,
                "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            },
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32},
        )
        model = Qwen2_5_VLForConditionalGeneration(config)
        plan = model.fsdp_plan
        # the vision tower names its blocks `blocks`, not the default plan's `layers`
        self.assertEqual(plan.get("model.visual.blocks.*"), "free_full_weight")
        self.assertEqual(plan.get("model.language_model.layers.*"), "free_full_weight")
        # the rules the vision tower inherited from the default plan, which name nothing in it, are gone
        self.assertNotIn("model.visual.layers.*", plan)
'''

FUNCTION = '''

def add_block_units_to_fsdp_plan(model: nn.Module, fsdp_plan: dict[str, str]) -> dict[str, str]:
    """
    Give the repeated blocks of `model` FSDP units of their own when the plan's rules name none of its modules.

    A config without its own `base_model_fsdp_plan` inherits `{"embed_tokens", "layers.*", "norm"}`, which names
    nothing in most vision towers (Qwen2.5-VL `blocks`, SigLIP `encoder.layers`, Pixtral `transformer.layers`): their
    blocks would stay in the root unit and be gathered whole at every forward. When rules match nothing, each
    `nn.ModuleList` of one class whose items are (or hold) a class of `_no_split_modules`, and that no rule covers,
    becomes `"<list>.*": "free_full_weight"`, and the rules that match nothing are dropped.
    """
    names = set()
    for name, _ in [*model.named_modules(), *model.named_parameters()]:
        names.update((name, replace_layer_number_by_wildcard(name)))
    unmatched = [rule for rule in fsdp_plan if rule not in names]
    if not unmatched:
        return fsdp_plan
    block_classes = {cls for module in model.modules() for cls in (getattr(module, "_no_split_modules", None) or ())}
    block_lists = []
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) > 0
            and len({type(item) for item in module}) == 1
            and all(any(type(inner).__name__ in block_classes for inner in item.modules()) for item in module)
            and not any(name.startswith(outer + ".") for outer in block_lists)
        ):
            block_lists.append(name)
    if not block_lists:
        return fsdp_plan
    matched = [rule for rule in fsdp_plan if rule not in unmatched]

    def covered(name: str) -> bool:
        parts = name.split(".")
        enclosing = {replace_layer_number_by_wildcard(".".join(parts[:i])) for i in range(1, len(parts) + 1)}
        return any(
            replace_layer_number_by_wildcard(rule) in enclosing or rule.startswith(name + ".") for rule in matched
        )

    plan = {rule: style for rule, style in fsdp_plan.items() if rule not in unmatched}
    plan.update({f"{name}.*": "free_full_weight" for name in block_lists if not covered(name)})
    return plan
'''

VERIFY = "\n\ndef verify_fsdp_plan(module_names: list[str], fsdp_plan: dict[str, str] | None) -> None:\n"
MERGE = '                self._fsdp_plan.update({f"{name}.{k}": v for k, v in plan.copy().items()})\n'
MERGE_NEW = MERGE + '''
        # A sub-model whose config inherits the default FSDP plan (a vision tower) names its blocks otherwise.
        from .fsdp import add_block_units_to_fsdp_plan

        self._fsdp_plan = add_block_units_to_fsdp_plan(self, self._fsdp_plan)
'''

EDITS = (
    Edit("src/transformers/distributed/fsdp.py", VERIFY, FUNCTION + VERIFY),
    Edit("src/transformers/distributed/mixin.py", MERGE, MERGE_NEW),
)
NEW_FILES = (NewFile("tests/models/qwen2_5_vl/test_fsdp_plan.py", TEST),)

FIX = Fix(
    id="transformers-fsdp-plan-unmatched-units",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.25.0)",
    summary="""
        A model's FSDP plan is merged from each sub-model's config.base_model_fsdp_plan. Every config without its
        own inherits {"embed_tokens", "layers.*", "norm"}, which names nothing in the vision towers of most VLMs
        (Qwen2.5-VL's blocks, SigLIP's encoder.layers, Pixtral's transformer.layers): loaded with
        DistributedConfig(fsdp_size=N), their blocks are no FSDP unit of their own, stay in the root unit and are
        gathered whole at every forward (transformers warns that the rules "match nothing"). Training is right, but
        the memory sharding was meant to save is spent (a Qwen2.5-VL with a 162M-parameter tower, fp32, 2 ranks:
        a training step peaks at 3.9-4.2 GiB of anonymous memory per rank, 2.3 GiB with the blocks as units).

        init_parallel_plans now completes the plan of each model whose rules match nothing: every ModuleList of
        one class whose items are (or hold) a class of _no_split_modules, and which no rule covers, becomes
        "<list>.*": "free_full_weight", and the rules that match nothing are dropped. Plans whose rules match are
        untouched. The test builds a tiny Qwen2.5-VL and checks that its vision blocks are in the plan.
    """,
    # the same change; upstream changed the code around it in 5.19 (mixin.py) and 5.23 (fsdp.py)
    variants=tuple(Variant(since=since, edits=EDITS, new_files=NEW_FILES) for since in ("5.15.0", "5.19.0", "5.23.0")),
)
