"""Scenario "cases": what is refused when peft adds an adapter to a sharded model, and initial values that do not
depend on each rank's seed.
"""

from __future__ import annotations

from typing import Any

from shardadopt.testing.lora.common import LR, SEED, adapter_params, load_model, lora_config

REFUSALS = {  # case -> LoraConfig overrides; each is refused when peft adds the adapter to a sharded model
    "pissa": {"init_lora_weights": "pissa"},
    "astra": {"init_lora_weights": "astra"},  # peft 0.22; peft 0.21 has no astra: refused alike
    "gather-output-plan": {"target_modules": ["lm_head"]},  # TP plan colwise_gather_output
    "save-sharded-module": {"modules_to_save": ["gate_proj"]},  # TP plan colwise: its copy would output whole
    "save-fsdp-unit": {"modules_to_save": ["embed_tokens"]},
    "modules-to-save": {"modules_to_save": ["lm_head"]},  # an untied head: an FSDP unit of its own (norm + head)
}


def adapter_case(path: str, sizes: dict[str, Any], case: str) -> dict[str, Any]:
    """One adapter scenario on a sharded load: a refusal (``REFUSALS``, ``added-before-enable``, ``merge``) as the
    error text, or ``seeds-differ``: adapters added with every rank seeded differently (rank 0 with ``SEED``), a
    second one through ``add_adapter``: their initial values on this rank."""
    import torch
    import torch.distributed as dist
    from peft import get_peft_model

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True)
        base = load_model(path, sizes)
        torch.manual_seed(SEED)
        try:
            if case in REFUSALS:
                get_peft_model(base, lora_config(**REFUSALS[case]))
            elif case == "added-before-enable":
                shardadopt.disable()
                model = get_peft_model(base, lora_config())
                shardadopt.enable()
                accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
            elif case == "merge":
                get_peft_model(base, lora_config()).merge_and_unload()
            elif case == "seeds-differ":
                torch.manual_seed(SEED + 1000 * dist.get_rank())
                model = get_peft_model(base, lora_config(init_lora_weights="gaussian"))
                model.add_adapter("second", lora_config(r=4, init_lora_weights="gaussian"))
                return {"init": adapter_params(model)}
            else:
                raise ValueError(f"unknown case {case!r}")
        except ValueError as exc:  # AdapterLayoutError, AdoptionError
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": None}
    finally:
        shardadopt.disable()


def initial_adapters(path: str) -> dict[str, Any]:
    """What one process initialises for ``adapter_case(..., "seeds-differ")`` from ``SEED``."""
    import torch
    from peft import get_peft_model

    torch.manual_seed(SEED)
    model = get_peft_model(load_model(path, None), lora_config(init_lora_weights="gaussian"))
    model.add_adapter("second", lora_config(r=4, init_lora_weights="gaussian"))
    return adapter_params(model)
