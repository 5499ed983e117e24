"""transformers-fsdp-plan-unmatched-units: the FSDP plan of a VLM gets a unit per vision block.

One process, models built on the meta device: which rules :func:`shardadopt.fsdpunits.complete_fsdp_plan` adds and
drops for vision towers named in each way upstream names them, and that it leaves a matching plan alone. The
multi-process check (the units a load with ``fsdp_size=2`` really has, and training equal to one process) is in
``tests/project/test_arch_sweep.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shardadopt.fsdpunits import complete_fsdp_plan, unmatched_rules
from shardadopt.testing.archs import IMAGE_TEXT, model_class, tiny_config

# model type -> the block lists of its vision tower that upstream's plan misses
VISION_BLOCKS = {
    "qwen2_5_vl": ["model.visual.blocks"],  # ``blocks`` of the Qwen vision tower
    "gemma3": ["model.vision_tower.encoder.layers"],  # SigLIP: ``encoder.layers``, its layer class in no-split
    "llava": ["model.vision_tower.encoder.layers"],  # CLIP
    "idefics3": ["model.vision_model.encoder.layers"],  # no-split names the attention class inside each layer
    "mistral3": ["model.vision_tower.transformer.layers"],  # Pixtral
}


def _meta_model(model_type: str):
    config = tiny_config(model_type, task=IMAGE_TEXT)
    with torch.device("meta"):
        return model_class(model_type, IMAGE_TEXT)(config)


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # transformers' config warnings about the tiny sizes
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("model_type", sorted(VISION_BLOCKS))
def test_vision_blocks_become_units_and_rules_that_match_nothing_go(model_type):
    model = _meta_model(model_type)
    plan = model.fsdp_plan
    before = dict(plan)
    assert unmatched_rules(model, before), f"upstream's {model_type} plan matches every module now: {before}"
    language_units = {rule: style for rule, style in before.items() if rule not in unmatched_rules(model, before)}
    added = complete_fsdp_plan(model)
    assert added == {f"{name}.*": "free_full_weight" for name in VISION_BLOCKS[model_type]}
    assert model.fsdp_plan is plan, "edited in place: the dict transformers reads when it applies FSDP"
    assert plan == language_units | added  # the language model's units kept, the vision blocks added
    assert not unmatched_rules(model, plan)
    assert complete_fsdp_plan(model) is None  # a plan that matches is left alone


def test_a_plan_that_matches_is_left_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    before = dict(model.fsdp_plan)
    assert complete_fsdp_plan(model) is None
    assert model.fsdp_plan == before


def test_rules_that_match_nothing_stay_without_block_lists():
    """A model with no list of its no-split blocks: nothing to say what the rules were meant for."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])  # not a decoder layer
    model.fsdp_plan["model.blocks.*"] = "free_full_weight"
    before = dict(model.fsdp_plan)
    assert complete_fsdp_plan(model) is None
    assert model.fsdp_plan == before


def test_probe_reads_the_qwen_vision_tower():
    from shardadopt.patches.transformers_fsdp_plan_unmatched_units import probe

    found = probe()
    assert found.needed, found.reason  # every release 5.15 .. 5.25 misses the tower's blocks
    assert "visual.blocks" in found.reason
