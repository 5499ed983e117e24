"""``trl-distillation-plain-tp-head``: TRL's DistillationTrainer on a student or teacher whose LM head is a plain
local tensor-parallel shard (transformers 5.15/5.16 keep TP shards as plain tensors) is refused by name when the
trainer is built, because its loss reads ``lm_head.weight`` itself and would compare student and teacher over one
rank's slice of the vocabulary. The refusal on a ``tp_size=2`` load is checked in ``test_distillation.py``; here:
that the refusal is needed (with the patch excluded the run trains and differs from one process), and that a
teacher's plain shard is named too (one process, a model whose head holds half the vocabulary).
"""

from __future__ import annotations

import math

import pytest

from shardadopt.adapters import dtensor_tensor_parallel
from shardadopt.testing.trl_distill import RTOL, distill_log

PATCH = "trl-distillation-plain-tp-head"
STUDENT, TEACHER = "qwen3", "llama"


def _half_head(path: str):
    """The checkpoint at ``path`` loaded plain in this process, its LM head replaced by a plain tensor of half the
    vocabulary's rows: the shape a TP rank holds on transformers 5.15/5.16."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head = model.get_output_embeddings()
    half = torch.nn.Linear(head.in_features, model.config.vocab_size // 2, bias=False)
    model.set_output_embeddings(half)
    return model


def test_a_plain_head_shard_is_named_student_or_teacher(tiny_models):
    from transformers import AutoModelForCausalLM

    from shardadopt.adopt import AdoptionError, refuse_distillation_heads_on_plain_shards

    whole = AutoModelForCausalLM.from_pretrained(tiny_models[STUDENT])
    refuse_distillation_heads_on_plain_shards(whole, AutoModelForCausalLM.from_pretrained(tiny_models[TEACHER]))
    refuse_distillation_heads_on_plain_shards(whole, None)
    with pytest.raises(AdoptionError, match="the teacher's lm_head.weight.*load the teacher with "
                                            r"DistributedConfig\(fsdp_size=\.\.\.\)"):
        refuse_distillation_heads_on_plain_shards(whole, _half_head(tiny_models[TEACHER]))
    with pytest.raises(AdoptionError, match="the student's lm_head.weight.*Upgrade transformers to 5.17"):
        refuse_distillation_heads_on_plain_shards(_half_head(tiny_models[STUDENT]), whole)


@pytest.mark.multiproc
@pytest.mark.skipif(dtensor_tensor_parallel(), reason="transformers 5.17+: TP heads are DTensors, which "
                    "DistillationTrainer gathers (test_distillation.py checks those runs track one process)")
def test_without_the_refusal_tp_trains_wrong(pool2, tiny_models, trl_tokenizer):
    """With the patch excluded, a tp_size=2 student and teacher on a release that keeps the heads as plain shards
    train (nothing else refuses it) and log other losses than one process on the plain checkpoints."""
    results = pool2.run(distill_log, tiny_models, trl_tokenizer, "tp", STUDENT, TEACHER, teacher_layout="tp",
                        exclude=(PATCH,), timeout=300)
    reference = distill_log(tiny_models, trl_tokenizer, None, STUDENT, TEACHER, teacher_layout=None, world=1)
    for rank, result in enumerate(results):
        assert result["plain_head_shard"] and "log" in result, f"rank {rank}: {result.get('refused')}"
        assert any(not math.isclose(have["loss"], want["loss"], rel_tol=RTOL)
                   for have, want in zip(result["log"], reference["log"])), f"rank {rank} matches one process"
