"""What the step-time benchmarks share: the small llama they write once, and the timed accelerate loop.

``benchmarks/accelerate_step.py`` and ``benchmarks/adapter_step.py`` import it (run as scripts, ``benchmarks/`` is
on ``sys.path``, and RankPool workers inherit it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def write_llama(root: str, hidden: int, layers: int, vocab: int) -> str:
    """A randomly initialised llama checkpoint (seed 0) under ``root``, written once per shape; its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(root, f"llama-h{hidden}-l{layers}-v{vocab}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=1024)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def timed_accelerate_loop(accelerator: Any, model: Any, optimizer: Any, loader: Any, max_grad_norm: float,
                          inputs: Callable[[Any], dict[str, Any]],
                          after_last_step: Callable[[], Any] | None = None) -> tuple[list[float], Any]:
    """The user's accelerate loop (``accumulate``, ``backward``, ``clip_grad_norm_`` on synchronised micro-batches,
    ``step``, ``zero_grad``) over the prepared ``loader``, ``inputs(batch)`` the model's keyword arguments.

    Returns the ``time.perf_counter()`` at the end of every optimizer step (a step: every micro-batch of it,
    clipping and the update), and what ``after_last_step()`` returned, called after the last step's update, before
    its ``zero_grad`` (gradients and optimizer state still there), or None."""
    model.train()
    steps = len(loader) // accelerator.gradient_accumulation_steps
    ends: list[float] = []
    measured = None
    for data in loader:
        with accelerator.accumulate(model):
            loss = model(**inputs(data)).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            if after_last_step is not None and accelerator.sync_gradients and len(ends) + 1 == steps:
                measured = after_last_step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ends.append(time.perf_counter())
    return ends, measured
