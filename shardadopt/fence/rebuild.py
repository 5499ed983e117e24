"""``rebuild_world``: broken process groups stay broken, so every group is destroyed and the default one initialised
again on the same rendezvous store (a new key prefix per generation), with the same backend, timeout and device.

The HPO loop does it between trials when the ranks agree that a fence was tripped; ``generation()`` counts rebuilds.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

from shardadopt import loadtime, upstream
from shardadopt.fence import breaking, records
from shardadopt.fence.state import BREAK_LOCK, STATE
from shardadopt.fence.watcher import WATCHER
from shardadopt.lifecycle import restarts, worldbound


def rebuild_world() -> None:
    """Destroy every process group and initialise the default one again on the same store; collective.

    Same backend, timeout and bound device. Groups created before (device meshes, ``new_group``) are gone:
    create them again (``transformers-reuse-device-mesh`` rebuilds a mesh whose groups were destroyed). DTensor's
    sharding-propagation caches are emptied: their entries hold the old meshes, and so are the caches of objects
    bound to the old world (``shardadopt.lifecycle.worldbound``)."""
    default = upstream.default_group()
    backend = dist.get_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = None
    try:
        timeout = upstream.group_timeout(default, default.bound_device_id or _cpu())
    except Exception:  # noqa: BLE001  (backend without options: torch's default timeout)
        pass
    device_id = getattr(default, "bound_device_id", None)
    counter = upstream.process_group_counter()
    base = records.default_base_store()
    with BREAK_LOCK:  # a watcher's break of the old groups finishes first; none starts on the new ones
        try:  # this rank's watcher stops waiting on the old generation
            base.set(records.wake_key(STATE.generation, rank), "1")
        except Exception:  # noqa: BLE001
            pass
        STATE.generation += 1
        breaking.forget_destroyed_groups()
        dist.destroy_process_group()
        loadtime.forget_device_meshes()  # their groups are gone: nothing may hand them out again, or keep them alive
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        if device_id is not None:
            kwargs["device_id"] = device_id
        prefix = f"shardadopt-rebuild/{restarts.attempt_tag()}/{STATE.generation}/"  # unique per torchrun attempt too
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, base), rank=rank, world_size=world, **kwargs)
        # torch names groups from 0 again after destroying the default one: a group (a mesh) kept from the old
        # world would resolve, by its name, to a new and unrelated group. Numbering on makes it fail to resolve.
        upstream.set_process_group_counter(max(counter, upstream.process_group_counter()))
        # DTensor's sharding-propagation caches match meshes by layout, not by process group: a hit would give
        # the next model's tensors the destroyed mesh of an earlier trial (whose group names are gone, or name
        # new, unrelated groups: torch numbers groups from 0 again after destroying the default one). Without
        # DTensor imported there is no cache, and importing it costs seconds per rank (every rank at once).
        if "torch.distributed.tensor" in sys.modules:
            upstream.clear_sharding_propagation_caches()
    try:
        worldbound.world_destroyed()  # outside the lock: the caches take their own locks
    finally:
        with WATCHER.generation_changed:
            WATCHER.generation_changed.notify_all()


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def generation() -> int:
    """How many times ``rebuild_world`` re-initialised the process groups in this process.

    Returns:
        The count: a custom loop that keeps process groups of its own across HPO trials creates them again when it
        changes.
    """
    return STATE.generation
