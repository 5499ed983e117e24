"""LoRA on a load-time-sharded model through the ordinary accelerate loop, and the one-process reference.

Workers for ``tests/test_adapters*.py`` (importable by RankPool workers): ``train_lora_rank`` is what a user writes
(load with ``DistributedConfig``, seed, ``get_peft_model``, AdamW over ``model.parameters()``, ``prepare``,
``accumulate``, ``clip_grad_norm_``, ``step``), then exports the adapter with ``save_pretrained`` on every rank and
loads it back onto a fresh sharded base; ``train_lora_reference`` runs the same steps in one process on the same
global batches.
"""

from __future__ import annotations

from typing import Any

SEED = 1234
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
PER_DP_BATCH = 2
STEPS = 3
ACCUM = 2
LR = 1e-2
MAX_NORM = 0.05  # below every step's adapter grad norm here: clipping is always active (the tests check)


def lora_config(**overrides: Any):
    from peft import LoraConfig

    return LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": TARGETS, **overrides})


def _rows(dp_size: int, steps: int, accum: int):
    from shardadopt.testing import token_batch

    return token_batch(SEED, steps * accum * dp_size * PER_DP_BATCH)


def _load(path: str, sizes: dict[str, Any] | None):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if sizes:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _adapter_params(model) -> dict[str, Any]:
    from shardadopt.testing import full

    return {n: full(p).detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _adapter_grads(model) -> dict[str, Any]:
    from shardadopt.testing import full

    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def probe_batch():
    from shardadopt.testing import token_batch

    return token_batch(SEED + 1, 2)


def train_lora_reference(path: str, dp_size: int, steps: int = STEPS, accum: int = ACCUM) -> dict[str, Any]:
    """One process, the same global batches: each step sees ``accum`` micro-batches of dp_size * PER_DP_BATCH."""
    import torch
    from peft import get_peft_model

    base = _load(path, None)
    torch.manual_seed(SEED)
    model = get_peft_model(base, lora_config())
    init = _adapter_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = _rows(dp_size, steps, accum)
    global_micro = dp_size * PER_DP_BATCH
    losses, norms = [], []
    for step in range(steps):
        micro = []
        for m in range(accum):
            batch = rows[(step * accum + m) * global_micro:(step * accum + m + 1) * global_micro]
            loss = model(input_ids=batch, labels=batch).loss
            (loss / accum).backward()
            micro.append(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(torch.stack(micro).mean()))
        grads = _adapter_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=probe_batch()).logits
    return {"losses": losses, "norms": norms, "init": init, "grads": grads, "params": _adapter_params(model),
            "logits": logits}


def train_lora_rank(path: str, sizes: dict[str, Any], dp_size: int, export_dir: str, steps: int = STEPS,
                    accum: int = ACCUM) -> dict[str, Any]:
    """The user's accelerate loop with LoRA on a sharded load, then ``save_pretrained`` and a sharded reload."""
    import torch
    import torch.distributed as dist
    from peft import PeftModel, get_peft_model

    import shardadopt
    from shardadopt.selftest.accelerate import _local, fresh_accelerator

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=accum)
        base = _load(path, sizes)
        torch.manual_seed(SEED)
        model = get_peft_model(base, lora_config())
        init = _adapter_params(model)
        frozen = {n: _local(p) for n, p in model.named_parameters() if "lora_" not in n}
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(list(_rows(dp_size, steps, accum)), batch_size=PER_DP_BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses, norms, micro, grads = [], [], [], {}
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                micro.append(loss.detach())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                    losses.append(float(accelerator.reduce(torch.stack(micro).mean(), "mean")))
                    micro = []
                    grads = _adapter_grads(model)
                optimizer.step()
                optimizer.zero_grad()
        unwrapped = accelerator.unwrap_model(model)
        base_unchanged = all(torch.equal(_local(p), frozen[n]) for n, p in unwrapped.named_parameters()
                             if n in frozen)
        trainable = sorted(n for n, p in unwrapped.named_parameters() if p.requires_grad)
        with torch.no_grad():
            logits = unwrapped(input_ids=probe_batch()).logits
        unwrapped.save_pretrained(export_dir)
        # the export loaded back onto a fresh sharded base: resharded, equal outputs
        reloaded = PeftModel.from_pretrained(_load(path, sizes), export_dir)
        with torch.no_grad():
            reloaded_logits = reloaded(input_ids=probe_batch()).logits
        return {"losses": losses, "norms": norms, "init": init, "grads": grads, "params": _adapter_params(unwrapped),
                "base_unchanged": base_unchanged, "trainable": trainable, "logits": logits,
                "reloaded_logits": reloaded_logits, "rank": dist.get_rank()}
    finally:
        shardadopt.disable()
