"""A tied LM head the tensor-parallel plan leaves out, while the embedding it shares is sharded by vocabulary.

Tying the word embeddings adds ``"embed_tokens": "embedding_rowwise"`` to a config's TP plan on every release 5.15 ..
5.25: the embedding table is split by vocabulary rows. A causal LM's own plan then shards the tied head the same way
and gathers its logits (``"lm_head": "colwise_gather_output"``). transformers 5.15 .. 5.19 give most vision-language
classes (``Gemma3ForConditionalGeneration``, ``PaliGemmaForConditionalGeneration``, LLaVA, Qwen2.5-VL, ... 47 of the
58 that tie ``lm_head`` to ``model.language_model.embed_tokens`` in 5.16) no such entry; 5.20 adds it to each class.
Without it the head holds this rank's rows of the shared table and is never gathered: the logits cover part of the
vocabulary (Gemma 3 on 5.15: ``ValueError: Expected input batch_size (17) to match target batch_size (34)`` in the
loss; ``generate`` picks tokens from a rank's half of the vocabulary without an error).
:func:`complete_tied_head_plan` adds the entry the causal-LM classes have.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TIED_HEAD_STYLE", "complete_tied_head_plan"]

TIED_HEAD_STYLE = "colwise_gather_output"  # what the causal-LM classes' plans give their tied lm_head
_VOCAB_SHARDED_EMBEDDING = "embedding_rowwise"


def _style(plan: dict[str, str], module_name: str) -> str | None:
    """The plan's style for ``module_name`` (rules name modules, ``*`` standing for a layer index)."""
    for rule, style in plan.items():
        if re.fullmatch(re.escape(rule).replace(r"\*", r"\d+"), module_name):
            return style
    return None


def _name_of(model: Any, module: Any) -> str | None:
    return next((name for name, candidate in model.named_modules() if candidate is module), None)


def complete_tied_head_plan(model: Any, plan: dict[str, str]) -> str | None:
    """Give the tied output embedding of ``model`` the plan entry a causal LM gives it, where ``plan`` shards the
    input embedding it is tied to by vocabulary and has no entry for the head.

    Args:
        model: a transformers model about to be sharded with tensor parallelism (parameters may be on meta).
        plan: its TP plan, edited in place (the dict transformers reads when it applies the plan).

    Returns:
        The head's module name where an entry was added, else None.
    """
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None:
        return None
    head_name, embedding_name = _name_of(model, head), _name_of(model, embedding)
    if not head_name or not embedding_name or _style(plan, head_name) is not None:
        return None
    tied = model.get_expanded_tied_weights_keys().get(f"{head_name}.weight") == f"{embedding_name}.weight"
    if not tied or _style(plan, embedding_name) != _VOCAB_SHARDED_EMBEDDING:
        return None
    plan[head_name] = TIED_HEAD_STYLE
    return head_name
