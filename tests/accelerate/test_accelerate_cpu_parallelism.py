"""accelerate-cpu-parallelism-config: a ParallelismConfig works on CPU processes (gloo) once the patch is on."""

from __future__ import annotations

import pytest

from shardadopt.testing.accelerator import fresh_accelerator

PATCH_ID = "accelerate-cpu-parallelism-config"


def build_with_config(patched: bool, sizes: dict[str, int]):
    """Build an Accelerator with ParallelismConfig(**sizes): the error text, or what its mesh and loader look like."""
    import torch
    import torch.distributed as dist
    from accelerate import ParallelismConfig

    import shardadopt

    if patched:
        shardadopt.enable(only=[PATCH_ID])
    else:
        shardadopt.disable()
    try:
        try:
            accelerator = fresh_accelerator(cpu=True, parallelism_config=ParallelismConfig(**sizes))
        except ValueError as exc:
            return {"error": str(exc)}
        loader = accelerator.prepare_data_loader(torch.utils.data.DataLoader(torch.arange(16), batch_size=2))
        batches = [b.tolist() for b in loader]
        return {"mesh": accelerator.torch_device_mesh.mesh_dim_names, "type": str(accelerator.distributed_type),
                "batches": batches, "rank": dist.get_rank()}
    finally:
        shardadopt.disable()


def test_upstream_refuses_parallelism_config_on_cpu(pool2):
    results = pool2.run(build_with_config, False, {"tp_size": 2})
    for result in results:
        assert "ParallelismConfig is only compatible" in result.get("error", ""), result


def test_tp_config_accepted_and_tp_ranks_share_batches(pool2):
    results = pool2.run(build_with_config, True, {"tp_size": 2})
    assert all("error" not in r for r in results), results
    assert all(r["type"].endswith("MULTI_CPU") and "tp" in r["mesh"] for r in results)
    # one data-parallel rank: both TP ranks see the whole dataset, in the same order
    assert results[0]["batches"] == results[1]["batches"] == [[i, i + 1] for i in range(0, 16, 2)]


def test_dp_shard_config_splits_data(pool2):
    results = pool2.run(build_with_config, True, {"dp_shard_size": 2})
    first, second = (sum(r["batches"], []) for r in results)
    assert not set(first) & set(second) and sorted(first + second) == list(range(16))


@pytest.mark.parametrize("patched", [False, True])
def test_single_process_is_untouched(patched):
    """One process: accelerate never refused (total_size 1); the patch changes nothing there."""
    import shardadopt

    if patched:
        shardadopt.enable(only=[PATCH_ID])
    try:
        from accelerate import ParallelismConfig

        accelerator = fresh_accelerator(cpu=True, parallelism_config=ParallelismConfig())
        assert accelerator.num_processes == 1
    finally:
        shardadopt.disable()


def prepare_with_dp_shard(path: str, sharded_load: bool) -> dict:
    """The user's script with shardadopt enabled: load the model (whole, or sharded with DistributedConfig), build an
    Accelerator with ParallelismConfig(dp_shard_size=2) on CPU and prepare model and optimizer."""
    import torch
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM

    import shardadopt

    shardadopt.enable()
    try:
        kwargs = {}
        if sharded_load:
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(fsdp_size=2)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        accelerator = fresh_accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2))
        try:
            prepared, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        except ValueError as exc:
            return {"error": str(exc)}
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in prepared.parameters())
        return {"wrapper": type(prepared).__name__, "local": local,
                "whole": sum(p.numel() for p in prepared.parameters())}
    finally:
        shardadopt.disable()


def test_dp_shard_config_refuses_a_whole_model(pool2, tiny_models):
    """A plain load under ParallelismConfig(dp_shard_size=2) would be DDP-wrapped (full replicas): refused, naming the
    load-time fix; the same config with the model sharded at load is adopted, one shard per rank."""
    refused = pool2.run(prepare_with_dp_shard, tiny_models["llama"], False)
    for result in refused:
        error = result.get("error", "")
        assert "dp_shard_size=2" in error and "DistributedConfig(fsdp_size=2)" in error, result
    adopted = pool2.run(prepare_with_dp_shard, tiny_models["llama"], True)
    for result in adopted:
        assert "error" not in result and result["wrapper"] != "DistributedDataParallel", result
        assert result["local"] < result["whole"], result
