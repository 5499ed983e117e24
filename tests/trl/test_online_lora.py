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
from shardadopt.testing.trl_online import NUM_GENERATIONS, RTOL, online_log, tracks

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def reference(pool2, tiny_models, trl_tokenizer):
    """``get(kind, layout, dp, pool, **config)``: the LoRA run on the plain checkpoint of ``layout``'s model in this
    process (``dp=1``) or under DDP on ``pool`` (every rank's result), ``config`` added to the trainer's config, once
    per argument set."""
    cache: dict[tuple, list[dict]] = {}

    def get(kind: str, layout: str, dp: int, pool=None, **config) -> list[dict]:
        key = (kind, MODELS[layout], dp, tuple(sorted(config.items())))
        if key not in cache:
            if dp == 1:
                cache[key] = [online_log(tiny_models, trl_tokenizer, kind, None, MODELS[layout], world=1, lora=True,
                                         **config)]
            else:
                cache[key] = pool.run(online_log, tiny_models, trl_tokenizer, kind, None, MODELS[layout], world=dp,
                                      lora=True, timeout=400, **config)
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


def test_ep_grpo_lora_tracks_reference(pool2, tiny_models, trl_tokenizer, reference):
    """GRPO with adapters on the attention of Qwen3-MoE loaded with ``ep_size=2, fsdp_size=2`` (2 data-parallel
    ranks) against DDP over 2; before transformers 5.21 EP runs on the TP mesh, where LoRA on plain TP shards
    (before 5.17) is refused."""
    from shardadopt.adapters import dtensor_tensor_parallel

    sizes, dp = distributed_sizes("ep", 2)
    results = pool2.run(online_log, tiny_models, trl_tokenizer, "grpo", "ep", MODELS["ep"], lora=True, timeout=400)
    if "tp_size" in sizes and not dtensor_tensor_parallel():
        for rank, result in enumerate(results):
            assert refusal_problem(result, "lora-tp") is None, f"grpo ep lora rank {rank}: {result}"
        return
    expected = reference("grpo", "ep", 1) * 2 if dp == 1 else reference("grpo", "ep", dp, pool2)
    check(results, expected, "grpo", "ep")


def test_2d_grpo_lora_tracks_ddp(request, pool2, tiny_models, trl_tokenizer, reference):
    """GRPO with LoRA on ``fsdp_size=2, tp_size=2`` (4 ranks, 2 data-parallel ranks) against DDP over 2: TP group k
    (ranks 2k, 2k+1) scores DDP's process k completions; whole groups per process (per-device batch 4)."""
    try:
        distributed_sizes("2d", 4)
    except LayoutUnsupported as exc:
        pytest.skip(f"2d: {exc}")
    pool = request.getfixturevalue("pool4")
    config = {"per_device_train_batch_size": NUM_GENERATIONS}
    results = pool.run(online_log, tiny_models, trl_tokenizer, "grpo", "2d", MODELS["2d"], world=4, lora=True,
                       timeout=600, **config)
    ddp = reference("grpo", "2d", 2, pool2, **config)
    check(results, [ddp[rank // 2] for rank in range(4)], "grpo", "2d")
