"""TRL's SFTTrainer (full fine-tuning) and DPOTrainer on load-time-sharded models track the DDP run.

The reference is the same trainer on the plain checkpoint under DDP over 2 ranks (upstream's own multi-process
answer: TRL SFT under DDP itself differs from one process by ~1e-5, from per-rank padding), with the same global
batch: a sharded run with ``dp`` data-parallel ranks takes ``GLOBAL_BATCH // dp`` per device. TRL is called as its
docs show: ``SFTConfig``/``SFTTrainer`` on a ``datasets`` text dataset, ``DPOConfig``/``DPOTrainer`` on
prompt/chosen/rejected, TRL's default reference model; a local tokenizer as ``processing_class`` (no downloads).
TRL's configs default to ``bf16=True``, on CPU too: the fp32 runs set ``bf16=False`` as a user comparing in fp32 does.
"""

from __future__ import annotations

import math

import pytest

from shardadopt.selftest.trainer import LayoutUnsupported, distributed_sizes

pytestmark = pytest.mark.multiproc

STEPS = 3
GLOBAL_BATCH = 4
MODELS = {"fsdp": "llama", "tp": "qwen3", "ep": "qwen3moe", "2d": "qwen3"}
# fp32: TP pads the whole global batch where DDP pads per rank, and sharded matmuls sum in another order
FP32_RTOL = 1e-4
# Qwen3-MoE: Adam's normalised update turns that reduction-order noise on near-zero expert gradients into visible
# steps (transformers 5.15, EP on the TP mesh: DPO grad norm 1.9e-4 off at step 3)
MOE_RTOL = 5e-4
BF16_RTOL = 2e-2  # bf16 autocast: ~3 significant digits per matmul


def _dataset(kind: str):
    from datasets import Dataset

    from shardadopt.testing.text import sentences

    n = STEPS * GLOBAL_BATCH
    if kind == "sft":
        return Dataset.from_dict({"text": sentences(n, seed=1)})
    return Dataset.from_dict({"prompt": sentences(n, seed=2, max_words=6), "chosen": sentences(n, seed=3, max_words=6),
                              "rejected": sentences(n, seed=4, max_words=6)})


def trl_log(models: dict[str, str], tokenizer: str, kind: str, layout: str | None, model: str, *,
            world: int = 2, bf16: bool = False) -> list[dict[str, float]]:
    """``kind`` ("sft" or "dpo") for STEPS steps on ``model`` sharded per ``layout`` over ``world`` ranks, or
    (``layout=None``) plain under DDP over ``world`` ranks; per step {"loss", "grad_norm"} as TRL logs them, or the
    reason TRL cannot train this load (a string)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    import shardadopt
    from shardadopt import upstream

    shardadopt.enable()
    try:
        kwargs = {"dtype": torch.float32}
        dp = world
        if layout is not None:
            from transformers.distributed import DistributedConfig

            sizes, dp = distributed_sizes(layout, world)
            kwargs["distributed_config"] = DistributedConfig(**sizes)
        network = AutoModelForCausalLM.from_pretrained(models[model], **kwargs)
        head = network.get_output_embeddings().weight
        if head.shape[0] != network.config.vocab_size:
            # TRL 1.16 scores tokens through its fused LM head, which reads lm_head.weight itself and gathers it only
            # when it is a DTensor; releases that keep TP shards as plain tensors hand it this rank's vocab slice
            return (f"lm_head.weight is a plain {tuple(head.shape)} shard of the {network.config.vocab_size}-token "
                    f"vocabulary: TRL's fused LM head would score against this rank's slice only (not fixed yet)")
        upstream.reset_accelerate_state()  # pooled ranks run several trainers in one process
        with tempfile.TemporaryDirectory(prefix="shardadopt-trl-") as out:
            common = dict(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=STEPS,
                          learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                          report_to=[], use_cpu=True, bf16=bf16, seed=0, max_length=32, disable_tqdm=True)
            processing_class = AutoTokenizer.from_pretrained(tokenizer)
            if kind == "sft":
                from trl import SFTConfig, SFTTrainer

                trainer = SFTTrainer(model=network, args=SFTConfig(**common), train_dataset=_dataset("sft"),
                                     processing_class=processing_class)
            else:
                from trl import DPOConfig, DPOTrainer

                trainer = DPOTrainer(model=network, args=DPOConfig(**common), train_dataset=_dataset("dpo"),
                                     processing_class=processing_class)
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

    def get(kind: str, model: str, bf16: bool = False):
        if (kind, model, bf16) not in cache:
            logs = pool2.run(trl_log, tiny_models, tokenizer, kind, None, model, bf16=bf16, timeout=300)
            assert logs[0] == logs[1], "DDP ranks log the same values"
            cache[kind, model, bf16] = logs[0]
        return cache[kind, model, bf16]

    return get


def _compare(result: list[dict[str, float]] | str, expected: list[dict[str, float]], rtol: float) -> str | None:
    if isinstance(result, str):  # this transformers cannot run the layout (the reason)
        pytest.skip(result)
    if len(result) != len(expected) or len(expected) != STEPS:
        return f"{len(result)} logged steps, the DDP run logged {len(expected)} (of {STEPS})"
    for step, (got, want) in enumerate(zip(result, expected), start=1):
        for key in ("loss", "grad_norm"):
            if not math.isclose(got[key], want[key], rel_tol=rtol):
                return f"step {step}: {key} {got[key]!r} vs DDP {want[key]!r} (rtol {rtol})"
    return None


def _sizes_or_skip(layout: str, world: int) -> None:
    try:
        distributed_sizes(layout, world)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")


@pytest.mark.parametrize("kind", ["sft", "dpo"])
@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_two_ranks_track_ddp(pool2, tiny_models, tokenizer, ddp_logs, kind, layout):
    expected = ddp_logs(kind, MODELS[layout])
    for rank, log in enumerate(pool2.run(trl_log, tiny_models, tokenizer, kind, layout, MODELS[layout],
                                         timeout=300)):
        problem = _compare(log, expected, MOE_RTOL if layout == "ep" else FP32_RTOL)
        assert problem is None, f"{kind} {layout} rank {rank}: {problem}"


def test_sft_bf16_tracks_ddp_bf16(pool2, tiny_models, tokenizer, ddp_logs):
    """TRL's default precision (bf16=True, autocast on CPU too) on an FSDP load, against DDP at bf16."""
    expected = ddp_logs("sft", MODELS["fsdp"], bf16=True)
    for rank, log in enumerate(pool2.run(trl_log, tiny_models, tokenizer, "sft", "fsdp", MODELS["fsdp"], bf16=True,
                                         timeout=300)):
        problem = _compare(log, expected, BF16_RTOL)
        assert problem is None, f"bf16 rank {rank}: {problem}"


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_2d_tracks_ddp(request, tiny_models, tokenizer, ddp_logs, kind):
    _sizes_or_skip("2d", 4)
    expected = ddp_logs(kind, MODELS["2d"])
    pool = request.getfixturevalue("pool4")
    for rank, log in enumerate(pool.run(trl_log, tiny_models, tokenizer, kind, "2d", MODELS["2d"], world=4,
                                        timeout=400)):
        problem = _compare(log, expected, FP32_RTOL)
        assert problem is None, f"{kind} 2d rank {rank}: {problem}"
