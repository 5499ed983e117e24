"""An ordinary accelerate loop on load-time-sharded models (2 ranks) equals one process on the same global batch."""

from __future__ import annotations

import pytest

from shardadopt.selftest.accelerate import (compare_training, eval_rank, train_rank, train_reference)


def _new_transformers() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.17")


# (model, DistributedConfig sizes, data-parallel size) per layout; EP before 5.17 is enable_expert_parallel on tp.
LAYOUTS = {
    "fsdp": ("llama", {"fsdp_size": 2}, 2),
    "tp": ("qwen3", {"tp_size": 2}, 1),
    "ep": ("qwen3moe", {"ep_size": 2, "fsdp_size": 2}, 2),
}
LEGACY_EP = ("qwen3moe", {"tp_size": 2, "enable_expert_parallel": True}, 1)


def _layout(name: str):
    return LEGACY_EP if name == "ep" and not _new_transformers() else LAYOUTS[name]


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}

    def get(model: str, dp: int):
        if (model, dp) not in cache:
            cache[model, dp] = train_reference(tiny_models[model], dp)
        return cache[model, dp]

    return get


# transformers (5.15 and 5.24 alike) `ReplicatedWithGradAllReduce` (Qwen3 q_norm/k_norm under TP) all-reduces the *accumulated*
# `param.grad` in a post-accumulate hook, so with gradient accumulation every earlier micro-step is summed over the
# TP group again (gradients of those norms off by ~100%). Upstream bug outside accelerate; reported to the lead.
TP_ACCUM_BUG = pytest.mark.xfail(
    strict=True,
    reason="transformers ReplicatedWithGradAllReduce re-reduces accumulated grads (needs a transformers patch)")


@pytest.mark.parametrize("layout, order", [("fsdp", "together"), pytest.param("tp", "loader-first", marks=TP_ACCUM_BUG),
                                           ("ep", "separate")])
def test_training_matches_single_process(pool2, tiny_models, references, layout, order):
    model, sizes, dp = _layout(layout)
    results = pool2.run(train_rank, tiny_models[model], sizes, dp, order, timeout=300)
    expected = references(model, dp)
    problem = compare_training(results[0], expected)
    assert problem is None, problem
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"] and result["norms"] == results[0]["norms"]
        assert result["unchanged"], "prepare() changed this rank's local parameters"
    # data: dp ranks see disjoint batches, ranks of a TP group identical ones
    first, second = (r["batches"] for r in results)
    if dp == 1:
        assert first == second
    else:
        flat = lambda batches: {tuple(row) for b in batches for row in b}  # noqa: E731
        assert not flat(first) & flat(second)
    # accumulate(): FSDP2 modules reduce only on the final micro-step
    flags = results[0]["sync_flags"]
    if any(f is not None for f in flags):
        assert flags == [False, True] * (len(flags) // 2), flags


def test_ep_experts_stay_as_loaded_and_differ_between_ranks(pool2, tiny_models):
    """transformers#45662: adoption must not overwrite a rank's experts with rank 0's copy."""
    model, sizes, dp = _layout("ep")
    results = pool2.run(expert_snapshot, tiny_models[model], sizes)
    for result in results:
        assert result["unchanged"], "prepare() changed this rank's experts"
    assert results[0]["experts"] != results[1]["experts"], "each EP rank must keep its own experts"


def expert_snapshot(path: str, sizes: dict):
    import torch

    import shardadopt
    from shardadopt.selftest.accelerate import _load, _local, fresh_accelerator

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True)
        model = _load(path, sizes)
        before = {n: _local(p) for n, p in model.named_parameters() if ".experts." in n}
        model = accelerator.prepare(model)
        after = {n: _local(p) for n, p in model.named_parameters() if ".experts." in n}
        return {"unchanged": all(torch.equal(after[n], before[n]) for n in before) and len(before) > 0,
                "experts": [round(float(v.sum()), 4) for v in after.values()]}
    finally:
        shardadopt.disable()


def test_without_enable_upstream_fails(pool2, tiny_models):
    """The same TP loop without shardadopt: accelerate DDP-wraps the DTensor model (or trains on wrong data)."""
    model, sizes, dp = _layout("tp")
    results = pool2.run(train_rank, tiny_models[model], sizes, dp, "together", False, timeout=300)
    problem = compare_training(results[0], train_reference(tiny_models[model], dp))
    assert problem is not None
    if _new_transformers():
        assert "mixed torch.Tensor and DTensor" in results[0].get("error", ""), results[0]


def test_gather_for_metrics_returns_each_sample_once_under_tp(pool2, tiny_models):
    model, sizes, _ = _layout("tp")
    for result in pool2.run(eval_rank, tiny_models[model], sizes, 7):
        assert result["tensors"] == result["expected"]
        assert result["objects"] == [row[0] for row in result["expected"]]
