"""shardadopt.checkpoint on 2 gloo ranks: exact resume in fresh processes (FSDP, TP, EP+FSDP), a crash during a
save, resharding, mismatches, and the streamed full export that plain ``from_pretrained`` loads.

The first pool runs every layout uninterrupted (saving at step 2) and ends by being killed mid-save; a second,
fresh pool resumes. The reference for a resumed run is the uninterrupted run of the same layout.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardadopt import checkpoint
from shardadopt.selftest import checkpoint as scenario
from shardadopt.testing import RankError, RankPool, RankTimeout, token_batch
from shardadopt.testing.patching import keeps_patch_state

pytestmark = pytest.mark.multiproc
SAVE_AT, TOTAL = 2, 4


def crash_mid_save(path: str, distributed: dict[str, int], directory: str) -> None:
    """Rank 1 SIGKILLs itself right after writing its DCP shard, before the save can complete."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    import shardadopt

    shardadopt.enable()
    model, optimizer, scheduler = scenario.build(path, distributed)
    scenario.train_steps(model, optimizer, scheduler, distributed, 1)
    original = filesystem.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        result = original(self, plan, planner)
        if dist.get_rank() == 1:
            result.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    filesystem.FileSystemWriter.write_data = write_then_die
    checkpoint.save(directory, model, optimizer, scheduler, step=99)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, root):
    """Every layout run for TOTAL steps with a checkpoint at SAVE_AT, then a save killed half-way (fsdp)."""
    expected = {}
    pool = RankPool(2)
    try:
        for name, (model, distributed) in scenario.LAYOUTS.items():
            expected[name] = pool.run(scenario.run_and_save, tiny_models[model], distributed,
                                      os.path.join(root, name), SAVE_AT, TOTAL, timeout=120)[0]
        model, distributed = scenario.LAYOUTS["fsdp"]
        with pytest.raises((RankError, RankTimeout)):
            pool.run(crash_mid_save, tiny_models[model], distributed, os.path.join(root, "fsdp", "step-99"),
                     timeout=60)
    finally:
        pool.close(force=True)
    return expected


@pytest.fixture(scope="module")
def fresh_pool(uninterrupted):
    with RankPool(2) as pool:
        yield pool


@pytest.mark.parametrize("layout", list(scenario.LAYOUTS))
def test_resume_in_fresh_processes_is_exact(layout, tiny_models, root, uninterrupted, fresh_pool):
    model, distributed = scenario.LAYOUTS[layout]
    results = fresh_pool.run(scenario.resume, tiny_models[model], distributed, os.path.join(root, layout), TOTAL,
                             timeout=120)
    for result in results:
        assert (result["step"], result["extra"], result["resharded"], result["rng_restored"]) == (
            SAVE_AT, {"next_step": SAVE_AT}, False, True)
    assert scenario.compare_exact(results[0], uninterrupted[layout], SAVE_AT) is None
    assert results[0]["lr"] == uninterrupted[layout]["lr"]


def test_crash_mid_save_leaves_no_complete_checkpoint(root, uninterrupted):
    fsdp_root = os.path.join(root, "fsdp")
    partial = os.path.join(fsdp_root, ".step-99.partial")
    assert os.path.isdir(os.path.join(partial, "state")), "the killed save should have left its staging directory"
    assert not os.path.exists(os.path.join(fsdp_root, "step-99"))
    assert checkpoint.latest(fsdp_root) == os.path.join(fsdp_root, f"step-{SAVE_AT}")
    with pytest.raises(checkpoint.IncompleteCheckpointError,
                       match=r"not a complete checkpoint.*interrupted.*latest complete checkpoint.*step-2"):
        checkpoint.read_info(partial)


def test_resume_after_crash_uses_previous_checkpoint(tiny_models, root, uninterrupted, fresh_pool):
    # the fresh pool resumes whatever latest() finds under the root the crash left behind
    model, distributed = scenario.LAYOUTS["fsdp"]
    result = fresh_pool.run(scenario.resume, tiny_models[model], distributed, os.path.join(root, "fsdp"), TOTAL,
                            timeout=120)[0]
    assert result["step"] == SAVE_AT
    assert scenario.compare_exact(result, uninterrupted["fsdp"], SAVE_AT) is None


@keeps_patch_state
def load_into(path: str, distributed: dict[str, int], directory: str, reshard: bool) -> dict:
    import shardadopt

    shardadopt.enable()
    model, optimizer, scheduler = scenario.build(path, distributed)
    try:
        info = checkpoint.load(directory, model, optimizer, scheduler, reshard=reshard)
    except checkpoint.CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"resharded": info.resharded, "rng_restored": info.rng_restored, "params": scenario.full_params(model),
            "optimizer": scenario.full_optimizer_state(model, optimizer)}


def assert_same_state(result: dict, expected: dict) -> None:
    for name, value in expected["params_at_save"].items():
        assert torch.equal(result["params"][name], value), name
    for name, state in expected["optimizer_at_save"].items():
        for key, value in state.items():
            assert torch.equal(result["optimizer"][name][key], value), (name, key)


def test_reshard_fsdp_checkpoint_into_tensor_parallel(tiny_models, root, uninterrupted, fresh_pool):
    path = tiny_models["qwen3"]
    directory = os.path.join(root, "fsdp", f"step-{SAVE_AT}")
    if uninterrupted["tp"]["rank_local"]:
        refused = fresh_pool.run(load_into, path, {"tp_size": 2}, directory, True, timeout=120)
        assert "cannot be resharded" in refused[0]["error"], refused[0]
        return
    results = fresh_pool.run(load_into, path, {"tp_size": 2}, directory, True, timeout=120)
    assert results[0]["resharded"] and not results[0]["rng_restored"]
    assert_same_state(results[0], uninterrupted["fsdp"])
    refused = fresh_pool.run(load_into, path, {"tp_size": 2}, directory, False, timeout=120)
    assert refused[0]["error"].startswith("CheckpointMismatchError") and "world size 2" in refused[0]["error"]
    assert "tp_size" in refused[0]["error"] and "reshard=True" in refused[0]["error"]


