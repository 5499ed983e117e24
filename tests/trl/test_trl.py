"""TRL's SFTTrainer (full fine-tuning), DPOTrainer, RewardTrainer and KTOTrainer on load-time-sharded models track
the DDP run.

The reference is the same trainer on the plain checkpoint under DDP over as many ranks as the layout has
data-parallel ranks (upstream's own multi-process answer: TRL SFT under DDP itself differs from one process by ~1e-5,
from per-rank padding): 2 for fsdp, ep and 2-D, 4 for HSDP (the 4-rank layouts share this module's ``pool4``), with
the same global batch; the workers are ``shardadopt.testing.trl`` (TRL called as its docs show). Where transformers
keeps TP shards as plain tensors (5.15, 5.16), TRL's fused LM head would read this rank's slice of
``lm_head.weight`` and train silently wrong: those runs must be refused at ``train()``, naming the combination and
the fix. KTO's KL term pairs completions within each per-device batch, so its runs with one data-parallel rank (tp)
are compared with one process.
"""

from __future__ import annotations

import pytest

from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.trl import (
    BF16_RTOL,
    FP32_RTOL,
    GLOBAL_BATCH,
    MODELS,
    MOE_RTOL,
    compare,
    refusal_problem,
    trl_log,
)

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


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_reward_trainer_tracks_ddp(pool2, tiny_models, trl_tokenizer, trl_ddp, layout):
    """RewardTrainer on ``AutoModelForSequenceClassification(num_labels=1)`` loaded sharded from the causal-LM
    checkpoint (a score head outside the TP plan, new at load), chosen/rejected pairs, fp32."""
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, "reward", layout, MODELS[layout], timeout=300)
    rtol = MOE_RTOL if layout == "ep" else FP32_RTOL
    for rank, result in enumerate(results):
        problem = compare(result, trl_ddp("reward", MODELS[layout]), rtol)
        assert problem is None, f"reward {layout} rank {rank}: {problem}"


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_kto_trainer_tracks_reference(pool2, tiny_models, trl_tokenizer, trl_ddp, layout):
    """KTOTrainer (TRL's default reference model, the KL term from completions rotated within each per-device
    batch) against its own multi-process answer for the layout's data parallelism: DDP over 2 ranks where the load
    has 2 data-parallel ranks (fsdp; ep from transformers 5.21: 2 rows each), one process (this test process) where
    it has 1 (tp; ep on the TP mesh before 5.21: all 4 rows in one batch, the KL pairs of one process)."""
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, "kto", layout, MODELS[layout], timeout=300)
    _, dp = distributed_sizes(layout, 2)
    rtol = MOE_RTOL if layout == "ep" else FP32_RTOL
    if dp == 2:
        check_run(results, lambda: trl_ddp("kto", MODELS[layout]), rtol, f"kto {layout}")
    else:
        check_run(results, lambda: trl_log(tiny_models, trl_tokenizer, "kto", None, MODELS[layout], world=1)["log"],
                  rtol, f"kto {layout}")


# KTO refuses a per-device batch of 1 (its KL pairs rotate completions within the per-device batch): on HSDP's 4
# data-parallel ranks it takes 2 rows per device, as its DDP-over-4 reference does.
FOUR_RANK_GLOBAL_BATCH = {("kto", "hsdp"): 8}


@pytest.fixture(scope="module")
def trl_ddp4(request, tiny_models, trl_tokenizer):
    """The TRL run on the plain checkpoint under DDP over 4 ranks (``pool4``, started on first use): the reference
    of HSDP's 4 data-parallel ranks."""
    from shardadopt.testing.trl import ddp_reference

    return ddp_reference(request.getfixturevalue("pool4"), tiny_models, trl_tokenizer)


@pytest.mark.parametrize("kind", ["sft", "dpo", "reward", "kto"])
@pytest.mark.parametrize("layout", ["2d", "hsdp"])
def test_four_ranks_track_ddp(request, tiny_models, trl_tokenizer, trl_ddp, kind, layout):
    """2-D (``fsdp_size=2, tp_size=2``: 2 data-parallel ranks) against DDP over 2 ranks, HSDP
    (``dp_replicate_size=2, fsdp_size=2``: 4 data-parallel ranks) against DDP over 4, the same global batch (so
    the same per-device batch: KTO's KL pairs are those of its DDP reference)."""
    _sizes_or_skip(layout, 4)
    _, dp = distributed_sizes(layout, 4)
    pool = request.getfixturevalue("pool4")
    batch = FOUR_RANK_GLOBAL_BATCH.get((kind, layout), GLOBAL_BATCH)
    results = pool.run(trl_log, tiny_models, trl_tokenizer, kind, layout, MODELS[layout], world=4,
                       global_batch=batch, timeout=400)
    reference = trl_ddp if dp == 2 else request.getfixturevalue("trl_ddp4")
    check_run(results, lambda: reference(kind, MODELS[layout], global_batch=batch), FP32_RTOL, f"{kind} {layout}")
