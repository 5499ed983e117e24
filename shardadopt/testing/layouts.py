"""The ``DistributedConfig`` sizes of each named layout (fsdp, tp, ep, hsdp, 2d) on the installed transformers.

Tests, ``shardadopt selftest``, the architecture sweep and the benchmarks name a layout and a world size; the sizes
(and whether this transformers can load that layout at all) follow from the installed release.
"""

from __future__ import annotations

from typing import Any

LAYOUT_NAMES = ("fsdp", "tp", "ep", "hsdp", "2d")


class LayoutUnsupported(RuntimeError):
    """The installed transformers cannot load this layout at all (not a shardadopt limitation)."""


def distributed_sizes(layout: str, world: int = 2) -> tuple[dict[str, Any], int]:
    """(``DistributedConfig`` kwargs, data-parallel size) for ``layout`` over ``world`` ranks on the installed
    transformers. ``hsdp`` and ``2d`` need 4 ranks."""
    from transformers.distributed import DistributedConfig

    fields = DistributedConfig.__dataclass_fields__
    if layout == "fsdp":
        return {"fsdp_size": world}, world
    if layout == "tp":
        return {"tp_size": world}, 1
    if layout == "ep":
        if "ep_size" in fields:
            return {"ep_size": world, "fsdp_size": world}, world
        return {"tp_size": world, "enable_expert_parallel": True}, 1  # before 5.21: EP on the TP mesh, no FSDP
    if layout not in ("hsdp", "2d"):
        raise ValueError(f"unknown layout {layout!r}; known: {sorted(LAYOUT_NAMES)}")
    if world != 4:
        raise LayoutUnsupported(f"{layout} is laid out over 4 ranks, not {world}")
    if layout == "hsdp":
        if "dp_replicate_size" not in fields:
            raise LayoutUnsupported("this transformers' DistributedConfig has no dp_replicate_size (HSDP)")
        return {"dp_replicate_size": 2, "fsdp_size": 2}, 4
    reason = unloadable_reason({"fsdp_size": 2, "tp_size": 2})
    if reason:
        raise LayoutUnsupported(reason)
    return {"fsdp_size": 2, "tp_size": 2}, 2


def unloadable_reason(sizes: dict[str, Any]) -> str | None:
    """Why the installed transformers cannot load a model with ``DistributedConfig(**sizes)``, or None."""
    from transformers.distributed import DistributedConfig

    from shardadopt.patches.transformers_fsdp_tp_refused import probe as fsdp_tp_refused

    try:
        DistributedConfig(**sizes)
    except (TypeError, ValueError) as exc:
        return f"this transformers refuses DistributedConfig({_kwargs(sizes)}): {exc}"
    if (sizes.get("fsdp_size") or 1) > 1 and (sizes.get("tp_size") or 1) > 1 and fsdp_tp_refused().needed:
        return "this transformers accepts fsdp_size x tp_size but applies TP alone (shardadopt refuses it)"
    return None


def _kwargs(sizes: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sizes.items())
