"""Fault fences: when one rank fails inside a collective section, every rank leaves it within a bounded time.

The problem: a rank that raises in the middle of training (a callback, a forward/backward hook, the optimizer
step, the dataloader, a save) leaves the others blocked in the next training collective, waiting for a peer that
will never come. From Python, a thread blocked in a gloo or NCCL collective cannot be interrupted; the wait lasts
the process group's timeout (30 minutes by default).

The mechanism, and why:

- **Trip** (the failing rank). A ``Fence`` covers a section that every rank enters together (one HPO trial, one
  checkpoint save). The rank whose code raises inside it records itself in the rendezvous store (first writer
  wins: ``store.add``, then its rank and message), then *breaks its own training process groups*.
- **Watchdog** (every other rank). A daemon thread per fence polls that store key every ``POLL_INTERVAL`` seconds
  and, when it appears, breaks this rank's training groups too: the thread blocked in a collective then raises at
  once. Polling the store (which lives outside the training groups) is the side channel; it costs one small store
  request per rank per interval and nothing on the training path.
- **Break**. NCCL (and any backend implementing it): ``ProcessGroup.abort()`` on every training group, the
  documented way to unblock a stuck communicator from another thread. Gloo has no collective abort (``abort()``
  and ``shutdown()`` leave a blocked peer waiting, measured on torch 2.13 and 2.15), but a gloo peer that loses its
  connection fails at once ("Connection closed by peer"): each rank shuts down (``shutdown(2)``) the TCP
  connections its own gloo listeners accepted, except the listener of a protected group (the HPO control group,
  see ``protected``), the rendezvous store's and wildcard-bound servers. Every gloo pair has exactly one accepting
  side, so once every live rank did it (a dead rank's sockets are closed by its kernel) no training pair is left.
  Linux only (``/proc/self/net/tcp``); elsewhere gloo peers wait for their timeout.
- **Rebuild**. Broken groups stay broken: ``rebuild_world`` destroys every process group and initialises the
  default group again on the same rendezvous store (a new key prefix per generation), with the same backend,
  timeout and bound device. The HPO loop does it between trials, on every rank at the same point; a checkpoint
  fence leaves the groups broken and the error propagates (the job ends; the last complete checkpoint resumes).

Why not a restart (fail fast, torchrun ``--max-restarts``): it pays model loading and rendezvous again, and loses
the study's in-process state; ``catch`` must go on in the same job. Why not a watchdog on the HPO control group:
the control group is a process group too, and a rank blocked in a training collective never reaches it.

Bound: a rank blocked in a collective leaves within ``POLL_INTERVAL`` plus the time to break the groups after the
failing rank tripped (well under a second on CPU/gloo, measured by ``benchmarks/hpo_recovery.py``); a rank that
is computing leaves at its next collective. Not covered: a rank blocked in the *rendezvous* of a new process
group (the store wait of ``new_group``, e.g. the first trial's device mesh while a peer failed before it) waits
for the process group timeout; a rank that hangs without raising is left to the collective timeouts; a rank
*killed* (SIGKILL, OOM killer) cannot trip the fence: gloo peers fail at once on the closed connections and trip
it themselves, NCCL peers wait for NCCL's own timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``). NCCL aborting is
written to torch's documented ``abort()`` contract but was not run here (one GPU); the gloo path is tested.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from shardadopt import upstream
from shardadopt.hpo.errors import RANK_ATTRIBUTE

POLL_INTERVAL = 0.05  # seconds between a watchdog's store checks
_LISTEN, _TCP_TABLES = 0x0A, ("/proc/self/net/tcp", "/proc/self/net/tcp6")
_WILDCARD = {"00000000", "0" * 32}

_PROTECTED_PORTS: set[int] = set()  # gloo listener ports of groups that must survive a break (control plane)
_PROTECTED_GROUPS: list[Any] = []
_STATE = {"generation": 0, "sequence": 0}  # the same on every rank: fences and rebuilds are collective
_BREAK_LOCK = threading.Lock()


class PeerFailedError(RuntimeError):
    """Another rank failed inside a fenced section; this rank's collectives were broken so it could leave.

    ``rank`` is the rank that failed first and ``message`` its error (``type: text``). The attribute
    ``shardadopt_rank`` is set too, so the HPO control plane treats it as a copy of that rank's error.
    """

    def __init__(self, message: str, rank: int, origin_message: str = ""):
        super().__init__(message)
        self.rank = rank
        self.origin_message = origin_message
        setattr(self, RANK_ATTRIBUTE, rank)

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank, self.origin_message))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _base_store(store: Any) -> Any:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _store() -> Any:
    store = upstream.default_store()
    return dist.PrefixStore(f"shardadopt-fence/{_STATE['generation']}/", store)


# -- sockets ---------------------------------------------------------------------------------------------------------


def _own_tcp_sockets() -> list[tuple[int, int, int, str, int]]:
    """This process's TCP sockets: (fd, state, local port, local address hex, remote port)."""
    inodes: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes[int(link[8:-1])] = int(fd)
    found = []
    for table in _TCP_TABLES:
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            inode = int(fields[9])
            if inode in inodes:
                address, port = fields[1].split(":")
                found.append((inodes[inode], int(fields[3], 16), int(port, 16), address,
                              int(fields[2].split(":")[1], 16)))
    return found


