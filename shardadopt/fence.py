"""Fault fences: when one rank fails or hangs inside a collective section, every rank leaves it within a bound.

The problem: a rank that raises in the middle of training (a callback, a forward/backward hook, the optimizer
step, the dataloader, a save) leaves the others blocked in the next training collective, waiting for a peer that
will never come; a rank that stops making progress without raising (a stuck dataloader worker, a filesystem that
blocks, a deadlock in user code) does the same. From Python, a thread blocked in a gloo or NCCL collective cannot
be interrupted; the wait lasts the process group's timeout (30 minutes by default).

The mechanism, and why:

- **Trip** (the failing rank). A ``Fence`` covers a section that every rank enters together (one HPO trial, one
  checkpoint save). The rank whose code raises inside it records itself in the rendezvous store with one atomic
  ``compare_set`` on the generation's trip key (first writer wins; a rank dying right after it leaves a complete
  record, never a half-written one), then *breaks its own training process groups*.
- **Watcher** (every rank). One daemon thread per process waits on its rank's wake key with a blocking ``store.wait``
  on a store connection of its own (the main thread's store calls never queue behind it); the tripping rank sets
  every rank's wake key in one ``multi_set`` right after its record. The watcher opens that connection and the hang
  monitors' one once per process, and the first fenced section starts only when both are open: a fault is seen only
  by a watcher that waits, and every rank's watcher must act before a blocked peer gets out (a TCPStore connection
  can take seconds when many ranks open one at once: 5 s for 14 of 32 here, in torch's client;
  ``benchmarks/fence_scale.py`` measured 4.7 s from a fault to every rank out at 16 ranks when the first section did
  not wait for them). The store answers the wait the moment the key is written: no polling, one open request per rank
  for the life of a process-group generation, and detection in the time of one store round trip (a rank dying between
  its record and the wake-up leaves a complete record: gloo peers fail on its closed connections and trip, reading
  it). At exit the watcher is woken and joined, so no thread is inside the store client while Python finalises. When
  a trip wakes it while a fence is armed, the watcher breaks this rank's training groups too: the thread blocked in a
  collective then raises at once. Stores other than ``TCPStore`` (``FileStore``) are polled every ``POLL_INTERVAL``
  instead.
- **Hangs**. While a fence is armed, each rank counts its progress: module forward calls (a global forward
  pre-hook), optimizer steps (a global step hook), control-plane rounds, the Trainer's step and evaluation events
  (``shardadopt.hpo.trainer_backend``) and ``progress()`` calls from custom code. A monitor thread publishes
  ``(beat, count, stalled, waiting)`` to the store every ``tick`` (``hang_timeout / 4``, 0.25-30 s). A rank whose
  count did not move for ``hang_timeout`` seconds is *stalled*; ranks blocked in a collective waiting for a hung
  peer are stalled too, but they went further first (they reached the collective, which needs a forward call, an
  optimizer step or a round after the last one the hung rank made), so once every rank is stalled or *silent* (its
  beat stopped for 3 ticks: its Python threads cannot run, e.g. C code holding the GIL), the hung ranks are the
  silent ones, else those with the lowest count when some rank went further, else, all at the same count, those not
  waiting in ``torch.distributed`` when some rank is (the main thread's innermost frame: a rank that hung before a
  collective nobody counts, e.g. DDP's first broadcast or a new group's rendezvous, while the others wait in it).
  All stalled at the same count and all (or none) in ``torch.distributed`` is all ranks slow at the same point, e.g.
  one long import or a save on every rank: not taken for a hang, and a hang of every rank at once is not detected. A
  stalled rank writes that decision as a trip of kind ``hang`` (``compare_set``: one decision wins). Every watcher
  breaks its groups; a hung rank's watcher interrupts its own main thread with ``SIGUSR1`` (installed while a fence
  is armed, when the signal has no handler of the program's), whose handler raises ``HangError`` there: Python code
  (``time.sleep``, a loop, a blocking read Python retries) is interrupted and the failure travels like any error. A
  hung rank that does not answer within ``ack`` seconds (signals blocked, C code that retries on ``EINTR``, the GIL
  held) cannot be interrupted: every rank whose Python still runs, the hung one included, exits with
  ``HANG_EXIT_CODE`` so torchrun or the scheduler restarts the job (``shardadopt hpo requeue`` picks the trial up).
  Bound from the last progress to every rank out: ``hang_timeout`` + 4 ticks, + ``ack`` (5 s or one tick) when the
  hung rank cannot be interrupted, i.e. at most ``2 * hang_timeout`` + 5 s.
- **Break**. NCCL (and any backend implementing it): ``ProcessGroup.abort()`` on every training group, the
  documented way to unblock a stuck communicator from another thread. Gloo has no collective abort (``abort()``
  and ``shutdown()`` leave a blocked peer waiting, measured on torch 2.13 and 2.15), but a gloo peer that loses its
  connection fails at once ("Connection closed by peer"): each rank shuts down (``shutdown(2)``) both ends it
  holds of its training gloo pairs: the connections its own gloo listeners accepted, and those it opened to a
  peer's training listener. Each rank publishes its training listeners (address, port) in the store when a fence
  is armed, with each hang-monitor beat when new ones appeared (a trial's device mesh), and at each break: one
  ``append`` per new set. Left alone: a protected group's listener (the HPO control group, see ``protected``),
  the rendezvous store's, wildcard-bound servers, and every connection to anything else (a database storage).
  Either end's shutdown fails the pair's pending operations on both ranks (measured: the accepting side alone left
  the connecting rank blocked whenever the accepting rank's break came after it had left the collectives), so
  one live rank's break is enough for each of its pairs. Linux only (``/proc/self/fd``); elsewhere gloo
  peers wait for their timeout.
- **Backstop**. After a trip, while a fence armed at the trip stays armed, the watcher looks at its main thread
  every ``BREAK_GRACE`` (5 s): found twice in the same ``torch.distributed`` call (same frame, same instruction:
  a collective the break did not reach, a new group's rendezvous, a store wait), it breaks again; still there at
  the next look, it exits with ``HANG_EXIT_CODE`` so the job is restarted. A wait in the control plane's rounds
  (``control_wait``) is exempt: the peers end it by reaching the round.
- **Rebuild**. Broken groups stay broken: ``rebuild_world`` destroys every process group and initialises the
  default group again on the same rendezvous store (a new key prefix per generation), with the same backend,
  timeout and bound device. The HPO loop does it between trials, on every rank, when the ranks agree (one control
  round) that a fence was tripped; a checkpoint fence leaves the groups broken and the error propagates (the job
  ends; the last complete checkpoint resumes).

Why not a restart (fail fast, torchrun ``--max-restarts``): it pays model loading and rendezvous again, and loses
the study's in-process state; ``catch`` must go on in the same job. Why not a watchdog on the HPO control group:
the control group is a process group too, and a rank blocked in a training collective never reaches it.

Bound on a raise: a rank blocked in a collective leaves within a store round trip plus the time to break the groups
after the failing rank tripped (well under a second on CPU/gloo, ``benchmarks/hpo_recovery.py``); a rank that is
computing leaves at its next collective; a rank that no break frees (blocked in the *rendezvous* of a new process
group, e.g. the first trial's device mesh while a peer failed before it) exits with ``HANG_EXIT_CODE`` within
``3 * BREAK_GRACE`` (15 s) of the trip. Not covered: hangs outside a fenced section (between trials, in
a plain training loop without a save); a rank *killed* (SIGKILL, OOM killer) cannot trip the fence: gloo peers fail
at once on the closed connections and trip it themselves, NCCL peers wait for NCCL's own timeout
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``). NCCL aborting is written to torch's documented ``abort()`` contract but was
not run here (one GPU); the gloo path is tested.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import math
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from shardadopt import loadtime, upstream
from shardadopt.hpo.errors import RANK_ATTRIBUTE, origin_rank

POLL_INTERVAL = 0.05  # seconds between a watcher's checks on a store it cannot wait on (not a TCPStore)
HANG_TIMEOUT_ENV = "SHARDADOPT_HANG_TIMEOUT"
DEFAULT_HANG_TIMEOUT = 900.0  # seconds without progress: longer than a slow evaluation, a save or a first batch
HANG_EXIT_CODE = 75  # EX_TEMPFAIL: a hung rank could not be interrupted; restart the job (requeue retries the trial)
BREAK_GRACE = 5.0  # seconds a rank's main thread may stay in one torch.distributed call after a trip's break
HANG_KIND = "hang"  # shardadopt.hpo.failures.HANG (a failure kind; not imported here: fence is lower)
_FAILURE_KIND = "shardadopt_failure_kind"  # the exception attribute shardadopt.hpo.failures.classify reads
_HANG_SIGNAL = signal.SIGUSR1
_CONNECT_TIMEOUT = timedelta(seconds=60)  # a side-channel connection to the store, and how long a fence waits for it
_FOREVER = timedelta(days=30)  # a watcher's store wait: woken by a trip or a rebuild, never by a timeout
_LISTEN, _CONNECTED = 0x0A, 0x01  # TCP states, numbered as /proc/net/tcp numbers them
_WILDCARD = {"00000000", "0" * 32}
_IPV6_LOOPBACK = "0" * 24 + "01000000"  # ::1 as /proc/net/tcp6 writes it
_HOST = socket.gethostname()

_PROTECTED_PORTS: set[int] = set()  # gloo listener ports of groups that must survive a break (control plane)
_PROTECTED_GROUPS: weakref.WeakSet = weakref.WeakSet()
# generation, tripped: the same on every rank (fences and rebuilds are collective); protecting: open ``protected()``
# blocks; protections: their starts and ends; control_waits: open ``control_wait()`` blocks
_STATE = {"generation": 0, "tripped": -1, "protecting": 0, "protections": 0, "control_waits": 0}
# (generation, store host, store port) -> this rank's training listeners published there
_PUBLISHED: dict[tuple[int, Any, Any], set[tuple[str, int]]] = {}
_BREAK_LOCK = threading.RLock()
_PROGRESS = [0]  # this rank's progress count (see the module docstring)


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

    def __reduce__(self):  # attributes (the failure kind of a hang) travel too
        return (type(self), (self.args[0], self.rank, self.origin_message), self.__dict__)


class HangError(RuntimeError):
    """Raised in the main thread of a rank that made no progress for ``hang_timeout`` seconds inside a fenced
    section, while its peers waited for it (see the module docstring). Failure kind ``hang``."""

    def __init__(self, message: str):
        super().__init__(message)
        _mark_hang(self)

    def __reduce__(self):
        return (type(self), (self.args[0],))


def progress() -> None:
    """Count one unit of progress on this rank: call it from long custom work that makes no forward call,
    optimizer step or control round (e.g. a data-preparation loop inside a trial), so it is not taken for a hang."""
    _PROGRESS[0] += 1


def resolve_hang_timeout(value: float | None = None) -> float:
    """Seconds without progress after which a rank inside a fenced section counts as hung: ``value``, else
    ``$SHARDADOPT_HANG_TIMEOUT``, else 900. ``math.inf`` turns hang detection off."""
    if value is None:
        value = float(os.environ.get(HANG_TIMEOUT_ENV, DEFAULT_HANG_TIMEOUT))
    if not value > 0:
        raise ValueError(f"hang_timeout must be > 0 seconds (math.inf: no hang detection), got {value}")
    return float(value)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _base_store(store: Any) -> Any:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _key(generation: int, *parts: object) -> str:
    """A fence key on the base store, per torchrun restart (an agent's store outlives the workers' attempts)."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return "/".join(("shardadopt-fence", attempt, str(generation), *map(str, parts)))


