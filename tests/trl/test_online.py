"""TRL's GRPOTrainer and RLOOTrainer, and a user's own sampling loop, on tensor-parallel loads: the ranks of a TP
group sample the same tokens (``transformers-tp-sampling-agreement``) and training tracks one process; on 2-D loads
each TP group seeds and sizes its generation batch as DDP's process of its data-parallel rank
(``trl-grpo-data-parallel``, ``trl-rloo-data-parallel``), and tracks DDP. On HSDP (4 data-parallel ranks) GRPO
and RLOO track DDP over 4 ranks; DistillationTrainer's 2-D (``trl-distillation-data-parallel``) and HSDP runs are
here too, with this module's 4 ranks.

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

from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.trl import MODELS, refusal_problem
from shardadopt.testing.trl_distill import RTOL as DISTILL_RTOL
from shardadopt.testing.trl_distill import STUDENT, TEACHER, distill_log
from shardadopt.testing.trl_distill import ddp_log as distill_ddp_log
from shardadopt.testing.trl_online import NUM_GENERATIONS, RTOL, online_log, sampled_tokens, tracks

pytestmark = pytest.mark.multiproc

PATCH = "transformers-tp-sampling-agreement"
TRL_PATCH = {"grpo": "trl-grpo-data-parallel", "rloo": "trl-rloo-data-parallel"}
# 2-D (fsdp_size=2, tp_size=2): each process's batch must hold whole groups of completions on a TP load (refused
# otherwise), so 2 prompts per global step: 4 rows on each of the 2 data-parallel ranks.
PER_DEVICE_2D = NUM_GENERATIONS


@pytest.fixture(scope="module")
def one_process(tiny_models, trl_tokenizer):
    """``get(kind, model="qwen3", **config)``: the TRL run on the plain checkpoint in this process (one process),
    computed once per argument set."""
    cache: dict[tuple, dict] = {}

    def get(kind: str, model: str = MODELS["tp"], **config) -> dict:
        key = (kind, model, tuple(sorted(config.items())))
        if key not in cache:
            cache[key] = online_log(tiny_models, trl_tokenizer, kind, None, model, world=1, **config)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def ddp(pool2, tiny_models, trl_tokenizer):
    """``get(kind, **config)``: the TRL run on the plain checkpoint under DDP on this module's 2 ranks (both ranks'
    results), computed once per argument set."""
    cache: dict[tuple, list[dict]] = {}

    def get(kind: str, **config) -> list[dict]:
        key = (kind, tuple(sorted(config.items())))
        if key not in cache:
            cache[key] = pool2.run(online_log, tiny_models, trl_tokenizer, kind, None, MODELS["2d"], timeout=400,
                                   **config)
        return cache[key]

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


TP_CASES = [
    ("grpo", {}),
    ("rloo", {}),
    # TRL's reference model and KL term, and old log-probs reused for a second pass over each generation batch
    ("grpo", {"beta": 0.04, "num_iterations": 2}),
    # a per-device batch of half a group: whole groups per generation batch through steps_per_generation
    ("grpo", {"per_device_train_batch_size": 2, "steps_per_generation": 2}),
    # advantages scaled over the whole gathered batch: the TP ranks' copies counted once (trl-*-data-parallel)
    ("grpo", {"scale_rewards": "batch"}),
    ("rloo", {"normalize_advantages": True}),
]


@pytest.mark.parametrize(("kind", "config"), TP_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
                         if isinstance(c, dict) else c)
def test_tp_ranks_sample_alike_and_track_one_process(pool2, tiny_models, trl_tokenizer, one_process, kind, config):
    """tp_size=2: both ranks score the same completions, the ones one process samples, and every step's loss,
    grad norm, reward and logged reward standard deviation match one process with the same config."""
    results = pool2.run(online_log, tiny_models, trl_tokenizer, kind, "tp", MODELS["tp"], timeout=400, **config)
    if refused_everywhere(results, f"{kind} tp"):
        return
    reference = one_process(kind, **config)
    assert results[0]["completions"] == results[1]["completions"], "the TP ranks sampled different completions"
    assert results[0]["completions"] == reference["completions"], "the TP group sampled other completions than " \
                                                                  "one process"
    rtol = RTOL["rloo"] if config.get("beta") else RTOL[kind]  # a plain reference model: see RTOL
    for rank, result in enumerate(results):
        problem = tracks(result, reference, rtol)
        assert problem is None, f"{kind} tp {config} rank {rank}: {problem}"


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


def test_without_the_patches_tp_ranks_sample_apart(pool2, tiny_models, trl_tokenizer, one_process):
    """The check above catches the bug: with the sampling agreement and trl-grpo-data-parallel excluded (each alone
    makes GRPO's TP ranks sample alike: the first shares the TP group's random state at generate, the second seeds
    both TP ranks by their data-parallel rank), GRPO's two TP ranks score different completions and the first step's
    grad norm is not one process's."""
    results = pool2.run(online_log, tiny_models, trl_tokenizer, "grpo", "tp", MODELS["tp"],
                        exclude=(PATCH, TRL_PATCH["grpo"]), timeout=400)
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


