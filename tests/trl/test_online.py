"""TRL's GRPOTrainer and RLOOTrainer, and a user's own sampling loop, on tensor-parallel loads: the ranks of a TP
group sample the same tokens (``transformers-tp-sampling-agreement``) and training tracks one process.

TRL seeds each process differently, so a multi-process run samples other completions than one process; with one
data-parallel rank (``tp_size=2`` on 2 ranks) the TP group takes its first rank's stream (``seed + 0``), which is one
process's: the reference is TRL on the plain checkpoint in one process (this test process), fp32, the same global
batch. Without the patch the two TP ranks sample different completions and the TP backward mixes two batches. Where
transformers keeps TP shards as plain tensors (5.15, 5.16), TRL's fused LM head reads this rank's slice of the head:
those runs must be refused, naming the combination and the fix.
"""

from __future__ import annotations

import math

import pytest

from shardadopt.testing.trl import MODELS, refusal_problem
from shardadopt.testing.trl_online import RTOL, STEPS, online_log, sampled_tokens

pytestmark = pytest.mark.multiproc

PATCH = "transformers-tp-sampling-agreement"


@pytest.fixture(scope="module")
def one_process(tiny_models, trl_tokenizer):
    """``get(kind, model="qwen3")``: the TRL run on the plain checkpoint in this process (one process), computed
    once per argument set."""
    cache: dict[tuple[str, str], dict] = {}

    def get(kind: str, model: str = MODELS["tp"]) -> dict:
        if (kind, model) not in cache:
            cache[kind, model] = online_log(tiny_models, trl_tokenizer, kind, None, model, world=1)
        return cache[kind, model]

    return get


def refused_everywhere(results: list[dict], what: str) -> bool:
    """Whether the load keeps the LM head as a plain TP shard (transformers 5.15/5.16), after checking that every
    rank was then refused for TRL's fused LM head, naming the fix."""
    if not results[0]["plain_head_shard"]:
        return False
    for rank, result in enumerate(results):
        problem = refusal_problem(result, "fused-head")
        assert problem is None, f"{what} rank {rank}: {problem}"
    return True


def tracks(result: dict, reference: dict, rtol: float) -> str | None:
    """What differs between a run's log and the reference's, step by step (None: every step within ``rtol``)."""
    if "log" not in result:
        return f"not trained: {result.get('refused')}"
    got, want = result["log"], reference["log"]
    if len(got) != len(want) or len(want) != STEPS:
        return f"{len(got)} logged steps, the reference logged {len(want)} (of {STEPS})"
    for step, (have, expected) in enumerate(zip(got, want), start=1):
        for key in ("loss", "grad_norm", "reward"):
            # GRPO/RLOO losses are ~0 by construction (advantages sum to zero per group): compare them absolutely
            if not math.isclose(have[key], expected[key], rel_tol=rtol, abs_tol=1e-6 if key == "loss" else 0.0):
                return f"step {step}: {key} {have[key]!r} vs one process {expected[key]!r} (rtol {rtol})"
    return None


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_tp_ranks_sample_alike_and_track_one_process(pool2, tiny_models, trl_tokenizer, one_process, kind):
    """tp_size=2: both ranks score the same completions, the ones one process samples, and every step's loss,
    grad norm and reward match one process."""
    results = pool2.run(online_log, tiny_models, trl_tokenizer, kind, "tp", MODELS["tp"], timeout=400)
    if refused_everywhere(results, f"{kind} tp"):
        return
    reference = one_process(kind)
    assert results[0]["completions"] == results[1]["completions"], "the TP ranks sampled different completions"
    assert results[0]["completions"] == reference["completions"], "the TP group sampled other completions than " \
                                                                  "one process"
    for rank, result in enumerate(results):
        problem = tracks(result, reference, RTOL[kind])
        assert problem is None, f"{kind} tp rank {rank}: {problem}"


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_data_parallel_layouts_track_ddp(pool2, tiny_models, trl_tokenizer, one_process, kind, layout):
    """fsdp_size=2 and ep_size=2, fsdp_size=2 (Qwen3-MoE): every rank is its own data-parallel rank with TRL's own
    per-process stream, as under DDP: the reference is the same trainer on the plain checkpoint under DDP over 2
    ranks. (transformers 5.15/5.16 run EP on the TP mesh, one data-parallel rank, and keep the LM head a plain TP
    shard there: refused.)"""
    results = pool2.run(online_log, tiny_models, trl_tokenizer, kind, layout, MODELS[layout], timeout=400)
    if refused_everywhere(results, f"{kind} {layout}"):
        return
    reference = (pool2.run(online_log, tiny_models, trl_tokenizer, kind, None, MODELS[layout], timeout=400)
                 if results[0]["dp"] == 2 else [one_process(kind, MODELS[layout])] * 2)
    for rank, (result, expected) in enumerate(zip(results, reference)):
        assert result.get("completions") == expected["completions"], f"{kind} {layout} rank {rank}: other samples"
        problem = tracks(result, expected, RTOL[kind])
        assert problem is None, f"{kind} {layout} rank {rank}: {problem}"


def test_without_the_patch_tp_ranks_sample_apart(pool2, tiny_models, trl_tokenizer, one_process):
    """The check above catches the bug: with the patch excluded, GRPO's two TP ranks score different completions
    and the first step's grad norm is not one process's."""
    results = pool2.run(online_log, tiny_models, trl_tokenizer, "grpo", "tp", MODELS["tp"], exclude=(PATCH,),
                        timeout=400)
    if results[0]["plain_head_shard"]:
        pytest.skip("transformers 5.15/5.16 keep the LM head as a plain TP shard: TRL's GRPO is refused there")
    assert results[0]["completions"] != results[1]["completions"]
    assert tracks(results[0], one_process("grpo"), RTOL["grpo"]) is not None


def test_user_loop_samples_alike_on_tp_ranks(pool2, tiny_models):
    """A user's loop: ``torch.manual_seed(rank)``, then ``model.generate(do_sample=True)`` on a tp_size=2 load; the
    TP ranks get the same tokens (and, with the patch excluded, do not: the per-rank seeds differ)."""
    fixed = pool2.run(sampled_tokens, tiny_models[MODELS["tp"]], "tp", timeout=300)
    assert fixed[0] == fixed[1], fixed
    unpatched = pool2.run(sampled_tokens, tiny_models[MODELS["tp"]], "tp", exclude=(PATCH,), timeout=300)
    assert unpatched[0] != unpatched[1], unpatched
