"""TRL's online trainers (GRPO, RLOO) and a user's own sampling loop on load-time-sharded models: workers for
``tests/trl/test_online.py`` (importable by RankPool workers).

:func:`online_log` is what a TRL user writes: load (sharded per ``layout``, or plain), ``GRPOConfig``/``GRPOTrainer``
or ``RLOOConfig``/``RLOOTrainer`` on a ``datasets`` prompt dataset with a plain python reward function, a local
tokenizer as ``processing_class``, ``train()``. The reward function also records the completions this rank scored,
so a test can compare what the ranks of a TP group sampled. TRL seeds every process differently
(``set_seed(args.seed, device_specific=True)``), so a multi-process run samples other completions than one process:
the reference of a layout with one data-parallel rank (``tp_size=2`` on 2 ranks) is one process on the plain
checkpoint with the same per-device batch, whose stream (``seed + 0``) is the one the TP group's first rank has.
:func:`sampled_tokens` is a user loop: a per-process seed, then ``model.generate(do_sample=True)``.
"""

from __future__ import annotations

import math
from typing import Any

from shardadopt.testing.patching import keeps_patch_state
from shardadopt.testing.trl import load_model, plain_head_shard

STEPS = 3
NUM_GENERATIONS = 4
PROMPTS_PER_STEP = 1  # the global batch: one prompt's group of NUM_GENERATIONS completions per step
MAX_COMPLETION_LENGTH = 8
LR = 1e-3
# fp32 tolerance per trainer. RLOO's default beta=0.05 adds a KL term against TRL's reference model, which is plain
# (loaded from the checkpoint) while the policy is sharded: their log-probs differ by fp32 reduction-order noise
# (~1e-7) where one process's are equal, and Adam turns that noise on otherwise zero gradients into full-size steps
# (measured: step-3 grad norm 2.7e-4 off in fp32; 1e-15 in float64, so no real difference).
RTOL = {"grpo": 1e-4, "rloo": 1e-3}


def prompts(n: int):
    """``n`` short prompts in a "prompt" column (standard, not conversational: the tiny tokenizer has no chat
    template)."""
    from datasets import Dataset

    from shardadopt.testing.text import sentences

    return Dataset.from_dict({"prompt": sentences(n, seed=5, max_words=6)})


