"""``transformers-reuse-device-mesh``: sharded loads with the same layout share one device mesh.

transformers 5.18+ build new meshes (a process group per dimension) on every sharded ``from_pretrained``; a search
whose ``model_init`` shards while loading piles them up trial after trial. The tests count the registered process
groups over repeated loads with and without the patch, and check that models sharing a mesh still compute one
process's gradients on the same global batch (FSDP and EP on 2 ranks, 2-D on 4).
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from packaging.version import Version

import shardadopt
from shardadopt import upstream
from shardadopt.selftest.trainer import full_grads, single_process_grads
from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes

pytestmark = pytest.mark.multiproc

ID = "transformers-reuse-device-mesh"
TRANSFORMERS = Version(version("transformers"))
BUILDS_MESHES_PER_LOAD = TRANSFORMERS >= Version("5.18")
# 5.18 builds one (pp, fsdp, tp) mesh, which torch backs with the default group on 2 ranks (new groups only for
# layouts of several dimensions); the expert mesh beside it adds groups on 2 ranks too (measured on 5.20.2, 5.22.0
# and 5.24.0: 4, 4 and 6 per load).
GROUPS_PER_LOAD_ON_TWO_RANKS = TRANSFORMERS >= Version("5.20")
SEED = 5
PER_RANK_BATCH = 2
LOADS = 3


def _registered_groups() -> int:
    return len(upstream.registered_process_groups())


def group_counts(models: dict[str, str], patched: bool) -> list[tuple[str, int]]:
    """On every rank: load FSDP, TP, FSDP, TP, ... and the number of registered process groups after each load."""
    import gc

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    shardadopt.enable() if patched else shardadopt.disable()
    try:
        counts = [("start", _registered_groups())]
        for _ in range(LOADS):
            for layout in ("fsdp", "tp"):
                sizes, _ = distributed_sizes(layout, dist.get_world_size())
                model = AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float32,
                                                             distributed_config=DistributedConfig(**sizes))
                del model
                gc.collect()
                counts.append((layout, _registered_groups()))
        return counts
    finally:
        shardadopt.disable()


def shared_mesh_grads(models: dict[str, str], layout: str) -> tuple[bool, dict, dict]:
    """On every rank: two models loaded with one layout; whether their meshes use the same process groups, and each
    one's full grads after one backward on this rank's share of the global batch."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.selftest.trainer import LAYOUTS
    from shardadopt.testing import token_batch

    shardadopt.enable()
    try:
        sizes, dp = distributed_sizes(layout, dist.get_world_size())
        first, second = (AutoModelForCausalLM.from_pretrained(models[LAYOUTS[layout].model], dtype=torch.float32,
                                                              distributed_config=DistributedConfig(**sizes))
                         for _ in range(2))
        dp_rank = shardadopt.topology(first).dp_rank
        batch = token_batch(SEED, PER_RANK_BATCH * dp).chunk(dp)[dp_rank]
        grads = []
        for model in (first, second):
            model(input_ids=batch, labels=batch).loss.backward()
            grads.append(full_grads(model))
        same_groups = all(a is b for a, b in zip(upstream.model_device_mesh(first).get_all_groups(),
                                                 upstream.model_device_mesh(second).get_all_groups(), strict=True))
        return same_groups, grads[0], grads[1]
    finally:
        shardadopt.disable()


def rebuilt_after_destroy(models: dict[str, str]) -> tuple[bool, bool] | None:
    """On every rank: load, destroy one of the mesh's process groups, load again: (new mesh?, loss finite?); None
    when the mesh has no group of its own to destroy."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.testing import token_batch

    shardadopt.enable()
    try:
        sizes, _ = distributed_sizes("fsdp", dist.get_world_size())

        def load():
            return AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float32,
                                                        distributed_config=DistributedConfig(**sizes))

        first = load()
        mesh = upstream.model_device_mesh(first)
        meshes = [mesh] if isinstance(mesh, DeviceMesh) else list(upstream.mesh_manager_meshes(mesh))
        doomed = next((group for mesh in meshes for group in mesh.get_all_groups() if group is not dist.group.WORLD),
                      None)
        if doomed is None:
            return None
        dist.destroy_process_group(doomed)
        second = load()
        batch = token_batch(SEED, PER_RANK_BATCH)
        loss = second(input_ids=batch, labels=batch).loss
        return doomed not in upstream.model_device_mesh(second).get_all_groups(), bool(torch.isfinite(loss))
    finally:
        shardadopt.disable()


# -- tests ----------------------------------------------------------------------------------------------------------

def test_probe_follows_upstream():
    import transformers.distributed.mixin  # noqa: F401  (the patch's target module)

    try:
        state = {s.id: s for s in shardadopt.enable(only=[ID])}[ID]
    finally:
        shardadopt.disable()
    assert state.state == ("applied" if BUILDS_MESHES_PER_LOAD else "not-needed"), state.reason


def test_repeated_loads_add_no_process_groups(pool2, tiny_models):
    patched = pool2.run(group_counts, tiny_models, True)
    assert patched[0] == patched[1]
    after_first_round = patched[0][2][1]  # after the first FSDP and the first TP load
    assert all(count == after_first_round for _, count in patched[0][3:]), patched[0]
    unpatched = pool2.run(group_counts, tiny_models, False)
    growth = unpatched[0][-1][1] - unpatched[0][2][1]
    if GROUPS_PER_LOAD_ON_TWO_RANKS:
        assert growth > 0, f"transformers {TRANSFORMERS} no longer adds process groups per load: {unpatched[0]}"
    else:
        assert growth == 0, unpatched[0]


@pytest.fixture(scope="module")
def reference(tiny_models):
    """One process's gradients per model on each layout's global batch."""
    from shardadopt.selftest.trainer import LAYOUTS

    cache: dict[str, dict] = {}

    def get(layout: str, world: int) -> dict:
        if layout not in cache:
            cache[layout] = single_process_grads(tiny_models[LAYOUTS[layout].model], layout, SEED,
                                                 per_rank_batch=PER_RANK_BATCH, world=world)
        return cache[layout]

    return get


def _check_shared(results, expected: dict) -> None:
    shared, first, second = results[0]
    # 5.18+: through the patch; before, torch backs both models' 1-D world meshes with the default group.
    assert shared
    for grads in (first, second):
        bad = [name for name, grad in grads.items()
               if not torch.allclose(grad, expected[name], rtol=1e-5, atol=1e-7)]
        assert not bad, bad


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_models_sharing_a_mesh_train_like_one_process(pool2, tiny_models, reference, layout):
    _check_shared(pool2.run(shared_mesh_grads, tiny_models, layout), reference(layout, 2))


def test_two_d_models_sharing_a_mesh_train_like_one_process(pool4, tiny_models, reference):
    try:
        distributed_sizes("2d", 4)
    except LayoutUnsupported as exc:
        pytest.skip(str(exc))
    _check_shared(pool4.run(shared_mesh_grads, tiny_models, "2d"), reference("2d", 4))


@pytest.mark.skipif(not BUILDS_MESHES_PER_LOAD, reason=f"transformers {TRANSFORMERS} builds no per-load meshes")
def test_a_mesh_with_a_destroyed_group_is_rebuilt(pool2, tiny_models):
    results = pool2.run(rebuilt_after_destroy, tiny_models)
    if results[0] is None:
        pytest.skip(f"transformers {TRANSFORMERS} backs a 2-rank FSDP mesh with the default group alone")
    for rebuilt, finite in results:
        assert rebuilt and finite
