"""transformers-fsdp-plan-unmatched-units: the FSDP plan of a VLM gets a unit per vision block; and the units a call
outside the root's forward reads (transformers-fsdp-generate-encoder-unshard).

One process, models built on the meta device: which rules :func:`shardadopt.parallel.fsdpunits.complete_fsdp_plan` adds
and drops for vision towers named in each way upstream names them, and that it leaves a matching plan alone. The
multi-process checks of the plan (the units a load with ``fsdp_size=2`` really has, and training equal to one process)
and of generate with images are in ``tests/project/test_arch_sweep.py``;
:func:`shardadopt.parallel.fsdpunits.gathered_for_call` on 2 ranks is checked here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shardadopt.parallel.fsdpunits import complete_fsdp_plan, unmatched_rules
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


def test_a_call_into_a_model_without_fsdp_units_gathers_nothing():
    from shardadopt.parallel.fsdpunits import enclosing_units, gathered_for_call

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert enclosing_units(model, model[1]) == [] and enclosing_units(model, torch.nn.Linear(2, 2)) == []
    with gathered_for_call(model, model[1]):
        assert model[1](torch.ones(1, 2)).shape == (1, 2)


def gathered_call_rank() -> dict[str, bool]:
    """On each rank: a root unit holding a plain layer and an inner unit (a tower's block), as transformers shards a
    VLM; a call into a submodule that is no forward of the root, inside :func:`gathered_for_call`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from shardadopt.parallel.fsdpunits import enclosing_units, gathered_for_call

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    tower = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # [0]: the root's, [1]: a unit
    model = torch.nn.Sequential(tower, torch.nn.Linear(4, 4))
    expected = tower(torch.ones(2, 4))
    fully_shard(tower[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded_before = isinstance(tower[0].weight, DTensor)
    with torch.no_grad(), gathered_for_call(model, tower):
        whole_inside = not isinstance(tower[0].weight, DTensor)
        got = tower(torch.ones(2, 4))  # the root's layer read outside any forward of the root; the unit's own runs
    return {"units": enclosing_units(model, tower) == [model], "sharded before": sharded_before,
            "whole inside": whole_inside, "as one process": torch.allclose(got, expected),
            "resharded after": isinstance(tower[0].weight, DTensor),
            "root forward after": model(torch.ones(2, 4)).shape == (2, 4)}


@pytest.mark.multiproc
def test_a_call_outside_the_roots_forward_reads_gathered_parameters_and_reshards(pool2):
    """What transformers-fsdp-generate-encoder-unshard relies on: the enclosing units are whole for the call and
    sharded again after, the inner unit gathers itself, and the root's first forward afterwards still works (the
    root took its role first)."""
    for rank, result in enumerate(pool2.run(gathered_call_rank, timeout=120)):
        assert all(result.values()), (rank, result)
