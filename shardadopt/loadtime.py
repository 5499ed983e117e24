"""What a model sharded at load time records about its sharding, on transformers releases that forget it.

transformers 5.18+ stamps ``model._tp_size`` and ``model._fsdp_size`` where it applies the sharding
(``maybe_distribute_model``) and exposes ``model.fsdp_size``; Trainer and accelerate read them to build their
``ParallelismConfig``. 5.15 sets ``_tp_size`` only when ``tp_size > 1``, 5.16 never sets it, and 5.15 .. 5.17 never
record ``_fsdp_size``. :func:`record_sharding_degrees` does what 5.18 does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["record_sharding_degrees"]


def record_sharding_degrees(model: Any, distributed_config: Any) -> Any:
    """Stamp ``_tp_size`` / ``_fsdp_size`` (and ``fsdp_size`` where the class has no such property) on ``model``."""
    if distributed_config is None:
        return model
    if isinstance(distributed_config, dict):
        from transformers.distributed import DistributedConfig

        distributed_config = DistributedConfig.from_dict(distributed_config)
    tp_size = getattr(distributed_config, "tp_size", None) or 1
    fsdp_size = getattr(distributed_config, "fsdp_size", None) or 1
    model._tp_size = tp_size
    model._fsdp_size = fsdp_size
    if not isinstance(getattr(type(model), "fsdp_size", None), property):
        # An instance attribute, not a class property, so only models sharded at load time gain it.
        model.fsdp_size = fsdp_size
    return model
