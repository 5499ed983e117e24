"""Sharded models that adoption cannot train like one process are refused before training, naming the fix.

``DistributedConfig`` options whose parameters adoption cannot keep (CPU offload, FSDP2's bf16 parameter policy) or
that cannot train (DeepGEMM Mega MoE experts), and TRL's fused LM head or DistillationTrainer's loss on a plain local
TP shard of the vocabulary (transformers 5.15/5.16), which would score every token against one rank's slice without
an error. And the other
way round: a whole (unsharded) model that a CPU ``Accelerator`` would DDP-wrap although its ``ParallelismConfig`` asks
for sharding (``dp_shard_size > 1``), which would train full replicas on every rank without a word.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from shardadopt import upstream
from shardadopt.adopt.record import AdoptionError

# DistributedConfig flags adoption does not train like one process, and what to load instead.
_UNSUPPORTED_FEATURES = {
    "fsdp_cpu_offload": ("FSDP2 CPU offload is not supported (the optimizer, clipping and checkpoints assume the "
                         "parameters stay on the model's device); load without it and, to fit in memory, shard over "
                         "more ranks (a larger fsdp_size)"),
    "fsdp_mixed_precision": ("FSDP2's bf16 parameter policy is not supported (adoption keeps the loaded fp32 "
                             "parameters and trains in their precision); load without it and use "
                             "Accelerator(mixed_precision=\"bf16\") / TrainingArguments(bf16=True) instead"),
}
# DeepGEMM Mega MoE (transformers 5.25): a fused dispatch + experts + combine kernel without a backward
_MEGAMOE = "deepgemm_megamoe"


def refuse_unsupported_distributed_features(model: nn.Module) -> None:
    """Refuse (:class:`AdoptionError`) a model loaded with a ``DistributedConfig`` option adoption cannot train
    like one process: ``fsdp_cpu_offload=True``, ``fsdp_mixed_precision=True``, DeepGEMM Mega MoE experts
    (``ep_implementation`` / ``experts_implementation`` ``"deepgemm_megamoe"``, inference only) (``pp_size > 1``:
    :func:`shardadopt.parallel.topology` refuses it).

    Args:
        model: the model handed to ``prepare`` / the Trainer (a PEFT model reads its base model's config).
    """
    model_config = getattr(model, "config", None)
    config = getattr(model_config, "distributed_config", None)
    if config is None:
        return
    for name, why in _UNSUPPORTED_FEATURES.items():
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value:
            raise AdoptionError(f"DistributedConfig({name}={value!r}): {why}.")
    ep_implementation = config.get("ep_implementation") if isinstance(config, Mapping) else getattr(
        config, "ep_implementation", None)
    experts_implementation = upstream.experts_implementation(model_config)
    if _MEGAMOE in (ep_implementation, experts_implementation):
        spelled = (f"DistributedConfig(ep_implementation={ep_implementation!r})" if ep_implementation == _MEGAMOE
                   else f"experts_implementation={experts_implementation!r}")
        raise AdoptionError(f"{spelled}: DeepGEMM Mega MoE's kernel has no backward, so transformers runs it at "
                            f"inference only; to train, load with ep_implementation=\"all_to_all\" (the default) "
                            f"and without experts_implementation=\"{_MEGAMOE}\".")


def _fused_lm_head_forwards(model: nn.Module) -> Iterator[nn.Module]:
    """Modules of ``model`` whose forward TRL's ``add_fused_lm_head`` replaced.

    TRL sets an instance ``forward`` made with ``functools.wraps(type(model).forward)``, which copies the original's
    ``__module__`` and ``__qualname__``: only its code object, one of ``add_fused_lm_head``'s nested functions, says
    where it comes from."""
    try:
        from trl.trainer import add_fused_lm_head
    except ImportError:  # a TRL without the fused head
        return
    nested = {c for c in add_fused_lm_head.__code__.co_consts if isinstance(c, types.CodeType)}
    for module in model.modules():
        forward = vars(module).get("forward")
        if getattr(getattr(forward, "__func__", None), "__code__", None) in nested:
            yield module


def plain_head_shard(model: Any) -> tuple[tuple[int, ...], int] | None:
    """(shape, vocabulary size) of ``model``'s LM head weight when it is a plain tensor holding part of the
    vocabulary (a tensor-parallel shard as transformers 5.15/5.16 keep it: not a DTensor, fewer rows than
    ``vocab_size``), else None (a whole or DTensor head, no LM head, not a model). Local.

    Args:
        model: a model (a peft model reads its base model's head), or anything else.

    Returns:
        The local weight's shape and the vocabulary size, or None.
    """
    from torch.distributed.tensor import DTensor

    get_head = getattr(model, "get_output_embeddings", None)
    config = getattr(model, "config", None)
    if not callable(get_head) or config is None:
        return None
    weight = getattr(get_head(), "weight", None)
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if weight is None or isinstance(weight, DTensor) or vocab is None or weight.shape[0] >= vocab:
        return None
    return tuple(weight.shape), vocab


def refuse_fused_lm_head_on_plain_shards(model: nn.Module) -> None:
    """Refuse (:class:`AdoptionError`) a model whose LM head is a plain local TP shard (transformers 5.15/5.16) when
    TRL's fused LM head reads it (SFTTrainer, DPOTrainer, KTO, GRPO, RLOO install it on the model they train).

    The fused head projects hidden states through ``lm_head.weight`` itself and gathers the weight only when it is
    a DTensor; a plain shard holds this rank's slice of the vocabulary, so every token would be scored against part
    of the vocabulary: wrong loss and gradients without an error. Local: no collective.

    Args:
        model: the model being prepared (TRL's trainers install the fused head before ``prepare``).
    """
    for module in _fused_lm_head_forwards(model):
        found = plain_head_shard(module)
        if found is None:
            continue
        import transformers

        (shape, vocab) = found
        raise AdoptionError(
            f"TRL's fused LM head (trl add_fused_lm_head, installed by SFTTrainer, DPOTrainer and the other TRL "
            f"trainers) reads lm_head.weight directly, and on this model it is a plain tensor-parallel shard of "
            f"{shape} rows of the {vocab}-token vocabulary (transformers {transformers.__version__} "
            f"keeps TP shards as plain tensors, 5.15 and 5.16): every rank would score tokens against its own slice "
            f"of the vocabulary and train silently wrong. Upgrade transformers to 5.17 or newer (TP shards are "
            f"DTensors there, which TRL gathers), or load the model with DistributedConfig(fsdp_size=...) instead "
            f"of tp_size. TRL has no option to turn its fused LM head off.")


def refuse_distillation_heads_on_plain_shards(student: Any, teacher: Any) -> None:
    """Refuse (:class:`AdoptionError`) a TRL ``DistillationTrainer`` whose student or teacher has its LM head as a
    plain local TP shard (transformers 5.15/5.16).

    DistillationTrainer's loss reads both models' ``lm_head.weight`` itself (``get_output_embeddings()``, not
    through the fused head :func:`refuse_fused_lm_head_on_plain_shards` detects) and gathers a weight only when it
    is a DTensor: with a plain shard every rank would compare student and teacher over its own slice of the
    vocabulary, a wrong loss and wrong gradients without an error. Local: no collective.

    Args:
        student: the model the trainer trains (a peft model too).
        teacher: its teacher model, or None.
    """
    for role, model in (("student", student), ("teacher", teacher)):
        found = plain_head_shard(model)
        if found is None:
            continue
        import transformers

        (shape, vocab) = found
        raise AdoptionError(
            f"TRL's DistillationTrainer reads the {role}'s lm_head.weight directly in its loss (not through the "
            f"model's forward) and gathers it only when it is a DTensor; on this {role} it is a plain "
            f"tensor-parallel shard of {shape[0]} rows of the {vocab}-token vocabulary (transformers "
            f"{transformers.__version__} keeps TP shards as plain tensors, 5.15 and 5.16): every rank would compare "
            f"student and teacher over its own slice of the vocabulary and train silently wrong. Upgrade "
            f"transformers to 5.17 or newer (TP shards are DTensors there, which TRL gathers), or load the "
            f"{role} with DistributedConfig(fsdp_size=...) instead of tp_size.")


def refuse_whole_model_for_dp_shard(accelerator: Any, model: Any, override: Mapping[str, int] | None = None) -> None:
    """Refuse (:class:`AdoptionError`) to prepare a whole model for training on CPU processes when the accelerator's
    ``ParallelismConfig`` asks for FSDP sharding (``dp_shard_size > 1``) and nothing else decides.

    accelerate shards a whole model in ``prepare`` only through its FSDP plugin, which CPU processes never get
    (``DistributedType.MULTI_CPU``); ``prepare_model`` would DDP-wrap it: a full replica of the parameters, gradients
    and optimizer states on every rank, where the user asked for one shard each. Local: no collective.

    Args:
        accelerator: the ``Accelerator`` preparing ``model`` for training.
        model: what ``prepare_model`` was given; a load-time-sharded model (``shardadopt.parallel.topology``) passes.
        override: explicit topology sizes (:class:`AdoptionKwargs` ``topology``).
    """
    from accelerate.utils.dataclasses import DistributedType

    from shardadopt.parallel.topology import topology

    config = accelerator.parallelism_config
    if (accelerator.distributed_type != DistributedType.MULTI_CPU or config is None or not config.dp_shard_enabled
            or config.tp_enabled or not isinstance(model, nn.Module) or topology(model, override).is_sharded):
        return
    size = config.dp_shard_size
    raise AdoptionError(
        f"ParallelismConfig(dp_shard_size={size}) asks for a model sharded over {size} ranks, but this model was "
        f"loaded whole, and accelerate on CPU processes (DistributedType.MULTI_CPU; its FSDP plugin is GPU-only) "
        f"can only DDP-wrap it: every rank would hold a full replica. Shard it while loading instead: "
        f"from_pretrained(..., distributed_config=DistributedConfig(fsdp_size={size})) (transformers.distributed), "
        f"with shardadopt.enable(); the ParallelismConfig may stay or go.")