@pytest.mark.parametrize("layout", list(scenario.LAYOUTS))
def test_reshard_into_a_single_process(layout, tiny_models, root, uninterrupted):
    model, _ = scenario.LAYOUTS[layout]
    directory = os.path.join(root, layout, f"step-{SAVE_AT}")
    if uninterrupted[layout]["rank_local"]:
        # transformers 5.15 TP/EP keeps plain per-rank shards: no placement to reshard from, so a clear refusal
        result = load_into(tiny_models[model], None, directory, True)
        assert result["error"].startswith("CheckpointMismatchError") and "cannot be resharded" in result["error"]
        return
    with pytest.warns(UserWarning, match="resharded"):
        result = load_into(tiny_models[model], None, directory, True)
    assert result["resharded"] and not result["rng_restored"]
    assert_same_state(result, uninterrupted[layout])


def test_different_model_is_refused_with_names(tiny_models, root, uninterrupted):
    result = load_into(tiny_models["qwen3moe"], None, os.path.join(root, "fsdp", f"step-{SAVE_AT}"), True)
    assert result["error"].startswith("CheckpointMismatchError")
    assert "missing from the checkpoint" in result["error"] and "experts" in result["error"]


def export(path: str, distributed: dict[str, int], directory: str, out: str) -> dict:
    """Load the step-2 checkpoint into a sharded model, export it, and compute its logits on a fixed batch."""
    import shardadopt
    from shardadopt.testing import full

    shardadopt.enable()
    model, optimizer, scheduler = scenario.build(path, distributed)
    checkpoint.load(directory, model, optimizer, scheduler)
    files = checkpoint.save_full(model, out, max_shard_size="100KB")
    ids = token_batch(7, 2)
    with torch.no_grad():
        logits = full(model(input_ids=ids).logits).detach().clone()
    return {"files": files, "logits": logits}


@pytest.mark.parametrize("layout", list(scenario.LAYOUTS))
def test_full_export_loads_with_plain_from_pretrained(layout, tiny_models, root, uninterrupted, fresh_pool,
                                                      tmp_path):
    from transformers import AutoModelForCausalLM

    model, distributed = scenario.LAYOUTS[layout]
    if uninterrupted[layout]["rank_local"]:
        pytest.skip("this transformers release keeps TP shards as plain per-rank tensors without placements; "
                    "save_full refuses them (tested in test_save_full_refuses_rank_local_shards)")
    out = str(tmp_path / layout)
    results = fresh_pool.run(export, tiny_models[model], distributed,
                             os.path.join(root, layout, f"step-{SAVE_AT}"), out, timeout=120)
    assert len(results[0]["files"]) > 1 and results[1]["files"] == []  # streamed into several shards by rank 0
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, value in uninterrupted[layout]["params_at_save"].items():
        assert torch.equal(plain.get_parameter(name), value), name
    with torch.no_grad():
        logits = plain(input_ids=token_batch(7, 2)).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)


def save_full_error(path: str, distributed: dict[str, int], out: str) -> str | None:
    model = scenario.load_model(path, distributed)
    try:
        checkpoint.save_full(model, out)
    except checkpoint.CheckpointError as exc:
        return str(exc)
    return None


def test_save_full_refuses_rank_local_shards(tiny_models, uninterrupted, fresh_pool, tmp_path):
    if not uninterrupted["tp"]["rank_local"]:
        pytest.skip("this transformers release shards TP with DTensors (exported in test_full_export_*)")
    errors = fresh_pool.run(save_full_error, tiny_models["llama"], {"tp_size": 2}, str(tmp_path / "x"))
    assert all(e and "plain per-rank shards" in e for e in errors), errors


def gather_layouts() -> dict[str, bool]:
    """Each hand-built layout gathered to rank 0 (point-to-point, or the full_tensor fallback) equals the source."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from shardadopt.checkpoint.export import _gather_to_root

    line, grid = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    flat = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    source = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7)  # odd sizes: uneven shards
    layouts = {"shard0-uneven": (line, [Shard(0)]), "shard1": (line, [Shard(1)]), "replicate": (line, [Replicate()]),
               "2d-shard-replicate": (grid, [Shard(1), Replicate()]), "2d-replicate-shard": (flat, [Replicate(),
                                                                                                    Shard(0)]),
               "1-row": (line, [Shard(0)])}
    out = {}
    for name, (mesh, placements) in layouts.items():
        tensor = source[:1] if name == "1-row" else source  # rank 1 holds an empty piece
        value = _gather_to_root(distribute_tensor(tensor, mesh, placements))
        out[name] = torch.equal(value, tensor) if dist.get_rank() == 0 else value is None
    partial = DTensor.from_local(source * 0.5, line, [Partial()])  # halves on each rank, summing exactly
    value = _gather_to_root(partial)  # Partial needs a reduction: full_tensor fallback
    out["partial"] = torch.equal(value, source) if dist.get_rank() == 0 else value is None
    return out


def test_gather_to_rank0_covers_placements(fresh_pool):
    for rank, result in enumerate(fresh_pool.run(gather_layouts, timeout=60)):
        assert all(result.values()), (rank, result)
