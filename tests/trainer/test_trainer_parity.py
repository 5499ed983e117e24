"""Trainer on models sharded at load time: per-step loss and grad_norm equal a single-process Trainer.

2 ranks: FSDP, TP, EP (+FSDP from transformers 5.21; before that EP lives on the TP mesh and has no FSDP).
4 ranks: HSDP and 2-D fsdp x tp (transformers 5.15 can load neither: skipped there with the reason).
Same global batch, same sample order, fp32, rtol 1e-5, 5 optimizer steps with clipping active (grad norm > 1).
"""

from __future__ import annotations

import pytest

from shardadopt.selftest.trainer import compare_logs, train_log
from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.patching import keeps_patch_state

pytestmark = pytest.mark.multiproc
STEPS = 5


def train_or_error(models: dict[str, str], layout: str, steps: int) -> str:
    """Upstream alone (no shardadopt): the error each rank hits, so the pool survives for the next test."""
    try:
        train_log(models, layout, steps, enable=False)
    except Exception as exc:  # the failure is the result under test
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def assert_parity(request, pool_fixture: str, models: dict[str, str], layout: str, **kwargs) -> None:
    try:
        distributed_sizes(layout)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    pool = request.getfixturevalue(pool_fixture)  # started only when some layout can run
    expected = train_log(models, layout, STEPS, single_process=True, **kwargs)
    assert len(expected) == STEPS and expected[0]["grad_norm"] > 1.0, "clipping must be active in the control"
    results = pool.run(train_log, models, layout, STEPS, **kwargs, timeout=240)
    for rank, result in enumerate(results):
        problem = compare_logs(result, expected)
        assert problem is None, f"{layout} rank {rank}: {problem}"


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_two_ranks_match_single_process(request, tiny_models, layout):
    assert_parity(request, "pool2", tiny_models, layout)


def test_model_init_with_tensor_parallel_load_matches_single_process(request, tiny_models):
    # Upstream builds the accelerator before model_init has a model (no ParallelismConfig): each TP rank then got
    # its own batch (patch trainer-model-init-parallelism).
    assert_parity(request, "pool2", tiny_models, "tp", model_init=True)


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_gradient_accumulation_matches_single_process(request, tiny_models, layout):
    # TP is left out on purpose: upstream's `replicated_with_grad_allreduce` (Qwen3 q_norm/k_norm) all-reduces the
    # accumulated .grad after every micro-batch, so earlier micro-batches are summed again (5.15 and 5.24 alike).
    assert_parity(request, "pool2", tiny_models, layout, grad_accum=2)


def test_upstream_alone_cannot_train_fsdp_model(pool2, tiny_models):
    """What the patches fix: without shardadopt, Trainer on an FSDP model fails on releases without adoption."""
    import inspect

    from transformers import Trainer

    if "is_distributed_loading_by_transformers" in inspect.getsource(Trainer.__init__):
        pytest.skip("this transformers' Trainer adopts load-time-sharded models itself (5.19+)")
    errors = pool2.run(train_or_error, tiny_models, "fsdp", 1, timeout=120)
    assert all(error != "trained" for error in errors), errors
    assert any("DTensor" in error for error in errors), errors


@pytest.mark.parametrize("layout", ["hsdp", "2d"])
def test_four_ranks_match_single_process(request, tiny_models, layout):
    assert_parity(request, "pool4", tiny_models, layout)


# The last global eval batch is partial in both layouts (tp: 1 of 2, 2d: 2 of 4) without padding any data-parallel
# rank: a padded rank's duplicate sample enters upstream's eval loss through average_tokens_across_devices (FSDP
# alone, where gather_for_metrics is upstream's, gives the same difference from one process).
EVAL_SAMPLES = {"tp": 5, "2d": 6}


@keeps_patch_state
def evaluate_log(models: dict[str, str], layout: str, *, single_process: bool = False) -> list[dict]:
    """``Trainer.evaluate()`` before training and after 2 steps: the metrics and what ``compute_metrics`` saw
    (label ids in order, the predictions' sum), as one process sees the whole eval set."""
    import tempfile

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.selftest.trainer import PER_RANK_BATCH, TokenDataset
    from shardadopt.testing.accelerator import forget_accelerate_state

    shardadopt.enable()
    sizes, dp = distributed_sizes(layout, 2 if layout == "tp" else 4)
    kwargs = {} if single_process else {"distributed_config": DistributedConfig(**sizes)}
    model = AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float32, **kwargs)
    per_device = PER_RANK_BATCH * (dp if single_process else 1)

    def metrics(prediction) -> dict:
        return {"samples": len(prediction.label_ids), "labels": np.asarray(prediction.label_ids).tolist(),
                "prediction_sum": float(np.asarray(prediction.predictions, dtype=np.float64).sum())}

    forget_accelerate_state()
    with tempfile.TemporaryDirectory(prefix="shardadopt-eval-") as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
            max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            seed=0, train_sampling_strategy="sequential", disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(2 * PER_RANK_BATCH * dp),
                          eval_dataset=TokenDataset(EVAL_SAMPLES[layout]), compute_metrics=metrics,
                          preprocess_logits_for_metrics=lambda logits, labels: logits.float().logsumexp(-1))
        trainer.remove_callback(PrinterCallback)
        before = trainer.evaluate()
        trainer.train()
        after = trainer.evaluate()
    keep = ("eval_loss", "eval_samples", "eval_labels", "eval_prediction_sum")
    return [{key: run[key] for key in keep} for run in (before, after)]


@pytest.mark.parametrize("layout", ["tp", "2d"])
def test_evaluate_sees_each_sample_once(request, tiny_models, layout):
    """TP ranks share a batch: the Trainer's gathered eval loss and compute_metrics inputs hold each sample once
    (upstream gathers every rank's copy: 9 of 5 samples under tp=2, and another eval loss)."""
    try:
        distributed_sizes(layout, 2 if layout == "tp" else 4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    pool = request.getfixturevalue("pool2" if layout == "tp" else "pool4")
    expected = evaluate_log(tiny_models, layout, single_process=True)
    samples = EVAL_SAMPLES[layout]
    assert [run["eval_samples"] for run in expected] == [samples] * 2
    for rank, runs in enumerate(pool.run(evaluate_log, tiny_models, layout, timeout=240)):
        for when, got, want in zip(("before training", "after 2 steps"), runs, expected):
            assert got["eval_samples"] == samples and got["eval_labels"] == want["eval_labels"], (rank, when)
            for key in ("eval_loss", "eval_prediction_sum"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (rank, when, key, got[key], want[key])
