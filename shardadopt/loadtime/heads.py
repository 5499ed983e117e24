"""Tensor parallelism splits attention projections by whole heads: a ``tp_size`` that does not divide them is refused.

A TP plan that shards ``q_proj`` / ``k_proj`` / ``v_proj`` with the ``colwise`` style splits their output features
evenly over the TP ranks. Attention then views each rank's slice as ``[..., heads, head_dim]``, which holds only
when ``tp_size`` divides the projection's head count. transformers 5.15 .. 5.25 never check it at load: a
multi-query model (PaliGemma's Gemma 2B language model: one key/value head) on ``tp_size=2`` loads, and its first
forward raises ``RuntimeError: shape '[2, 28, -1, 16]' is invalid``, naming neither the heads nor the fix.
(5.25's ``unit_colwise`` style replicates heads instead and is left alone.)

:func:`refuse_indivisible_heads` reads the model about to be sharded (each planned projection's width and its
attention module's ``head_dim``) and raises :class:`~shardadopt.loadtime.sizes.UnsupportedShardingError` naming
the model, the head counts, ``tp_size`` and the sizes that would work, before any weight is read.
"""

from __future__ import annotations

import math
from typing import Any

from shardadopt.loadtime.sizes import UnsupportedShardingError, config_sizes
from shardadopt.parallel.fsdpunits import wildcard

__all__ = ["indivisible_heads", "refuse_indivisible_heads"]

# the projections whose output a colwise split cuts into heads, and the config field that counts those heads
HEAD_PROJECTIONS = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads", "v_proj": "num_key_value_heads"}
# the TP styles that split a projection's output evenly, whatever its heads (upstream's ``get_kv_heads_per_rank``
# counts the same one)
HEAD_SPLITTING_STYLES = frozenset({"colwise"})


def _head_counts(model: Any, plan: dict[str, str]) -> list[tuple[str, str, int]]:
    """``(module name, config field, heads)`` for every projection of ``model`` that ``plan`` splits colwise and
    whose attention module states its ``head_dim`` (a projection whose width is no whole number of heads is left
    out: its layout is not the one this check knows)."""
    rules = {rule.removesuffix(".weight"): style for rule, style in plan.items()}
    found = []
    for name, module in model.named_modules():
        parent, _, last = name.rpartition(".")
        field = HEAD_PROJECTIONS.get(last)
        if field is None or (rules.get(name) or rules.get(wildcard(name))) not in HEAD_SPLITTING_STYLES:
            continue
        head_dim = getattr(model.get_submodule(parent), "head_dim", None)
        width = getattr(module, "out_features", None)
        if isinstance(head_dim, int) and isinstance(width, int) and head_dim > 0 and width % head_dim == 0:
            found.append((name, field, width // head_dim))
    return found


def indivisible_heads(model: Any, plan: dict[str, str], tp_size: int) -> list[tuple[str, str, int]]:
    """The projections ``plan`` splits colwise whose head count ``tp_size`` does not divide.

    Args:
        model: the model about to be sharded (on the meta device is fine: only shapes and attributes are read).
        plan: its tensor-parallel plan (rules with ``*`` for layer numbers, as transformers writes them).
        tp_size: the tensor-parallel degree.

    Returns:
        ``(module name, config field, heads)`` for each such projection (``num_key_value_heads`` for ``k_proj`` /
        ``v_proj``, ``num_attention_heads`` for ``q_proj``).
    """
    return [entry for entry in _head_counts(model, plan) if entry[2] % tp_size]


def refuse_indivisible_heads(model: Any, distributed_config: Any) -> None:
    """Raise :class:`UnsupportedShardingError` where ``distributed_config``'s ``tp_size`` does not divide the heads
    of a projection the TP plan splits colwise (see the module docstring).

    Args:
        model: the model ``from_pretrained`` is about to shard.
        distributed_config: its ``DistributedConfig`` (or dict form); None or ``tp_size`` 1: nothing to check.
            Its ``tp_plan``, where it gives one, is read instead of the model's, as transformers 5.15 .. 5.18 apply
            it (5.19+ merge it into the model's: the model's rules it leaves out then go unchecked, never refused
            wrongly).

    Raises:
        UnsupportedShardingError: naming the model, the head counts, ``tp_size`` and the sizes that divide them.
    """
    if distributed_config is None:
        return
    sizes = config_sizes(distributed_config)
    tp_size = sizes.get("tp_size") or 1
    if tp_size <= 1:
        return
    plan = sizes.get("tp_plan")
    if not isinstance(plan, dict):
        plan = dict(getattr(model, "tp_plan", None) or {})
    counts = _head_counts(model, plan)
    bad = [entry for entry in counts if entry[2] % tp_size]
    if not bad:
        return
    def stated(entries: list[tuple[str, str, int]]) -> str:
        per_field: dict[str, set[int]] = {}
        for _, field, heads in entries:
            per_field.setdefault(field, set()).add(heads)
        return ", ".join(f"{field}={'/'.join(map(str, sorted(h)))}" for field, h in sorted(per_field.items()))

    common = math.gcd(*(heads for _, _, heads in counts))
    working = [size for size in range(2, common + 1) if common % size == 0]
    instead = f"fsdp_size={tp_size} instead of tp_size"
    fix = (f"Use a tp_size that divides {common} ({', '.join(map(str, working))}), or shard it with {instead}"
           if working else f"Tensor parallelism cannot split these heads: shard it with {instead}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    shown = ", ".join(name for name, _, _ in bad[:2]) + (f" and {len(bad) - 2} more" if len(bad) > 2 else "")
    raise UnsupportedShardingError(
        f"{type(model).__name__}{f' ({model_type})' if model_type else ''} cannot be loaded with tp_size={tp_size}: "
        f"its tensor-parallel plan splits the attention projections by whole heads (colwise), and {tp_size} does "
        f"not divide {stated(bad)} ({shown}; the model's heads: {stated(counts)}), so each rank would hold part of "
        f"a head and the first forward would fail. {fix}.")
