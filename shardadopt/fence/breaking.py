"""The break: make every collective of this rank's training process groups fail now, from any thread.

NCCL: ``ProcessGroup.abort()``. Gloo has no collective abort, but a gloo peer that loses its connection fails at once,
so each rank shuts down both ends it holds of its training gloo pairs (found through ``/proc/self/fd``; Linux only):
the connections its listeners accepted, and those it opened to a peer's training listener, which every rank publishes
in the store. Protected groups (the HPO control group), the store and every other connection are left alone.
Why each piece is so: ``docs/fence.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch.distributed as dist

from shardadopt import upstream
from shardadopt.fence import records
from shardadopt.fence.state import BREAK_LOCK, STATE

LISTEN, CONNECTED = 0x0A, 0x01  # TCP states, numbered as /proc/net/tcp numbers them
_WILDCARD = {"00000000", "0" * 32}
_IPV6_LOOPBACK = "0" * 24 + "01000000"  # ::1 as /proc/net/tcp6 writes it
_HOST = socket.gethostname()


class Protection(NamedTuple):
    """What a protected group opened: its gloo listener ports and the inodes of all its sockets (its pairs too: a
    peer's published listener that closed and whose port a control socket took since is still in the store's list)."""
    ports: frozenset[int] = frozenset()
    inodes: frozenset[int] = frozenset()

    def __or__(self, other: Protection) -> Protection:
        return Protection(self.ports | other.ports, self.inodes | other.inodes)


# Groups that must survive a break (the HPO control plane) -> what they opened. Weak: a group's sockets stop being
# protected when it is freed, so a training group that reuses one of its ports later is broken as any other.
_PROTECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNCLAIMED = [Protection()]  # opened by the last protected() block, until protect_group names their group
# Held to change or read the two above: the watcher publishes and breaks while the main thread creates a group.
_PROTECTED_LOCK = threading.Lock()
# (generation, store host, store port) -> this rank's training listeners published there
_PUBLISHED: dict[tuple[int, Any, Any], set[tuple[str, int]]] = {}
# generation -> inodes of the connections this rank shut down in it: a second break (the watcher's, then the main
# thread's trip) shuts down only what is new, so each rank pays the shutdowns once
_SHUT: dict[int, set[int]] = {}


class TcpSocket(NamedTuple):
    fd: int
    inode: int
    state: int
    port: int
    address: str  # hex, as /proc/net/tcp writes it
    remote_address: str
    remote_port: int


# -- this process's sockets -------------------------------------------------------------------------------------------


@contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A Python socket over a duplicate of ``fd``. The duplicate shares the open file's status flags, and a socket
    built while ``socket.setdefaulttimeout`` is set switches them to non-blocking: they are put back as they were,
    so gloo's and the store's sockets keep their own mode. Read and put back through the duplicate, never through
    ``fd``: gloo's event loop closes a pair's descriptor as soon as the break shuts the connection down, and by the
    time the flags were put back the number could name a socket another thread had just opened (a gloo pair made
    blocking stalls its event loop, and every collective on it with it)."""
    duplicate = os.dup(fd)
    try:
        flags = fcntl.fcntl(duplicate, fcntl.F_GETFL)
        sock = socket.socket(fileno=duplicate)
    except BaseException:
        os.close(duplicate)
        raise
    with sock:
        try:
            yield sock
        finally:
            with contextlib.suppress(OSError):
                fcntl.fcntl(duplicate, fcntl.F_SETFL, flags)


