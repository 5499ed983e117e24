"""shardadopt.adapters in one process: what is refused before peft injects, and plain models left to peft."""

from __future__ import annotations

import pytest
import torch

import shardadopt
from shardadopt.adapters import AdapterLayoutError, check_config
from shardadopt.testing.lora.common import lora_config

pytest.importorskip("peft", reason="the adapter tests need peft (shardadopt[peft])")


@pytest.mark.parametrize("overrides, named", [
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
    ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
    ({"init_lora_weights": "astra"}, "init_lora_weights='astra' (computed from the whole base weight and the "
                                     "activations preprocess_astra recorded, and it rewrites the base weight"),
    ({"target_modules": [], "target_parameters": ["experts.down_proj"], "use_dora": True},
     "use_dora / lora_bias with target_parameters=['experts.down_proj']"),
])
def test_configs_that_cannot_be_laid_out_are_refused_by_name(overrides, named):
    with pytest.raises(AdapterLayoutError, match="on a model sharded at load time is not supported") as raised:
        check_config(lora_config(**overrides))
    assert str(raised.value).startswith("LoraConfig: ") and named in str(raised.value)


@pytest.mark.parametrize("init", [True, False, "gaussian", "nora"])
@pytest.mark.parametrize("use_dora", [False, True])
def test_weight_free_configs_pass(init, use_dora):
    check_config(lora_config(init_lora_weights=init, use_dora=use_dora))


def test_plain_model_takes_peft_exact_path(tiny_models):
    """Not sharded: the same adapters, forward and merge with and without the patch."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from shardadopt.testing.lora.common import probe_batch

    def build():
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32),
                               lora_config(init_lora_weights="gaussian"))
        with torch.no_grad():
            logits = model(input_ids=probe_batch()).logits
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        merged = model.merge_and_unload()
        return adapters, logits, {n: p.detach().clone() for n, p in merged.named_parameters()}

    plain = build()
    shardadopt.enable()
    try:
        patched = build()
    finally:
        shardadopt.disable()
    for got, want in zip(patched, plain):
        if isinstance(want, dict):
            assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        else:
            assert torch.equal(got, want)
