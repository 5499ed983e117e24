"""TRL's DistillationTrainer on load-time-sharded models: workers for ``tests/trl/test_distillation.py``.

:func:`distill_log` is what a TRL user writes: the student loaded (sharded per ``layout``, or plain), the teacher (a
second model of the same vocabulary) loaded sharded the same way or plain, ``DistillationConfig``/
``DistillationTrainer`` on a ``datasets`` prompt dataset, a local tokenizer as ``processing_class``, ``train()``.
DistillationTrainer samples its completions on-policy and seeds every process differently, as GRPO does, so the
reference of a layout with one data-parallel rank (``tp_size=2`` on 2 ranks) is one process on the plain
checkpoints with the same per-device batch; a layout with 2 data-parallel ranks is compared with DDP.
"""

from __future__ import annotations

from typing import Any

from shardadopt.testing.patching import keeps_patch_state
from shardadopt.testing.trl import load_model, plain_head_shard

STEPS = 3
GLOBAL_BATCH = 4
MAX_COMPLETION_LENGTH = 8
LR = 1e-3
RTOL = 1e-4
STUDENT, TEACHER = "qwen3", "llama"  # keys of the tiny checkpoints: two architectures of one vocabulary


@keeps_patch_state
def distill_log(models: dict[str, str], tokenizer: str, layout: str | None, student: str, teacher: str, *,
                teacher_layout: str | None, world: int = 2, exclude: tuple[str, ...] = (), from_path: bool = False,
                **config: Any) -> dict[str, Any]:
    """DistillationTrainer for :data:`STEPS` steps, full fine-tuning in fp32, of ``student`` sharded per ``layout``
    over ``world`` ranks, or plain (``layout=None``: one process, or DDP over the process group it runs in), with
    ``teacher`` loaded sharded per ``teacher_layout`` (the student's, or another where the teacher cannot take the
    student's) or plain (``None``), with shardadopt enabled minus ``exclude``; ``config`` adds to the trainer's
    config. ``from_path``: TRL loads the student itself (``model=<path>``, ``model_init_kwargs={"dtype": "float32",
    "distributed_config": DistributedConfig(...)}`` for a ``layout``). Returns ``{"log": [{"loss",
    "grad_norm"} per step], "dp": data-parallel size, "plain_head_shard": ...}`` or ``{"refused": shardadopt's
    error, ...}``."""
    import tempfile

    from transformers import AutoTokenizer, PrinterCallback
    from trl import DistillationConfig, DistillationTrainer

    import shardadopt
    from shardadopt.adopt import AdoptionError
    from shardadopt.testing.trl_online import prompts

    shardadopt.enable(exclude=exclude)
    try:
        init: dict[str, Any] = {}
        if from_path:
            from transformers.distributed import DistributedConfig

            from shardadopt.testing.layouts import distributed_sizes

            network, dp, init["dtype"] = models[student], world, "float32"
            if layout is not None:
                sizes, dp = distributed_sizes(layout, world)
                init["distributed_config"] = DistributedConfig(**sizes)
        else:
            network, dp = load_model(models[student], layout, world)
        teacher_model, _ = load_model(models[teacher], teacher_layout, world)
        result: dict[str, Any] = {"plain_head_shard": not from_path and plain_head_shard(network), "dp": dp}
        processing_class = AutoTokenizer.from_pretrained(tokenizer)
        processing_class.padding_side = "left"  # what DistillationTrainer asks of its processing class
        with tempfile.TemporaryDirectory(prefix="shardadopt-trl-distill-") as out:
            common = dict(
                output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=STEPS, learning_rate=LR,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                bf16=False, seed=0, disable_tqdm=True, max_completion_length=MAX_COMPLETION_LENGTH,
                **({"model_init_kwargs": init} if from_path else {}))
            config = DistillationConfig(**{**common, **config})
            try:
                trainer = DistillationTrainer(model=network, teacher_model=teacher_model, args=config,
                                              train_dataset=prompts(STEPS * GLOBAL_BATCH * 4),
                                              processing_class=processing_class)
                trainer.remove_callback(PrinterCallback)
                trainer.train()
            except AdoptionError as exc:
                return {**result, "refused": f"{type(exc).__name__}: {exc}"}
        result["log"] = [{"loss": row["loss"], "grad_norm": float(row["grad_norm"])}
                         for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        return result
    finally:
        shardadopt.disable()


def ddp_log(pool, models: dict[str, str], tokenizer: str, student: str = STUDENT,
            teacher: str = TEACHER) -> list[dict[str, float]]:
    """:func:`distill_log` on the plain checkpoints under DDP over all of ``pool``'s ranks (a RankPool; the ranks
    must log the same values, :data:`STEPS` steps): its log."""
    runs = pool.run(distill_log, models, tokenizer, None, student, teacher, teacher_layout=None, world=pool.nproc,
                    timeout=300)
    assert all(run.get("log") == runs[0]["log"] for run in runs), f"DDP ranks log the same values: {runs}"
    assert len(runs[0]["log"]) == STEPS, runs[0]
    return runs[0]["log"]


@keeps_patch_state
def head_without_gradient(*, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """What TRL's distillation loss does with a tensor-parallel teacher's LM head, on this pool's ranks: read it
    whole through ``full_tensor()`` and feed it to an autograd Function that returns no gradient for it (the
    teacher is not trained), with the student's input differentiated; then a real gradient through
    ``full_tensor()``. Returns ``{"error": ...}`` where backward fails, else the student input's gradient, the
    teacher weight's gradient (None) and the real gradient against its expected value."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardadopt

    class StudentOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, teacher_weight):
            ctx.save_for_backward(hidden, teacher_weight)
            return hidden @ teacher_weight.t()

        @staticmethod
        def backward(ctx, grad):
            _, teacher_weight = ctx.saved_tensors
            return grad @ teacher_weight, None

    shardadopt.enable(exclude=exclude)
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        generator = torch.Generator().manual_seed(0)
        full = torch.randn(4, 3, generator=generator)
        teacher = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        hidden = torch.randn(5, 3, generator=generator, requires_grad=True)
        try:
            StudentOnly.apply(hidden, teacher.full_tensor()).sum().backward()
        except AttributeError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        weights = torch.randn(4, 3, generator=generator)
        (teacher.full_tensor() * weights).sum().backward()
        return {"hidden_grad": hidden.grad, "expected_hidden_grad": torch.ones(5, 4) @ full,
                "teacher_grad": teacher.grad.full_tensor(), "expected_teacher_grad": weights}
    finally:
        shardadopt.disable()