def own_tcp_sockets() -> list[TcpSocket]:
    """This process's TCP sockets, asked of each socket of ``/proc/self/fd`` (not read from ``/proc/net/tcp``: that
    table lists every socket of the network namespace, every other rank's gloo pairs included, so parsing it cost
    each rank time in the world size squared at every break and publication). A socket already asked about (same
    descriptor, same inode) is not asked again: a listener stays a listener and a connected socket keeps its ends, and
    a rank holds two per peer and group, read at every publication and twice at every break."""
    global _KNOWN
    found, known = [], {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not link.startswith("socket:["):
            continue
        seen = _KNOWN.get((int(fd), link))
        if seen is not None:
            found.append(known.setdefault((int(fd), link), seen))
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
        found.append(TcpSocket(int(fd), inode, LISTEN if listening else CONNECTED, local[1],
                               _proc_hex(sock.family, local[0]), _proc_hex(sock.family, remote[0]), remote[1]))
        if listening or remote[1]:  # settled: not a socket still connecting (or closed) whose ends may change
            known[(int(fd), link)] = found[-1]
    _KNOWN = known  # one assignment: the watcher, the monitor and the main thread may read the sockets at once
    return found


# (descriptor, "socket:[inode]") -> what own_tcp_sockets found for a settled socket of this process
_KNOWN: dict[tuple[int, str], TcpSocket] = {}


def _proc_hex(family: int, address: str) -> str:
    """``address`` as ``/proc/net/tcp`` writes it (each 32-bit word in host byte order, hex), the form the store's
    published listeners use."""
    packed = socket.inet_pton(family, address.split("%")[0])
    return "".join(f"{int.from_bytes(packed[i:i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))


def _opened() -> Protection:
    """This process's listener ports and socket inodes, now."""
    try:
        sockets = own_tcp_sockets()
    except OSError:
        return Protection()
    return Protection(frozenset(s.port for s in sockets if s.state == LISTEN), frozenset(s.inode for s in sockets))


def training_listeners(sockets: list[TcpSocket], store_port: int | None) -> set[tuple[str, int]]:
    """(address hex, port) of this process's gloo listeners of training groups: bound to one address (not a
    wildcard server), neither the store's nor a protected group's."""
    ports = protection().ports
    return {(s.address, s.port) for s in sockets
            if s.state == LISTEN and s.address not in _WILDCARD and s.port != store_port and s.port not in ports}


def _loopback(address: str) -> bool:
    return address.endswith("7F") if len(address) == 8 else address == _IPV6_LOOPBACK


# -- protected groups -------------------------------------------------------------------------------------------------


@contextmanager
def protected() -> Iterator[None]:
    """Process groups created inside this block survive ``break_training_groups`` once ``protect_group`` names them
    (used for the control group, which must carry the ranks' agreement after the training groups were broken).
    Collective like ``new_group``."""
    before = _opened()
    with BREAK_LOCK:  # a publication that read the sockets before this block began sees it and gives up
        STATE.protecting += 1
        STATE.protections += 1
    try:
        yield
        after = _opened()
        with _PROTECTED_LOCK:
            _UNCLAIMED[0] |= Protection(after.ports - before.ports, after.inodes - before.inodes)
    finally:
        with BREAK_LOCK:
            STATE.protecting -= 1
            STATE.protections += 1


def protect_group(group: Any) -> None:
    """``group`` (created inside ``protected()``) is not aborted by ``break_training_groups``. Held weakly: a
    destroyed group is freed as usual (``shardadopt.lifecycle.cleanexit`` relies on it at exit), and its ports with
    it."""
    with _PROTECTED_LOCK:
        _PROTECTED[group] = _PROTECTED.get(group, Protection()) | _UNCLAIMED[0]
        _UNCLAIMED[0] = Protection()


def protection() -> Protection:
    """What the live protected groups opened (and a protected() block not yet claimed)."""
    with _PROTECTED_LOCK:
        found = _UNCLAIMED[0]
        for opened in _PROTECTED.values():
            found |= opened
    return found


def forget_destroyed_groups() -> None:
    """Every registered process group is about to be destroyed (``rebuild_world``): what the protected ones opened
    may be reused by training groups. A protected group outside torch's registry (the HPO control group) survives the
    rebuild and stays protected while it lives."""
    with _PROTECTED_LOCK:
        _UNCLAIMED[0] = Protection()
    registered = None
    for _ in range(10):  # another thread may be creating a group while the registry is read
        try:
            registered = upstream.registered_process_groups()
            break
        except RuntimeError:
            continue
        except AttributeError:  # private registry renamed: forget them all (a group kept unprotected fails later)
            break
    with _PROTECTED_LOCK:
        for group in list(_PROTECTED):
            if registered is None or group in registered:
                _PROTECTED.pop(group, None)


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
    with _PROTECTED_LOCK:
        return [g for g in groups if g is not None and g not in _PROTECTED]


# -- the break --------------------------------------------------------------------------------------------------------


def break_training_groups(store: Any = None) -> int:
    """Make every collective of this rank's training process groups fail now (see ``docs/fence.md``).

    Safe to call from any thread, more than once.

    Args:
        store: the base store connection to read the peers' listeners with (default: the default group's, which a
            thread other than the main one should not use: the main thread may be blocked in a request on it).

    Returns:
        How many gloo connections were shut down.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    with BREAK_LOCK:  # re-entrant: the watcher breaks while holding it, so no rebuild slips in between
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


def _listeners_key(generation: int) -> str:
    return records.key(generation, "listeners")


def publish_listeners(store: Any, blocking: bool = True, sockets: list[TcpSocket] | None = None) -> None:
    """Add this rank's training listeners not yet published in this generation to the store's list (one ``append``
    request, none when nothing is new), so a peer can shut the connections it opened to them.

    Args:
        store: the base store, or a connection of its.
        blocking: False to give up when a break or a rebuild holds the lock.
        sockets: this process's sockets, just read (``own_tcp_sockets``); None to read them.
    """
    protections, generation, base = STATE.protections, STATE.generation, records.base_store(store)
    if STATE.protecting:  # a protected group's listener may be open but not marked protected yet
        return
    try:
        current = training_listeners(own_tcp_sockets() if sockets is None else sockets, getattr(base, "port", None))
    except OSError:  # no /proc: not Linux
        return
    where = (generation, getattr(base, "host", None), getattr(base, "port", None))
    if not BREAK_LOCK.acquire(blocking=blocking):
        return
    try:
        published = _PUBLISHED.setdefault(where, set())
        new = current - published
        if not new or STATE.protections != protections or STATE.generation != generation:
            return  # a protected group came or went while the sockets were read: the next publication has it
        store.append(_listeners_key(generation),
                     "".join(f"{_HOST}/{address}:{port};" for address, port in sorted(new)))
        published.update(new)
        for old in [w for w in _PUBLISHED if w[0] < generation]:
            del _PUBLISHED[old]
    finally:
        BREAK_LOCK.release()


def _published_listeners(store: Any, generation: int) -> set[tuple[str, int]]:
    """The training listeners every rank published in ``generation``; a loopback one only from this host (on
    another host, the same loopback address and port are a local service of that host's)."""
    listeners = _listeners_key(generation)
    if not store.check([listeners]):
        return set()
    found = set()
    for entry in store.get(listeners).decode().split(";"):
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
        store = store if store is not None else records.default_base_store()
        store_port = getattr(records.base_store(store), "port", None)
    except Exception:  # noqa: BLE001  (no default group any more)
        return 0
    try:  # read once, for the publication and the shutdown: with 2 per peer and group, the scan is a break's cost
        sockets = own_tcp_sockets()
    except OSError:  # no /proc: not Linux
        return 0
    try:
        publish_listeners(store, sockets=sockets)  # for the peers' breaks that come after this one
        peers = _published_listeners(store, STATE.generation)
    except Exception:  # noqa: BLE001  (store gone: the accepted connections still go)
        pass
    own = {port for _, port in training_listeners(sockets, store_port)}
    kept = protection().inodes
    generation = STATE.generation
    for old in [g for g in _SHUT if g != generation]:
        del _SHUT[old]
    shut = _SHUT.setdefault(generation, set())
    count = 0
    for s in sockets:
        if s.state == LISTEN or s.inode in shut or not (s.port in own or (s.remote_address, s.remote_port) in peers):
            continue
        if s.inode in kept:  # a protected group's pair, whatever a stale entry of the peers' list says
            continue
        try:
            with _borrowed(s.fd) as connection:
                if os.fstat(connection.fileno()).st_ino != s.inode:
                    continue  # the number was closed and reused since it was read: someone else's socket
                connection.shutdown(socket.SHUT_RDWR)
            shut.add(s.inode)
            count += 1
        except OSError:
            continue
    return count
