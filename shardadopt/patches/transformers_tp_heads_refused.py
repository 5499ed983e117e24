"""Tensor parallelism: refuse, at load, a ``tp_size`` that does not divide the attention heads the TP plan splits.

Upstream: not reported yet (proposal, ``upstream-fixes/transformers-tp-heads-refused@*.diff``). A TP plan that shards
``k_proj`` / ``v_proj`` (``q_proj``) colwise splits their output evenly over the ranks; transformers 5.15 .. 5.25
never check that ``tp_size`` divides ``num_key_value_heads`` (``num_attention_heads``), neither for text models nor
for the language model of a VLM. A multi-query model (PaliGemma, whose Gemma 2B language model has one key/value
head) loads on ``tp_size=2`` and its first forward raises ``RuntimeError: shape '[2, 28, -1, 16]' is invalid``
(5.25 only counts heads per rank for a static cache in ``generate``: ``get_kv_heads_per_rank``).

The wrapper calls :func:`shardadopt.loadtime.refuse_indivisible_heads` at the top of
``DistributedMixin.maybe_distribute_model`` (the model is built, its plan known, no weight read yet): every rank
raises the same :class:`~shardadopt.loadtime.UnsupportedShardingError`, naming the model, its head counts,
``tp_size`` and the sizes that work. The probe reads ``maybe_distribute_model`` and the ``apply_tensor_parallelism``
it calls: neither reading a head count (``num_key_value_heads``, ``get_kv_heads_per_rank``) means ``needed``; one
that reads it means ``not-needed``.
"""

from __future__ import annotations

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported

DISTRIBUTE = upstream.MAYBE_DISTRIBUTE_MODEL
TP_APPLY = "apply_tensor_parallelism"
# What a load that checks the heads against tp_size reads.
_HEAD_CHECKS = {"num_key_value_heads", "get_kv_heads_per_rank"}


def probe() -> Probe:
    import inspect

    from shardadopt.upstream.probing import calls, names, source_tree, undecided

    where = f"{PATCH.id} probe"
    distribute = upstream.upstream_method(DISTRIBUTE, where)
    apply = inspect.unwrap(distribute).__globals__.get(TP_APPLY)
    if not calls(source_tree(distribute), TP_APPLY) or apply is None:
        raise undecided(DISTRIBUTE.qualname, f"a call of {TP_APPLY} (the load this patch checks)")
    checks = _HEAD_CHECKS & (names(source_tree(distribute)) | names(source_tree(apply)))
    if checks:
        return Probe(False, f"the tensor-parallel load checks the heads against tp_size ({', '.join(sorted(checks))})")
    return Probe(True, f"{TP_APPLY} splits attention projections colwise without checking that tp_size divides "
                       "their heads: a multi-query model (PaliGemma) on tp_size=2 fails at its first forward")


def _maybe_distribute_model(wrapped, instance, args, kwargs):
    from shardadopt.loadtime import refuse_indivisible_heads

    call = upstream.bind_maybe_distribute_model(wrapped, args, kwargs)
    if call.model is not None:
        refuse_indivisible_heads(call.model, call.distributed_config)
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-tp-heads-refused",
    summary="TP: a tp_size that does not divide the attention heads the TP plan splits (PaliGemma's one key/value "
            "head on tp_size=2) is refused at load with a clear error, not a reshape error at the first forward",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers"),
    wrappers={DISTRIBUTE: _maybe_distribute_model},
    probe=probe,
)
