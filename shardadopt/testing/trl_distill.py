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

from shardadopt.testing.trl import _load, plain_head_shard

STEPS = 3
GLOBAL_BATCH = 4
MAX_COMPLETION_LENGTH = 8
LR = 1e-3
RTOL = 1e-4


def distill_log(models: dict[str, str], tokenizer: str, layout: str | None, student: str, teacher: str, *,
                teacher_sharded: bool, world: int = 2) -> dict[str, Any]:
    """DistillationTrainer for :data:`STEPS` steps, full fine-tuning in fp32, of ``student`` sharded per ``layout``
    over ``world`` ranks, or plain (``layout=None``: one process, or DDP over the process group it runs in), with
    ``teacher`` loaded with the same ``DistributedConfig`` (``teacher_sharded``) or plain. Returns ``{"log": [{"loss",
    "grad_norm"} per step], "dp": data-parallel size, "plain_head_shard": ..., "teacher_mesh_shared": whether the
    teacher's device mesh is the student's object}`` or ``{"refused": shardadopt's error, ...}``."""
    import tempfile

    from transformers import AutoTokenizer, PrinterCallback
    from trl import DistillationConfig, DistillationTrainer

    import shardadopt
    from shardadopt.adopt import AdoptionError
    from shardadopt.testing.trl_online import prompts

    shardadopt.enable()
    try:
        network, dp = _load(models[student], layout, world)
        teacher_model, _ = _load(models[teacher], layout if teacher_sharded else None, world)
        result: dict[str, Any] = {"plain_head_shard": plain_head_shard(network), "dp": dp,
                                  "teacher_mesh_shared": getattr(teacher_model, "_device_mesh", None) is not None
                                  and getattr(teacher_model, "_device_mesh", None)
                                  is getattr(network, "_device_mesh", None)}
        processing_class = AutoTokenizer.from_pretrained(tokenizer)
        processing_class.padding_side = "left"  # what DistillationTrainer asks of its processing class
        with tempfile.TemporaryDirectory(prefix="shardadopt-trl-distill-") as out:
            config = DistillationConfig(
                output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=STEPS, learning_rate=LR,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                bf16=False, seed=0, disable_tqdm=True, max_completion_length=MAX_COMPLETION_LENGTH)
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
