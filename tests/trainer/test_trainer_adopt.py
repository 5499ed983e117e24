"""Trainer adopts load-time-sharded models (trainer-adopt-sharded-model) and steps fused optimizers over them.

Against a single-process Trainer on the same global batches (fp32, rtol 1e-5):

- ``trainer.evaluate()`` before ``train()`` on an FSDP model: upstream 5.15 .. 5.18 build the optimizer from the
  unsharded parameters the evaluation left behind (final norm and LM head), so those weights never train; without
  the patch the losses drift from the control, with it they match.
- ``optim="adamw_torch_fused"`` on TP and EP models (F4/F5 through Trainer: the optimizer sees parameters on
  several meshes, or DTensors next to plain tensors, and Trainer clips over all of them). On transformers 5.15
  the TP row-parallel shards are non-contiguous views, which torch's fused CPU AdamW mis-updates when their grads
  are contiguous; the patch gives them their own storage before the optimizer is built (that torch behaviour
  itself: tests/upstream/test_torch_behaviour.py).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from shardadopt.patches.trainer_adopt_sharded_model import PATCH
from shardadopt.selftest.trainer import (
    LAYOUTS,
    PER_RANK_BATCH,
    TokenDataset,
    compare_logs,
    train_log,
)
from shardadopt.testing.accelerator import forget_accelerate_state
from shardadopt.testing.layouts import distributed_sizes

PATCH_ID = PATCH.id

pytestmark = pytest.mark.multiproc
STEPS = 3


def evaluate_then_train(models: dict[str, str], single_process: bool = False, exclude: tuple[str, ...] = ()
                        ) -> dict[str, Any]:
    """FSDP Trainer: one evaluate(), then STEPS steps; the log and which parameter types the optimizer holds."""
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments

    import shardadopt

    shardadopt.enable(exclude=list(exclude))
    try:
        sizes, dp = distributed_sizes("fsdp")
        kwargs: dict[str, Any] = {"dtype": torch.float32}
        if not single_process:
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(**sizes)
        model = AutoModelForCausalLM.from_pretrained(models[LAYOUTS["fsdp"].model], **kwargs)
        per_device = PER_RANK_BATCH * (dp if single_process else 1)
        forget_accelerate_state()
        with tempfile.TemporaryDirectory(prefix="shardadopt-trainer-") as out:
            args = TrainingArguments(
                output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=1.0,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                train_sampling_strategy="sequential", disable_tqdm=True)
            trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(STEPS * PER_RANK_BATCH * dp),
                              eval_dataset=TokenDataset(PER_RANK_BATCH * dp))
            trainer.remove_callback(PrinterCallback)
            trainer.evaluate()
            trainer.train()
        kinds = sorted({type(p).__name__ for group in trainer.optimizer.param_groups for p in group["params"]})
        log = [{"loss": row["loss"], "grad_norm": float(row["grad_norm"])}
               for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        return {"log": log, "optimizer_params": kinds}
    finally:
        shardadopt.disable()


@pytest.fixture(scope="module")
def evaluate_first_control(tiny_models) -> list[dict[str, float]]:
    return evaluate_then_train(tiny_models, single_process=True)["log"]


def test_evaluate_before_train_matches_single_process(pool2, tiny_models, evaluate_first_control):
    for rank, result in enumerate(pool2.run(evaluate_then_train, tiny_models, timeout=180)):
        assert result["optimizer_params"] == ["DTensor"], (rank, result["optimizer_params"])
        problem = compare_logs(result["log"], evaluate_first_control)
        assert problem is None, f"rank {rank}: {problem}"


def test_evaluate_before_train_without_patch(pool2, tiny_models, evaluate_first_control):
    import shardadopt

    try:
        state = {s.id: s.state for s in shardadopt.enable()}[PATCH_ID]
    finally:
        shardadopt.disable()  # this process runs the other modules' tests: leave upstream as it was
    if state != "applied":
        pytest.skip(f"{PATCH_ID} is {state} on this transformers (upstream reshards before building the optimizer)")
    results = pool2.run(evaluate_then_train, tiny_models, exclude=(PATCH_ID,), timeout=180)
    # upstream hands the optimizer the unsharded norm/LM-head parameters: they never train and the losses drift
    assert all("Parameter" in r["optimizer_params"] for r in results), [r["optimizer_params"] for r in results]
    assert all(compare_logs(r["log"], evaluate_first_control) is not None for r in results)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_fused_optimizer_matches_single_process(pool2, tiny_models, layout):
    expected = train_log(tiny_models, layout, STEPS, single_process=True, optim="adamw_torch_fused")
    assert expected[0]["grad_norm"] > 1.0, "clipping must be active in the control"
    results = pool2.run(train_log, tiny_models, layout, STEPS, optim="adamw_torch_fused", timeout=240)
    for rank, result in enumerate(results):
        problem = compare_logs(result, expected)
        assert problem is None, f"{layout} rank {rank}: {problem}"

