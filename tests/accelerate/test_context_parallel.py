"""Context parallelism (``ParallelismConfig(cp_size=2)``) on a model sharded at load time (``fsdp_size=2``).

The accelerate loop as accelerate documents ``maybe_context_parallel`` (labels shifted before the split, position
ids passed) and the Trainer with ``TrainingArguments(parallelism_config=...)`` train as one process on the whole
sequence: per-step loss and grad norm, and the parameters after 3 fp32 steps. Each rank's forward sees half of the
positions (the split happened). Unequal valid-token counts per chunk (``-100`` on the last labels, the Trainer's
``num_items_in_batch``); ``Trainer.evaluate`` after training gives one process's evaluation loss; the patch
``torch-cp-cpu-flash-attention`` off (the first forward raises). The other traps: test_context_parallel_traps.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

STEPS, BATCH, SEQ, LR, MAX_NORM = 3, 2, 16, 1e-3, 1e9
# AdamW moves a parameter by about LR whatever its gradient's size, so a near-zero gradient that rounds the other way
# moves it the other way: parameters are compared as shardadopt.selftest.accelerate does (largest difference under
# LR / 2, root mean square under LR / 1000).
PARAM_MAX_DIFF, PARAM_RMS = 0.5 * LR, 1e-3 * LR
PATCH_ID = "torch-cp-cpu-flash-attention"


def batches(padded: bool) -> list[dict[str, torch.Tensor]]:
    """The global batches, the same on every rank; ``padded``: the last 6 labels of every row are ``-100`` (the
    ranks' chunks then hold different numbers of valid tokens)."""
    from shardadopt.testing.models import token_batch

    out = []
    for step in range(STEPS):
        ids = token_batch(100 + step, BATCH, SEQ)
        labels = ids.clone()
        if padded:
            labels[:, -6:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def eval_batches() -> list[dict[str, torch.Tensor]]:
    """Evaluation batches: in each, one row's last 6 labels are ``-100`` (the CP chunks hold different numbers of
    valid tokens, and so do the batches)."""
    from shardadopt.testing.models import token_batch

    out = []
    for step in range(2):
        ids = token_batch(300 + step, BATCH, SEQ)
        labels = ids.clone()
        labels[step, -6:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def one_process(path: str, padded: bool) -> dict[str, Any]:
    """One process on the whole sequence: losses, grad norms, final parameters, and the evaluation loss after
    training as the Trainer reports it (the mean over evaluation batches of each batch's loss)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    losses, norms = [], []
    for batch in batches(padded):
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        eval_loss = sum(float(model(**batch).loss) for batch in eval_batches()) / len(eval_batches())
    return {"losses": losses, "norms": norms, "eval_loss": eval_loss,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def cp_loop(path: str, padded: bool, patch: bool = True) -> dict[str, Any]:
    """The user's accelerate loop, as accelerate documents ``maybe_context_parallel``: labels shifted before the
    split (``shift_labels``), position ids passed, every buffer split on its sequence dim."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.models import full

    shardadopt.enable(exclude=[] if patch else [PATCH_ID])
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                     distributed_config=DistributedConfig(fsdp_size=2))
        accelerator = fresh_accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))
        rows = [{k: v[i] for k, v in batch.items()} for batch in batches(padded) for i in range(BATCH)]
        model, optimizer, loader = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False),
            torch.utils.data.DataLoader(rows, batch_size=BATCH))
        seen, losses, norms = [], [], []
        for batch in loader:
            input_ids, labels = batch["input_ids"], batch["labels"]
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            position_ids = torch.arange(SEQ).expand(BATCH, -1).contiguous()
            buffers = [input_ids, labels, shift_labels, position_ids]
            with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                                    no_restore_buffers=set(buffers)):
                seen.append(input_ids.shape[1])
                loss = model(input_ids=input_ids, labels=labels, shift_labels=shift_labels,
                             position_ids=position_ids).loss
                accelerator.backward(loss)
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            optimizer.step()
            optimizer.zero_grad()
        params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        return {"seen": seen, "losses": losses, "norms": norms, "params": params if dist.get_rank() == 0 else None}
    except Exception as exc:  # noqa: BLE001  (the test reads what each rank raised)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shardadopt.disable()


def _param_matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    diff = (got - want).abs()
    return float(diff.max()) < PARAM_MAX_DIFF and float(diff.pow(2).mean().sqrt()) <= PARAM_RMS


def mismatch(result: dict[str, Any], expected: dict[str, Any], rtol: float = 1e-4) -> str | None:
    """What differs from one process (None: nothing)."""
    if "error" in result:
        return result["error"]
    for what in ("losses", "norms"):
        if not torch.allclose(torch.tensor(result[what]), torch.tensor(expected[what]), rtol=rtol, atol=1e-6):
            return f"{what} {result[what]} != one process {expected[what]}"
    if result.get("params") is not None:
        bad = [n for n, p in expected["params"].items() if not _param_matches(result["params"][n], p)]
        if bad:
            worst = max(float((result["params"][n] - expected["params"][n]).abs().max()) for n in bad)
            return f"{len(bad)} parameters differ after {STEPS} steps (up to {worst:.3g}): {bad[:3]}"
    return None


