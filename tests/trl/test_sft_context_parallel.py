"""TRL's SFTTrainer with context parallelism (``SFTConfig(parallelism_config=ParallelismConfig(cp_size=2))``) on a
model sharded at load time (``fsdp_size=2``, 2 gloo ranks) trains as the same SFTTrainer on one process with the
same global batch: per-step loss and grad norm, fp32, 3 steps; each forward sees half of the positions. Rows are
padded on the right to a multiple of ``2 x cp_size`` (``pad_to_multiple_of``); accelerate drops the padding mask for
``is_causal=True``, which is exact for right padding (a pad comes after every real token of its row and its labels
are ``-100``).

Packing is refused by TRL itself with CP. ``padding_free=True`` without packing (rows flattened into one, position
ids restarting at each row) is not: under CP the block-diagonal mask is dropped and the rows would attend to each
other, so shardadopt refuses it by name at the first step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.multiproc

STEPS, GLOBAL_BATCH, MAX_LENGTH, LR = 3, 4, 32, 1e-3
CP_SPLIT = 4  # 2 x cp_size: torch's load-balanced ring splits every sequence into 2 x cp_size chunks
RTOL = 1e-4


def sft_run(path: str, tokenizer: str, cp: bool, padding_free: bool = False) -> dict[str, Any]:
    """The SFTTrainer as TRL's docs show it, on the sharded model with ``cp_size=2`` (``cp``) or on the plain
    checkpoint in one process: the logged per-step loss and grad norm, and the sequence lengths the forwards saw."""
    import tempfile

    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    import shardadopt
    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.trl import dataset

    def run() -> dict[str, Any]:
        from transformers.distributed import DistributedConfig

        if cp:
            shardadopt.enable()
        kwargs = {"distributed_config": DistributedConfig(fsdp_size=2)} if cp else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa", **kwargs)
        seen: list[int] = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
        forget_accelerate_state()
        with tempfile.TemporaryDirectory() as out:
            config = SFTConfig(
                output_dir=out, per_device_train_batch_size=GLOBAL_BATCH, max_steps=STEPS, learning_rate=LR,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                bf16=False, seed=0, disable_tqdm=True, pad_to_multiple_of=CP_SPLIT,
                max_length=None if padding_free else MAX_LENGTH,  # TRL: padding_free without packing truncates nothing
                padding_free=padding_free, train_sampling_strategy="sequential",
                parallelism_config=ParallelismConfig(cp_size=2) if cp else None)
            trainer = SFTTrainer(model=model, args=config, train_dataset=dataset("sft", STEPS * GLOBAL_BATCH),
                                 processing_class=AutoTokenizer.from_pretrained(tokenizer))
            trainer.remove_callback(PrinterCallback)
            trainer.train()
        logged = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        return {"losses": [row["loss"] for row in logged], "norms": [float(row["grad_norm"]) for row in logged],
                "seen": seen}

    try:
        return run()
    except Exception as exc:  # noqa: BLE001  (the test reads what each rank raised)
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        if cp:
            shardadopt.disable()


def mismatch(result: dict[str, Any], expected: dict[str, Any]) -> str | None:
    if "error" in result:
        return result["traceback"]
    for what in ("losses", "norms"):
        if len(result[what]) != STEPS or not torch.allclose(torch.tensor(result[what]), torch.tensor(expected[what]),
                                                            rtol=RTOL, atol=1e-6):
            return f"{what} {result[what]} != one process {expected[what]}"
    return None


def test_sft_trainer_matches_one_process(pool2, tiny_models, trl_tokenizer):
    expected = sft_run(tiny_models["llama"], trl_tokenizer, cp=False)
    assert "error" not in expected, expected.get("traceback")
    for rank, result in enumerate(pool2.run(sft_run, tiny_models["llama"], trl_tokenizer, True, timeout=600)):
        assert mismatch(result, expected) is None, f"rank {rank}: {mismatch(result, expected)}"
        # the split happened: each forward saw half of its batch's padded length
        assert all(n * 2 in expected["seen"] for n in result["seen"]), (result["seen"], expected["seen"])


def test_padding_free_refused_at_first_step(pool2, tiny_models, trl_tokenizer):
    """``padding_free=True`` (TRL flattens the batch into one row, position ids restarting at each sequence), which
    TRL allows with CP: refused by name at the first step's forward, on every rank."""
    for result in pool2.run(sft_run, tiny_models["llama"], trl_tokenizer, True, padding_free=True, timeout=300):
        error = result.get("error", "")
        assert error.startswith("AdoptionError") and "position ids restart inside a row" in error, result
        assert "padding_free=False" in error, result
