"""PEFT LoRA on load-time-sharded models (2 ranks), through the ordinary accelerate loop, equals one process.

Each layout trains ``STEPS`` optimizer steps with gradient accumulation and clipping: per-step loss and grad norm,
the adapter gradients of the last step and the adapter weights after training equal a one-process run on the same
global batches; the adapters are equal on every rank and the base weights unchanged. The adapter each run exports
with ``save_pretrained`` (every rank) loads in one process with equal outputs, and back onto a sharded base.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from shardadopt.selftest.trainer import distributed_sizes
from shardadopt.testing.lora import LR, MAX_NORM, probe_batch, train_lora_rank, train_lora_reference

MODELS = {"fsdp": "llama", "tp": "qwen3"}
# Adam normalises each element's step: a gradient that nearly cancels can move one element by a fraction of LR
# (see shardadopt.selftest.accelerate); whole-tensor errors move by ~LR per step.
PARAM_MAX_DIFF = 0.5 * LR
PARAM_RMS = 1e-3 * LR


def _close(got: torch.Tensor, want: torch.Tensor, max_diff: float, rms: float) -> bool:
    diff = (got - want).abs()
    return got.shape == want.shape and float(diff.max()) < max_diff and float(diff.pow(2).mean().sqrt()) <= rms


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}

    def get(model: str, dp: int):
        if (model, dp) not in cache:
            cache[model, dp] = train_lora_reference(tiny_models[model], dp)
        return cache[model, dp]

    return get


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_lora_training_matches_single_process(pool2, tiny_models, references, tmp_path, layout):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sizes, dp = distributed_sizes(layout, 2)
    path = tiny_models[MODELS[layout]]
    export = str(tmp_path / "adapter")
    results = pool2.run(train_lora_rank, path, sizes, dp, export, timeout=600)
    expected = references(MODELS[layout], dp)
    assert all(n > MAX_NORM for n in expected["norms"]), "clipping must be active in every step"
    first = results[0]
    for rank, result in enumerate(results):
        assert result["base_unchanged"], f"rank {rank}: a base weight changed"
        assert all("lora_" in n for n in result["trainable"]) and result["trainable"], result["trainable"]
        for key in ("init", "params", "grads"):
            for name, value in result[key].items():
                assert torch.equal(value, first[key][name]), f"{key} {name} differs between rank 0 and {rank}"
        assert result["losses"] == first["losses"] and result["norms"] == first["norms"]
    assert sorted(first["init"]) == sorted(expected["init"])
    for name, value in expected["init"].items():
        assert torch.equal(first["init"][name], value), f"initial {name} differs from one process"
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(first["norms"]), torch.tensor(expected["norms"]), rtol=1e-5, atol=0)
    for name, value in expected["grads"].items():
        torch.testing.assert_close(first["grads"][name], value, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")
    bad = [n for n, v in expected["params"].items() if not _close(first["params"][n], v, PARAM_MAX_DIFF, PARAM_RMS)]
    assert not bad, f"adapter weights differ from one process after training: {bad[:3]}"

    # the export: an ordinary PEFT adapter, full tensors, that one process loads with equal outputs
    assert sorted(os.listdir(export)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(export, "adapter_config.json")) as file:
        assert sorted(json.load(file)["target_modules"]) == sorted(["q_proj", "v_proj", "o_proj", "down_proj"])
    one = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), export)
    with torch.no_grad():
        logits = one(input_ids=probe_batch()).logits
    for result in results:
        torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["reloaded_logits"], result["logits"], rtol=1e-6, atol=1e-6)
