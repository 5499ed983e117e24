"""The ordinary accelerate loop on 4 ranks: HSDP and 2-D (fsdp x tp) models sharded at load time equal one process.

Same global batch, foreach AdamW, gradient accumulation 2, clipping, 5 optimizer steps; per-step loss and grad norm
within rtol 1e-5 (fp32), parameters after training equal the single-process reference's. transformers 5.15 can load
neither layout (no ``dp_replicate_size``; ``fsdp_size`` with ``tp_size`` refused): skipped there with the reason.
"""

from __future__ import annotations

import pytest

from shardadopt.selftest.accelerate import MAX_NORM, compare_training, train_rank, train_reference
from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes

pytestmark = pytest.mark.multiproc

def _sizes(layout: str) -> tuple[dict, int]:
    try:
        return distributed_sizes(layout, world=4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")


def _expected_topology(layout: str, rank: int) -> dict:
    """Row-major over (dp_replicate, fsdp, tp), as init_device_mesh lays ranks out."""
    if layout == "hsdp":
        return dict(dp_replicate_size=2, dp_replicate_rank=rank // 2, dp_shard_size=2, dp_shard_rank=rank % 2,
                    dp_size=4, dp_rank=rank, tp_size=1, tp_rank=0)
    return dict(dp_replicate_size=1, dp_replicate_rank=0, dp_shard_size=2, dp_shard_rank=rank // 2, dp_size=2,
                dp_rank=rank // 2, tp_size=2, tp_rank=rank % 2)


# 2-D qwen3 with accumulation needs patch transformers-tp-replicated-grad-accumulation (q_norm/k_norm grads);
# llama has no such parameter.
@pytest.mark.parametrize("layout, model", [("hsdp", "llama"), ("2d", "llama"), ("2d", "qwen3")])
def test_four_ranks_match_single_process(request, tiny_models, layout, model):
    sizes, dp = _sizes(layout)
    pool = request.getfixturevalue("pool4")  # started only when a layout can load
    results = pool.run(train_rank, tiny_models[model], sizes, dp, timeout=400)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result['error']}"
        topo = result["topology"]
        assert topo["source"] == "transformers" and topo["world_size"] == 4, topo
        assert {k: topo[k] for k in _expected_topology(layout, rank)} == _expected_topology(layout, rank), topo
    expected = train_reference(tiny_models[model], dp)
    assert min(expected["norms"]) > MAX_NORM, "clipping must be active in the reference"
    problem = compare_training(results[0], expected)
    assert problem is None, problem
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"] and result["norms"] == results[0]["norms"]
        assert result["unchanged"], "prepare() changed this rank's local parameters"
    # data: ranks of one data-parallel rank see identical batches, distinct dp ranks disjoint ones
    rows = {}
    for result in results:
        rows.setdefault(result["topology"]["dp_rank"], []).append(
            {tuple(row) for batch in result["batches"] for row in batch})
    assert len(rows) == dp
    for same in rows.values():
        assert all(s == same[0] for s in same)
    firsts = [same[0] for same in rows.values()]
    assert sum(map(len, firsts)) == len(set().union(*firsts)), "data-parallel ranks must see disjoint rows"
    # accumulate(): FSDP2 modules reduce only on the final micro-step
    flags = results[0]["sync_flags"]
    assert flags == [False, True] * (len(flags) // 2), flags


@pytest.mark.parametrize("layout", ["hsdp", "2d"])
def test_without_enable_upstream_fails(request, tiny_models, layout):
    """The same loop without shardadopt: accelerate DDP-wraps the DTensor model (fails in prepare)."""
    sizes, dp = _sizes(layout)
    pool = request.getfixturevalue("pool4")
    results = pool.run(train_rank, tiny_models["llama"], sizes, dp, "together", False, timeout=400)
    for result in results:
        assert "DTensor" in result.get("error", ""), result
