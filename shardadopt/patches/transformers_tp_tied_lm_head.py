"""Tensor parallelism at load time: a vision-language model's tied LM head is sharded and gathered like a causal LM's.

Upstream: fixed in transformers 5.20, which gives each vision-language class ``_tp_plan = {"lm_head":
"colwise_gather_output"}`` (backport, ``upstream-fixes/transformers-tp-tied-lm-head@*.diff``). In 5.15 .. 5.19 most
of those classes have no entry, while tying the word embeddings shards the shared table by vocabulary
(``embedding_rowwise``): on ``tp_size=2`` the head computes logits over this rank's half of the vocabulary and nothing
gathers them (Gemma 3 on 5.15: the loss raises ``Expected input batch_size (17) to match target batch_size (34)``;
``generate`` picks each token from a rank's half of the vocabulary, silently). The wrapper runs
:func:`shardadopt.loadtime.plans.complete_tied_head_plan` on the model ``maybe_distribute_model`` is about to shard
with tensor parallelism under the model's own plan (``tp_plan`` unset or ``"auto"``; a plan the user passes is left
as given).

The probe reads the class body of ``Gemma3ForConditionalGeneration`` in the installed source, without importing it
(the probe may run while transformers imports the modeling module of the model being loaded): a class that ties
``lm_head.weight`` and whose ``_tp_plan`` names no ``lm_head`` means ``needed``, one that names it ``not-needed``.
"""

from __future__ import annotations

import ast
import logging

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported

REPRESENTATIVE = ("models", "gemma3", "modeling_gemma3.py")
REPRESENTATIVE_CLASS = "Gemma3ForConditionalGeneration"
_LOG = logging.getLogger("shardadopt")


def _class_dict_keys(class_node: ast.ClassDef, attribute: str) -> set[str] | None:
    """The string keys of the dict literal the class body assigns to ``attribute``; None where it assigns none."""
    for node in class_node.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attribute for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
    return None


def probe() -> Probe:
    from shardadopt.upstream.probing import package_file, undecided

    where = f"{REPRESENTATIVE_CLASS} in transformers/{'/'.join(REPRESENTATIVE)}"
    path = package_file("transformers", *REPRESENTATIVE)
    if path is None:
        raise undecided(where, "the module (a release without Gemma 3)")
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    found = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == REPRESENTATIVE_CLASS),
                 None)
    if found is None:
        raise undecided(where, "the class")
    tp_plan = _class_dict_keys(found, upstream.CLASS_TP_PLAN_ATTRIBUTE) or set()
    if "lm_head" in tp_plan:
        return Probe(False, f"{REPRESENTATIVE_CLASS}'s TP plan shards and gathers its tied lm_head")
    if "lm_head.weight" in (_class_dict_keys(found, upstream.CLASS_TIED_WEIGHTS_ATTRIBUTE) or set()):
        return Probe(True, f"{REPRESENTATIVE_CLASS} ties lm_head to the vocabulary-sharded embedding but its TP plan "
                           f"has no lm_head entry: the logits cover one rank's part of the vocabulary")
    raise undecided(where, "an lm_head entry in _tp_plan (the fix) nor a tied lm_head without one (the gap)")


def _maybe_distribute_model(wrapped, instance, args, kwargs):
    from shardadopt.loadtime.plans import TIED_HEAD_STYLE, complete_tied_head_plan

    call = upstream.bind_maybe_distribute_model(wrapped, args, kwargs)
    model, config = call.model, call.distributed_config
    if (model is not None and (getattr(config, "tp_size", None) or 1) > 1
            and getattr(config, "tp_plan", None) in (None, "auto")
            and not getattr(config, "enable_expert_parallel", False)):
        head = complete_tied_head_plan(model, model.tp_plan)
        if head:
            _LOG.info("shardadopt: %s of %s tied to the vocabulary-sharded embedding: planned as %r, as a causal "
                      "LM's", head, type(model).__name__, TIED_HEAD_STYLE)
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-tp-tied-lm-head",
    summary="TP at load time: a vision-language model's LM head tied to the vocabulary-sharded embedding is sharded "
            "and gathered as a causal LM's (transformers 5.15-5.19 computed logits over part of the vocabulary)",
    upstream="fixed in transformers 5.20 (lm_head in each vision-language class's _tp_plan)",
    requires=supported("transformers"),
    wrappers={upstream.MAYBE_DISTRIBUTE_MODEL: _maybe_distribute_model},
    probe_modules=("transformers.modeling_utils",),
    probe=probe,
    # the heads refusal checks the TP plan the load will apply: with this patch's head entry in it
    wraps_around=("transformers-tp-heads-refused",),
)