@pytest.fixture(scope="module")
def reference(tiny_models):
    return {padded: one_process(tiny_models["llama"], padded) for padded in (False, True)}


@pytest.mark.multiproc
@pytest.mark.parametrize("padded", [False, True], ids=["equal-chunks", "padding-in-one-chunk"])
def test_accelerate_loop_matches_one_process(pool2, tiny_models, reference, padded):
    results = pool2.run(cp_loop, tiny_models["llama"], padded, timeout=300)
    for result in results:
        assert all(seen == SEQ // 2 for seen in result.get("seen", [0])), result.get("seen", result)
        assert mismatch(result, reference[padded]) is None, mismatch(result, reference[padded])


def cp_trainer(path: str, padded: bool) -> dict[str, Any]:
    """``Trainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))`` on the same rows (one
    per-device batch of 2 per step, both CP ranks on the same rows): losses and grad norms as it logs them, the
    positions each forward saw, the parameters after training."""
    import tempfile

    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.adopt import AdoptionError
    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.models import full

    rows = [{k: v[i] for k, v in batch.items()} for batch in batches(padded) for i in range(BATCH)]
    shardadopt.enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                     distributed_config=DistributedConfig(fsdp_size=2))
        seen: list[Any] = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].tolist()), with_kwargs=True)
        forget_accelerate_state()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=MAX_NORM, optim="adamw_torch",
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                train_sampling_strategy="sequential", disable_tqdm=True, per_device_eval_batch_size=BATCH,
                parallelism_config=ParallelismConfig(cp_size=2))
            trainer = Trainer(model=model, args=args, train_dataset=rows)
            trainer.remove_callback(PrinterCallback)
            trainer.train()
            eval_rows = [{k: v[i] for k, v in batch.items()} for batch in eval_batches() for i in range(BATCH)]
            try:
                eval_loss = trainer.evaluate(eval_dataset=eval_rows)["eval_loss"]
            except AdoptionError as exc:  # transformers before 5.25 (see the test)
                eval_loss = f"AdoptionError: {exc}"
        logged = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        params = {n: full(p).detach().clone() for n, p in trainer.model.named_parameters()}
        return {"seen": [len(ids[0]) for ids in seen], "ids": seen,
                "losses": [row["loss"] for row in logged], "norms": [float(row["grad_norm"]) for row in logged],
                "eval_loss": eval_loss, "params": params if dist.get_rank() == 0 else None}
    except Exception as exc:  # noqa: BLE001  (the test reads what each rank raised)
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    finally:
        shardadopt.disable()


@pytest.mark.multiproc
@pytest.mark.parametrize("padded", [False, True], ids=["equal-chunks", "padding-in-one-chunk"])
def test_trainer_matches_one_process(pool2, tiny_models, reference, padded):
    results = pool2.run(cp_trainer, tiny_models["llama"], padded, timeout=300)
    for result in results:
        assert "error" not in result, result["error"]
        assert result["seen"][:STEPS] == [SEQ // 2] * STEPS, result["seen"]  # training; then evaluation's
        assert mismatch(result, reference[padded]) is None, mismatch(result, reference[padded])
        # Trainer.evaluate under CP: transformers 5.25 splits evaluation batches too and gives one process's loss (not
        # cp_size times it, nor one chunk's); 5.15 runs the whole sequence on each rank with its count divided by
        # cp_size (cp_size x the loss): refused by name
        if result["seen"][STEPS] == SEQ // 2:
            assert result["eval_loss"] == pytest.approx(reference[padded]["eval_loss"], rel=1e-5), result["eval_loss"]
        else:
            assert "outside maybe_context_parallel" in str(result["eval_loss"]), result["eval_loss"]
            assert "Upgrade transformers to 5.25" in result["eval_loss"]
    # both CP ranks hold chunks of the same rows
    assert results[0]["ids"] != results[1]["ids"]


@pytest.mark.multiproc
def test_patch_off_raises(pool2, tiny_models):
    """Without torch-cp-cpu-flash-attention the first forward raises (the other traps:
    test_context_parallel_traps.py)."""
    for result in pool2.run(cp_loop, tiny_models["llama"], False, patch=False, timeout=300):
        assert "NotImplementedError" in result.get("error", "") and "sharding strategy" in result["error"], result


def test_probe_decides_by_the_handler_table():
    """Needed while ring attention's table has the CUDA flash kernel and not the CPU one; not-needed once torch
    lists the CPU kernel (simulated by adding it to the table)."""
    from shardadopt import upstream
    from shardadopt.patches.torch_cp_cpu_flash_attention import probe

    assert probe().needed
    table, cpu = upstream.cp_custom_ops(), upstream.sdpa_flash_kernels()["cpu"]
    table[cpu] = table[upstream.sdpa_flash_kernels()["cuda"]]  # upstream-private: torch's own fix, simulated
    try:
        assert not probe().needed
    finally:
        del table[cpu]
