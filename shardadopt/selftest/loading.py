"""Selftest scenarios for load-time sharding itself: gradients of a sharded model equal one process's."""

from __future__ import annotations

from typing import Any

from shardadopt.selftest.scenario import Context, Scenario

GLOBAL_SEED = 1234
PER_RANK_BATCH = 2


def _load(path: str, ctx: Context, **distributed: int):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if distributed:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**distributed)
    elif ctx.device == "cuda":
        kwargs["device_map"] = "cuda"
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _grads_after_one_step(model, ids) -> dict[str, Any]:
    from shardadopt.testing import full

    model(input_ids=ids, labels=ids).loss.backward()
    # full() is a collective for DTensors: every rank gathers every gradient in the same order.
    return {name: full(p.grad).detach().float().cpu() for name, p in model.named_parameters()}


def fsdp_grads_rank(ctx: Context) -> dict[str, Any]:
    import torch.distributed as dist

    from shardadopt.testing import token_batch

    model = _load(ctx.models["qwen3"], ctx, fsdp_size=ctx.nproc)
    global_batch = token_batch(GLOBAL_SEED, PER_RANK_BATCH * ctx.nproc)
    local = global_batch.chunk(ctx.nproc)[dist.get_rank()].to(model.device)
    return _grads_after_one_step(model, local)


def fsdp_grads_reference(ctx: Context) -> dict[str, Any]:
    from shardadopt.testing import token_batch

    model = _load(ctx.models["qwen3"], ctx)
    return _grads_after_one_step(model, token_batch(GLOBAL_SEED, PER_RANK_BATCH * ctx.nproc).to(model.device))


def compare_grads(result: dict[str, Any], expected: dict[str, Any], rtol: float = 1e-5,
                  atol: float = 1e-7) -> str | None:
    import torch

    if set(result) != set(expected):
        return f"parameter names differ: {sorted(set(result) ^ set(expected))[:5]}"
    bad = []
    for name, grad in expected.items():
        got = result[name]
        if got.shape != grad.shape or not torch.allclose(got, grad, rtol=rtol, atol=atol):
            diff = (got - grad).abs().max().item() if got.shape == grad.shape else f"shape {tuple(got.shape)}"
            bad.append(f"{name} (max |diff| {diff})")
    if bad:
        return f"{len(bad)} of {len(expected)} gradients differ from the single-process reference: {bad[:3]}"
    return None


SCENARIOS = [
    Scenario(
        name="fsdp-load-grads",
        description="fsdp_size=N load: every gradient equals one process on the same global batch",
        run=fsdp_grads_rank,
        reference=fsdp_grads_reference,
        compare=compare_grads,
        unsupported=lambda nproc: "needs at least 2 processes" if nproc < 2 else None,
    ),
]
