"""shardadopt.parallel.topology: sizes and ranks of load-time-sharded and hand-sharded models; clear errors
otherwise."""

from __future__ import annotations

import pytest
import torch

from shardadopt.parallel.topology import Topology, TopologyError, topology
from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes


def _load(path: str, **sizes):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                distributed_config=DistributedConfig(**sizes))


def _summary(t: Topology) -> dict:
    return {k: getattr(t, k) for k in ("source", "world_size", "dp_replicate_size", "dp_shard_size", "dp_size",
                                       "dp_rank", "tp_size", "tp_rank", "ep_size", "ep_rank")}


def transformers_topology(path: str, sizes: dict) -> dict:
    import torch.distributed as dist

    model = _load(path, **sizes)
    t = topology(model)
    counts = {n: t.plain_replication(p) for n, p in model.named_parameters()
              if not hasattr(p, "device_mesh")}
    # Every plain parameter's claimed replication must match reality: equal copies on exactly that many ranks.
    observed = {}
    for name, p in model.named_parameters():
        if hasattr(p, "device_mesh"):
            continue
        gathered = [torch.empty_like(p.data) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.data.contiguous())
        observed[name] = sum(torch.equal(g, p.data) for g in gathered)
    assert topology(model) is t, "topology is cached on the model"
    return {"summary": _summary(t), "counts": counts, "observed": observed}


def _expected_2rank(kind: str, sizes: dict) -> dict:
    if kind == "fsdp":
        return dict(dp_shard_size=2, tp_size=1, ep_size=1)
    if kind == "tp":
        return dict(dp_shard_size=1, tp_size=2, ep_size=1)
    # EP is ep_size x fsdp_size where DistributedConfig has ep_size, else EP on the TP mesh
    return dict(dp_shard_size=2, tp_size=1, ep_size=2) if "ep_size" in sizes else dict(dp_shard_size=1, tp_size=2,
                                                                                          ep_size=2)


def _transformers_at_least(version: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(version)


@pytest.mark.parametrize("kind, model", [("fsdp", "llama"), ("tp", "qwen3"), ("ep", "qwen3moe")])
def test_transformers_loaded_two_ranks(pool2, tiny_models, kind, model):
    old_plain_shards = not _transformers_at_least("5.16")  # 5.16 shards TP/EP as DTensors
    sizes, _ = distributed_sizes(kind, 2)
    results = pool2.run(transformers_topology, tiny_models[model], sizes)
    expected = _expected_2rank(kind, sizes)
    for rank, result in enumerate(results):
        summary = result["summary"]
        assert summary["source"] == "transformers" and summary["world_size"] == 2
        assert {k: summary[k] for k in expected} == expected
        assert summary["dp_size"] == expected["dp_shard_size"]
        assert summary["dp_rank"] == (rank if expected["dp_shard_size"] == 2 else 0)
        assert summary["tp_rank"] == (rank if expected["tp_size"] == 2 else 0)
        assert summary["ep_rank"] == (rank if expected["ep_size"] == 2 else 0)
        # claimed replication of plain tensors == how many ranks really hold the same values
        assert result["counts"] == result["observed"], (result["counts"], result["observed"])
    if old_plain_shards and kind in ("tp", "ep"):
        # transformers 5.15 keeps shards as plain tensors: some must be counted as held by one rank only
        assert 1 in results[0]["counts"].values()


@pytest.mark.parametrize("layout, model", [("2d", "llama"), ("hsdp", "qwen3")])
def test_transformers_loaded_four_ranks(pool4, tiny_models, layout, model):
    """fsdp x tp and dp_replicate x fsdp: ranks laid out row-major over (dp_replicate, fsdp, tp), whatever dims the
    installed transformers names its mesh with (no dp_replicate dim on 5.18 .. 5.20)."""
    try:
        sizes, _ = distributed_sizes(layout, 4)
    except LayoutUnsupported as exc:
        pytest.skip(f"transformers {transformers_version()} cannot load this layout: {exc}")
    from transformers.distributed import utils

    if layout == "2d" and not hasattr(utils, "initialize_distributed_mesh"):
        pytest.skip(f"transformers {transformers_version()} accepts fsdp_size x tp_size but loads it as TP alone on a "
                    "1-D mesh of tp_size ranks (prepare_distribute_model: tp wins, fsdp ignored); the other ranks fail "
                    "to load. 2-D needs initialize_distributed_mesh (5.18+)")
    results = pool4.run(transformers_topology, tiny_models[model], sizes)
    replicate, shard, tp = sizes.get("dp_replicate_size", 1), sizes.get("fsdp_size", 1), sizes.get("tp_size", 1)
    for rank, result in enumerate(results):
        summary = result["summary"]
        assert summary["source"] == "transformers" and summary["world_size"] == 4
        assert (summary["dp_replicate_size"], summary["dp_shard_size"], summary["tp_size"]) == (replicate, shard, tp)
        assert summary["tp_rank"] == rank % tp
        assert summary["dp_rank"] == rank // tp  # dp_replicate_rank * dp_shard_size + dp_shard_rank
        assert result["counts"] == result["observed"], (result["counts"], result["observed"])


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def hand_sharded(layout: str, override=None):
    from shardadopt.testing.models import hand_sharded_mlp

    model = hand_sharded_mlp(layout, width=8)
    try:
        return _summary(topology(model, override))
    except TopologyError as exc:
        return {"error": str(exc)}


def test_hand_sharded_fsdp_and_tp(pool2):
    fsdp = pool2.run(hand_sharded, "fsdp")
    assert [(r["source"], r["dp_shard_size"], r["dp_rank"], r["tp_size"]) for r in fsdp] == [
        ("hand-sharded", 2, 0, 1), ("hand-sharded", 2, 1, 1)]
    tp = pool2.run(hand_sharded, "tp")
    assert [(r["dp_size"], r["tp_size"], r["tp_rank"]) for r in tp] == [(1, 2, 0), (1, 2, 1)]
    plain = pool2.run(hand_sharded, "plain")
    assert all(r["source"] == "plain" and r["dp_size"] == 1 for r in plain)


def test_mesh_not_covering_world_is_a_clear_error(pool2):
    for result in pool2.run(hand_sharded, "partial-mesh"):
        assert "but the world has 2" in result["error"] and "cover the world" in result["error"]


def test_ambiguous_hand_sharded_mesh_needs_override(pool2):
    for result in pool2.run(hand_sharded, "ambiguous"):
        assert "ambiguous" in result["error"] and "AdoptionKwargs(topology=" in result["error"]
    resolved = pool2.run(hand_sharded, "ambiguous", {"tp": 2})
    assert [(r["source"], r["tp_size"], r["tp_rank"], r["dp_size"]) for r in resolved] == [
        ("override", 2, 0, 1), ("override", 2, 1, 1)]


def test_override_must_match_world(pool2):
    for result in pool2.run(hand_sharded, "tp", {"tp": 4}):
        assert "multiplies to 4 ranks, but the world has 2" in result["error"]
    for result in pool2.run(hand_sharded, "tp", {"tensor": 2}):
        assert "unknown topology override key" in result["error"]


def test_single_process_plain_model():
    t = topology(torch.nn.Linear(2, 2))
    assert (t.source, t.world_size, t.dp_size, t.is_sharded) == ("plain", 1, 1, False)


def test_public_name_is_callable_after_module_import():
    import importlib

    import shardadopt

    importlib.import_module("shardadopt.parallel.topology")  # binds the package attribute to the module
    assert shardadopt.topology(torch.nn.Linear(2, 2)).source == "plain"
    assert shardadopt.Topology is Topology