def _listen_ports() -> set[int]:
    try:
        return {port for _, state, port, _, _ in _own_tcp_sockets() if state == _LISTEN}
    except OSError:
        return set()


@contextmanager
def protected() -> Iterator[None]:
    """Process groups created inside this block survive ``break_training_groups`` (used for the control group,
    which must carry the ranks' agreement after the training groups were broken). Collective like ``new_group``."""
    before = _listen_ports()
    yield
    _PROTECTED_PORTS.update(_listen_ports() - before)


def protect_group(group: Any) -> None:
    """``group`` (created inside ``protected()``) is not aborted by ``break_training_groups``."""
    _PROTECTED_GROUPS.append(group)


def _training_groups() -> list[Any]:
    groups: list[Any] = [dist.group.WORLD]
    for _ in range(10):  # the main thread may be creating a group while the watchdog reads the registry
        try:
            groups = upstream.registered_process_groups()
            break
        except RuntimeError:
            continue
        except AttributeError:  # private registry renamed: the default group at least
            break
    return [g for g in groups if g is not None and not any(g is p for p in _PROTECTED_GROUPS)]


def break_training_groups() -> int:
    """Make every collective of this rank's training process groups fail now (see the module docstring).

    Returns how many gloo connections were shut down. Safe to call from any thread, more than once."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    with _BREAK_LOCK:
        gloo = False
        for group in _training_groups():
            try:
                gloo = gloo or "gloo" in str(dist.get_backend(group))
            except Exception:  # noqa: BLE001  (a half-destroyed group: nothing to break)
                continue
            try:
                group.abort()  # NCCL: unblocks this rank's pending collectives; gloo: a no-op
            except Exception:  # noqa: BLE001  (older backends without abort)
                pass
        return _shutdown_gloo_connections() if gloo else 0


def _shutdown_gloo_connections() -> int:
    try:
        sockets = _own_tcp_sockets()
        store_port = getattr(_base_store(upstream.default_store()), "port", None)
    except Exception:  # noqa: BLE001  (no /proc: not Linux)
        return 0
    listeners = {port for _, state, port, address, _ in sockets
                 if state == _LISTEN and address not in _WILDCARD and port != store_port
                 and port not in _PROTECTED_PORTS}
    count = 0
    for fd, state, port, _, _ in sockets:
        if state != _LISTEN and port in listeners:
            try:
                with socket.socket(fileno=os.dup(fd)) as connection:
                    connection.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                continue
    return count


# -- fences ----------------------------------------------------------------------------------------------------------


class Fence:
    """One fenced section, entered by every rank in the same order (see the module docstring).

    ``start()`` starts the watchdog; ``trip(exc)`` on the rank whose code raised; ``origin()`` says which rank
    failed first (or ``None``); ``stop()`` ends the watchdog (always, before groups are rebuilt)."""

    def __init__(self, what: str):
        self.what = what
        self.local = not _distributed()
        self.rank = dist.get_rank() if not self.local else 0
        _STATE["sequence"] += 1
        self._key = f"{_STATE['sequence']}"
        self._store = None if self.local else _store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Fence:
        if not self.local:
            self._thread = threading.Thread(target=self._watch, name=f"shardadopt-fence: {self.what}", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        key = f"{self._key}/origin"
        while not self._stop.wait(POLL_INTERVAL):
            try:
                tripped = self._store.check([key])
            except Exception:  # noqa: BLE001  (the store is gone: the job is ending)
                return
            if tripped and not self._stop.is_set():
                break_training_groups()
                return

    def trip(self, exc: BaseException) -> int:
        """This rank raised ``exc`` inside the section: record it (first rank wins), break this rank's groups.
        Returns the rank that failed first."""
        if self.local:
            return self.rank
        origin = self.rank
        try:
            if self._store.add(f"{self._key}/count", 1) == 1:
                text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self._store.set(f"{self._key}/origin", f"{self.rank}\n{text[:2000]}")
            else:
                origin = self.origin()[0]  # type: ignore[index]  # the first writer sets it right after its add
        except Exception:  # noqa: BLE001  (store unreachable: its host died; break anyway)
            pass
        break_training_groups()
        return origin

    def origin(self) -> tuple[int, str] | None:
        """(rank, message) of the rank that failed first, or ``None`` when nobody tripped the fence."""
        if self.local:
            return None
        try:
            if not self._store.check([f"{self._key}/count"]):
                return None
            rank, _, message = self._store.get(f"{self._key}/origin").decode(errors="replace").partition("\n")
            return int(rank), message
        except Exception:  # noqa: BLE001
            return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:  # a break in progress finishes before the caller goes on (e.g. rebuilds)
            self._thread.join(timeout=5)
            self._thread = None


@contextmanager
def fenced(what: str) -> Iterator[Fence]:
    """Run a collective section under a fence: when any rank raises inside it, every rank raises (the failing
    rank its own error, the others ``PeerFailedError`` naming it) instead of waiting in a collective. The process
    groups are broken afterwards: the error is fatal for the job unless something rebuilds them."""
    fence = Fence(what).start()
    try:
        yield fence
    except BaseException as exc:
        origin = fence.trip(exc)
        found = fence.origin()
        if origin != fence.rank and found is not None:
            raise PeerFailedError(f"rank {found[0]} failed during {what}: {found[1]}; this rank's collectives "
                                  f"were broken so it could leave (the process groups are unusable now)",
                                  found[0], found[1]) from exc
        raise
    finally:
        fence.stop()


def rebuild_world() -> None:
    """Destroy every process group and initialise the default one again on the same store; collective.

    Same backend, timeout and bound device. Groups created before (device meshes, ``new_group``) are gone:
    create them again (``transformers-reuse-device-mesh`` rebuilds a mesh whose groups were destroyed)."""
    default = upstream.default_group()
    backend = dist.get_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = None
    try:
        timeout = upstream.group_timeout(default, default.bound_device_id or _cpu())
    except Exception:  # noqa: BLE001  (backend without options: torch's default timeout)
        pass
    device_id = getattr(default, "bound_device_id", None)
    base = _base_store(upstream.default_store())
    _STATE["generation"] += 1
    _STATE["sequence"] = 0
    _PROTECTED_GROUPS.clear()
    _PROTECTED_PORTS.clear()
    dist.destroy_process_group()
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if device_id is not None:
        kwargs["device_id"] = device_id
    dist.init_process_group(backend, store=dist.PrefixStore(f"shardadopt-rebuild/{_STATE['generation']}/", base),
                            rank=rank, world_size=world, **kwargs)


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def generation() -> int:
    """How many times ``rebuild_world`` re-initialised the process groups in this process: a custom loop that
    keeps process groups of its own across HPO trials creates them again when this changes."""
    return _STATE["generation"]
