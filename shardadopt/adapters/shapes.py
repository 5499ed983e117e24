"""peft builds LoRA factors on a sharded base by the base layer's global shape, and whole.

peft sizes a factor on a tensor-parallel base by the local shard, which changes the init scale with the TP size and
breaks row-parallel layers. Inside :func:`global_adapter_shapes` (where the ``peft-sharded-adapters`` patch runs
peft's injection) peft's own initialiser sees the global ``in_features``/``out_features``, and DoRA's initial
magnitude the whole base weight; shardadopt then makes the factors rank 0's values and lays them out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_shapes = threading.local()


@contextlib.contextmanager
def global_adapter_shapes() -> Iterator[None]:
    """While active (in this thread), peft sizes LoRA factors on a sharded base by its global shape.

    Without the patch: ``with global_adapter_shapes(): model = get_peft_model(...)``, then
    :func:`shardadopt.adapters.lay_out_adapters` on every rank (likewise around ``add_adapter`` / ``load_adapter``).
    Re-entrant.

    Returns:
        A context manager; it yields None.
    """
    depth = getattr(_shapes, "depth", 0)
    _shapes.depth = depth + 1
    try:
        yield
    finally:
        _shapes.depth = depth


def global_shape_requested() -> bool:
    """Whether this thread is inside :func:`global_adapter_shapes`."""
    return getattr(_shapes, "depth", 0) > 0


def global_in_out_features(base_layer: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a Linear whose weight is a DTensor, from the global shape; else None."""
    from torch.distributed.tensor import DTensor

    weight = getattr(base_layer, "weight", None)
    if isinstance(base_layer, nn.Linear) and isinstance(weight, DTensor) and weight.ndim == 2:
        out_features, in_features = weight.shape
        return in_features, out_features
    return None


def whole_tensor(param: torch.Tensor) -> torch.Tensor:
    """``param`` as one full tensor: a DTensor's ``full_tensor()`` (collective), else ``param`` detached."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def whole_weight(weight: Any) -> Any:
    """What peft's DoRA computes the initial magnitude from on a sharded base: the whole weight.

    Args:
        weight: a base layer's weight, sharded (a DTensor: collective) or plain.

    Returns:
        The full tensor for a sharded weight, ``weight`` itself otherwise.
    """
    return whole_tensor(weight) if getattr(weight, "device_mesh", None) is not None else weight
