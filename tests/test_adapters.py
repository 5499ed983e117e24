"""PEFT LoRA on load-time-sharded models (2 ranks), through the ordinary accelerate loop, equals one process.

Each layout trains a few optimizer steps with gradient accumulation and clipping: per-step loss and grad norm, the
adapter gradients of the last step and the adapter weights after training equal a one-process run on the same
global batches; the adapters are equal on every rank and the base weights unchanged. The adapter each run exports
with ``save_pretrained`` (every rank) loads in one process with equal outputs, and back onto a sharded base
(``shardadopt.testing.lora.check_lora_training``). transformers before 5.17 refuses LoRA on TP (checked there).
"""

from __future__ import annotations

import pytest

from shardadopt.selftest.trainer import distributed_sizes
from shardadopt.testing.lora import check_lora_training, reference_cache

pytestmark = pytest.mark.multiproc

# EP: Qwen3-MoE with adapters on attention (its down_proj are expert tensors: refused, see the refusal tests)
MODELS = {"fsdp": "llama", "tp": "qwen3", "ep": "qwen3moe"}


@pytest.fixture(scope="module")
def references(tiny_models):
    return reference_cache(tiny_models)


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_lora_training_matches_single_process(pool2, tiny_models, references, tmp_path, layout):
    sizes, dp = distributed_sizes(layout, 2)
    model = MODELS[layout]
    check_lora_training(pool2, tiny_models[model], model, sizes, dp, references, str(tmp_path))