def _trip_key(generation: int) -> str:
    return _key(generation, "trip")


def _store() -> Any:
    """The base store under the default group's (whose key prefix changes with every rebuild)."""
    return _base_store(upstream.default_store())


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001  (an exception whose __str__ raises still trips the fence)
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _parse(value: bytes | str) -> tuple[int, str, list[int], str]:
    """A trip record: (origin rank, kind, hung ranks, message). Kinds: ``error``, ``hang``."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    rank, _, rest = text.partition("\n")
    kind, _, message = rest.partition("\n")
    kind, _, hung = kind.partition(":")
    return int(rank), kind, [int(r) for r in hung.split(",") if r], message


def _connect(base: Any) -> Any:
    """A store connection of this thread's own to ``base`` (the default group's base store, read by the main thread:
    a thread that reads it itself may run while a rebuild has destroyed the group), or None (not a TCPStore)."""
    if not isinstance(base, dist.TCPStore):
        return None
    return dist.TCPStore(base.host, base.port, None, False, timeout=_CONNECT_TIMEOUT, wait_for_workers=False)


# -- sockets ---------------------------------------------------------------------------------------------------------


class _Socket(NamedTuple):
    fd: int
    inode: int
    state: int
    port: int
    address: str  # hex, as /proc/net/tcp writes it
    remote_address: str
    remote_port: int


@contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A Python socket over a duplicate of ``fd``. The duplicate shares the open file's status flags, and a socket
    built while ``socket.setdefaulttimeout`` is set switches them to non-blocking: they are put back as they were,
    so gloo's and the store's sockets keep their own mode."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            yield sock
    finally:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _own_tcp_sockets() -> list[_Socket]:
    """This process's TCP sockets, asked of each socket of ``/proc/self/fd`` (not read from ``/proc/net/tcp``: that
    table lists every socket of the network namespace, every other rank's gloo pairs included, so parsing it cost
    each rank time in the world size squared at every break and publication)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not link.startswith("socket:["):
            continue
        try:
            with _borrowed(int(fd)) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                local, inode = sock.getsockname(), os.fstat(sock.fileno()).st_ino
                remote = ("::" if sock.family == socket.AF_INET6 else "0.0.0.0", 0)
                if not listening:
                    with contextlib.suppress(OSError):  # not connected (yet, or any more)
                        remote = sock.getpeername()
        except OSError:  # closed since it was listed
            continue
        found.append(_Socket(int(fd), inode, _LISTEN if listening else _CONNECTED, local[1],
                             _proc_hex(sock.family, local[0]), _proc_hex(sock.family, remote[0]), remote[1]))
    return found


