"""What a model sharded at load time records about its sharding, on transformers releases that forget it.

transformers 5.18+ stamps ``model._tp_size`` and ``model._fsdp_size`` where it applies the sharding
(``maybe_distribute_model``) and exposes ``model.fsdp_size``; Trainer and accelerate read them to build their
``ParallelismConfig``. 5.15 sets ``_tp_size`` only when ``tp_size > 1``, 5.16 never sets it, and 5.15 .. 5.17 never
record ``_fsdp_size``. :func:`record_sharding_degrees` does what 5.18 does.

transformers 5.16 and 5.17 accept ``DistributedConfig(fsdp_size=N, tp_size=M)`` but shard with tensor parallelism
alone; :func:`refuse_fsdp_with_tp` turns that into an error before any rank builds a mesh.

transformers 5.18+ build new device meshes, with a new process group per mesh dimension, on every ``from_pretrained``
with a ``DistributedConfig``, and nothing destroys them: a hyperparameter search whose ``model_init`` shards while
loading gains process groups every trial (6 on 2 ranks with 5.24; each with its own connections and threads, and NCCL
communicators hold GPU memory). :func:`reuse_device_mesh` builds the meshes once per layout and process group and
hands them out again.

A weight conversion that transposes a checkpoint tensor only where its shape is not already the parameter's
(``Transpose(check_dims=True)``: Qwen3-VL-MoE's stacked experts) compares the tensor read for a parameter sharded at
load time, this rank's slice, with the parameter's global shape: it transposes a slice already in the right layout.
:func:`in_shard_layout` is the comparison with the shard's own shape.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from shardadopt import upstream

__all__ = ["UnsupportedShardingError", "forget_device_meshes", "in_shard_layout", "record_sharding_degrees",
           "refuse_fsdp_with_tp", "reuse_device_mesh", "shard_shape"]


class UnsupportedShardingError(ValueError):
    """The installed transformers cannot shard a model the way its ``DistributedConfig`` asks."""


def _sizes(distributed_config: Any) -> dict[str, Any]:
    """A ``DistributedConfig`` (a dataclass) or its dict form, as a dict. A dict is read as is: building a
    ``DistributedConfig`` from it may already refuse the combination being checked (5.15)."""
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
    sizes = _sizes(distributed_config)
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
    sizes = _sizes(distributed_config)
    tp_size = sizes.get("tp_size") or 1
    fsdp_size = sizes.get("fsdp_size") or 1
    upstream.set_model_sharding_sizes(model, tp_size, fsdp_size)
    if not isinstance(getattr(type(model), "fsdp_size", None), property):
        # An instance attribute, not a class property, so only models sharded at load time gain it.
        model.fsdp_size = fsdp_size
    return model


_MESHES: dict[tuple, tuple[Any, Any, Any]] = {}  # layout key -> (default group, device_map, mesh)
_MESHES_LOCK = threading.Lock()


def _layout_key(distributed_config: Any) -> tuple:
    """Every ``*_size`` field of the config (what the mesh shapes are made of) and the accelerator type."""
    sizes = _sizes(distributed_config)
    return (upstream.accelerator_type(),
            tuple(sorted((name, value) for name, value in sizes.items() if name.endswith("_size"))))


def _device_meshes(mesh: Any) -> list[Any]:
    from torch.distributed.device_mesh import DeviceMesh

    candidates = [mesh, *(upstream.mesh_manager_meshes(mesh) if upstream.is_mesh_manager(mesh) else ())]
    return [candidate for candidate in candidates if isinstance(candidate, DeviceMesh)]


def _alive(mesh: Any) -> bool:
    """Whether every process group behind ``mesh`` is still registered (none was destroyed)."""
    meshes = _device_meshes(mesh)
    try:
        groups = [group for device_mesh in meshes for group in device_mesh.get_all_groups()]
    except Exception:  # noqa: BLE001  (torch fails the lookup of a destroyed group's name in various ways)
        return False
    registered = upstream.registered_process_groups()
    return bool(meshes) and all(group in registered for group in groups)


def forget_device_meshes() -> None:
    """Drop every cached mesh: ``shardadopt.fence.rebuild_world`` destroyed their groups (a cached entry kept the old
    world's default group and mesh alive until its layout was loaded again)."""
    with _MESHES_LOCK:
        _MESHES.clear()


def reuse_device_mesh(distributed_config: Any, build: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``build()`` -> ``(device_map, mesh)`` once per layout; later calls with the same layout return the same pair.

    The layout is every ``*_size`` field of ``distributed_config`` on this process's accelerator, within one default
    process group: a re-initialised world, or a mesh whose process group was destroyed, builds afresh. Every rank
    takes the same path (the key is the same on every rank), so a build stays a collective that all ranks join.
    Models loaded with the same layout then share one mesh, as the parts of a torchtitan model do.

    Args:
        distributed_config: the ``DistributedConfig`` the model is loaded with.
        build: upstream's mesh building, called on a layout's first load.

    Returns:
        The ``(device_map, mesh)`` pair built for this layout.
    """
    import torch.distributed as dist

    key = _layout_key(distributed_config)
    with _MESHES_LOCK:
        cached = _MESHES.get(key)
        if (cached is not None and dist.is_initialized() and cached[0] is dist.group.WORLD
                and _alive(cached[2])):
            return cached[1], cached[2]
        device_map, mesh = build()  # may initialise the default process group itself
        if mesh is not None and dist.is_initialized():
            _MESHES[key] = (dist.group.WORLD, device_map, mesh)
        return device_map, mesh


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
