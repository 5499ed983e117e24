"""The sharding degrees a model loaded with a ``DistributedConfig`` records, and a combination some releases ignore.

transformers 5.18+ stamps ``model._tp_size`` and ``model._fsdp_size`` where it applies the sharding
(``maybe_distribute_model``) and exposes ``model.fsdp_size``; Trainer and accelerate read them to build their
``ParallelismConfig``. 5.15 sets ``_tp_size`` only when ``tp_size > 1``, 5.16 never sets it, and 5.15 .. 5.17 never
record ``_fsdp_size``. :func:`record_sharding_degrees` does what 5.18 does.

transformers 5.16 and 5.17 accept ``DistributedConfig(fsdp_size=N, tp_size=M)`` but shard with tensor parallelism
alone; :func:`refuse_fsdp_with_tp` turns that into an error before any rank builds a mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardadopt import upstream

__all__ = ["UnsupportedShardingError", "config_sizes", "record_sharding_degrees", "refuse_fsdp_with_tp"]


class UnsupportedShardingError(ValueError):
    """The installed transformers cannot shard a model the way its ``DistributedConfig`` asks."""


def config_sizes(distributed_config: Any) -> dict[str, Any]:
    """A ``DistributedConfig`` (a dataclass) or its dict form, as a dict. A dict is read as is: building a
    ``DistributedConfig`` from it may already refuse the combination being checked (5.15).

    Args:
        distributed_config: a ``DistributedConfig`` or a dict of its fields.

    Returns:
        Its fields by name.
    """
    if isinstance(distributed_config, dict):
        return distributed_config
    return {field.name: getattr(distributed_config, field.name) for field in dataclasses.fields(distributed_config)}


def refuse_fsdp_with_tp(distributed_config: Any, transformers_version: str) -> None:
    """Raise :class:`UnsupportedShardingError` if ``distributed_config`` asks for ``fsdp_size`` and ``tp_size`` both
    above 1, for a transformers release that applies only one of them.

    Such a release (5.16, 5.17) builds a ``tp_size``-rank mesh and applies tensor parallelism alone: FSDP is never
    applied, ranks outside that mesh fail with an ``IndexError`` and the others wait for them in collectives. The
    check reads only the config, so every rank raises the same error before any collective.

    Args:
        distributed_config: the ``DistributedConfig`` passed to ``from_pretrained`` (None: nothing to check).
        transformers_version: the installed transformers release, e.g. ``"5.16.1"``.

    Raises:
        UnsupportedShardingError: ``fsdp_size`` and ``tp_size`` are both above 1.
    """
    if distributed_config is None:
        return
    sizes = config_sizes(distributed_config)
    fsdp_size = sizes.get("fsdp_size") or 1
    tp_size = sizes.get("tp_size") or 1
    if fsdp_size > 1 and tp_size > 1:
        raise UnsupportedShardingError(
            f"DistributedConfig(fsdp_size={fsdp_size}, tp_size={tp_size}) asks for fully-sharded x tensor-parallel "
            f"(2-D) loading, which transformers {transformers_version} cannot do: it accepts the config but applies "
            f"tensor parallelism alone on a {tp_size}-rank mesh, so FSDP is never applied and the ranks outside that "
            f"mesh fail. Upgrade to transformers>=5.18 for 2-D loading, or set only one of fsdp_size / tp_size.")


def record_sharding_degrees(model: Any, distributed_config: Any) -> Any:
    """Stamp ``_tp_size`` / ``_fsdp_size`` (and ``fsdp_size`` where the class has no such property) on ``model``.

    Args:
        model: the model ``from_pretrained`` just loaded.
        distributed_config: the ``DistributedConfig`` it was loaded with (None: nothing is stamped).

    Returns:
        ``model``.
    """
    if distributed_config is None:
        return model
    sizes = config_sizes(distributed_config)
    tp_size = sizes.get("tp_size") or 1
    fsdp_size = sizes.get("fsdp_size") or 1
    upstream.set_model_sharding_sizes(model, tp_size, fsdp_size)
    if not isinstance(getattr(type(model), "fsdp_size", None), property):
        # An instance attribute, not a class property, so only models sharded at load time gain it.
        model.fsdp_size = fsdp_size
    return model