def even_words(completions: list[str]) -> list[float]:
    """The reward: the share of a completion's words whose number is even (``w12`` yes, ``w7`` no)."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / max(len(c.split()), 1)
            for c in completions]


@keeps_patch_state
def online_log(models: dict[str, str], tokenizer: str, kind: str, layout: str | None, model: str, *,
               world: int = 2, exclude: tuple[str, ...] = (), dtype: str = "float32", lora: bool = False,
               from_path: bool = False, **config: Any) -> dict[str, Any]:
    """``kind`` ("grpo" or "rloo") for :data:`STEPS` steps, full fine-tuning in ``dtype`` (or with ``lora``: TRL's
    ``peft_config=LoraConfig(...)``, every rank seeded the same first), on ``model`` sharded per
    ``layout`` over ``world`` ranks, or plain (``layout=None``: one process, or DDP over the process group it runs
    in), with shardadopt enabled minus ``exclude``; ``config`` adds to the trainer's config. ``from_path``: TRL
    loads the model itself (``model=<path>``, ``model_init_kwargs={"dtype": ..., "distributed_config":
    DistributedConfig(...)}`` for a ``layout``). Returns ``{"log":
    [{"loss", "grad_norm", "reward", "reward_std"} per step], "completions": [the completions this rank's reward
    function scored, per call], "dp": data-parallel size, "plain_head_shard": ...}``, or ``{"refused": shardadopt's
    error, ...}``; a step that generated nothing (``steps_per_generation``/``num_iterations`` > 1) logs reward
    None."""
    import tempfile

    import torch
    from transformers import AutoTokenizer, PrinterCallback

    import shardadopt
    from shardadopt.adapters import AdapterLayoutError
    from shardadopt.adopt import AdoptionError
    from shardadopt.testing.trl import LORA_SEED, lora_config

    seen: list[list[str]] = []

    def reward_even_words(completions, **kwargs):
        seen.append(list(completions))
        return even_words(completions)

    shardadopt.enable(exclude=exclude)
    try:
        init: dict[str, Any] = {}
        if from_path:
            from shardadopt import upstream
            from shardadopt.testing.layouts import distributed_sizes

            network, dp, init["dtype"] = models[model], world, dtype
            if layout is not None:
                from transformers.distributed import DistributedConfig

                sizes, dp = distributed_sizes(layout, world)
                init["distributed_config"] = DistributedConfig(**sizes)
            upstream.reset_accelerate_state()  # pooled ranks run several trainers in one process
            result: dict[str, Any] = {"dp": dp}
        else:
            network, dp = load_model(models[model], layout, world, dtype)
            result = {"plain_head_shard": plain_head_shard(network), "dp": dp}
        with tempfile.TemporaryDirectory(prefix="shardadopt-trl-online-") as out:
            common = dict(output_dir=out, per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS // dp,
                          num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION_LENGTH,
                          max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", logging_steps=1,
                          save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
                          **({"model_init_kwargs": init} if from_path else {}))
            common.update(config)
            if kind == "grpo":
                from trl import GRPOConfig as Config
                from trl import GRPOTrainer as Trainer
            else:
                from trl import RLOOConfig as Config
                from trl import RLOOTrainer as Trainer
            extra: dict[str, Any] = {}
            if lora:
                torch.manual_seed(LORA_SEED)
                extra["peft_config"] = lora_config(model)
            try:
                trainer = Trainer(model=network, reward_funcs=reward_even_words, args=Config(**common),
                                  train_dataset=prompts(STEPS * PROMPTS_PER_STEP * 4),
                                  processing_class=AutoTokenizer.from_pretrained(tokenizer), **extra)
                result["plain_head_shard"] = plain_head_shard(trainer.model)
                trainer.remove_callback(PrinterCallback)
                trainer.train()
            except (AdapterLayoutError, AdoptionError) as exc:
                return {**result, "refused": f"{type(exc).__name__}: {exc}"}
        result.update(log=[{"loss": row["loss"], "grad_norm": float(row["grad_norm"]), "reward": row.get("reward"),
                            "reward_std": row.get("reward_std")}
                           for row in trainer.state.log_history if "loss" in row and "grad_norm" in row],
                      completions=seen)
        return result
    finally:
        shardadopt.disable()


def tracks(result: dict[str, Any], reference: dict[str, Any], rtol: float) -> str | None:
    """What differs between an :func:`online_log` run's log and the reference's, step by step (None: every step's
    loss, grad norm, reward and logged reward standard deviation within ``rtol``; a step that logged no reward must
    log none on both)."""
    if "log" not in result:
        return f"not trained: {result.get('refused')}"
    got, want = result["log"], reference["log"]
    if len(got) != len(want) or len(want) != STEPS:
        return f"{len(got)} logged steps, the reference logged {len(want)} (of {STEPS})"
    for step, (have, expected) in enumerate(zip(got, want), start=1):
        for key in ("loss", "grad_norm", "reward", "reward_std"):
            if have[key] is None or expected[key] is None:
                if have[key] is not expected[key]:
                    return f"step {step}: {key} {have[key]!r} vs reference {expected[key]!r}"
                continue
            # GRPO/RLOO losses are ~0 by construction (advantages sum to zero per group): compare them absolutely
            if not math.isclose(have[key], expected[key], rel_tol=rtol, abs_tol=1e-6 if key == "loss" else 0.0):
                return f"step {step}: {key} {have[key]!r} vs reference {expected[key]!r} (rtol {rtol})"
    return None


@keeps_patch_state
def sampled_tokens(path: str, layout: str | None, *, world: int = 2, exclude: tuple[str, ...] = ()) -> list[list[int]]:
    """A user's sampling loop on ``path`` (sharded per ``layout`` over ``world`` ranks, or plain): seed this process
    by its rank, then ``model.generate(do_sample=True)`` on the same prompts on every rank; the sampled tokens."""
    import torch
    import torch.distributed as dist

    import shardadopt

    shardadopt.enable(exclude=exclude)
    try:
        network, _ = load_model(path, layout, world)
        torch.manual_seed(dist.get_rank() if dist.is_initialized() else 0)
        prompt = torch.arange(3, 15).reshape(2, 6)
        with torch.no_grad():
            out = network.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                   max_new_tokens=MAX_COMPLETION_LENGTH, pad_token_id=0)
        return out[:, prompt.shape[1]:].tolist()
    finally:
        shardadopt.disable()
