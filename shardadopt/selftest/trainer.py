"""Trainer on models sharded at load time: per-step loss and grad norm against a single-process Trainer.

Shared by ``shardadopt selftest`` (scenarios ``trainer-train`` and ``trainer-ep-grads``), tests/test_trainer_parity.py
and benchmarks/loss_parity.py. A *layout* names a ``DistributedConfig`` as the installed transformers spells it;
:func:`train_log` runs the same Trainer recipe sharded (on every rank of a pool) or in one process (``layout=None``,
with the whole global batch on that process), so the two runs see the same samples in the same order.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from typing import Any

from shardadopt.selftest import Context, Scenario

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


class LayoutUnsupported(RuntimeError):
    """The installed transformers cannot load this layout at all (not a shardadopt limitation)."""


def distributed_sizes(layout: str) -> tuple[dict[str, Any], int]:
    """(``DistributedConfig`` kwargs, data-parallel size) for ``layout`` on the installed transformers."""
    from transformers.distributed import DistributedConfig

    fields = DistributedConfig.__dataclass_fields__
    if layout == "fsdp":
        return {"fsdp_size": 2}, 2
    if layout == "tp":
        return {"tp_size": 2}, 1
    if layout == "ep":
        if "ep_size" in fields:
            return {"ep_size": 2, "fsdp_size": 2}, 2
        return {"tp_size": 2, "enable_expert_parallel": True}, 1  # before 5.21: EP on the TP mesh, no FSDP
    if layout == "hsdp":
        if "dp_replicate_size" not in fields:
            raise LayoutUnsupported("this transformers' DistributedConfig has no dp_replicate_size (HSDP)")
        return {"dp_replicate_size": 2, "fsdp_size": 2}, 4
    if layout == "2d":
        try:
            DistributedConfig(fsdp_size=2, tp_size=2)
        except ValueError as exc:
            raise LayoutUnsupported(f"this transformers refuses fsdp_size x tp_size: {exc}") from None
        return {"fsdp_size": 2, "tp_size": 2}, 2
    raise ValueError(f"unknown layout {layout!r}; known: {sorted(LAYOUTS)}")


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


def _fresh_accelerate_state() -> None:
    # accelerate keeps process-wide singletons; pooled ranks and the launcher run several Trainers in one process.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def train_log(models: dict[str, str], layout: str, steps: int, *, single_process: bool = False,
              grad_accum: int = 1, optim: str = "adamw_torch", max_grad_norm: float = 1.0,
              learning_rate: float = 1e-3, enable: bool = True) -> list[dict[str, float]]:
    """Train ``steps`` optimizer steps with Trainer; per step ``{"loss", "grad_norm"}`` as Trainer logs them.

    Sharded per ``layout`` on every rank of a pool, or, with ``single_process=True``, the control: the same model
    unsharded in one process whose per-device batch is the sharded run's global batch.
    """
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments

    import shardadopt

    if enable:
        shardadopt.enable()
    else:
        shardadopt.disable()
    sizes, dp = distributed_sizes(layout)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if not single_process:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    model = AutoModelForCausalLM.from_pretrained(models[LAYOUTS[layout].model], **kwargs)
    per_device = PER_RANK_BATCH * (dp if single_process else 1)
    _fresh_accelerate_state()
    with tempfile.TemporaryDirectory(prefix="shardadopt-trainer-") as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=grad_accum,
            max_steps=steps, learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=max_grad_norm, optim=optim, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, seed=0, train_sampling_strategy="sequential", dataloader_num_workers=0,
            disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(steps * grad_accum * PER_RANK_BATCH * dp))
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
