"""TRL's DistillationTrainer (on-policy: the student samples its completions) with a load-time-sharded student and
a teacher loaded sharded the same way or plain, against the same trainer on the plain checkpoints: one process for
``tp_size=2`` (one data-parallel rank; TRL seeds each process differently, so only one process samples what the TP
group samples), DDP over 2 ranks for ``fsdp_size=2``. Two sharded models in one process share their meshes
(``transformers-reuse-device-mesh`` on transformers 5.18+) and neither waits on the other's collectives.
"""

from __future__ import annotations

import math

import pytest

from shardadopt.testing.trl import refusal_problem
from shardadopt.testing.trl_distill import RTOL, STEPS, distill_log, head_without_gradient

pytestmark = pytest.mark.multiproc

STUDENT, TEACHER = "qwen3", "llama"


@pytest.fixture(scope="module")
def reference(pool2, tiny_models, trl_tokenizer):
    """``get(dp)``: the plain run in this process (``dp=1``) or under DDP on the pool (``dp=2``), once each."""
    cache: dict[int, list] = {}

    def get(dp: int) -> list:
        if dp not in cache:
            if dp == 1:
                run = distill_log(tiny_models, trl_tokenizer, None, STUDENT, TEACHER, teacher_sharded=False, world=1)
            else:
                runs = pool2.run(distill_log, tiny_models, trl_tokenizer, None, STUDENT, TEACHER,
                                 teacher_sharded=False, timeout=300)
                assert runs[0]["log"] == runs[1]["log"], "DDP ranks log the same values"
                run = runs[0]
            assert len(run["log"]) == STEPS, run
            cache[dp] = run["log"]
        return cache[dp]

    return get


@pytest.mark.parametrize("teacher_sharded", [True, False], ids=["teacher-sharded", "teacher-plain"])
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_distillation_tracks_reference(pool2, tiny_models, trl_tokenizer, reference, layout, teacher_sharded):
    from shardadopt.adapters import dtensor_tensor_parallel

    results = pool2.run(distill_log, tiny_models, trl_tokenizer, layout, STUDENT, TEACHER,
                        teacher_sharded=teacher_sharded, timeout=300)
    for rank, result in enumerate(results):
        if result["plain_head_shard"]:  # TP shards as plain tensors (transformers 5.15/5.16): the loss reads them
            assert not dtensor_tensor_parallel()
            problem = refusal_problem(result, "distill-head")
            assert problem is None, f"{layout} rank {rank}: {problem}"
            continue
        assert "log" in result, f"rank {rank}: {result.get('refused')}"
        expected = reference(result["dp"])
        assert len(result["log"]) == STEPS
        for step, (have, want) in enumerate(zip(result["log"], expected), start=1):
            for key in ("loss", "grad_norm"):
                assert math.isclose(have[key], want[key], rel_tol=RTOL), (
                    f"{layout} rank {rank} step {step}: {key} {have[key]!r} vs reference {want[key]!r}")


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
