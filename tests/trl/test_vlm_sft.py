"""TRL's SFTTrainer on a vision-language model loaded sharded tracks its multi-process answer (issue 41).

As TRL's docs show vision-language SFT: ``AutoModelForImageTextToText`` (a tiny Gemma 3), ``AutoProcessor`` as
``processing_class``, conversational ``"messages"`` rows with an ``"images"`` column, ``SFTConfig(max_length=None)``,
fp32 (``bf16=False``); workers in ``shardadopt.testing.trl_vlm``. Per-step loss and grad norm over 3 steps, the same
global batch of 4 rows everywhere.

The reference has the layout's data-parallel ranks. ``fsdp_size=2``: DDP over 2 ranks on the plain checkpoint, 2 rows
per rank. ``tp_size=2`` has one data-parallel rank that takes all 4 rows in one batch: TRL's collator pads per
device batch, so one process (this test process) pads as the TP run does, where DDP's two batches would pad each
pair to its own length. Where transformers keeps TP shards as plain tensors (5.15, 5.16), TRL's fused LM head would
score each rank's slice of the vocabulary: the tp run must be refused at ``train()``, as for text.
"""

from __future__ import annotations

import pytest

from shardadopt.testing.trl import FP32_RTOL, compare, refusal_problem
from shardadopt.testing.trl_vlm import tiny_vlm, vlm_sft_log

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> tuple[str, str]:
    """(tiny Gemma 3 checkpoint, its processor), written once for the module."""
    return tiny_vlm(tmp_path_factory.mktemp("tiny-vlm-sft"))


def _ddp_log(pool2, vlm) -> list[dict]:
    runs = pool2.run(vlm_sft_log, *vlm, None, timeout=300)
    assert "log" in runs[0], runs[0]
    assert runs[0]["log"] == runs[1]["log"], "DDP ranks log the same values"
    return runs[0]["log"]


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_vlm_sft_tracks_its_data_parallel_reference(pool2, vlm, layout):
    from shardadopt.adapters import dtensor_tensor_parallel

    results = pool2.run(vlm_sft_log, *vlm, layout, timeout=300)
    if layout == "tp":  # the head is sharded on TP loads: plain on 5.15/5.16 (refused), a DTensor from 5.17
        assert all(r["plain_head_shard"] for r in results) != dtensor_tensor_parallel(), results
    if results[0]["plain_head_shard"]:
        problems = [refusal_problem(result, "fused-head") for result in results]
    else:
        reference = _ddp_log(pool2, vlm) if layout == "fsdp" else vlm_sft_log(*vlm, None, world=1)["log"]
        problems = [compare(result, reference, FP32_RTOL) for result in results]
    assert problems == [None, None], f"vlm sft {layout}: {problems}"
