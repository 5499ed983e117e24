"""TRL's trainers (and Trainer with LoRA) on load-time-sharded models, and their DDP reference: workers for
``tests/trl/`` (importable by RankPool workers).

:func:`trl_log` is what a TRL user writes: load (sharded per ``layout``, or plain under DDP), optionally add LoRA
(TRL's ``peft_config=`` or ``get_peft_model`` first), ``SFTConfig``/``SFTTrainer`` on a ``datasets`` text dataset or
``DPOConfig``/``DPOTrainer`` on prompt/chosen/rejected with TRL's default reference model, or
``RewardConfig``/``RewardTrainer`` on chosen/rejected with ``AutoModelForSequenceClassification(num_labels=1)`` loaded
from the causal-LM checkpoint (its score head initialised after ``set_seed``, as TRL's docs do), or
``KTOConfig``/``KTOTrainer`` on prompt/completion/label with TRL's default reference model, a local tokenizer as
``processing_class`` (no downloads), ``train()``; or, as transformers' docs show the plain ``Trainer``, the same text
tokenized with ``DataCollatorForLanguageModeling``. The same global batch on every layout: a run with ``dp``
data-parallel ranks takes ``GLOBAL_BATCH // dp`` per device. TRL's configs default to ``bf16=True``, on CPU too: the
fp32 runs set ``bf16=False`` as a user comparing in fp32 does. :func:`resume_log` trains an adapter run with
checkpoints, stops it after one and resumes it in a new trainer (``trainer.train(resume_from_checkpoint=True)``).
"""

from __future__ import annotations

import math
from typing import Any

