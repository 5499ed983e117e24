"""One device mesh per layout and process group, handed out again to every later sharded load.

transformers 5.18+ build new device meshes, with a new process group per mesh dimension, on every ``from_pretrained``
with a ``DistributedConfig``, and nothing destroys them: a hyperparameter search whose ``model_init`` shards while
loading gains process groups every trial (6 on 2 ranks with 5.24; each with its own connections and threads, and NCCL
communicators hold GPU memory). :func:`reuse_device_mesh` builds the meshes once per layout and process group and
hands them out again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from shardadopt import upstream
from shardadopt.loadtime.sizes import config_sizes

__all__ = ["forget_device_meshes", "reuse_device_mesh"]

_MESHES: dict[tuple, tuple[Any, Any, Any]] = {}  # layout key -> (default group, device_map, mesh)
_MESHES_LOCK = threading.Lock()


def _layout_key(distributed_config: Any) -> tuple:
    """Every ``*_size`` field of the config (what the mesh shapes are made of) and the accelerator type."""
    sizes = config_sizes(distributed_config)
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
