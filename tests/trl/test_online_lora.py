"""GRPO and RLOO with LoRA (``peft_config=LoraConfig(...)``, as TRL's docs call them) on load-time-sharded models.

TRL adds the adapters itself; with ``beta > 0`` (RLOO's default 0.05) its reference model is the same peft model
with the adapter disabled, so the KL term runs the sharded base without the factors. Each layout is compared with
the same call on the plain checkpoint: DDP over as many ranks as it has data-parallel ranks (``fsdp_size=2``: 2;
HSDP ``dp_replicate_size=2, fsdp_size=2``: 4), one process for ``tp_size=2`` (one data-parallel rank, whose TP group
samples one process's completions: ``trl-grpo-data-parallel``/``trl-rloo-data-parallel``). Per step: loss, grad
norm and logged reward, fp32. LoRA on TP before transformers 5.17 (TP shards as plain tensors) is refused when TRL
adds the adapters, naming the fix (workers: ``shardadopt.testing.trl_online``).
"""

from __future__ import annotations

import pytest

from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.trl import MODELS, refusal_problem
from shardadopt.testing.trl_online import RTOL, online_log, tracks

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def reference(pool2, tiny_models, trl_tokenizer):
    """``get(kind, layout, dp, pool)``: the LoRA run on the plain checkpoint of ``layout``'s model in this process
    (``dp=1``) or under DDP on ``pool`` (every rank's result), once per argument set."""
    cache: dict[tuple, list[dict]] = {}

    def get(kind: str, layout: str, dp: int, pool=None) -> list[dict]:
        key = (kind, MODELS[layout], dp)
        if key not in cache:
            if dp == 1:
                cache[key] = [online_log(tiny_models, trl_tokenizer, kind, None, MODELS[layout], world=1, lora=True)]
            else:
                cache[key] = pool.run(online_log, tiny_models, trl_tokenizer, kind, None, MODELS[layout], world=dp,
                                      lora=True, timeout=400)
            assert all("log" in run for run in cache[key]), cache[key]
        return cache[key]

    return get


def check(results: list[dict], expected: list[dict], kind: str, layout: str) -> None:
    """Each rank scored its reference rank's completions and logged its loss, grad norm and reward."""
    for rank, (result, want) in enumerate(zip(results, expected)):
        assert result.get("completions") == want["completions"], f"{kind} {layout} rank {rank}: other completions"
        problem = tracks(result, want, RTOL[kind])
        assert problem is None, f"{kind} {layout} lora rank {rank}: {problem}"


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_lora_tracks_reference(pool2, tiny_models, trl_tokenizer, reference, kind, layout):
    """fsdp_size=2 against DDP over 2 ranks (rank i samples DDP's rank i completions); tp_size=2 against one
    process (both TP ranks sample its completions). Refused on TP before transformers 5.17."""
    from shardadopt.adapters import dtensor_tensor_parallel

    results = pool2.run(online_log, tiny_models, trl_tokenizer, kind, layout, MODELS[layout], lora=True,
                        timeout=400)
    if layout == "tp" and not dtensor_tensor_parallel():
        for rank, result in enumerate(results):
            problem = refusal_problem(result, "lora-tp")
            assert problem is None, f"{kind} tp lora rank {rank}: {problem}"
        return
    if layout == "tp":
        check(results, reference(kind, layout, 1) * 2, kind, layout)
    else:
        check(results, reference(kind, layout, 2, pool2), kind, layout)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_hsdp_lora_tracks_ddp(request, tiny_models, trl_tokenizer, reference, kind):
    """HSDP (dp_replicate_size=2, fsdp_size=2: 4 data-parallel ranks) against DDP over 4 ranks."""
    try:
        distributed_sizes("hsdp", 4)
    except LayoutUnsupported as exc:
        pytest.skip(f"hsdp: {exc}")
    pool = request.getfixturevalue("pool4")
    results = pool.run(online_log, tiny_models, trl_tokenizer, kind, "hsdp", MODELS["hsdp"], world=4, lora=True,
                       timeout=600)
    check(results, reference(kind, "hsdp", 4, pool), kind, "hsdp")