STEPS = 3
GLOBAL_BATCH = 4
MODELS = {"fsdp": "llama", "tp": "qwen3", "ep": "qwen3moe", "2d": "qwen3", "hsdp": "llama"}
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
ATTENTION = ["q_proj", "v_proj", "o_proj"]  # Qwen3-MoE: its down_proj are fused expert tensors (experts=...)
# LoRA on the MoE experts, by how the user names them: "down_proj" in target_modules (peft maps it to the fused
# tensor), or both fused tensors in target_parameters (with attention in target_modules)
EXPERTS = {"down_proj": {"target_modules": TARGETS},
           "parameters": {"target_modules": ATTENTION,
                          "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}}
MAX_LENGTH = 32
LORA_SEED = 0  # every rank seeded the same before the adapters are added, as a user does
LR = {"full": 1e-3, "lora": 1e-2}
# fp32: TP pads the whole global batch where DDP pads per rank, and sharded matmuls sum in another order
FP32_RTOL = 1e-4
# Qwen3-MoE: Adam's normalised update turns that reduction-order noise on near-zero expert gradients into visible
# steps (transformers 5.15, EP on the TP mesh: DPO grad norm 1.9e-4 off at step 3)
MOE_RTOL = 5e-4
BF16_RTOL = 2e-2  # bf16 autocast: ~3 significant digits per matmul
# What shardadopt's refusals say, by cause (the tests assert the refusal of each combination names it and the fix)
REFUSALS = {"fused-head": ("TRL's fused LM head", "Upgrade transformers to 5.17"),
            "lora-tp": ("tensor parallelism on transformers before 5.17", "Upgrade transformers to 5.17"),
            "experts-tp-mesh": ("not sharded by expert on an ep mesh", "transformers 5.21 or newer"),
            "partial-groups": ("does not hold whole groups of num_generations=4",
                               "TRL refuses it under DDP over 1 process", "steps_per_generation=2"),
            "vllm": ("use_vllm=True cannot train a model sharded at load time", "Set use_vllm=False"),
            "distill-head": ("DistillationTrainer reads the student's lm_head.weight directly",
                             "Upgrade transformers to 5.17", "DistributedConfig(fsdp_size=...)")}


def dataset(kind: str, n: int = STEPS * GLOBAL_BATCH):
    """``n`` samples: a "text" column for SFT, "prompt"/"chosen"/"rejected" for DPO, "chosen"/"rejected" (TRL's
    implicit-prompt preference form) for the reward model, "prompt"/"completion"/"label" for KTO."""
    from datasets import Dataset

    from shardadopt.testing.text import sentences

    if kind == "sft":
        return Dataset.from_dict({"text": sentences(n, seed=1)})
    if kind == "reward":
        return Dataset.from_dict({"chosen": sentences(n, seed=5), "rejected": sentences(n, seed=6)})
    if kind == "kto":  # TRL's unpaired preference form: a completion and whether it is desirable
        return Dataset.from_dict({"prompt": sentences(n, seed=7, max_words=6),
                                  "completion": sentences(n, seed=8, max_words=6),
                                  "label": [i % 2 == 0 for i in range(n)]})
    return Dataset.from_dict({"prompt": sentences(n, seed=2, max_words=6), "chosen": sentences(n, seed=3, max_words=6),
                              "rejected": sentences(n, seed=4, max_words=6)})


def lora_config(model: str, experts: str | None = None):
    """The adapters for ``model`` (a key of the tiny checkpoints): :data:`TARGETS`, attention only on the MoE model
    unless ``experts`` (a key of :data:`EXPERTS`) names how its fused expert tensors are targeted."""
    from peft import LoraConfig

    from shardadopt.testing.models import MOE_MODELS

    targets = {"target_modules": ATTENTION if model in MOE_MODELS else TARGETS}
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM", **EXPERTS.get(experts, targets))


def load_model(path: str, layout: str | None, world: int, dtype: str = "float32", reward: bool = False):
    """The model in ``dtype``, sharded per ``layout`` over ``world`` ranks or plain (DDP); and the data-parallel
    size. In float64 the experts run transformers' ``"eager"`` implementation: CPU ``grouped_mm`` has no float64.
    ``reward``: ``AutoModelForSequenceClassification`` with one label (a reward model) from the causal-LM checkpoint,
    after ``set_seed(0)`` (its new score head is drawn from the RNG, the same on every rank and run)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

    from shardadopt import upstream
    from shardadopt.testing.layouts import distributed_sizes

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if dtype == "float64":
        kwargs["experts_implementation"] = "eager"
    dp = world
    if layout is not None:
        from transformers.distributed import DistributedConfig

        sizes, dp = distributed_sizes(layout, world)
        kwargs["distributed_config"] = DistributedConfig(**sizes)
    if reward:
        set_seed(0)
        network = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    else:
        network = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    upstream.reset_accelerate_state()  # pooled ranks run several trainers in one process
    return network, dp


def plain_head_shard(network) -> bool:
    """Whether the LM head is a plain tensor holding part of the vocabulary (TP on transformers 5.15/5.16), as the
    refusals read it (:func:`shardadopt.adopt.plain_head_shard`); False for a classification head."""
    from shardadopt.adopt import plain_head_shard as found

    return found(network) is not None


def _trainer(kind: str, network, common: dict[str, Any], tokenizer: str, global_batch: int = GLOBAL_BATCH,
             **extra):
    """``kind``: "sft" / "dpo" / "reward" / "kto" (TRL's trainer and config) or "trainer" (``Trainer`` and
    ``TrainingArguments`` on the SFT text tokenized, ``DataCollatorForLanguageModeling``), sequences cut at
    :data:`MAX_LENGTH` either way; the dataset holds ``STEPS`` global batches of ``global_batch`` samples for each of
    ``common``'s gradient accumulation steps."""
    from transformers import AutoTokenizer, PrinterCallback

    processing_class = AutoTokenizer.from_pretrained(tokenizer)
    samples = STEPS * global_batch * common.get("gradient_accumulation_steps", 1)
    if kind == "trainer":
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        data = dataset("sft", samples).map(
            lambda batch: processing_class(batch["text"], truncation=True, max_length=MAX_LENGTH), batched=True,
            remove_columns=["text"])
        trainer = Trainer(model=network, args=TrainingArguments(**common), train_dataset=data,
                          data_collator=DataCollatorForLanguageModeling(processing_class, mlm=False), **extra)
    elif kind == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=network, args=SFTConfig(**common, max_length=MAX_LENGTH),
                             train_dataset=dataset("sft", samples), processing_class=processing_class, **extra)
    elif kind == "reward":
        from trl import RewardConfig, RewardTrainer

        trainer = RewardTrainer(model=network, args=RewardConfig(**common, max_length=MAX_LENGTH),
                                train_dataset=dataset("reward", samples), processing_class=processing_class, **extra)
    elif kind == "kto":
        from trl import KTOConfig, KTOTrainer

        trainer = KTOTrainer(model=network, args=KTOConfig(**common, max_length=MAX_LENGTH),
                             train_dataset=dataset("kto", samples), processing_class=processing_class, **extra)
    else:
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=network, args=DPOConfig(**common, max_length=MAX_LENGTH),
                             train_dataset=dataset("dpo", samples), processing_class=processing_class, **extra)
    trainer.remove_callback(PrinterCallback)
    return trainer


def logged_steps(trainer) -> list[dict[str, float]]:
    """Per optimizer step {"loss", "grad_norm"} as the trainer logged them."""
    return [{"loss": row["loss"], "grad_norm": float(row["grad_norm"])}
            for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]


