"""The architecture sweep's two runs of one tiny model: the one-process reference (the same optimizer steps on the
same global batches) and, on every rank of a pool, the accelerate loop users write on the model sharded at load time.
Both see the same samples: token rows for causal LMs, the image-text samples ``shardadopt/testing/vlm.py`` writes
next to the checkpoint for image-text-to-text models. ``shardadopt/testing/sweep.py`` runs them per type and layout;
``shardadopt/testing/sweep_compare.py`` judges them.
"""

from __future__ import annotations

import os
from typing import Any

from shardadopt.testing.archs import CAUSAL_LM, IMAGE_TEXT

STEPS = 3
ACCUM = 2
PER_DP_BATCH = 2
SEQ_LEN = 16
LR = 1e-3
MAX_NORM = 0.5
SEED = 1234


def sample_count(dp: int) -> int:
    return STEPS * ACCUM * dp * PER_DP_BATCH


def _rows(dp: int):
    import torch

    return torch.randint(0, 512, (sample_count(dp), SEQ_LEN), generator=torch.Generator().manual_seed(SEED))


def _samples(path: str, dp: int, task: str) -> list[dict[str, Any]]:
    """The run's samples in order: token rows (causal LM), or the image-text samples written next to the tiny
    checkpoint (:func:`shardadopt.testing.vlm.write_batches`)."""
    import torch

    if task == CAUSAL_LM:
        return [{"input_ids": row, "labels": row} for row in _rows(dp)]
    return torch.load(os.path.join(path, f"samples-{sample_count(dp)}.pt"))


def _auto_class(task: str):
    import transformers

    return {CAUSAL_LM: transformers.AutoModelForCausalLM,
            IMAGE_TEXT: transformers.AutoModelForImageTextToText}[task]


class RandomForward(RuntimeError):
    """The model's training forward draws random numbers: one process and the sharded run cannot agree."""


def reference(path: str, dp: int, split: int = 1, task: str = CAUSAL_LM) -> dict[str, Any]:
    """One process: the same optimizer steps on the same global batches (``dp * PER_DP_BATCH`` rows a
    micro-step). ``split``: each micro-batch's backward runs on that many equal chunks, the same sum in another
    floating-point order (what a sharded run changes too), which measures how far fp32 noise alone moves later
    steps of this model. Raises :class:`RandomForward` when two forwards of one batch differ."""
    import torch

    from shardadopt.testing.vlm import collate

    model = _auto_class(task).from_pretrained(path, dtype=torch.float32)
    model.train()
    rows, micro_rows = _samples(path, dp, task), dp * PER_DP_BATCH
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        first = model(**collate(rows[:micro_rows])).loss
        torch.manual_seed(2)
        if not torch.equal(first, model(**collate(rows[:micro_rows])).loss):
            raise RandomForward("its training forward draws random numbers (two forwards of one batch differ), "
                                "so one process and the sharded run cannot agree")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        micro = []
        for m in range(ACCUM):
            batch = rows[(step * ACCUM + m) * micro_rows:(step * ACCUM + m + 1) * micro_rows]
            chunk_losses = []
            for c in range(split):
                chunk = batch[c * len(batch) // split:(c + 1) * len(batch) // split]
                loss = model(**collate(chunk)).loss
                (loss / (ACCUM * split)).backward()
                chunk_losses.append(loss.detach())
            micro.append(torch.stack(chunk_losses).mean())
        if grads is None:
            grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(torch.stack(micro).mean()))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def check_rank(path: str, sizes: dict[str, Any], dp: int, task: str = CAUSAL_LM) -> dict[str, Any]:
    """On every rank of a pool: the accelerate loop users write, after ``shardadopt.enable()``, on ``path`` loaded
    with ``DistributedConfig(**sizes)``. Returns this rank's losses, norms, first-step gradients and final
    parameters (DTensors whole, plain tensors as this rank holds them), or the stage that raised."""
    import torch
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing import full
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.vlm import collate

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        try:
            model = _auto_class(task).from_pretrained(path, dtype=torch.float32,
                                                      distributed_config=DistributedConfig(**sizes))
        except Exception as exc:
            return {"stage": "load", "error": error_text(exc), "shardadopt": _raised_by_shardadopt(exc)}
        try:
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
            loader = torch.utils.data.DataLoader(_samples(path, dp, task), batch_size=PER_DP_BATCH,
                                                 collate_fn=collate)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            losses, norms, micro, grads = [], [], [], None
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    micro.append(loss.detach())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if grads is None:
                            grads = {n: None if p.grad is None else full(p.grad).detach().clone()
                                     for n, p in accelerator.unwrap_model(model).named_parameters()}
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                        losses.append(float(accelerator.reduce(torch.stack(micro).mean(), "mean")))
                        micro = []
                    optimizer.step()
                    optimizer.zero_grad()
            params = {n: full(p).detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
        except Exception as exc:
            return {"stage": "train", "error": error_text(exc)}
        return {"losses": losses, "norms": norms, "grads": grads, "params": params}
    finally:
        shardadopt.disable()


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 400 else text[:397] + "..."


def _raised_by_shardadopt(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("shardadopt")
