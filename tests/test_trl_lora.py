"""LoRA through TRL on load-time-sharded models tracks the same run on the plain checkpoint under DDP.

``SFTTrainer(model=<sharded>, peft_config=LoraConfig(...))``, ``SFTTrainer(model=get_peft_model(<sharded>, ...))``
and ``DPOTrainer(model=<sharded>, peft_config=...)`` (TRL's reference: the base with the adapter disabled), every
rank seeded the same before the adapters are added, as TRL's docs call them; the reference is the same call on the
plain checkpoint under DDP over 2 ranks with the same global batch (see tests/test_trl.py).
"""

from __future__ import annotations

import pytest

from shardadopt.selftest.trainer import distributed_sizes
from test_trl import FP32_RTOL, GLOBAL_BATCH, MODELS, STEPS, _compare, _dataset

pytestmark = pytest.mark.multiproc

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def lora_log(models: dict[str, str], tokenizer: str, kind: str, how: str, layout: str | None, model: str
             ) -> list[dict[str, float]]:
    """``kind`` ("sft"/"dpo") with LoRA added ``how`` ("peft_config": by TRL, "wrapped": get_peft_model first) on
    ``model`` sharded per ``layout`` over 2 ranks, or plain under DDP (``layout=None``); per step
    {"loss", "grad_norm"}, or shardadopt's refusal of this layout on the installed transformers (a string)."""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    import shardadopt
    from shardadopt import upstream
    from shardadopt.adapters import AdapterLayoutError

    shardadopt.enable()
    try:
        kwargs = {"dtype": torch.float32}
        dp = 2
        if layout is not None:
            from transformers.distributed import DistributedConfig

            sizes, dp = distributed_sizes(layout, 2)
            kwargs["distributed_config"] = DistributedConfig(**sizes)
        network = AutoModelForCausalLM.from_pretrained(models[model], **kwargs)
        upstream.reset_accelerate_state()
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        torch.manual_seed(0)  # the same on every rank, before the adapters are initialised
        extra = {"peft_config": config}
        with tempfile.TemporaryDirectory(prefix="shardadopt-trl-lora-") as out:
            common = dict(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=STEPS,
                          learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                          report_to=[], use_cpu=True, bf16=False, seed=0, max_length=32, disable_tqdm=True)
            processing_class = AutoTokenizer.from_pretrained(tokenizer)
            try:  # TP LoRA before transformers 5.17 (plain TP shards) is refused when the adapters are added
                if how == "wrapped":
                    network, extra = get_peft_model(network, config), {}
                if kind == "sft":
                    from trl import SFTConfig, SFTTrainer

                    trainer = SFTTrainer(model=network, args=SFTConfig(**common), train_dataset=_dataset("sft"),
                                         processing_class=processing_class, **extra)
                else:
                    from trl import DPOConfig, DPOTrainer

                    trainer = DPOTrainer(model=network, args=DPOConfig(**common), train_dataset=_dataset("dpo"),
                                         processing_class=processing_class, **extra)
            except AdapterLayoutError as exc:
                return f"refused: {exc}"
            trainer.remove_callback(PrinterCallback)
            trainer.train()
        return [{"loss": row["loss"], "grad_norm": float(row["grad_norm"])}
                for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    finally:
        shardadopt.disable()


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    import os

    from shardadopt.testing.text import tiny_tokenizer

    return tiny_tokenizer(os.path.dirname(tiny_models["qwen3"]))


@pytest.fixture(scope="module")
def ddp_logs(pool2, tiny_models, tokenizer):
    cache = {}

    def get(kind: str, how: str, model: str):
        if (kind, how, model) not in cache:
            logs = pool2.run(lora_log, tiny_models, tokenizer, kind, how, None, model, timeout=300)
            assert logs[0] == logs[1], "DDP ranks log the same values"
            cache[kind, how, model] = logs[0]
        return cache[kind, how, model]

    return get


@pytest.mark.parametrize("kind, how, layout", [("sft", "peft_config", "fsdp"), ("sft", "wrapped", "fsdp"),
                                               ("sft", "peft_config", "tp"), ("sft", "wrapped", "tp"),
                                               ("dpo", "peft_config", "fsdp")])
def test_lora_tracks_ddp(pool2, tiny_models, tokenizer, ddp_logs, kind, how, layout):
    expected = ddp_logs(kind, how, MODELS[layout])
    results = pool2.run(lora_log, tiny_models, tokenizer, kind, how, layout, MODELS[layout], timeout=300)
    for rank, log in enumerate(results):
        problem = _compare(log, expected, FP32_RTOL)
        assert problem is None, f"{kind} {how} {layout} rank {rank}: {problem}"
