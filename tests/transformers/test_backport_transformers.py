"""Backports F1-F3 (transformers 5.15 / 5.16): each fails without its patch and matches one process with it.

F1 transformers-sharding-sizes, F2 transformers-ep-grouped-mm-sentinel, F3 transformers-ep-router-grad. Expert
parallelism is configured as each release spells it: ``tp_size=2, enable_expert_parallel=True`` (one data-parallel
rank: both ranks see the same batch) before 5.21, ``ep_size=2, fsdp_size=2`` (two data-parallel ranks) from 5.21.
Every gradient, the router gates' and the experts' included, is compared with a single process on the same global
batch (rtol 1e-5, fp32).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from packaging.version import Version

import shardadopt
from shardadopt import upstream
from shardadopt.patching.registry import APPLIED, NOT_NEEDED
from shardadopt.selftest.trainer import full_grads, single_process_grads
from shardadopt.testing.layouts import distributed_sizes
from shardadopt.upstream.versions import installed_version

SIZES = "transformers-sharding-sizes"
SENTINEL = "transformers-ep-grouped-mm-sentinel"
ROUTER = "transformers-ep-router-grad"
ROUTER_POST_FORWARD = "transformers-ep-router-grad-post-forward"  # the same fix in the 5.16 code layout
PER_RANK_BATCH = 2
SEED = 7

pytestmark = pytest.mark.multiproc
TRANSFORMERS = installed_version("transformers")
OLD_EP = TRANSFORMERS < Version("5.17")  # F2 and F3 landed in 5.17 (FINDINGS table)


class NaNTailGroupedMM(torch.autograd.Function):
    """A grouped GEMM kernel that writes NaN into every row beyond ``offs[-1]``, in its output and its d_input.

    ``torch._grouped_mm`` leaves those rows undefined (uninitialised memory on CUDA), so NaN is a value the real
    kernel is allowed to produce; this makes CPU runs show what CUDA can.
    """

    kernel = None  # upstream's own grouped GEMM, set by install_nan_tail_kernel

    @staticmethod
    def forward(ctx, input, weight, offs):
        ctx.save_for_backward(input, weight, offs)
        out = NaNTailGroupedMM.kernel(input, weight, offs).clone()
        out[int(offs[-1]):] = float("nan")
        return out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, offs = ctx.saved_tensors
        with torch.enable_grad():
            leaf_input, leaf_weight = input.detach().requires_grad_(), weight.detach().requires_grad_()
            out = NaNTailGroupedMM.kernel(leaf_input, leaf_weight, offs)
            grad_input, grad_weight = torch.autograd.grad(out, (leaf_input, leaf_weight), grad_output)
        grad_input = grad_input.clone()
        grad_input[int(offs[-1]):] = float("nan")
        return grad_input, grad_weight, None


def install_nan_tail_kernel():
    from transformers.integrations import moe

    original = moe._grouped_mm  # upstream-private: the fault goes where upstream's kernel sits
    NaNTailGroupedMM.kernel = original
    moe._grouped_mm = NaNTailGroupedMM.apply  # upstream-private: as above
    return lambda: setattr(moe, "_grouped_mm", original)  # upstream-private: as above


# -- worker functions (run on every rank) -------------------------------------------------------------------------

def sharding_record(models: dict[str, str], exclude: list[str]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    shardadopt.enable(exclude=exclude)
    try:
        seen = {}
        for label, sizes, family in (("fsdp", {"fsdp_size": 2}, "llama"), ("tp", {"tp_size": 2}, "qwen3")):
            model = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32,
                                                         distributed_config=DistributedConfig(**sizes))
            seen[label] = (*(getattr(model, name, None) for name in upstream.MODEL_SHARDING_SIZE_ATTRIBUTES),
                           getattr(model, "fsdp_size", "missing"))
        return seen
    finally:
        shardadopt.disable()


def ep_gradients(models: dict[str, str], exclude: list[str], nan_tail: bool) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.testing import token_batch

    shardadopt.enable(exclude=exclude)
    restore = install_nan_tail_kernel() if nan_tail else (lambda: None)
    try:
        sizes, dp = distributed_sizes("ep", dist.get_world_size())
        model = AutoModelForCausalLM.from_pretrained(models["qwen3moe"], dtype=torch.float32,
                                                     distributed_config=DistributedConfig(**sizes))
        batch = token_batch(SEED, PER_RANK_BATCH * dp).chunk(dp)[dist.get_rank() % dp]
        model(input_ids=batch, labels=batch).loss.backward()
        return full_grads(model)
    finally:
        restore()
        shardadopt.disable()


# -- tests ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ep_reference(tiny_models) -> dict[str, torch.Tensor]:
    return single_process_grads(tiny_models["qwen3moe"], "ep", SEED, per_rank_batch=PER_RANK_BATCH)


def mismatched(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    assert grads.keys() == reference.keys()
    return [name for name, grad in grads.items()
            if grad.shape != reference[name].shape or not torch.allclose(grad, reference[name], rtol=1e-5, atol=1e-7)]


def patch_states() -> dict[str, str]:
    for module in ("transformers.distributed.mixin", "transformers.integrations.moe",
                   "transformers.integrations.tensor_parallel"):
        importlib.import_module(module)
    try:
        return {s.id: s.state for s in shardadopt.enable(only=[SIZES, SENTINEL, ROUTER, ROUTER_POST_FORWARD])}
    finally:
        shardadopt.disable()


def test_probes_follow_upstream():
    """Needed on 5.15 / 5.16 (F1 through 5.17), not-needed (nothing touched) where upstream has the fix."""
    states = patch_states()
    assert states[SENTINEL] == (APPLIED if OLD_EP else NOT_NEEDED), states
    # 5.15 masks in RouterParallel._prepare_output_fn, 5.16 in EpRouterParallel.transform_output_post_forward
    router_516 = Version("5.16") <= TRANSFORMERS < Version("5.17")
    assert states[ROUTER] == (APPLIED if OLD_EP and not router_516 else NOT_NEEDED), states
    assert states[ROUTER_POST_FORWARD] == (APPLIED if router_516 else NOT_NEEDED), states
    fixed_f1 = TRANSFORMERS >= Version("5.18")
    assert states[SIZES] == (NOT_NEEDED if fixed_f1 else APPLIED), states


def test_plain_model_is_untouched(tiny_models):
    from transformers import AutoModelForCausalLM

    shardadopt.enable(only=[SIZES, SENTINEL, ROUTER, ROUTER_POST_FORWARD])
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3moe"], dtype=torch.float32)
    finally:
        shardadopt.disable()
    assert model.tp_size is None and "fsdp_size" not in vars(model)
    ids = torch.arange(16).view(2, 8)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_sharding_degrees_recorded(pool2, tiny_models):
    patched = pool2.run(sharding_record, tiny_models, [])
    for seen in patched:
        assert seen == {"fsdp": (1, 2, 2), "tp": (2, 1, 1)}, seen
    if patch_states()[SIZES] == APPLIED:
        unpatched = pool2.run(sharding_record, tiny_models, [SIZES])
        # upstream records no FSDP degree and, for an FSDP model, no TP degree
        assert unpatched[0]["fsdp"] != (1, 2, 2) and unpatched[0]["fsdp"][1] is None, unpatched[0]


def test_ep_gradients_match_single_process(pool2, tiny_models, ep_reference):
    results = pool2.run(ep_gradients, tiny_models, [], False)
    for rank, grads in enumerate(results):
        bad = mismatched(grads, ep_reference)
        assert not bad, f"rank {rank}: {len(bad)} of {len(grads)} gradients differ from one process: {bad[:5]}"
    assert any("mlp.gate." in name for name in results[0]), "the router gates must be among the compared gradients"


def test_ep_router_gradient_wrong_without_patch(pool2, tiny_models, ep_reference):
    states = patch_states()
    if APPLIED not in (states[ROUTER], states[ROUTER_POST_FORWARD]):
        pytest.skip(f"transformers {TRANSFORMERS} sums the router-score gradient itself (probe: not-needed)")
    results = pool2.run(ep_gradients, tiny_models, [ROUTER, ROUTER_POST_FORWARD], False)
    bad = mismatched(results[0], ep_reference)
    assert "model.layers.0.mlp.gate.weight" in bad, bad
    assert any(not torch.equal(results[0][n], results[1][n]) for n in bad if ".experts." not in n), \
        "without the fix the replicated parameters' gradients differ between ranks"


def test_ep_nan_tail_kernel(pool2, tiny_models, ep_reference):
    """A grouped GEMM that fills the undefined tail rows with NaN: correct grads with the patch, NaN without."""
    results = pool2.run(ep_gradients, tiny_models, [], True)
    for rank, grads in enumerate(results):
        bad = mismatched(grads, ep_reference)
        assert not bad, f"rank {rank}: {len(bad)} gradients differ with a NaN-tail kernel: {bad[:5]}"
    if patch_states()[SENTINEL] == APPLIED:
        unpatched = pool2.run(ep_gradients, tiny_models, [SENTINEL], True)
        nan = [name for name, grad in unpatched[0].items() if not torch.isfinite(grad).all()]
        assert "model.layers.0.mlp.gate.weight" in nan and "model.embed_tokens.weight" in nan, nan
