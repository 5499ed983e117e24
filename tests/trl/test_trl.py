"""TRL's SFTTrainer (full fine-tuning), DPOTrainer, RewardTrainer and KTOTrainer on load-time-sharded models track
the DDP run.

The reference is the same trainer on the plain checkpoint under DDP over 2 ranks (upstream's own multi-process
answer: TRL SFT under DDP itself differs from one process by ~1e-5, from per-rank padding), with the same global
batch; the workers are ``shardadopt.testing.trl`` (TRL called as its docs show). Where transformers keeps TP shards
as plain tensors (5.15, 5.16), TRL's fused LM head would read this rank's slice of ``lm_head.weight`` and train
silently wrong: those runs must be refused at ``train()``, naming the combination and the fix. KTO's KL term pairs
completions within each per-device batch, so its tp run (one data-parallel rank) is compared with one process.
"""

from __future__ import annotations

import pytest

from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.trl import BF16_RTOL, FP32_RTOL, MODELS, MOE_RTOL, compare, refusal_problem, trl_log

pytestmark = pytest.mark.multiproc


def check_run(results: list[dict], reference, rtol: float, what: str) -> None:
    """Every rank tracks the DDP run (``reference()``), or (an LM head kept as a plain TP shard) every rank is
    refused."""
    from shardadopt.adapters import dtensor_tensor_parallel

    for rank, result in enumerate(results):
        if result["plain_head_shard"]:
            assert not dtensor_tensor_parallel(), "plain LM head shard on a transformers that shards with DTensors"
            problem = refusal_problem(result, "fused-head")
        else:
            problem = compare(result, reference(), rtol)
        assert problem is None, f"{what} rank {rank}: {problem}"


def _sizes_or_skip(layout: str, world: int) -> None:
    try:
        distributed_sizes(layout, world)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")


@pytest.mark.parametrize("kind", ["sft", "dpo"])
@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_two_ranks_track_ddp(pool2, tiny_models, trl_tokenizer, trl_ddp, kind, layout):
    from shardadopt.adapters import dtensor_tensor_parallel

    results = pool2.run(trl_log, tiny_models, trl_tokenizer, kind, layout, MODELS[layout], timeout=300)
    if layout == "tp":  # the head is sharded on TP loads: plain on 5.15/5.16 (refused), a DTensor from 5.17
        assert all(r["plain_head_shard"] for r in results) != dtensor_tensor_parallel(), results
    rtol = MOE_RTOL if layout == "ep" else FP32_RTOL
    check_run(results, lambda: trl_ddp(kind, MODELS[layout]), rtol, f"{kind} {layout}")


def test_sft_bf16_tracks_ddp_bf16(pool2, tiny_models, trl_tokenizer, trl_ddp):
    """TRL's default precision (bf16=True, autocast on CPU too) on an FSDP load, against DDP at bf16."""
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, "sft", "fsdp", MODELS["fsdp"], bf16=True, timeout=300)
    check_run(results, lambda: trl_ddp("sft", MODELS["fsdp"], bf16=True), BF16_RTOL, "bf16")


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_2d_tracks_ddp(request, tiny_models, trl_tokenizer, trl_ddp, kind):
    _sizes_or_skip("2d", 4)
    pool = request.getfixturevalue("pool4")
    results = pool.run(trl_log, tiny_models, trl_tokenizer, kind, "2d", MODELS["2d"], world=4, timeout=400)
    check_run(results, lambda: trl_ddp(kind, MODELS["2d"]), FP32_RTOL, f"{kind} 2d")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_reward_trainer_tracks_ddp(pool2, tiny_models, trl_tokenizer, trl_ddp, layout):
    """RewardTrainer on ``AutoModelForSequenceClassification(num_labels=1)`` loaded sharded from the causal-LM
    checkpoint (a score head outside the TP plan, new at load), chosen/rejected pairs, fp32."""
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, "reward", layout, MODELS[layout], timeout=300)
    for rank, result in enumerate(results):
        problem = compare(result, trl_ddp("reward", MODELS[layout]), FP32_RTOL)
        assert problem is None, f"reward {layout} rank {rank}: {problem}"


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_kto_trainer_tracks_reference(pool2, tiny_models, trl_tokenizer, trl_ddp, layout):
    """KTOTrainer (TRL's default reference model, the KL term from completions rotated within each per-device
    batch) against its own multi-process answer for the layout's data parallelism: DDP over 2 ranks for fsdp (2
    data-parallel ranks, 2 rows each), one process (this test process) for tp (1 data-parallel rank, all 4 rows in
    one batch: the KL pairs of one process)."""
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, "kto", layout, MODELS[layout], timeout=300)
    if layout == "fsdp":
        check_run(results, lambda: trl_ddp("kto", MODELS[layout]), FP32_RTOL, "kto fsdp")
    else:
        check_run(results, lambda: trl_log(tiny_models, trl_tokenizer, "kto", None, MODELS[layout], world=1)["log"],
                  FP32_RTOL, "kto tp")
