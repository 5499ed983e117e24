"""The fence's keys and records in the rendezvous store: trip records, wake keys, and the side-channel connections.

Every fence key lives on the base store under the default group's (whose key prefix changes with every rebuild),
named per torchrun attempt and process-group generation. A trip record is written once per generation with an atomic
``compare_set`` (first writer wins; a rank dying right after leaves a complete record, never a half-written one), and
every rank's watcher is woken by its own wake key.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from shardadopt import upstream
from shardadopt.lifecycle import restarts

POLL_INTERVAL = 0.05  # seconds between a watcher's checks on a store it cannot wait on (not a TCPStore)
CONNECT_TIMEOUT = timedelta(seconds=60)  # a side-channel connection to the store, and how long a fence waits for it
_FOREVER = timedelta(days=30)  # a watcher's store wait: woken by a trip or a rebuild, never by a timeout

ERROR_KIND = "error"  # a trip's kind when a rank raised; a hang's is shardadopt.fence.errors.HANG_KIND


class Trip(NamedTuple):
    """A trip record: the rank that failed (or the first hung one), its kind, the hung ranks, the message."""

    origin: int
    kind: str
    hung: list[int]
    message: str


def key(generation: int, *parts: object) -> str:
    """A fence key on the base store, per torchrun restart (an agent's store outlives the workers' attempts)."""
    return "/".join(("shardadopt-fence", restarts.attempt_tag(), str(generation), *map(str, parts)))


def trip_key(generation: int) -> str:
    return key(generation, "trip")


def wake_key(generation: int, rank: int) -> str:
    return key(generation, "wake", rank)


def base_store(store: Any) -> Any:
    """The store under ``store``'s prefixes."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def default_base_store() -> Any:
    """The base store under the default group's (whose key prefix changes with every rebuild)."""
    return base_store(upstream.default_store())


def connect(base: Any) -> Any:
    """A store connection of this thread's own to ``base`` (the default group's base store, read by the main thread:
    a thread that reads it itself may run while a rebuild has destroyed the group), or None (not a TCPStore)."""
    if not isinstance(base, dist.TCPStore):
        return None
    return dist.TCPStore(base.host, base.port, None, False, timeout=CONNECT_TIMEOUT, wait_for_workers=False)


def format_trip(origin: int, kind: str, message: str, hung: list[int] | None = None) -> str:
    """The text of a trip record (``parse_trip`` reads it back)."""
    return f"{origin}\n{kind}{':' + ','.join(map(str, hung)) if hung else ''}\n{message}"


def parse_trip(value: bytes | str) -> Trip:
    """A trip record read from the store."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    rank, _, rest = text.partition("\n")
    kind, _, message = rest.partition("\n")
    kind, _, hung = kind.partition(":")
    return Trip(int(rank), kind, [int(r) for r in hung.split(",") if r], message)


def read_trip(store: Any, generation: int) -> bytes | None:
    """The trip record of ``generation``, or None (none yet, or the store is gone)."""
    trip = trip_key(generation)
    try:
        return store.get(trip) if store.check([trip]) else None
    except Exception:  # noqa: BLE001
        return None


def wake_all(store: Any, generation: int) -> None:
    """One request: every rank's watcher of ``generation`` wakes up and reads the trip record."""
    world = dist.get_world_size()
    store.multi_set([wake_key(generation, r) for r in range(world)], ["1"] * world)


def wait_for_wake(store: Any, blocking: bool, generation: int, rank: int) -> bool:
    """Block until ``rank``'s wake key of ``generation`` is written (a trip, a rebuild, exit): a ``store.wait`` when
    ``blocking`` (the watcher's own TCPStore connection), else polled; False when the store is gone."""
    wake, trip = wake_key(generation, rank), trip_key(generation)
    while True:
        try:
            if blocking:
                store.wait([wake], _FOREVER)
                return True
            if store.check([wake]) or store.check([trip]):
                return True
        except Exception as exc:  # noqa: BLE001
            if "timeout" not in str(exc).lower():
                return False
            continue
        time.sleep(POLL_INTERVAL)
