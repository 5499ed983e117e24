"""transformers-tp-tied-lm-head: a vision-language model's tied LM head gets the TP plan entry a causal LM's has.

One process, models built on the meta device from the tiny configs the architecture sweep uses. Where the installed
release's class plan has no entry for its tied head (5.15 .. 5.19), :func:`complete_tied_head_plan` adds one; where it
has one (5.20+), the entry upstream gives is the one shardadopt would add. The multi-process check (``tp_size=2``
training and ``generate`` with images equal to one process, Gemma 3 on 5.15 failing both before) is
``tests/project/test_arch_sweep.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from shardadopt.loadtime.plans import TIED_HEAD_STYLE, complete_tied_head_plan
from shardadopt.patches import transformers_tp_tied_lm_head as patch
from shardadopt.testing.archs import IMAGE_TEXT, model_class, tiny_config

TIED = ("gemma3", "paligemma")  # Gemma language models tie their word embeddings


def _meta_model(model_type: str, **values):
    config = tiny_config(model_type, task=IMAGE_TEXT)
    for key, value in values.items():
        setattr(config.get_text_config(), key, value)
        setattr(config, key, value)
    with torch.device("meta"):
        return model_class(model_type, IMAGE_TEXT)(config)


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # transformers' config warnings about the tiny sizes
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("model_type", TIED)
def test_a_tied_head_gets_the_entry_upstream_gives_it_from_5_20(model_type):
    model = _meta_model(model_type)
    plan = model.tp_plan
    embedding = next(rule for rule in plan if rule.endswith("embed_tokens"))
    assert plan[embedding] == "embedding_rowwise", "tying shards the shared table by vocabulary"
    if patch.probe().needed:
        assert "lm_head" not in plan, plan
        assert complete_tied_head_plan(model, plan) == "lm_head"
        assert model.tp_plan is plan and plan["lm_head"] == TIED_HEAD_STYLE, "edited in place, as upstream's"
    else:
        assert plan.get("lm_head") == TIED_HEAD_STYLE, "the style upstream's fix gives is the one added on 5.15-5.19"
    assert complete_tied_head_plan(model, plan) is None, "a head the plan names is left alone"


def test_an_untied_head_is_left_alone():
    model = _meta_model("gemma3", tie_word_embeddings=False)
    plan = dict(model.tp_plan)
    plan.pop("lm_head", None)
    assert complete_tied_head_plan(model, plan) is None
    assert "lm_head" not in plan


def test_a_plan_the_user_passes_is_left_as_given():
    from transformers.distributed import DistributedConfig

    model = _meta_model("gemma3")
    model.tp_plan.pop("lm_head", None)
    given = {"model.language_model.layers.*.mlp.down_proj": "rowwise"}
    seen = []
    patch._maybe_distribute_model(lambda *args, **kwargs: seen.append(args), None,
                                  (model, DistributedConfig(tp_size=2, tp_plan=given), None), {})
    assert seen and "lm_head" not in model.tp_plan
    patch._maybe_distribute_model(lambda *args, **kwargs: seen.append(args), None,
                                  (model, DistributedConfig(tp_size=2), None), {})
    assert model.tp_plan["lm_head"] == TIED_HEAD_STYLE
