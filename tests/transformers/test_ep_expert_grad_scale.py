"""F4 transformers-ep-expert-grad-scale: with ``ep_size == fsdp_size`` (a one-rank ``efsdp`` mesh) transformers
5.19 .. 5.22 divide every expert gradient by ``fsdp_size`` twice (0.5x on 2 ranks); 5.23 fixed it.

Every gradient of tiny Qwen3-MoE under expert parallelism is compared with one process on the same global batch
(fp32, rtol 1e-5), with and without gradient accumulation. Before 5.21 expert parallelism runs on the TP mesh
without FSDP (the layout ``distributed_sizes("ep")`` picks), so there is no expert FSDP to get wrong.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

import shardadopt
from shardadopt.patching.registry import APPLIED, NOT_NEEDED
from shardadopt.selftest.trainer import full_grads, single_process_grads
from shardadopt.testing.layouts import distributed_sizes
from shardadopt.upstream.versions import installed_version

ID = "transformers-ep-expert-grad-scale"
PER_RANK_BATCH = 2
SEED = 11

pytestmark = pytest.mark.multiproc
TRANSFORMERS = installed_version("transformers")


def ep_gradients(models: dict[str, str], exclude: list[str], micro_batches: int) -> tuple[dict, list[str]]:
    """Full gradients after ``micro_batches`` accumulated backward passes over this rank's share of the batch, and
    the modules ``fix_single_rank_expert_grad_divide`` still finds to fix on the loaded model."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.parallel.moe import fix_single_rank_expert_grad_divide
    from shardadopt.testing import token_batch

    shardadopt.enable(exclude=exclude)
    try:
        sizes, dp = distributed_sizes("ep", dist.get_world_size())
        model = AutoModelForCausalLM.from_pretrained(models["qwen3moe"], dtype=torch.float32,
                                                     distributed_config=DistributedConfig(**sizes))
        batch = token_batch(SEED, PER_RANK_BATCH * dp).chunk(dp)[dist.get_rank() % dp]
        for micro in batch.chunk(micro_batches):
            (model(input_ids=micro, labels=micro).loss / micro_batches).backward()
        grads = full_grads(model)
        return grads, fix_single_rank_expert_grad_divide(model)
    finally:
        shardadopt.disable()


@pytest.fixture(scope="module")
def reference(tiny_models) -> dict[str, torch.Tensor]:
    return single_process_grads(tiny_models["qwen3moe"], "ep", SEED, per_rank_batch=PER_RANK_BATCH)


def state() -> str:
    import transformers.distributed.mixin  # noqa: F401  (the patch's target module)

    try:
        return {s.id: s.state for s in shardadopt.enable(only=[ID])}[ID]
    finally:
        shardadopt.disable()


def close(grad: torch.Tensor, expected: torch.Tensor) -> bool:
    return grad.shape == expected.shape and torch.allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_probe_follows_upstream():
    """Applied on 5.19 .. 5.22 (unconditional or non-NCCL forced sum), not-needed before (no expert FSDP divide
    factor) and from 5.23 (forced sum only when efsdp_size > 1)."""
    affected = Version("5.19") <= TRANSFORMERS < Version("5.23")
    assert state() == (APPLIED if affected else NOT_NEEDED)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_expert_grads_match_single_process(pool2, tiny_models, reference, micro_batches):
    results = pool2.run(ep_gradients, tiny_models, [], micro_batches, timeout=240)
    for rank, (grads, left_to_fix) in enumerate(results):
        assert grads.keys() == reference.keys()
        bad = [name for name, grad in grads.items() if not close(grad, reference[name])]
        assert not bad, f"rank {rank}: {len(bad)} of {len(grads)} gradients differ from one process: {bad[:5]}"
        assert not left_to_fix, left_to_fix
    assert any(".experts." in name for name in results[0][0]), "the experts must be among the compared gradients"


def test_expert_grads_halved_without_patch(pool2, tiny_models, reference):
    if state() != APPLIED:
        pytest.skip(f"transformers {TRANSFORMERS} does not divide expert gradients twice (probe: not-needed)")
    results = pool2.run(ep_gradients, tiny_models, [ID], 1, timeout=240)
    for rank, (grads, left_to_fix) in enumerate(results):
        experts = [name for name in grads if ".experts." in name]
        assert experts and all(close(grads[n], reference[n] / 2) and not close(grads[n], reference[n])
                               for n in experts), f"rank {rank}: expert grads are not 0.5x the reference"
        others = [n for n in grads if n not in experts and not close(grads[n], reference[n])]
        assert not others, f"rank {rank}: non-expert gradients differ: {others[:5]}"
        # the public function finds exactly the experts the patch would have fixed
        assert left_to_fix and all(name.endswith(".experts") for name in left_to_fix), left_to_fix
