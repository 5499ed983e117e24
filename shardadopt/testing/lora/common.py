"""What every LoRA scenario shares: the run's constants, the config, the batches, the model load, and how adapters
are read and compared with the one-process run.

The sharded side (``training``, ``resume``, ``cases``, ``several``) runs in RankPool workers, the reference in this
process; both load the same tiny checkpoint and see the same global batches.
"""

from __future__ import annotations

from typing import Any

SEED = 1234
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
ATTENTION = ("q_proj", "v_proj", "o_proj")  # Qwen3-MoE: every down_proj is an expert tensor
PER_DP_BATCH = 2
STEPS = 3
ACCUM = 2
LR = 1e-2
MAX_NORM = 0.05  # below every step's adapter grad norm here: clipping is always active (the tests check)
SECOND = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "gate_proj"]}  # a second adapter, "b"

# Adam normalises each element's step: a gradient that nearly cancels can move one element by a fraction of LR
# (see shardadopt.selftest.accelerate); whole-tensor errors (wrong data, gradient, clip) move by ~LR per step.
PARAM_MAX_DIFF = 0.5 * LR
PARAM_RMS = 1e-3 * LR


def lora_config(**overrides: Any):
    """The scenarios' ``LoraConfig`` (r 8, alpha 16, :data:`TARGETS`) with ``overrides``."""
    from peft import LoraConfig

    return LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": list(TARGETS), **overrides})


def token_rows(dp_size: int, steps: int, accum: int):
    """The run's token rows: ``steps * accum`` global micro-batches of ``dp_size * PER_DP_BATCH`` rows."""
    from shardadopt.testing import token_batch

    return token_batch(SEED, steps * accum * dp_size * PER_DP_BATCH)


def load_model(path: str, sizes: dict[str, Any] | None):
    """The checkpoint at ``path`` in fp32, sharded with ``DistributedConfig(**sizes)`` (None: one process)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if sizes:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is trained by the adapter: LoRA factors, DoRA magnitudes, ``modules_to_save``
    copies."""
    return "lora_" in name or ".modules_to_save." in name


def adapter_params(model) -> dict[str, Any]:
    """Every adapter parameter of ``model``, whole, by name."""
    from shardadopt.testing import full

    return {n: full(p).detach().clone() for n, p in model.named_parameters() if is_adapter(n)}


def adapter_grads(model) -> dict[str, Any]:
    """Every adapter parameter's gradient, whole, by name."""
    from shardadopt.testing import full

    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if is_adapter(n)}


def probe_batch():
    """The batch whose logits the scenarios compare."""
    from shardadopt.testing import token_batch

    return token_batch(SEED + 1, 2)


def params_close(got, want) -> bool:
    """Whether adapter ``got`` equals the one-process ``want`` within Adam's per-element noise."""
    diff = (got - want).abs()
    return got.shape == want.shape and float(diff.max()) < PARAM_MAX_DIFF and float(diff.pow(2).mean().sqrt()) \
        <= PARAM_RMS