def trl_log(models: dict[str, str], tokenizer: str, kind: str, layout: str | None, model: str, *,
            world: int = 2, bf16: bool = False, lora: str | None = None, experts: str | None = None,
            accum: int = 1, dtype: str = "float32", global_batch: int = GLOBAL_BATCH) -> dict[str, Any]:
    """``kind`` ("sft", "dpo", "reward", "kto" or "trainer": :func:`_trainer`) for STEPS steps of ``global_batch``
    samples on ``model`` sharded per ``layout`` over ``world`` ranks, or (``layout=None``) plain under DDP over
    ``world`` ranks (one process: ``world=1``); full fine-tuning, or
    LoRA added ``lora`` ("peft_config": by TRL, "wrapped": ``get_peft_model`` first), on the MoE experts too with
    ``experts`` (:func:`lora_config`), each step accumulating ``accum`` global batches, the model loaded in ``dtype``
    (:func:`load_model`). ``{"log": [{"loss", "grad_norm"} per step], "adapter_grad_reductions": {LoRA factor:
    all_reduce calls on its gradient}, "dp": data-parallel size}`` or
    ``{"refused": shardadopt's error}``, and ``"plain_head_shard"`` (:func:`plain_head_shard` of the loaded model).
    With ``experts`` also ``"adapter"`` (every factor's full tensor after training), ``"export"`` (global rank 0:
    what ``trainer.model.save_pretrained`` wrote, as ``safetensors`` loads it) and ``"expert_replicas"`` ({expert
    factor: ranks holding its experts}, sharded loads)."""
    import os
    import tempfile

    import torch

    import shardadopt
    from shardadopt.adapters import AdapterLayoutError
    from shardadopt.adopt import AdoptionError
    from shardadopt.testing.collectives import counted_grad_reductions

    shardadopt.enable()
    try:
        network, dp = load_model(models[model], layout, world, dtype, reward=kind == "reward")
        result: dict[str, Any] = {"plain_head_shard": plain_head_shard(network)}
        extra: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="shardadopt-trl-") as out:
            common = dict(output_dir=out, per_device_train_batch_size=global_batch // dp, max_steps=STEPS,
                          learning_rate=LR["lora" if lora else "full"], lr_scheduler_type="constant",
                          logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=bf16, seed=0,
                          gradient_accumulation_steps=accum, disable_tqdm=True)
            try:
                if lora is not None:
                    torch.manual_seed(LORA_SEED)
                    if lora == "wrapped":
                        from peft import get_peft_model

                        network = get_peft_model(network, lora_config(model, experts))
                    else:
                        extra["peft_config"] = lora_config(model, experts)
                trainer = _trainer(kind, network, common, tokenizer, global_batch, **extra)
                with counted_grad_reductions(trainer.model, lambda name: "lora_" in name) as reductions:
                    trainer.train()
            except (AdapterLayoutError, AdoptionError) as exc:
                return {**result, "refused": f"{type(exc).__name__}: {exc}"}
            result.update(log=logged_steps(trainer), adapter_grad_reductions=reductions, dp=dp)
            if experts:
                import torch.distributed as dist
                from safetensors.torch import load_file

                # a collective; the file is written on global rank 0 (a sharded model's export writes it once)
                trainer.model.save_pretrained(os.path.join(out, "adapter"))
                if dist.get_rank() == 0:
                    result["export"] = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
                result.update(adapter=_lora_tensors(trainer.model), expert_replicas=_expert_replicas(trainer.model))
        return result
    finally:
        shardadopt.disable()


def _expert_replicas(network) -> dict[str, int]:
    """{LoRA factor on a laid-out expert tensor: how many ranks hold its experts} (empty without expert parallelism)."""
    from torch.distributed.tensor import DTensor

    from shardadopt.adapters.experts import expert_replicas, is_expert_layer

    found = {}
    for prefix, module in network.named_modules():
        if is_expert_layer(module) and isinstance(module.get_param(), DTensor):
            for name, _ in module.named_parameters(prefix=prefix):
                if "lora_" in name:
                    found[name] = expert_replicas(module)
    return found


def compare(result: dict[str, Any], expected: list[dict[str, float]], rtol: float) -> str | None:
    """What differs between a :func:`trl_log` run and the DDP run's log (None: every step within ``rtol``)."""
    if "log" not in result:
        return f"not trained: {result.get('refused')}"
    got = result["log"]
    if len(got) != len(expected) or len(expected) != STEPS:
        return f"{len(got)} logged steps, the DDP run logged {len(expected)} (of {STEPS})"
    for step, (have, want) in enumerate(zip(got, expected), start=1):
        for key in ("loss", "grad_norm"):
            if not math.isclose(have[key], want[key], rel_tol=rtol):
                return f"step {step}: {key} {have[key]!r} vs DDP {want[key]!r} (rtol {rtol})"
    return None


def refusal_problem(result: dict[str, Any], cause: str) -> str | None:
    """What is wrong with ``result`` as shardadopt's refusal for ``cause`` (a key of REFUSALS), or None."""
    if "refused" not in result:
        return f"trained instead of being refused for {cause}"
    missing = [part for part in REFUSALS[cause] if part not in result["refused"]]
    return f"the refusal does not name {missing}: {result['refused']}" if missing else None


