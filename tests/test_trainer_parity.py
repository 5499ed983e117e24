"""Trainer on models sharded at load time: per-step loss and grad_norm equal a single-process Trainer.

2 ranks: FSDP, TP, EP (+FSDP from transformers 5.21; before that EP lives on the TP mesh and has no FSDP).
4 ranks: HSDP and 2-D fsdp x tp (transformers 5.15 can load neither: skipped there with the reason).
Same global batch, same sample order, fp32, rtol 1e-5, 5 optimizer steps with clipping active (grad norm > 1).
"""

from __future__ import annotations

import pytest

from shardadopt.selftest.trainer import LayoutUnsupported, compare_logs, distributed_sizes, train_log

pytestmark = pytest.mark.multiproc
STEPS = 5


def train_or_error(models: dict[str, str], layout: str, steps: int) -> str:
    """Upstream alone (no shardadopt): the error each rank hits, so the pool survives for the next test."""
    try:
        train_log(models, layout, steps, enable=False)
    except Exception as exc:  # the failure is the result under test
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def assert_parity(request, pool_fixture: str, models: dict[str, str], layout: str, **kwargs) -> None:
    try:
        distributed_sizes(layout)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    pool = request.getfixturevalue(pool_fixture)  # started only when some layout can run
    expected = train_log(models, layout, STEPS, single_process=True, **kwargs)
    assert len(expected) == STEPS and expected[0]["grad_norm"] > 1.0, "clipping must be active in the control"
    results = pool.run(train_log, models, layout, STEPS, **kwargs, timeout=240)
    for rank, result in enumerate(results):
        problem = compare_logs(result, expected)
        assert problem is None, f"{layout} rank {rank}: {problem}"


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_two_ranks_match_single_process(request, tiny_models, layout):
    assert_parity(request, "pool2", tiny_models, layout)


def test_model_init_with_tensor_parallel_load_matches_single_process(request, tiny_models):
    # Upstream builds the accelerator before model_init has a model (no ParallelismConfig): each TP rank then got
    # its own batch (patch trainer-model-init-parallelism).
    assert_parity(request, "pool2", tiny_models, "tp", model_init=True)


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_gradient_accumulation_matches_single_process(request, tiny_models, layout):
    # TP is left out on purpose: upstream's `replicated_with_grad_allreduce` (Qwen3 q_norm/k_norm) all-reduces the
    # accumulated .grad after every micro-batch, so earlier micro-batches are summed again (5.15 and 5.24 alike).
    assert_parity(request, "pool2", tiny_models, layout, grad_accum=2)


def test_upstream_alone_cannot_train_fsdp_model(pool2, tiny_models):
    """What the patches fix: without shardadopt, Trainer on an FSDP model fails on releases without adoption."""
    import inspect

    from transformers import Trainer

    if "is_distributed_loading_by_transformers" in inspect.getsource(Trainer.__init__):
        pytest.skip("this transformers' Trainer adopts load-time-sharded models itself (5.19+)")
    errors = pool2.run(train_or_error, tiny_models, "fsdp", 1, timeout=120)
    assert all(error != "trained" for error in errors), errors
    assert any("DTensor" in error for error in errors), errors


@pytest.mark.parametrize("layout", ["hsdp", "2d"])
def test_four_ranks_match_single_process(request, tiny_models, layout):
    assert_parity(request, "pool4", tiny_models, layout)