REFUSED = [
    # TRL accepts this on a TP load (its own check counts the TP ranks as data-parallel ranks) and refuses it under
    # DDP over the one data-parallel rank: half a group per generation batch
    ("grpo", "tp", {"per_device_train_batch_size": 2}, "partial-groups"),
    ("rloo", "tp", {"per_device_train_batch_size": 2}, "partial-groups"),
    ("grpo", "fsdp", {"use_vllm": True}, "vllm"),
    ("rloo", "fsdp", {"use_vllm": True}, "vllm"),
]


def test_refused_by_name(pool2, tiny_models, trl_tokenizer):
    """What TRL accepts on a sharded load but cannot train as DDP is refused when the trainer is built, on every
    rank, naming the fix: on tp_size=2 (one data-parallel rank) a generation batch of half a group
    (per_device_train_batch_size=2, num_generations=4: TRL refuses it under DDP over one process, and counting the
    TP ranks as processes passes its check); use_vllm=True on fsdp_size=2 (vLLM's weight sync would send DTensor
    shards)."""
    for kind, layout, config, cause in REFUSED:
        results = pool2.run(online_log, tiny_models, trl_tokenizer, kind, layout, MODELS[layout], timeout=300,
                            **config)
        for rank, result in enumerate(results):
            problem = refusal_problem(result, cause)
            assert problem is None, f"{kind} {layout} {config} rank {rank}: {problem}"