def ddp_reference(pool, tiny_models: dict[str, str], tokenizer: str):
    """``get(kind, model, bf16=False, lora=None, experts=None, part="log", accum=1, dtype="float32",
    global_batch=GLOBAL_BATCH)``: :func:`trl_log` on the plain checkpoint under DDP over all of ``pool``'s ranks (they
    must log the same values), computed once per argument set; its log, or with ``part="adapter"`` (``experts`` runs)
    the adapter factors after training."""
    cache: dict[tuple, dict[str, Any]] = {}

    def get(kind: str, model: str, bf16: bool = False, lora: str | None = None, experts: str | None = None,
            part: str = "log", accum: int = 1, dtype: str = "float32", global_batch: int = GLOBAL_BATCH) -> Any:
        key = (kind, model, bf16, lora, experts, accum, dtype, global_batch)
        if key not in cache:
            runs = pool.run(trl_log, tiny_models, tokenizer, kind, None, model, world=pool.nproc, bf16=bf16,
                            lora=lora, experts=experts, accum=accum, dtype=dtype, global_batch=global_batch,
                            timeout=300)
            assert "log" in runs[0], runs[0]
            assert all(run["log"] == runs[0]["log"] for run in runs), "DDP ranks log the same values"
            cache[key] = runs[0]
        return cache[key][part]

    return get


def _lora_tensors(network) -> dict[str, Any]:
    """Every LoRA factor of ``network`` as its full tensor (a collective on sharded factors)."""
    from shardadopt.testing import full

    return {n: full(p).detach().clone() for n, p in network.named_parameters() if "lora_" in n}


def resume_log(models: dict[str, str], tokenizer: str, how: str, layout: str, model: str, directory: str, *,
               steps: int = 4, stop_after: int = 2, experts: str | None = None) -> dict[str, Any]:
    """An adapter run with a checkpoint every 2 steps, three ways on ``model`` sharded per ``layout`` over 2 ranks:
    ``steps`` steps straight; the same stopped after ``checkpoint-{stop_after}`` (a callback setting
    ``control.should_training_stop``, as examples/trainer_finetune.py does); and a new trainer on a fresh load, its
    adapters initialised from another seed, resuming with ``train(resume_from_checkpoint=True)``. ``how``: "sft"
    (``SFTTrainer(peft_config=...)``) or "trainer" (``Trainer`` on a ``get_peft_model`` model, a tokenized dataset
    and ``DataCollatorForLanguageModeling``), with ``experts`` on the MoE experts too (:func:`lora_config`). Per
    run its log, its adapter factors (full tensors) at the end, ``checkpoint-{stop_after}`` (path and files) and
    what ``trainer.save_model`` wrote at the end (``"final"``); or ``{"refused": ...}``."""
    import os

    import torch
    from peft import get_peft_model
    from transformers import TrainerCallback

    import shardadopt
    from shardadopt.adapters import AdapterLayoutError

    class StopAfter(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == stop_after:
                control.should_training_stop = True

    def run(seed: int, out: str, *, stop: bool, resume: bool) -> dict[str, Any]:
        network, dp = load_model(models[model], layout, 2)
        common = dict(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=steps,
                      learning_rate=LR["lora"], lr_scheduler_type="constant", logging_steps=1,
                      save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, bf16=False, seed=0,
                      disable_tqdm=True)
        callbacks = [StopAfter()] if stop else []
        torch.manual_seed(seed)
        if how == "sft":
            trainer = _trainer("sft", network, common, tokenizer, peft_config=lora_config(model, experts),
                               callbacks=callbacks)
        else:
            trainer = _trainer("trainer", get_peft_model(network, lora_config(model, experts)), common, tokenizer,
                               callbacks=callbacks)
        trainer.train(resume_from_checkpoint=True if resume else None)
        trainer.save_model(os.path.join(out, "final"))  # an adapter run's final model: its adapter, as upstream
        checkpoint = os.path.join(out, f"checkpoint-{stop_after}")
        return {"log": logged_steps(trainer), "adapter": _lora_tensors(trainer.model), "checkpoint": checkpoint,
                "files": sorted(os.listdir(checkpoint)), "final": os.path.join(out, "final"),
                "global_step": trainer.state.global_step}

    shardadopt.enable()
    try:
        straight = run(LORA_SEED, os.path.join(directory, "straight"), stop=False, resume=False)
        stopped = run(LORA_SEED, os.path.join(directory, "resumed"), stop=True, resume=False)
        resumed = run(LORA_SEED + 1, os.path.join(directory, "resumed"), stop=False, resume=True)
        return {"straight": straight, "stopped": stopped, "resumed": resumed}
    except AdapterLayoutError as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    finally:
        shardadopt.disable()
