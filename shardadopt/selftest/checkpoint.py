"""Checkpoint scenarios: a sharded run saved at step k and resumed continues exactly like the uninterrupted run.

The rank functions here also serve the test suite (tests/checkpoint/). In ``shardadopt selftest`` there
is one pool, so the resume happens in the same processes (a new model, optimizer and scheduler are built and
loaded from the checkpoint; nothing of the first run is reused); the test suite resumes in fresh processes.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from shardadopt.selftest.scenario import Context, Scenario
from shardadopt.testing.patching import keeps_patch_state


def _ep_layout() -> dict[str, Any]:
    """Expert parallelism on 2 ranks: ``ep_size`` with FSDP where DistributedConfig has it, else EP through TP."""
    import inspect

    from transformers.distributed import DistributedConfig

    if "ep_size" in inspect.signature(DistributedConfig).parameters:
        return {"ep_size": 2, "fsdp_size": 2}
    return {"tp_size": 2, "enable_expert_parallel": True}


# layout name -> (tiny model, DistributedConfig kwargs) on 2 ranks
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp": ("qwen3", {"fsdp_size": 2}),
    "tp": ("llama", {"tp_size": 2}),
    "ep": ("qwen3moe", _ep_layout()),
}
PER_DP_RANK_BATCH = 2
LR = 1e-2


def load_model(path: str, distributed: dict[str, int] | None):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if distributed:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**distributed)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def dp_coordinates(distributed: dict[str, int] | None) -> tuple[int, int]:
    """(dp size, dp rank): tensor-parallel ranks share a batch, fsdp/ep+fsdp ranks split it."""
    import torch.distributed as dist

    if not distributed or not dist.is_initialized():
        return 1, 0
    tp = distributed.get("tp_size", 1)
    return dist.get_world_size() // tp, dist.get_rank() // tp


def build(path: str, distributed: dict[str, int] | None):
    """A model, a (non-foreach) AdamW and a warm-up scheduler: the objects a checkpoint must restore."""
    import torch

    model = load_model(path, distributed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, distributed, steps: int) -> list[float]:
    """``steps`` optimizer steps. Each global batch is drawn from torch's global RNG (seeded alike on every
    rank), so a resumed run only matches if the RNG state was restored too. Returns the global mean losses."""
    import torch
    import torch.distributed as dist

    from shardadopt.testing import VOCAB_SIZE

    dp_size, dp_rank = dp_coordinates(distributed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB_SIZE, (PER_DP_RANK_BATCH * dp_size, 16))
        local = ids.chunk(dp_size)[dp_rank].to(model.device)  # drawn on the CPU RNG, used where the model is
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(reported)
            reported /= dist.get_world_size()
        losses.append(reported.item())
    return losses


def full_params(model) -> dict[str, Any]:
    from shardadopt.testing import full

    return {name: full(p).detach().clone() for name, p in model.named_parameters()}


def full_optimizer_state(model, optimizer) -> dict[str, dict[str, Any]]:
    """Each parameter's AdamW state as full tensors (a collective per DTensor)."""
    from shardadopt.testing import full

    return {name: {k: full(v).detach().clone() for k, v in sorted(optimizer.state[p].items())}
            for name, p in model.named_parameters()}


@keeps_patch_state
def run_and_save(path: str, distributed: dict[str, int], root: str, save_at: int, total: int,
                 seed: int = 0) -> dict[str, Any]:
    """The uninterrupted run: ``total`` steps, a checkpoint at step ``save_at`` under ``root``."""
    import torch

    import shardadopt
    from shardadopt import checkpoint

    shardadopt.enable()  # as users do: e.g. 5.15's EP needs its grouped-GEMM fix to be deterministic
    torch.manual_seed(seed)
    model, optimizer, scheduler = build(path, distributed)
    losses = train_steps(model, optimizer, scheduler, distributed, save_at)
    saved = checkpoint.save(os.path.join(root, f"step-{save_at}"), model, optimizer, scheduler, step=save_at,
                            extra={"next_step": save_at})
    params_at_save = full_params(model)
    optimizer_at_save = full_optimizer_state(model, optimizer)
    losses += train_steps(model, optimizer, scheduler, distributed, total - save_at)
    return {"losses": losses, "params": full_params(model), "params_at_save": params_at_save,
            "optimizer_at_save": optimizer_at_save, "saved": saved, "rank_local": checkpoint.rank_local(model),
            "lr": scheduler.get_last_lr()}


@keeps_patch_state
def resume(path: str, distributed: dict[str, int] | None, root: str, total: int,
           directory: str | None = None) -> dict[str, Any]:
    """Build everything afresh, load the latest complete checkpoint under ``root`` (or ``directory``), continue."""
    import torch

    import shardadopt
    from shardadopt import checkpoint

    shardadopt.enable()
    torch.manual_seed(12345)  # a different seed: what continues must come from the checkpoint
    model, optimizer, scheduler = build(path, distributed)
    directory = directory or checkpoint.latest(root)
    info = checkpoint.load(directory, model, optimizer, scheduler)
    losses = train_steps(model, optimizer, scheduler, distributed, total - info.step)
    return {"losses": losses, "params": full_params(model), "step": info.step, "extra": info.extra,
            "resharded": info.resharded, "rng_restored": info.rng_restored, "lr": scheduler.get_last_lr()}


def compare_exact(result: dict[str, Any], expected: dict[str, Any], first_step: int) -> str | None:
    """None when the resumed losses and final parameters equal the uninterrupted run's bit for bit."""
    import torch

    tail = expected["losses"][first_step:]
    if result["losses"] != tail:
        return f"resumed losses {result['losses']} != uninterrupted {tail}"
    differ = [n for n, p in expected["params"].items() if not torch.equal(result["params"][n], p)]
    if differ:
        return f"{len(differ)} parameters differ after resuming, e.g. {differ[:3]}"
    return None


# -- selftest scenario ---------------------------------------------------------------------------------------------

def same_pool_resume_rank(ctx: Context) -> dict[str, Any]:
    """FSDP over all ranks: uninterrupted run vs save at step 2 then a fresh model/optimizer loading it."""
    import torch.distributed as dist

    distributed = {"fsdp_size": ctx.nproc}
    path = ctx.models["qwen3"]
    root = tempfile.mkdtemp(prefix="shardadopt-ckpt-") if dist.get_rank() == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder)
    root = holder[0]
    try:
        expected = run_and_save(path, distributed, root, save_at=2, total=4)
        result = resume(path, distributed, root, total=4)
        return {"problem": compare_exact(result, expected, 2)}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def _no_reference(ctx: Context) -> None:
    return None  # the reference is the uninterrupted run, computed on the ranks themselves


def _compare(result: dict[str, Any], expected: None) -> str | None:
    return result["problem"]


SCENARIOS = [
    Scenario(
        name="checkpoint-resume",
        description="fsdp_size=N: save at step 2, resume (same pool, fresh objects): steps 3-4 and params exact",
        run=same_pool_resume_rank,
        reference=_no_reference,
        compare=_compare,
        unsupported=lambda nproc: "needs at least 2 processes" if nproc < 2 else None,
    ),
]