def _proc_hex(family: int, address: str) -> str:
    """``address`` as ``/proc/net/tcp`` writes it (each 32-bit word in host byte order, hex), the form the store's
    published listeners use."""
    packed = socket.inet_pton(family, address.split("%")[0])
    return "".join(f"{int.from_bytes(packed[i:i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))


def _listen_ports() -> set[int]:
    try:
        return {s.port for s in _own_tcp_sockets() if s.state == _LISTEN}
    except OSError:
        return set()


@contextmanager
def protected() -> Iterator[None]:
    """Process groups created inside this block survive ``break_training_groups`` (used for the control group,
    which must carry the ranks' agreement after the training groups were broken). Collective like ``new_group``."""
    before = _listen_ports()
    with _BREAK_LOCK:  # a publication that read the sockets before this block began sees it and gives up
        _STATE["protecting"] += 1
        _STATE["protections"] += 1
    try:
        yield
        _PROTECTED_PORTS.update(_listen_ports() - before)
    finally:
        with _BREAK_LOCK:
            _STATE["protecting"] -= 1
            _STATE["protections"] += 1


def protect_group(group: Any) -> None:
    """``group`` (created inside ``protected()``) is not aborted by ``break_training_groups``. Held weakly: a
    destroyed group is freed as usual (``shardadopt.cleanexit`` relies on it at exit)."""
    _PROTECTED_GROUPS.add(group)


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
    return [g for g in groups if g is not None and g not in _PROTECTED_GROUPS]


def break_training_groups(store: Any = None) -> int:
    """Make every collective of this rank's training process groups fail now (see the module docstring).

    Returns how many gloo connections were shut down. Safe to call from any thread, more than once; ``store``: the
    base store connection to read the peers' listeners with (default: the default group's, which a thread other
    than the main one should not use: the main thread may be blocked in a request on it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    with _BREAK_LOCK:  # re-entrant: the watcher breaks while holding it, so no rebuild slips in between
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
        return _shutdown_gloo_connections(store) if gloo else 0


def _training_listeners(sockets: list[_Socket], store_port: int | None) -> set[tuple[str, int]]:
    """(address hex, port) of this process's gloo listeners of training groups: bound to one address (not a
    wildcard server), neither the store's nor a protected group's."""
    return {(s.address, s.port) for s in sockets
            if s.state == _LISTEN and s.address not in _WILDCARD and s.port != store_port
            and s.port not in _PROTECTED_PORTS}


def _loopback(address: str) -> bool:
    return address.endswith("7F") if len(address) == 8 else address == _IPV6_LOOPBACK


def _listeners_key(generation: int) -> str:
    return _key(generation, "listeners")


def publish_listeners(store: Any, blocking: bool = True) -> None:
    """Add this rank's training listeners not yet published in this generation to the store's list (one ``append``
    request, none when nothing is new), so a peer can shut the connections it opened to them. ``store``: the base
    store, or a connection of its; ``blocking=False``: give up when a break or a rebuild holds the lock."""
    protections, generation, base = _STATE["protections"], _STATE["generation"], _base_store(store)
    if _STATE["protecting"]:  # a protected group's listener may be open but not marked protected yet
        return
    try:
        current = _training_listeners(_own_tcp_sockets(), getattr(base, "port", None))
    except OSError:  # no /proc: not Linux
        return
    where = (generation, getattr(base, "host", None), getattr(base, "port", None))
    if not _BREAK_LOCK.acquire(blocking=blocking):
        return
    try:
        published = _PUBLISHED.setdefault(where, set())
        new = current - published
        if not new or _STATE["protections"] != protections or _STATE["generation"] != generation:
            return  # a protected group came or went while the sockets were read: the next publication has it
        store.append(_listeners_key(generation),
                     "".join(f"{_HOST}/{address}:{port};" for address, port in sorted(new)))
        published.update(new)
        for old in [w for w in _PUBLISHED if w[0] < generation]:
            del _PUBLISHED[old]
    finally:
        _BREAK_LOCK.release()


def _published_listeners(store: Any, generation: int) -> set[tuple[str, int]]:
    """The training listeners every rank published in ``generation``; a loopback one only from this host (on
    another host, the same loopback address and port are a local service of that host's)."""
    key = _listeners_key(generation)
    if not store.check([key]):
        return set()
    found = set()
    for entry in store.get(key).decode().split(";"):
        host, _, endpoint = entry.rpartition("/")
        address, _, port = endpoint.partition(":")
        if port and (host == _HOST or not _loopback(address)):
            found.add((address, int(port)))
    return found


def _shutdown_gloo_connections(store: Any = None) -> int:
    """Shut down this rank's side of every training gloo pair: the connections its own training listeners
    accepted, and those it opened to a peer's published training listener. Either side's shutdown fails the
    pair's pending operations on both ranks at once (measured: only the accepting side's, where no listener
    was published, which left a rank blocked whenever its peer's break came too late)."""
    peers: set[tuple[str, int]] = set()
    try:
        store = store if store is not None else _store()
        store_port = getattr(_base_store(store), "port", None)
    except Exception:  # noqa: BLE001  (no default group any more)
        return 0
    try:
        publish_listeners(store)  # for the peers' breaks that come after this one
        peers = _published_listeners(store, _STATE["generation"])
    except Exception:  # noqa: BLE001  (store gone: the accepted connections still go)
        pass
    try:  # read after the store's answers: gloo closes a broken pair's fd, and a new socket may take its number
        sockets = _own_tcp_sockets()
    except OSError:  # no /proc: not Linux
        return 0
    own = {port for _, port in _training_listeners(sockets, store_port)}
    count = 0
    for s in sockets:
        if s.state == _LISTEN or not (s.port in own or (s.remote_address, s.remote_port) in peers):
            continue
        try:
            with _borrowed(s.fd) as connection:
                if os.fstat(connection.fileno()).st_ino != s.inode:
                    continue  # the number was closed and reused since it was read: someone else's socket
                connection.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            continue
    return count


@contextmanager
def control_wait() -> Iterator[None]:
    """A collective of a protected group (the HPO control plane) runs inside this block: a rank waiting there
    after a trip waits for its peers to reach the round, not in a training collective the break missed."""
    _STATE["control_waits"] += 1
    try:
        yield
    finally:
        _STATE["control_waits"] -= 1


# -- the watcher, the hang monitor ------------------------------------------------------------------------------------


class _Watcher:
    """This process's side channel (see the module docstring): the armed fences, the watcher thread, the monitor."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: list[Fence] = []
        self.thread: threading.Thread | None = None
        self.generation_changed = threading.Condition()
        self.monitor: tuple[threading.Thread, threading.Event] | None = None
        self.interrupted = threading.Event()
        self.pending_hang: str | None = None  # the HangError message for the main thread's signal handler
        self.handler_installed = False
        self.exiting = False
        self.store: Any = None  # the base store the watcher watches (kept for the exit wake-up)
        self.rank = 0
        # The hang monitors' store connection, opened once per process by the watcher thread next to its own.
        self.monitor_store: Any = None
        self.ready = threading.Event()  # both connections are open (or the store is unreachable)

    # -- arming (main thread) ------------------------------------------------------------------------------------

    def arm(self, fence: Fence) -> None:
        with self.lock:
            self.armed.append(fence)
            if self.thread is None or not self.thread.is_alive():
                if self.thread is None:
                    atexit.register(self.release)
                self.store, self.rank = _store(), fence.rank
                self.ready.clear()
                self.thread = threading.Thread(target=self._watch, name="shardadopt-fence watcher", daemon=True)
                self.thread.start()
        # A fault before this rank's watcher waits in the store is seen only once it does: every rank's watcher
        # must break its side of the gloo pairs before any blocked peer gets out. So the section starts once the
        # connections are open (once per process: milliseconds, or seconds when many ranks connect at once).
        self.ready.wait(_CONNECT_TIMEOUT.total_seconds())
        if math.isfinite(fence.hang_timeout):
            self._install_handler()
            if self.monitor is None:
                _PROGRESS[0] = 0  # counted from the section's start, which every rank enters together
                stop = threading.Event()
                thread = threading.Thread(target=self._monitor, args=(stop, fence.generation),
                                          name="shardadopt-fence hang monitor", daemon=True)
                self.monitor = (thread, stop)
                thread.start()
        try:  # a peer's break reaches the connections it opened to this rank's listeners too
            publish_listeners(_store())
        except Exception:  # noqa: BLE001  (store gone: the trip that follows finds out)
            pass
        if _STATE["tripped"] == fence.generation:  # a peer tripped this generation while no fence was armed here
            break_training_groups()

    def disarm(self, fence: Fence) -> None:
        with self.lock:
            if fence in self.armed:
                self.armed.remove(fence)
            last = not self.armed
        if last and self.monitor is not None:  # no hang decision of this rank's after the section ended
            thread, stop = self.monitor
            self.monitor = None
            stop.set()
            thread.join(timeout=10)
        if last and self.handler_installed and threading.current_thread() is threading.main_thread():
            signal.signal(_HANG_SIGNAL, signal.SIG_DFL)
            self.handler_installed = False

    def _install_handler(self) -> None:
        if self.handler_installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(_HANG_SIGNAL) is signal.SIG_DFL:  # the program's own handler wins: not interruptible
            signal.signal(_HANG_SIGNAL, _on_hang_signal)
            self.handler_installed = True

    def hang_settings(self) -> tuple[float, float, str] | None:
        """(hang timeout, tick, what) of the armed fences, or None when none watches for hangs."""
        with self.lock:
            watching = [f for f in self.armed if math.isfinite(f.hang_timeout)]
        if not watching:
            return None
        timeout = min(f.hang_timeout for f in watching)
        return timeout, min(max(timeout / 4, 0.25), 30.0), watching[-1].what

    # -- the watcher thread --------------------------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            connection = _connect(self.store)
            self.monitor_store = _connect(self.store)
        except Exception:  # noqa: BLE001  (store unreachable: the job is ending)
            return
        finally:
            self.ready.set()
        # This thread never asks torch.distributed for the rank or the store: between a rebuild's destroy and init
        # the default group does not exist, and the rank and the base store are the same in every generation.
        store, blocking = (connection, True) if connection is not None else (self.store, False)
        while not self.exiting:
            generation = _STATE["generation"]
            if not _wait_for_wake(store, blocking, generation, self.rank) or self.exiting:  # store gone, or exit
                return
            value = _read_trip(store, generation)
            if value is not None:
                self._tripped(generation, value, connection)
                self._see_the_break_through(generation, connection)
            with self.generation_changed:
                self.generation_changed.wait_for(
                    lambda seen=generation: _STATE["generation"] != seen or self.exiting)

    def release(self) -> None:
        """At interpreter exit: wake the watcher and let it end, so no thread is inside the store client while
        Python finalises (that aborted the process: ``terminate called without an active exception``)."""
        self.exiting = True
        thread = self.thread
        if thread is None or not thread.is_alive():
            return
        try:
            self.store.set(_key(_STATE["generation"], "wake", self.rank), "1")
        except Exception:  # noqa: BLE001  (the store is gone: the wait has ended already)
            pass
        with self.generation_changed:
            self.generation_changed.notify_all()
        thread.join(timeout=5)

    def _tripped(self, generation: int, value: bytes, connection: Any) -> None:
        origin, kind, hung, message = _parse(value)
        with _BREAK_LOCK:
            if generation != _STATE["generation"]:
                return
            _STATE["tripped"] = generation
            with self.lock:
                armed = bool(self.armed)
            if armed:
                break_training_groups(store=connection)
        if kind == HANG_KIND and armed:
            self._resolve_hang(generation, hung, message, connection)

    def _see_the_break_through(self, generation: int, store: Any) -> None:
        """After a trip: while a fence armed at the trip stays armed, a main thread found in the same
        ``torch.distributed`` call (same frame, same instruction) at two checks ``BREAK_GRACE`` seconds apart is
        blocked in a collective the break did not reach: break again (the peers' listeners published since then
        included); still there ``BREAK_GRACE`` seconds later, nothing here can end the wait but the process: exit
        with ``HANG_EXIT_CODE``. Waits on the control plane (``control_wait``) are the peers' to end."""
        with self.lock:
            tripped_in = list(self.armed)
        grace, seen, strikes = BREAK_GRACE, _main_thread_call(), 0
        while tripped_in:
            with self.generation_changed:
                if self.generation_changed.wait_for(
                        lambda: _STATE["generation"] != generation or self.exiting, timeout=grace):
                    return
            with self.lock:
                if not any(f in self.armed for f in tripped_in):
                    return
            call = _main_thread_call()
            if call is None or call != seen or _STATE["control_waits"]:
                seen, strikes = call, 0
                continue
            strikes += 1
            where = f"{call[0].f_code.co_name} ({call[0].f_code.co_filename}:{call[0].f_lineno})"
            if strikes == 1:
                print(f"shardadopt.fence: rank {self.rank} is still blocked in {where} {grace:.0f}s after the "
                      "fence was tripped; breaking its process groups again", file=sys.stderr, flush=True)
                with _BREAK_LOCK:
                    if _STATE["generation"] != generation:  # rebuilt meanwhile: the new groups are not broken
                        return
                    break_training_groups(store=store)
            else:
                _exit_hung(f"rank {self.rank} stayed blocked in {where} for {2 * grace:.0f}s after the fence was "
                           "tripped and its groups were broken twice")

    def _resolve_hang(self, generation: int, hung: list[int], message: str, connection: Any) -> None:
        settings = self.hang_settings()
        ack = max(5.0, settings[1] if settings else 5.0)
        store = connection if connection is not None else self.store
        rank = self.rank
        if rank in hung:
            if self.handler_installed:
                self.interrupted.clear()
                self.pending_hang = message
                signal.pthread_kill(threading.main_thread().ident, _HANG_SIGNAL)
                if self.interrupted.wait(ack):
                    store.set(_key(generation, "interrupted", rank), "1")
                    return
            _exit_hung(f"rank {rank} is hung ({message}) and its main thread could not be interrupted")
        try:
            store.wait([_key(generation, "interrupted", r) for r in hung], timedelta(seconds=ack))
        except Exception:  # noqa: BLE001  (timed out, or the store is gone)
            _exit_hung(f"{message}; rank(s) {hung} could not be interrupted within {ack:.0f}s")

    # -- the hang monitor thread ---------------------------------------------------------------------------------

    def _monitor(self, stop: threading.Event, generation: int) -> None:
        store = self.monitor_store if self.monitor_store is not None else self.store
        rank, world = self.rank, dist.get_world_size()
        count, changed, beat = _PROGRESS[0], time.monotonic(), 0
        seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (its last beat, when it changed, my clock)
        settings = self.hang_settings()
        while settings is not None:
            timeout, tick, what = settings
            now = time.monotonic()
            if _PROGRESS[0] != count:
                count, changed = _PROGRESS[0], now
            stalled = now - changed >= timeout
            in_torch = stalled and _waiting_in_torch_distributed()
            beat += 1
            try:
                store.set(_key(generation, "beat", rank), f"{beat} {count} {int(stalled)} {int(in_torch)}")
                # groups created inside the section (a trial's device mesh); never waits for a break or a rebuild
                publish_listeners(store, blocking=False)
                if stalled and _STATE["tripped"] != generation:
                    self._decide(store, generation, rank, world, count, in_torch, timeout, tick, what, seen)
            except Exception:  # noqa: BLE001  (the store is gone: the job is ending)
                return
            if stop.wait(tick):
                return
            settings = self.hang_settings()

    def _decide(self, store: Any, generation: int, rank: int, world: int, count: int, in_torch: bool,
                timeout: float, tick: float, what: str, seen: dict) -> None:
        """This rank is stalled: when every other rank is stalled or silent, name the hung ranks (a trip)."""
        keys = [_key(generation, "beat", r) for r in range(world)]
        values = store.multi_get(keys) if store.check(keys) else \
            [store.get(k) if store.check([k]) else None for k in keys]
        now = time.monotonic()
        counts, silent, in_torch_by_rank = {rank: count}, [], {rank: in_torch}
        for r, value in enumerate(values):
            if r == rank:
                continue
            if seen.get(r, (b"", 0.0))[0] != value:
                seen[r] = (value, now)
            if now - seen[r][1] >= 3 * tick:
                silent.append(r)
                continue
            if value is None:
                return
            _, their_count, their_stall, their_in_torch = (int(x) for x in value.decode().split())
            if not their_stall:
                return  # rank r still makes progress: whoever it waits for is not hung yet
            counts[r], in_torch_by_rank[r] = their_count, bool(their_in_torch)
        lowest = min(counts.values())
        if silent:
            hung = silent
        elif lowest != max(counts.values()):
            hung = sorted(r for r, c in counts.items() if c == lowest)
        else:  # nobody went further: those waiting in torch.distributed (a collective, a rendezvous) wait for the rest
            hung = sorted(r for r, inside in in_torch_by_rank.items() if not inside)
            if len(hung) in (0, len(in_torch_by_rank)):
                return  # all slow at the same point (an import, a save, every rank in one collective): not a hang
        waiting = sorted(set(range(world)) - set(hung))
        how = " and does not answer (blocked outside Python)" if silent else ""
        message = (f"rank(s) {hung} made no progress for {timeout:g}s in {what}{how}"
                   + (f"; rank(s) {waiting} waited for them" if waiting else ""))
        store.compare_set(_trip_key(generation), "", f"{hung[0]}\n{HANG_KIND}:{','.join(map(str, hung))}\n{message}")
        _wake_all(store, generation)


_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep


def _waiting_in_torch_distributed() -> bool:
    """Whether the main thread's innermost Python frame is ``torch.distributed`` code: a stalled rank there waits in
    a collective or a process group's rendezvous for a peer (or is blocked inside DCP's writes, which the save's
    progress counts tell apart), where a rank hung in its own code (a dataloader, a read, a lock) is elsewhere."""
    return _main_thread_frame_in_torch_distributed() is not None


def _main_thread_frame_in_torch_distributed() -> Any:
    """The main thread's innermost Python frame when it is ``torch.distributed`` code, else None."""
    frame = upstream.thread_frame(threading.main_thread().ident)
    return frame if frame is not None and frame.f_code.co_filename.startswith(_TORCH_DISTRIBUTED) else None


_DCP_FILE_IO = os.path.join(_TORCH_DISTRIBUTED, "checkpoint", "")  # + "*filesystem.py": DCP's reads and writes


def _main_thread_call() -> tuple[Any, int] | None:
    """(innermost frame, instruction) of the main thread when that frame is ``torch.distributed`` code waiting on
    peers (not DCP's file I/O: a long ``fsync`` of a big shard is no wait), else None. The same pair at two reads
    means the thread did not move in between: it is blocked in a call from there."""
    frame = _main_thread_frame_in_torch_distributed()
    if frame is None or (frame.f_code.co_filename.startswith(_DCP_FILE_IO)
                         and frame.f_code.co_filename.endswith("filesystem.py")):
        return None
    return frame, frame.f_lasti


def _wait_for_wake(store: Any, blocking: bool, generation: int, rank: int) -> bool:
    """Block until ``rank``'s wake key of ``generation`` is written (a trip, a rebuild, exit): a ``store.wait`` when
    ``blocking`` (the watcher's own TCPStore connection), else polled; False when the store is gone."""
    wake, trip = _key(generation, "wake", rank), _trip_key(generation)
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


def _read_trip(store: Any, generation: int) -> bytes | None:
    key = _trip_key(generation)
    try:
        return store.get(key) if store.check([key]) else None
    except Exception:  # noqa: BLE001
        return None


def _wake_all(store: Any, generation: int) -> None:
    """One request: every rank's watcher of ``generation`` wakes up and reads the trip record."""
    world = dist.get_world_size()
    store.multi_set([_key(generation, "wake", r) for r in range(world)], ["1"] * world)


def _on_hang_signal(signum: int, frame: Any) -> None:
    message = _WATCHER.pending_hang
    if message is None:  # not ours: the signal's default action (terminate), as without shardadopt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _WATCHER.pending_hang = None
    _WATCHER.interrupted.set()
    raise HangError(message)


def _mark_hang(exc: BaseException) -> None:
    try:
        setattr(exc, _FAILURE_KIND, HANG_KIND)
    except Exception:  # noqa: BLE001  (an exception type refusing attributes keeps its own kind)
        pass


def _exit_hung(message: str) -> None:
    print(f"shardadopt.fence: {message}; exiting with code {HANG_EXIT_CODE} so the job is restarted",
          file=sys.stderr, flush=True)
    os._exit(HANG_EXIT_CODE)


def _count_progress(*args: Any) -> None:
    _PROGRESS[0] += 1


_WATCHER = _Watcher()
_PROGRESS_HOOKS: list[Any] = []


# -- fences ----------------------------------------------------------------------------------------------------------


class Fence:
    """One fenced section, entered by every rank in the same order (see the module docstring).

    ``start()`` arms it; ``trip(exc)`` on the rank whose code raised; ``origin()`` says which rank failed first
    (or ``None``); ``stop()`` disarms it (always, before groups are rebuilt). ``hang_timeout``: seconds without
    progress that count as a hang (default ``resolve_hang_timeout()``; ``math.inf``: off)."""

    def __init__(self, what: str, hang_timeout: float | None = None):
        self.what = what
        self.local = not _distributed()
        self.rank = dist.get_rank() if not self.local else 0
        self.hang_timeout = resolve_hang_timeout(hang_timeout)
        self.generation = _STATE["generation"]

    def start(self) -> Fence:
        if not self.local:
            if math.isfinite(self.hang_timeout) and not _PROGRESS_HOOKS:
                _add_progress_hooks()
            _WATCHER.arm(self)
        return self

    def trip(self, exc: BaseException) -> int:
        """This rank raised ``exc`` inside the section: record it (first rank wins, one atomic store request),
        break this rank's groups. Returns the rank that failed first."""
        if self.local:
            return self.rank
        origin = self.rank
        try:
            store = _store()
            # a copy of another rank's error (DCP hands every rank all of its ranks' failures) names that rank
            theirs = exc.origin_message if isinstance(exc, PeerFailedError) and exc.origin_message else None
            mine = f"{origin_rank(exc, self.rank)}\nerror\n{(theirs or _describe(exc))[:2000]}"
            record = store.compare_set(_trip_key(self.generation), "", mine)
            origin, kind, _, _ = _parse(record)
            if kind == HANG_KIND:  # whatever this rank raised (DCP wraps errors in its own) follows from the hang
                _mark_hang(exc)
            _wake_all(store, self.generation)
        except Exception:  # noqa: BLE001  (store unreachable: its host died; break anyway)
            pass
        break_training_groups()
        return origin

    def origin(self) -> tuple[int, str] | None:
        """(rank, message) of the rank that failed or hung first, or ``None`` when nobody tripped the fence."""
        try:
            return self._record()
        except Exception:  # noqa: BLE001
            return None

    def tripped(self) -> bool:
        """Whether any rank tripped this fence's generation; store errors raise (the job cannot go on)."""
        return False if self.local else self._record() is not None

    def _record(self) -> tuple[int, str] | None:
        if self.local:
            return None
        store = _store()
        key = _trip_key(self.generation)
        if not store.check([key]):
            return None
        rank, _, _, message = _parse(store.get(key))
        return rank, message

    def stop(self) -> None:
        if not self.local:
            _WATCHER.disarm(self)
            if not _WATCHER.armed:
                _remove_progress_hooks()


def gathered_error(exc: BaseException, rank: int) -> BaseException:
    """What ``rank`` raises for ``exc`` when ``exc`` is DCP's ``CheckpointException`` (else ``exc`` itself).

    DCP gathers every rank's error into one ``CheckpointException`` raised on every rank: a ``BaseException``, which
    a search's ``catch=(RuntimeError,)`` (or ``except Exception``) lets through, and whose kind is nobody's. On a
    rank that failed: its own error (a copy: DCP pickles it through its gather, same type and attributes, a
    ``HangError`` where it was hung); on the others, ``PeerFailedError`` naming the first rank that failed (a hang
    stays a hang)."""
    if "torch.distributed.checkpoint" not in sys.modules:  # DCP never ran here: exc cannot be one of its errors
        return exc
    from torch.distributed.checkpoint import CheckpointException

    if not isinstance(exc, CheckpointException):
        return exc
    raised = {r: failure[0] if isinstance(failure, tuple) else failure  # (error, its stack summary)
              for r, failure in exc.failures.items()}
    if not raised:
        return exc
    if rank in raised:
        return raised[rank]
    first = min(raised)
    error = raised[first]
    text = f"{type(error).__name__}: {error}"
    peer = PeerFailedError(f"rank {first} failed in torch.distributed.checkpoint: {text}", first, text)
    if getattr(error, _FAILURE_KIND, None) == HANG_KIND:
        _mark_hang(peer)
    return peer


def _add_progress_hooks() -> None:
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _PROGRESS_HOOKS.append(register_module_forward_pre_hook(_count_progress))
    _PROGRESS_HOOKS.append(register_optimizer_step_post_hook(_count_progress))


def _remove_progress_hooks() -> None:
    while _PROGRESS_HOOKS:
        _PROGRESS_HOOKS.pop().remove()


@contextmanager
def fenced(what: str, hang_timeout: float | None = None) -> Iterator[Fence]:
    """Run a collective section under a fence: when any rank raises inside it, every rank raises (the failing
    rank its own error, the others ``PeerFailedError`` naming it) instead of waiting in a collective; when a rank
    stops making progress for ``hang_timeout`` seconds, it raises ``HangError`` (or, not interruptible, every rank
    exits with ``HANG_EXIT_CODE``); a rank named hung raises ``HangError`` whatever it raised on its way out (a broken
    collective, a wrapper such as DCP's ``CheckpointException``). The process groups are broken afterwards: the error
    is fatal for the job unless something rebuilds them."""
    fence = Fence(what, hang_timeout).start()
    try:
        yield fence
    except BaseException as exc:
        origin = fence.trip(exc)
        found = fence.origin()
        hung_here = getattr(exc, _FAILURE_KIND, None) == HANG_KIND and origin == fence.rank
        if hung_here and found is not None and isinstance(exc, Exception) and not isinstance(exc, HangError):
            # this rank was named hung: what it raised on its way out (a broken collective, a wrapped HangError)
            # follows from the interruption, so it leaves with the HangError a hang outside this section raises
            raise HangError(found[1]) from exc
        if origin != fence.rank and found is not None:
            peer = PeerFailedError(f"rank {found[0]} failed during {what}: {found[1]}; this rank's collectives "
                                   f"were broken so it could leave (the process groups are unusable now)",
                                   found[0], found[1])
            if getattr(exc, _FAILURE_KIND, None) == HANG_KIND:
                _mark_hang(peer)
            raise peer from exc
        raise
    finally:
        fence.stop()


def rebuild_world() -> None:
    """Destroy every process group and initialise the default one again on the same store; collective.

    Same backend, timeout and bound device. Groups created before (device meshes, ``new_group``) are gone:
    create them again (``transformers-reuse-device-mesh`` rebuilds a mesh whose groups were destroyed). DTensor's
    sharding-propagation caches are emptied: their entries hold the old meshes."""
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
    base = _store()
    with _BREAK_LOCK:  # a watcher's break of the old groups finishes first; none starts on the new ones
        try:  # this rank's watcher stops waiting on the old generation
            base.set(_key(_STATE["generation"], "wake", rank), "1")
        except Exception:  # noqa: BLE001
            pass
        _STATE["generation"] += 1
        _PROTECTED_PORTS.clear()
        dist.destroy_process_group()
        loadtime.forget_device_meshes()  # their groups are gone: nothing may hand them out again, or keep them alive
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        if device_id is not None:
            kwargs["device_id"] = device_id
        dist.init_process_group(backend, store=dist.PrefixStore(f"shardadopt-rebuild/{_STATE['generation']}/",
                                                                base), rank=rank, world_size=world, **kwargs)
        # torch names groups from 0 again after destroying the default one: a group (a mesh) kept from the old
        # world would resolve, by its name, to a new and unrelated group. Numbering on makes it fail to resolve.
        upstream.set_process_group_counter(max(counter, upstream.process_group_counter()))
        # DTensor's sharding-propagation caches match meshes by layout, not by process group: a hit would give
        # the next model's tensors the destroyed mesh of an earlier trial (whose group names are gone, or name
        # new, unrelated groups: torch numbers groups from 0 again after destroying the default one). Without
        # DTensor imported there is no cache, and importing it costs seconds per rank (every rank at once).
        if "torch.distributed.tensor" in sys.modules:
            upstream.clear_sharding_propagation_caches()
    with _WATCHER.generation_changed:
        _WATCHER.generation_changed.notify_all()


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def generation() -> int:
    """How many times ``rebuild_world`` re-initialised the process groups in this process: a custom loop that
    keeps process groups of its own across HPO trials creates them again when this changes."""
    return _STATE["generation"]
