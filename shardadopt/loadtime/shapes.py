"""How a checkpoint tensor read for a parameter sharded at load time relates to this rank's shard.

A fused checkpoint tensor that a weight conversion splits into several sharded parameters must be converted whole
before sharding (:func:`is_fused_source`). A weight conversion that transposes a checkpoint tensor only where its
shape is not already the parameter's (``Transpose(check_dims=True)``: Qwen3-VL-MoE's stacked experts) compares the
tensor read for a parameter sharded at load time, this rank's slice, with the parameter's global shape: it
transposes a slice already in the right layout. :func:`in_shard_layout` is the comparison with the shard's own
shape (:func:`shard_shape`).
"""

from __future__ import annotations

from typing import Any

from shardadopt import upstream

__all__ = ["in_shard_layout", "is_fused_source", "shard_shape"]


def is_fused_source(source_shape: tuple[int, ...], param_shape: tuple[int, ...], sharded_dims: set[int]) -> bool:
    """Whether a checkpoint tensor differs from the parameter it is loaded into along a dimension that parameter is
    sharded on: a fused tensor that a weight conversion turns into several parameters (HRM's ``gqkv_proj``
    chunked into gate/q/k/v), or several into one. Slicing it with the parameter's own shard bounds takes the
    wrong rows (rank 0 gets gate and q, rank 1 k and v); it must be converted whole and each result sharded.
    A tensor with another number of dimensions (one expert of a stacked parameter) is sliced per piece upstream.

    Args:
        source_shape: the checkpoint tensor's shape.
        param_shape: the global shape of the parameter it is loaded into.
        sharded_dims: the dimensions the parameter is sharded on.

    Returns:
        True when the tensor must be read and converted whole before sharding.
    """
    if len(source_shape) != len(param_shape):
        return False
    return any(source_shape[dim] != param_shape[dim] for dim in sharded_dims)


def shard_shape(param: Any, layer: Any = None) -> tuple[int, ...] | None:
    """The shape of this rank's shard of a parameter sharded at load time, or None where it is held whole.

    Args:
        param: the parameter (a DTensor where transformers 5.16+ or FSDP shard it; a plain, often meta, tensor of
            the global shape under transformers 5.15's tensor-parallel layers).
        layer: transformers 5.15's tensor-parallel layer the loader shards this parameter's checkpoint tensors
            with (``WeightConverter.distributed_operation``), if any.

    Returns:
        The local shape where it differs from the global one, else None.
    """
    from torch.distributed.tensor import DTensor

    full = tuple(param.shape)
    if isinstance(param, DTensor):
        local = tuple(upstream.dtensor_local(param).shape)
    elif layer is not None and hasattr(layer, "get_expected_sharded_shape"):
        local = tuple(layer.get_expected_sharded_shape(full))
    else:
        return None
    return local if local != full else None


def in_shard_layout(tensor_shape: tuple[int, ...], param_shape: tuple[int, ...],
                    local_shape: tuple[int, ...] | None) -> bool:
    """Whether a checkpoint tensor read for a sharded parameter is this rank's slice already in the parameter's
    layout (its shape is the shard's), where a shape check against the parameter's global shape would take it for
    the other layout and transpose it: the stored layout is then decided as one process decides it on the whole
    tensor (the slice keeps the dims a layout swap exchanges). A tensor read whole (the global shape) is left to
    the upstream check.

    Args:
        tensor_shape: the shape of the tensor the loader read (this rank's slice, or the whole tensor).
        param_shape: the parameter's global shape.
        local_shape: this rank's shard shape (:func:`shard_shape`), None where the parameter is not sharded.

    Returns:
        True when the tensor must be kept as it is.
    """
    return local_shape is not None and tuple(tensor_shape) == tuple(local_shape) != tuple(param_shape)
