"""Trainer on models sharded at load time: per-step loss and grad norm against a single-process Trainer.

Shared by ``shardadopt selftest`` (scenarios ``trainer-train`` and ``trainer-ep-grads``),
tests/trainer/test_trainer_parity.py and benchmarks/loss_parity.py. A *layout* names a ``DistributedConfig`` as the
installed transformers spells it;
:func:`train_log` runs the same Trainer recipe sharded (on every rank of a pool) or in one process (``layout=None``,
with the whole global batch on that process), so the two runs see the same samples in the same order.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from typing import Any

from shardadopt.selftest.scenario import Context, Scenario
from shardadopt.testing.accelerator import forget_accelerate_state
from shardadopt.testing.layouts import distributed_sizes
from shardadopt.testing.patching import keeps_patch_state

SEQ_LEN = 16
PER_RANK_BATCH = 2


@dataclass(frozen=True)
class Layout:
    name: str
    model: str  # tiny checkpoint family
    nproc: int
    description: str


LAYOUTS = {
    "fsdp": Layout("fsdp", "qwen3", 2, "FSDP2 over 2 ranks (fsdp_size=2)"),
    "tp": Layout("tp", "qwen3", 2, "tensor parallel over 2 ranks (tp_size=2)"),
    "ep": Layout("ep", "qwen3moe", 2, "expert parallel (+FSDP where the release has it) over 2 ranks"),
    "hsdp": Layout("hsdp", "llama", 4, "HSDP: 2 replicas x fsdp_size=2"),
    "2d": Layout("2d", "qwen3", 4, "2-D: fsdp_size=2 x tp_size=2"),
}


class TokenDataset:
    """Deterministic random token sequences; sample i is the same on every process."""

    def __init__(self, size: int, vocab_size: int = 512):
        self.size, self.vocab_size = size, vocab_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        ids = torch.randint(0, self.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(1000 + index))
        return {"input_ids": ids, "labels": ids.clone()}


@keeps_patch_state
def train_log(models: dict[str, str], layout: str, steps: int, *, single_process: bool = False,
              world: int | None = None, device: str = "cpu", grad_accum: int = 1, optim: str = "adamw_torch",
              max_grad_norm: float = 1.0,
              learning_rate: float = 1e-3, enable: bool = True, streamed: bool = False,
              model_init: bool = False) -> list[dict[str, float]]:
    """Train ``steps`` optimizer steps with Trainer; per step ``{"loss", "grad_norm"}`` as Trainer logs them.

    Sharded per ``layout`` on every rank of a pool, or, with ``single_process=True``, the control: the same model
    unsharded in one process whose per-device batch is the sharded run's global batch. ``streamed``: the samples
    come from a streamed ``datasets`` dataset (``to_iterable_dataset``), which accelerate dispatches from rank 0.
    ``model_init``: the Trainer gets ``model_init=`` (a function loading the model as above) instead of ``model=``.
    """
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments

    import shardadopt

    if enable:
        shardadopt.enable()
    else:
        shardadopt.disable()
    sizes, dp = distributed_sizes(layout, world or LAYOUTS[layout].nproc)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if not single_process:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(models[LAYOUTS[layout].model], **kwargs)

    model = None if model_init else load()
    per_device = PER_RANK_BATCH * (dp if single_process else 1)
    forget_accelerate_state()
    with tempfile.TemporaryDirectory(prefix="shardadopt-trainer-") as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=grad_accum,
            max_steps=steps, learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=max_grad_norm, optim=optim, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=device == "cpu", seed=0, train_sampling_strategy="sequential", dataloader_num_workers=0,
            disable_tqdm=True)
        dataset = TokenDataset(steps * grad_accum * PER_RANK_BATCH * dp)
        if streamed:
            from datasets import Dataset

            dataset = Dataset.from_list([{k: v.tolist() for k, v in dataset[i].items()} for i in range(len(dataset))]
                                        ).to_iterable_dataset()
        trainer = Trainer(model=model, model_init=load if model_init else None, args=args, train_dataset=dataset)
        trainer.remove_callback(PrinterCallback)  # every rank would print every step
        trainer.train()
    return [{"loss": row["loss"], "grad_norm": float(row["grad_norm"])}
            for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]


def compare_logs(result: list[dict[str, float]], expected: list[dict[str, float]], rtol: float = 1e-5
                 ) -> str | None:
    """None when every step's loss and grad norm agree within ``rtol``, else what differs first."""
    if len(result) != len(expected):
        return f"{len(result)} logged steps, the single-process control logged {len(expected)}"
    for step, (got, want) in enumerate(zip(result, expected), start=1):
        for key in ("loss", "grad_norm"):
            if not math.isclose(got[key], want[key], rel_tol=rtol, abs_tol=1e-7):
                return f"step {step}: {key} {got[key]!r} vs single process {want[key]!r} (rtol {rtol})"
    return None


