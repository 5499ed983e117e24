"""TRL's DistillationTrainer refuses a student or teacher whose LM head is a plain local tensor-parallel shard.

Upstream: not reported yet (proposal, ``upstream-fixes/trl-distillation-plain-tp-head.diff``). trl 1.16's
``DistillationTrainer._compute_loss`` projects the student's and the teacher's hidden states through their
``get_output_embeddings().weight`` itself (a chunked divergence loss, not the models' forward) and gathers a weight
only when it is a DTensor. transformers 5.15/5.16 keep tensor-parallel shards as plain tensors, so on a ``tp_size``
load each rank compares student and teacher over its own slice of the vocabulary: wrong loss and gradients, no error
(TRL's fused LM head, which the other trainers install, is refused at ``prepare`` by
:func:`shardadopt.adopt.refuse_fused_lm_head_on_plain_shards`; this loss does not go through it). The wrapper of
``DistillationTrainer.__init__`` calls :func:`shardadopt.adopt.refuse_distillation_heads_on_plain_shards` on the
student and teacher the trainer built (models given as instances or loaded by TRL from a path), on every rank,
before anything is trained. On transformers 5.17+ the heads are DTensors and nothing is refused.

The probe reads ``DistillationTrainer._compute_loss``: reading ``get_output_embeddings()``'s ``weight`` there is the
gap (``needed``); ``__init__`` comparing an LM head weight's rows with ``vocab_size`` (the proposed fix's refusal) is
``not-needed``; anything else undecided. No ``needed_by``: the refusal is the whole patch.
"""

from __future__ import annotations

import ast

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

INIT = Target("trl.trainer.distillation_trainer", "DistillationTrainer.__init__")


def reads_head_weight(function) -> bool:
    """Whether ``function`` reads ``.weight`` of what ``get_output_embeddings()`` returns (directly or through a
    name it assigns it to)."""
    from shardadopt.upstream.probing import calls, source_tree

    tree = source_tree(function)
    heads: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and calls(node.value,
                                                                                        "get_output_embeddings"):
            heads |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "weight":
            if isinstance(node.value, ast.Name) and node.value.id in heads:
                return True
            if isinstance(node.value, ast.Call) and calls(node.value, "get_output_embeddings"):
                return True
    return False


def checks_head_rows(function) -> bool:
    """Whether ``function`` compares a weight's ``shape`` with ``vocab_size`` (the proposed fix's check)."""
    from shardadopt.upstream.probing import names, source_tree

    return any(isinstance(node, ast.Compare) and {"shape", "weight", "vocab_size"} <= names(node)
               for node in ast.walk(source_tree(function)))


def probe() -> Probe:
    from shardadopt.upstream.probing import undecided

    where = f"{PATCH.id} probe"
    if checks_head_rows(upstream.upstream_method(INIT, where)):
        return Probe(False, "DistillationTrainer refuses an LM head with fewer rows than the vocabulary")
    loss = upstream.upstream_method(upstream.DISTILLATION_COMPUTE_LOSS, where)
    if reads_head_weight(loss):
        return Probe(True, "DistillationTrainer's loss reads lm_head.weight itself and gathers it only when it is a "
                           "DTensor: a plain tensor-parallel shard (transformers 5.15/5.16) scores one rank's slice "
                           "of the vocabulary")
    raise undecided(upstream.DISTILLATION_COMPUTE_LOSS.qualname,
                    "get_output_embeddings().weight read by the loss (the gap) nor, in __init__, a check of the "
                    "head's rows against vocab_size (the fix)")


def trainer_init(wrapped, instance, args, kwargs):
    """Wraps ``DistillationTrainer.__init__``: refuses plain TP head shards on the models it built."""
    from shardadopt.adopt import refuse_distillation_heads_on_plain_shards

    result = wrapped(*args, **kwargs)
    refuse_distillation_heads_on_plain_shards(instance.model, getattr(instance, "teacher_model", None))
    return result


PATCH = Patch(
    id="trl-distillation-plain-tp-head",
    summary="TRL DistillationTrainer refused by name on a student or teacher whose LM head is a plain TP shard "
            "(transformers 5.15/5.16), which its loss reads itself",
    upstream="proposal for trl main (not reported yet)",
    requires=supported("trl", "transformers", "accelerate"),
    wrappers={INIT: trainer_init},
    probe=probe,
)
