"""TRL's DistillationTrainer (on-policy: the student samples its completions) with a load-time-sharded student and
a teacher loaded sharded the same way or plain, against the same trainer on the plain checkpoints: one process for
``tp_size=2`` (one data-parallel rank; TRL seeds each process differently, so only one process samples what the TP
group samples), DDP over 2 ranks for ``fsdp_size=2`` and ``ep_size=2, fsdp_size=2`` (the 4-rank layouts are in
tests/trl/test_online.py, whose ``pool4`` they share). Two sharded models in one process share their meshes
(``transformers-reuse-device-mesh`` on transformers 5.18+) and neither waits on the other's collectives.
"""

from __future__ import annotations

import math

import pytest

from shardadopt.testing.trl import MODELS, refusal_problem
from shardadopt.testing.trl_distill import RTOL, STEPS, STUDENT, TEACHER, ddp_log, distill_log, head_without_gradient

pytestmark = pytest.mark.multiproc

# transformers refuses ep_size for a model without an ep_plan (the dense Llama teacher: "`LlamaForCausalLM` has no
# `ep_plan` ... or set `ep_size=1`"): next to an ep student, a sharded teacher takes the FSDP part of its config
TEACHER_LAYOUT = {"ep": "fsdp"}


@pytest.fixture(scope="module")
def reference(pool2, tiny_models, trl_tokenizer):
    """``get(dp, student=STUDENT)``: the plain run in this process (``dp=1``) or under DDP on the pool (``dp=2``),
    once each."""
    cache: dict[tuple, list] = {}

    def get(dp: int, student: str = STUDENT) -> list:
        if (dp, student) not in cache:
            if dp == 1:
                run = distill_log(tiny_models, trl_tokenizer, None, student, TEACHER, teacher_layout=None, world=1)
                assert len(run["log"]) == STEPS, run
                cache[dp, student] = run["log"]
            else:
                cache[dp, student] = ddp_log(pool2, tiny_models, trl_tokenizer, student)
        return cache[dp, student]

    return get


@pytest.mark.parametrize("teacher_sharded", [True, False], ids=["teacher-sharded", "teacher-plain"])
@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_distillation_tracks_reference(pool2, tiny_models, trl_tokenizer, reference, layout, teacher_sharded):
    """The student: Qwen3, Qwen3-MoE on ep; the teacher (Llama) plain or loaded with the student's
    ``DistributedConfig`` (``fsdp_size=2`` next to an ep student: :data:`TEACHER_LAYOUT`)."""
    from shardadopt.adapters import dtensor_tensor_parallel

    student = MODELS["ep"] if layout == "ep" else STUDENT
    results = pool2.run(distill_log, tiny_models, trl_tokenizer, layout, student, TEACHER,
                        teacher_layout=TEACHER_LAYOUT.get(layout, layout) if teacher_sharded else None, timeout=300)
    for rank, result in enumerate(results):
        if result["plain_head_shard"]:  # TP shards as plain tensors (transformers 5.15/5.16): the loss reads them
            assert not dtensor_tensor_parallel()
            problem = refusal_problem(result, "distill-head")
            assert problem is None, f"{layout} rank {rank}: {problem}"
            continue
        assert "log" in result, f"rank {rank}: {result.get('refused')}"
        expected = reference(result["dp"], student)
        assert len(result["log"]) == STEPS
        for step, (have, want) in enumerate(zip(result["log"], expected), start=1):
            for key in ("loss", "grad_norm"):
                assert math.isclose(have[key], want[key], rel_tol=RTOL), (
                    f"{layout} rank {rank} step {step}: {key} {have[key]!r} vs reference {want[key]!r}")


# 2 x 2 accumulated: generated once per optimizer step, from the first of the two micro-batches' prompts
ACCUMULATION = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}


@pytest.fixture(scope="module")
def accumulated_one_process(tiny_models, trl_tokenizer):
    """:data:`ACCUMULATION` on the plain checkpoints in this process, once."""
    run = distill_log(tiny_models, trl_tokenizer, None, STUDENT, TEACHER, teacher_layout=None, world=1,
                      **ACCUMULATION)
    assert len(run["log"]) == STEPS, run
    return run["log"]


@pytest.mark.parametrize("from_path", [False, True], ids=["loaded", "path-loaded"])
def test_accumulation_on_tp_tracks_one_process(pool2, tiny_models, trl_tokenizer, accumulated_one_process,
                                               from_path):
    """``trl-distillation-data-parallel``: gradient_accumulation_steps=2 on a tp_size=2 student (given loaded, or
    loaded by TRL from a path with a ``distributed_config`` in ``model_init_kwargs``) tracks one process: the
    sampler's blocks count the one data-parallel rank (unpatched they counted both TP ranks: step 2 trained the
    first step's prompts again, loss 0.02356 where one process gives 0.02580)."""
    results = pool2.run(distill_log, tiny_models, trl_tokenizer, "tp", STUDENT, TEACHER, teacher_layout=None,
                        from_path=from_path, timeout=300, **ACCUMULATION)
    from shardadopt.adapters import dtensor_tensor_parallel

    for rank, result in enumerate(results):
        if not dtensor_tensor_parallel():  # transformers 5.15/5.16: the loss would read a plain TP head shard
            problem = refusal_problem(result, "distill-head")
            assert problem is None, f"rank {rank}: {problem}"
            continue
        assert "log" in result, f"rank {rank}: {result.get('refused')}"
        for step, (have, want) in enumerate(zip(result["log"], accumulated_one_process, strict=True), start=1):
            for key in ("loss", "grad_norm"):
                assert math.isclose(have[key], want[key], rel_tol=RTOL), (
                    f"tp accumulated rank {rank} step {step}: {key} {have[key]!r} vs one process {want[key]!r}")


def test_teacher_head_without_gradient_backward(pool2):
    """``torch-dtensor-redistribute-no-grad``: backward through a sharded teacher head's ``full_tensor()`` that
    received no gradient (TRL's distillation loss) passes none back, and a real gradient still flows; without the
    patch torch's ``Redistribute.backward`` fails on autograd's plain zeros."""
    import torch

    for rank, result in enumerate(pool2.run(head_without_gradient, timeout=120)):
        assert "error" not in result, f"rank {rank}: {result['error']}"
        torch.testing.assert_close(result["hidden_grad"], result["expected_hidden_grad"])
        torch.testing.assert_close(result["teacher_grad"], result["expected_teacher_grad"])
    from shardadopt.patches.torch_dtensor_redistribute_no_grad import probe

    if not probe().needed:  # the installed torch has the fix
        return
    for rank, result in enumerate(pool2.run(head_without_gradient, exclude=("torch-dtensor-redistribute-no-grad",),
                                            timeout=120)):
        # upstream-private: the AttributeError torch raises names its DTensor's local tensor attribute
        assert "_local_tensor" in result.get("error", ""), f"rank {rank}: the probe's broken shape passes: {result}"
