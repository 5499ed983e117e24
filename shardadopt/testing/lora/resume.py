"""Scenario "resume": two adapters trained in turn, ``save_state`` mid-run, a fresh load resumed with ``load_state``.

``resume_lora_rank`` returns both runs' losses and final adapters and what the checkpoint holds, for the test to
check that the resumed run equals the straight one bit for bit and that the frozen base is not saved.
``straight_and_resumed`` is its accelerate loop, shared with the expert LoRA test (which builds another model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardadopt.testing.lora.common import (
    ACCUM,
    LR,
    MAX_NORM,
    PER_DP_BATCH,
    SECOND,
    SEED,
    adapter_params,
    load_model,
    lora_config,
    token_rows,
)


def straight_and_resumed(build: Callable[[], Any], dp_size: int, steps: int, directory: str, save_after: int,
                         before_step: Callable[[Any, int], None] | None = None) -> dict[str, Any]:
    """The user's accelerate loop (gradient accumulation, clipping) run twice on one rank, ``shardadopt`` enabled:
    straight through ``steps`` optimizer steps with ``save_state(directory)`` after ``save_after`` of them; then on
    a fresh model whose adapters start from another seed, ``load_state(directory)`` and the remaining steps.

    Args:
        build: makes the PEFT model (called after the run's seed is set).
        dp_size: the data-parallel size (sets the global batches).
        steps: the optimizer steps of the straight run.
        directory: where ``save_state`` writes and ``load_state`` reads.
        save_after: the optimizer steps before ``save_state``.
        before_step: ``before_step(model, step)`` before each optimizer step's first micro-batch (``set_adapter``).

    Returns:
        ``straight``/``resumed``: the runs' reduced losses per step (the resumed run's from ``save_after`` on);
        ``params``/``resumed_params``: their final adapters.
    """
    import torch

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator

    def run(seed: int, resume: bool) -> tuple[list[float], dict[str, Any]]:
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        torch.manual_seed(seed)
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(list(token_rows(dp_size, steps, ACCUM)), batch_size=PER_DP_BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if resume:
            accelerator.load_state(directory)
        losses, done = [], save_after if resume else 0
        for index, batch in enumerate(loader):
            if resume and index < save_after * ACCUM:
                continue  # the batches the saved run consumed
            if before_step is not None and index % ACCUM == 0:
                before_step(model, done)
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    losses.append(float(accelerator.reduce(loss.detach(), "mean")))
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                done += 1
                if not resume and done == save_after:
                    accelerator.save_state(directory)
        return losses, adapter_params(model)

    shardadopt.enable()
    try:
        straight, params = run(SEED, False)
        resumed, resumed_params = run(SEED + 99, True)
    finally:
        shardadopt.disable()
    return {"straight": straight, "resumed": resumed, "params": params, "resumed_params": resumed_params}


def resume_lora_rank(path: str, sizes: dict[str, Any], dp_size: int, directory: str, plan: tuple[str, ...],
                     save_after: int = 2) -> dict[str, Any]:
    """Two adapters, ``plan``: the one active in each step; ``save_state(directory)`` after ``save_after`` steps;
    then a fresh load (the default adapter active), adapters initialised from another seed,
    ``load_state(directory)`` and the remaining steps. Both runs' losses and final adapters, and (rank 0) what the
    checkpoint holds: its model entries with their bytes, its optimizer entries, and the bytes of the adapters."""
    import os

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def build() -> Any:
        from peft import get_peft_model

        model = get_peft_model(load_model(path, sizes), lora_config())
        model.add_adapter("b", lora_config(**SECOND))
        return model

    result = straight_and_resumed(build, dp_size, len(plan), directory, save_after,
                                  before_step=lambda model, step: model.set_adapter(plan[step]))
    metadata = FileSystemReader(os.path.join(directory, "state")).read_metadata().state_dict_metadata
    tensors = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    model_bytes = {k: v.size.numel() * v.properties.dtype.itemsize for k, v in tensors.items()
                   if k.split(".")[0].startswith("model")}
    return {**result, "model_entries": model_bytes,
            "optimizer_entries": sorted(k for k in tensors if k.startswith("optimizer")),
            "adapter_bytes": sum(v.numel() * v.element_size() for v in result["params"].values())}