def _sizes_or_skip(layout: str) -> None:
    try:
        distributed_sizes(layout, 4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")


CASES_2D = [
    ("grpo", {"per_device_train_batch_size": PER_DEVICE_2D}),
    ("rloo", {"per_device_train_batch_size": PER_DEVICE_2D}),
    # each group of 4 completions spans the two data-parallel ranks (2 rows each), with advantages scaled over the
    # whole batch, and a second pass over each generation batch (old log-probs reused)
    ("grpo", {"per_device_train_batch_size": 2, "scale_rewards": "batch", "num_iterations": 2}),
    ("rloo", {"per_device_train_batch_size": 2, "normalize_advantages": True}),
]


@pytest.mark.parametrize(("kind", "config"), CASES_2D, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
                         if isinstance(c, dict) else c)
def test_2d_tracks_ddp(request, tiny_models, trl_tokenizer, ddp, kind, config):
    """fsdp_size=2, tp_size=2 on 4 ranks against DDP on 2: the two ranks of each TP group score the same
    completions, TP group k the ones DDP's process k samples (seeded by data-parallel rank), and every step's loss,
    grad norm, reward and logged reward standard deviation match DDP, groups that span the data-parallel ranks and
    batch-wide advantage statistics included (the TP ranks' copies gathered once, trl-*-data-parallel)."""
    _sizes_or_skip("2d")
    pool = request.getfixturevalue("pool4")
    results = pool.run(online_log, tiny_models, trl_tokenizer, kind, "2d", MODELS["2d"], world=4, timeout=600,
                       **config)
    reference = ddp(kind, **config)
    assert reference[0]["log"] == reference[1]["log"], "DDP ranks log the same values"
    for group, (first, second) in enumerate([(0, 1), (2, 3)]):
        assert results[first].get("completions") == results[second].get("completions"), (
            f"{kind} 2d: the ranks of TP group {group} sampled different completions")
        assert results[first].get("completions") == reference[group]["completions"], (
            f"{kind} 2d: TP group {group} sampled other completions than DDP's process {group}")
    for rank, result in enumerate(results):
        problem = tracks(result, reference[0], RTOL[kind])
        assert problem is None, f"{kind} 2d rank {rank}: {problem}"


def test_2d_without_the_fix_second_tp_group_samples_apart(request, tiny_models, trl_tokenizer, ddp):
    """The check above catches the bug: with trl-grpo-data-parallel excluded, TRL seeds global rank 2 (the second
    TP group's first rank) with seed + 2 where DDP's second process has seed + 1, so the second TP group samples
    other completions from the first step on, and the step's grad norm is not DDP's."""
    _sizes_or_skip("2d")
    pool = request.getfixturevalue("pool4")
    results = pool.run(online_log, tiny_models, trl_tokenizer, "grpo", "2d", MODELS["2d"], world=4,
                       per_device_train_batch_size=PER_DEVICE_2D, exclude=(TRL_PATCH["grpo"],), max_steps=1,
                       timeout=600)
    reference = ddp("grpo", per_device_train_batch_size=PER_DEVICE_2D)
    assert results[0]["completions"][0] == reference[0]["completions"][0]  # seed + 0 on both
    assert results[2]["completions"][0] == results[3]["completions"][0]  # the TP group still agrees
    assert results[2]["completions"][0] != reference[1]["completions"][0]
    step = results[0]["log"][0]["grad_norm"]
    assert not math.isclose(step, reference[0]["log"][0]["grad_norm"], rel_tol=RTOL["grpo"])


@pytest.fixture(scope="module")
def ddp4(request, tiny_models, trl_tokenizer):
    """``get(kind, model)``: the TRL run on the plain checkpoint under DDP over 4 ranks (``pool4``; all ranks'
    results), computed once per argument set: the reference of HSDP's 4 data-parallel ranks."""
    cache: dict[tuple, list[dict]] = {}

    def get(kind: str, model: str) -> list[dict]:
        if (kind, model) not in cache:
            cache[kind, model] = request.getfixturevalue("pool4").run(
                online_log, tiny_models, trl_tokenizer, kind, None, model, world=4, timeout=400)
        return cache[kind, model]

    return get


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_hsdp_tracks_ddp_over_4(request, tiny_models, trl_tokenizer, ddp4, kind):
    """dp_replicate_size=2, fsdp_size=2 (4 data-parallel ranks, one completion of the step's group each, as under
    DDP) against DDP over 4 ranks: every rank samples its DDP process's completions (TRL's per-process stream), and
    every step's loss, grad norm and reward match."""
    _sizes_or_skip("hsdp")
    pool = request.getfixturevalue("pool4")
    results = pool.run(online_log, tiny_models, trl_tokenizer, kind, "hsdp", MODELS["hsdp"], world=4, timeout=600)
    reference = ddp4(kind, MODELS["hsdp"])
    for rank, (result, expected) in enumerate(zip(results, reference)):
        assert result.get("completions") == expected["completions"], f"{kind} hsdp rank {rank}: other samples"
        problem = tracks(result, expected, RTOL[kind])
        assert problem is None, f"{kind} hsdp rank {rank}: {problem}"


@pytest.fixture(scope="module")
def distill_ddp(request, tiny_models, trl_tokenizer):
    """``get(dp)``: DistillationTrainer on the plain checkpoints under DDP over ``dp`` ranks (2: ``pool2``, 4:
    ``pool4``), once each."""
    cache: dict[int, list[dict]] = {}

    def get(dp: int) -> list[dict]:
        if dp not in cache:
            cache[dp] = distill_ddp_log(request.getfixturevalue(f"pool{dp}"), tiny_models, trl_tokenizer)
        return cache[dp]

    return get


@pytest.mark.parametrize("teacher_sharded", [True, False], ids=["teacher-sharded", "teacher-plain"])
@pytest.mark.parametrize("layout", ["2d", "hsdp"])
def test_distillation_four_ranks_track_ddp(request, tiny_models, trl_tokenizer, distill_ddp, layout,
                                           teacher_sharded):
    """DistillationTrainer (tests/trl/test_distillation.py's student and teacher), the teacher plain or loaded
    with the student's ``DistributedConfig``, on 2-D against DDP over 2 ranks and on HSDP against DDP over 4 (TRL
    seeds each process differently: the reference has the layout's data-parallel ranks; on 2-D each TP group seeds
    as DDP's process of its data-parallel rank, ``trl-distillation-data-parallel``), per-step loss and grad norm."""
    _sizes_or_skip(layout)
    _, dp = distributed_sizes(layout, 4)
    pool = request.getfixturevalue("pool4")
    results = pool.run(distill_log, tiny_models, trl_tokenizer, layout, STUDENT, TEACHER,
                       teacher_layout=layout if teacher_sharded else None, world=4, timeout=600)
    reference = distill_ddp(dp)
    for rank, result in enumerate(results):
        assert "log" in result, f"{layout} rank {rank}: {result.get('refused')}"
        for step, (have, want) in enumerate(zip(result["log"], reference, strict=True), start=1):
            for key in ("loss", "grad_norm"):
                assert math.isclose(have[key], want[key], rel_tol=DISTILL_RTOL), (
                    f"distillation {layout} rank {rank} step {step}: {key} {have[key]!r} vs DDP {want[key]!r}")


def test_distillation_2d_without_the_fix_differs(request, tiny_models, trl_tokenizer, distill_ddp):
    """The check above catches the bug: with trl-distillation-data-parallel excluded, TRL seeds global rank 2 (the
    second TP group's first rank) with seed + 2 where DDP's second process has seed + 1: that group distills other
    completions, and the first step's loss is not DDP's."""
    _sizes_or_skip("2d")
    pool = request.getfixturevalue("pool4")
    results = pool.run(distill_log, tiny_models, trl_tokenizer, "2d", STUDENT, TEACHER, teacher_layout=None, world=4,
                       exclude=("trl-distillation-data-parallel",), max_steps=1, timeout=600)
    loss = results[0]["log"][0]["loss"]
    assert not math.isclose(loss, distill_ddp(2)[0]["loss"], rel_tol=DISTILL_RTOL), loss