def full_grads(model) -> dict[str, Any]:
    """Every parameter's full gradient (a collective: every rank calls it, in the same order).

    DTensor grads are gathered over their mesh; experts that transformers 5.15/5.16 slice by expert into plain
    tensors are concatenated over the EP group, which is the whole world for the layouts here.
    """
    import torch
    import torch.distributed as dist

    num_experts = getattr(model.config, "num_experts", None)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        elif num_experts and ".experts." in name and grad.shape[0] < num_experts:
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, grad.contiguous())
            grad = torch.cat(parts)
        grads[name] = grad.detach().float().cpu()
    return grads


EP_SEED = 11


@keeps_patch_state
def ep_grads_rank(ctx: Context) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing import token_batch

    shardadopt.enable()
    sizes, dp = distributed_sizes("ep", ctx.nproc)
    model = AutoModelForCausalLM.from_pretrained(ctx.models["qwen3moe"], dtype=torch.float32,
                                                 distributed_config=DistributedConfig(**sizes))
    batch = token_batch(EP_SEED, PER_RANK_BATCH * dp).chunk(dp)[dist.get_rank() % dp].to(model.device)
    model(input_ids=batch, labels=batch).loss.backward()
    return full_grads(model)


def ep_grads_reference(ctx: Context) -> dict[str, Any]:
    return single_process_grads(ctx.models["qwen3moe"], "ep", EP_SEED, world=ctx.nproc)


def single_process_grads(path: str, layout: str, seed: int, *, per_rank_batch: int = PER_RANK_BATCH,
                         world: int = 2) -> dict[str, Any]:
    """The reference for a sharded backward: one process's gradients of the unsharded checkpoint after one backward
    on ``layout``'s global batch over ``world`` ranks (``per_rank_batch`` rows per data-parallel rank)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardadopt.testing import token_batch

    _, dp = distributed_sizes(layout, world)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = token_batch(seed, per_rank_batch * dp)
    model(input_ids=batch, labels=batch).loss.backward()
    return {name: p.grad.detach().float().cpu() for name, p in model.named_parameters()}


def compare_ep_grads(result: dict[str, Any], expected: dict[str, Any]) -> str | None:
    from shardadopt.selftest.loading import compare_grads

    if not any(".mlp.gate." in name for name in expected):
        return "no router gate among the parameters"
    return compare_grads(result, expected)


TRAIN_STEPS = 5


def train_rank(ctx: Context) -> list[dict[str, float]]:
    return train_log(ctx.models, "fsdp", TRAIN_STEPS, world=ctx.nproc, device=ctx.device)


def train_reference(ctx: Context) -> list[dict[str, float]]:
    return train_log(ctx.models, "fsdp", TRAIN_STEPS, world=ctx.nproc, device=ctx.device, single_process=True)


def _needs_two(nproc: int) -> str | None:
    return "needs at least 2 processes" if nproc < 2 else None


SCENARIOS = [
    Scenario(
        name="trainer-train",
        description=f"Trainer on an fsdp_size=N model: {TRAIN_STEPS} steps' loss and grad_norm equal one process",
        run=train_rank,
        reference=train_reference,
        compare=compare_logs,
        unsupported=_needs_two,
    ),
    Scenario(
        name="trainer-ep-grads",
        description="expert-parallel qwen3moe: every gradient (router gates, experts) equals one process",
        run=ep_grads_rank,
        reference=ep_grads_reference,
        compare=compare_ep_grads,
        unsupported=lambda nproc: None if nproc in (2, 4) else "the tiny MoE has 4 experts: needs 2 or 4 processes",
    ),
]
