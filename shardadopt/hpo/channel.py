"""The control plane: small collective rounds on a dedicated gloo group, with a timeout and rank-naming errors.

Every control message is a *round*: each rank contributes one row ``(op, status, length, aux)`` of a
``world x 4`` int64 table, gathered on the group's rank 0 and broadcast back, so every rank gets the whole table.
So any rank can announce an error or a different code path in any round (a broadcast from rank 0 alone could not),
and the common case - rank 0's prune decision at a report - costs one gather and one broadcast. Not an all-reduce:
gloo's is a ring, ``2 (world - 1)`` hops one after the other, each waiting for the next rank to be scheduled (0.56 s
for this table at 64 ranks on 2 loaded cores, against 0.03 s for the gather and broadcast; ``docs/fence.md``).
When a row announces a payload (``length > 0``) the ranks agree from the table on one source and broadcast its bytes.

The group is gloo (CPU tensors, safe next to NCCL training), created once per (world group, timeout) and reused. It
is a gloo backend of its own, outside torch's group registry, used through its own methods: destroying every group
(a rebuild after a fault) leaves it whole, so ``Channel.rebuild`` carries it into the new world instead of paying a
second full-mesh rendezvous, and the old one's teardown, at every fault. A plain ``rebuild_world`` or
``shardadopt.lifecycle.cleanexit``'s release at a successful exit still frees it (``shardadopt.lifecycle.worldbound``:
torch may keep a
destroyed world's Python object alive, so the cache does not count on that object being freed); after a direct
``dist.destroy_process_group()`` it goes when the world's object is freed or the next control group is created.
A dead peer makes gloo fail at once (closed connection); a stuck one trips the group timeout. Either way the
surviving ranks check in through the rendezvous store for a few seconds, so the error names the ranks that never
arrived (``PeerLostError``) and any error they recorded before going silent, instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardadopt import fence, upstream
from shardadopt.hpo.errors import PeerLostError
from shardadopt.lifecycle import worldbound

# Ops: what a rank is doing in this round. Rows with different ops in one round mean the ranks diverged.
OP_COMMAND = 1  # between trials: rank 0 says START (payload: trial info) or STOP (payload: None or an error)
OP_INIT = 2  # a standalone DistributedTrial is being constructed
OP_SUGGEST = 3
OP_REPORT = 4  # report(); rank 0's aux carries its prune decision
OP_SHOULD_PRUNE = 5
OP_SET_ATTR = 6
OP_END = 7  # the objective finished on this rank: status OK / PRUNED / ERROR
OP_ROOT_CALL = 8  # rank 0 runs a function, every rank gets its result or its error
OP_FINISH = 9  # after a trial: aux 1 where this rank saw the trial's fence tripped; any 1 rebuilds everywhere

OP_NAMES = {OP_COMMAND: "wait for the next trial", OP_INIT: "DistributedTrial()", OP_SUGGEST: "suggest_*()",
            OP_REPORT: "report()", OP_SHOULD_PRUNE: "should_prune()", OP_SET_ATTR: "set_*_attr()",
            OP_END: "end of the objective", OP_ROOT_CALL: "a call on rank 0",
            OP_FINISH: "the end of a trial"}

STATUS_OK = 0
STATUS_ERROR = 1
STATUS_PRUNED = 2

TIMEOUT_ENV = "SHARDADOPT_HPO_TIMEOUT"
DEFAULT_TIMEOUT = 600.0  # seconds: NCCL's default collective timeout; long evaluations on rank 0 fit in it
_CHECK_IN_WAIT = 5.0  # seconds the survivors of a failed round wait for each other in the store

# The current world's control groups: [weak reference to the world group, {timeout: control group}]. Dropped when
# that object is freed, and when shardadopt destroys the world (a rebuild, the release at exit: worldbound) even
# though torch may still hold the object.
_GROUPS: list[Any] = [None, {}]
_GROUPS_LOCK = threading.Lock()
_CREATED = [0]  # control groups this process created: their rendezvous keys (creation is collective, in order)


def _world_freed(ref: Any) -> None:
    # No lock: garbage collection can run this inside control_group, which holds it. One assignment is atomic.
    if _GROUPS[0] is ref:
        _GROUPS[:] = [None, {}]


def _held_for(world: Any) -> bool:
    """Whether the cached groups belong to ``world`` (None: no world, which holds none)."""
    return world is not None and _GROUPS[0] is not None and _GROUPS[0]() is world


def _current_world_groups() -> dict[float, Any]:
    """The current world's control groups (``_GROUPS_LOCK`` held); those of a world that is gone are dropped."""
    world = dist.group.WORLD
    if world is None:  # no default group object (a stand-in world): nothing to keep them with
        return {}
    if not _held_for(world):
        _GROUPS[:] = [weakref.ref(world, _world_freed), {}]
    return _GROUPS[1]


def control_groups() -> list[Any]:
    """This process's control groups of the current world: those ``control_group`` created in it and those a
    ``Channel.rebuild`` carried into it.

    Returns:
        The groups (``ProcessGroupGloo`` objects outside torch's registry; ``group.name()`` is their backend).
    """
    with _GROUPS_LOCK:
        return list(_GROUPS[1].values()) if _held_for(dist.group.WORLD if dist.is_initialized() else None) else []


def _forget_destroyed_worlds(exiting: bool) -> None:
    dropped = None
    with _GROUPS_LOCK:
        if exiting or not _held_for(dist.group.WORLD if dist.is_initialized() else None):
            dropped, _GROUPS[:] = _GROUPS[1], [None, {}]
    del dropped  # the groups' teardown (a while at many ranks) runs here, outside the lock


worldbound.on_world_destroyed(_forget_destroyed_worlds)


def control_timeout(timeout: float | None = None) -> float:
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    if timeout <= 0:
        raise ValueError(f"the HPO control timeout must be > 0 seconds, got {timeout}")
    return float(timeout)


def control_group(timeout: float) -> Any:
    """The gloo group for control messages over the whole world, created on first use (a collective: every rank
    must reach it together, which ``optimize`` and ``DistributedTrial`` guarantee) and cached.

    A ``ProcessGroupGloo`` of its own, not registered with torch (no ``new_group``): destroying the process groups
    does not shut it down, so a rebuild can keep it (``Channel.rebuild``). Group rank = global rank."""
    with _GROUPS_LOCK:
        groups = _current_world_groups()
        group = groups.get(timeout)
        if group is None:
            _CREATED[0] += 1
            store = dist.PrefixStore(f"shardadopt-hpo-control/{_CREATED[0]}/", upstream.default_store())
            with fence.protected():  # it must carry the ranks' agreement after a fault broke the training groups
                group = groups[timeout] = dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(),
                                                                timedelta(seconds=timeout))
            fence.protect_group(group)
        return group


def _keep_control_group(group: Any, timeout: float) -> None:
    """``group`` (this process's control group of the world just destroyed) serves the new world: same ranks, its
    connections untouched by the break and the rebuild."""
    with _GROUPS_LOCK:
        _current_world_groups()[timeout] = group
    fence.protect_group(group)


class FenceOffWarning(RuntimeWarning):
    """The HPO control group was given (``ControlOptions(group=...)``): trials run without a fault fence."""


FENCE_OFF_WITH_GROUP = (
    "shardadopt HPO: with a control group given (ControlOptions(group=...) / DistributedTrial(group=...)) trials "
    "run without the fault fence and without hang detection: a rank failing or hanging while its peers wait in a "
    "training collective leaves them waiting for the collective timeout, because recovering means rebuilding "
    "every process group, the given one included. Pass group=None (the default) so shardadopt owns the control "
    "group.")


class Channel:
    """Control rounds among the ranks of ``group`` (default: a dedicated gloo group over the world).

    Without an initialised process group (or with one rank) it is local: rounds return this rank's row alone.
    ``hang_timeout``: the trials' hang bound (``shardadopt.fence.resolve_hang_timeout``).
    """

    def __init__(self, group: Any = None, timeout: float | None = None, hang_timeout: float | None = None):
        self.timeout = control_timeout(timeout)
        self.hang_timeout = fence.resolve_hang_timeout(hang_timeout)
        self.local = not (dist.is_available() and dist.is_initialized())
        self.own_group = group is None
        if self.local:
            if group is not None:
                raise ValueError("group= was given but torch.distributed is not initialised")
            self.group, self.rank, self.world = None, 0, 1
        else:
            if group is not None and dist.get_backend(group) != "gloo":
                raise ValueError(f"the HPO control group must use gloo (got {dist.get_backend(group)!r}): control "
                                 "messages are CPU tensors; pass a gloo group, or group=None for a dedicated one")
            if group is not None and dist.get_world_size(group) > 1:
                warnings.warn(FENCE_OFF_WITH_GROUP, FenceOffWarning, stacklevel=3)
            self._bind(group if group is not None else control_group(self.timeout))
        self._table = torch.zeros(self.world, 4, dtype=torch.int64)
        self._rows = self._table.numpy()
        self._row = torch.zeros(4, dtype=torch.int64)  # this rank's row, gathered into rank 0's table
        self._gathered = list(self._table.unbind()) if self.rank == 0 else None
        self.rounds = 0
        self.broken: PeerLostError | None = None
        self.context = ""  # what the ranks are doing, for error messages (e.g. "trial 3")

    def _bind(self, group: Any) -> None:
        # The group's own methods (a registered group's or the control backend's): ranks are the group's.
        self.group = group
        self.rank = group.rank()
        self.world = group.size()

    def rebuild(self) -> None:
        """After a fault broke the training process groups: re-initialise every group (``fence.rebuild_world``),
        keeping the control group (protected from the break, outside the registry the rebuild destroys, and the
        round that decided the rebuild just ran on it). Collective; every rank calls it at the same point."""
        if self.local:
            return
        if not self.own_group:
            self.broken = PeerLostError(
                "shardadopt HPO: a fault broke the training process groups and rebuilding them destroys every "
                "group, including the control group given as group=; pass group=None (the default) so shardadopt "
                "owns the control group and the study can go on after a fault")
            raise self.broken
        group = self.group
        fence.rebuild_world()
        _keep_control_group(group, self.timeout)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def exchange(self, op: int, status: int = STATUS_OK, length: int = 0, aux: int = 0) -> list[list[int]]:
        """One round: every rank's ``(op, status, length, aux)`` row, in rank order."""
        if self.broken is not None:
            raise self.broken
        self.rounds += 1
        fence.progress()  # a round is progress: the hang monitor tells a rank waiting here from a hung one
        if self.local:
            return [[op, status, length, aux]]
        self._row.numpy()[:] = (op, status, length, aux)  # a numpy view: filling it costs no torch dispatch
        self._collective(self._gather_table, op)
        return self._rows.tolist()

    def _gather_table(self) -> None:
        """Every rank's row into the table on every rank: gathered on rank 0, broadcast back (two hops, not a ring)."""
        self.group.gather(self._gathered if self.rank == 0 else [], self._row, 0).wait()
        self.group.broadcast(self._table, 0).wait()

    def broadcast_bytes(self, src: int, data: bytes | None, length: int, op: int) -> bytes:
        """The ``length`` bytes ``data`` of rank ``src``, on every rank."""
        if self.local:
            assert data is not None
            return data
        if self.broken is not None:
            raise self.broken
        if self.rank == src:
            assert data is not None and len(data) == length
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
        self._collective(lambda: self.group.broadcast(buffer, src).wait(), op)
        return data if self.rank == src else buffer.numpy().tobytes()

    def broadcast_object(self, src: int, obj: Any, op: int) -> Any:
        """Pickle ``obj`` on ``src``; one header round plus one broadcast. Every rank must call it."""
        data = pickle.dumps(obj) if self.rank == src else None
        table = self.exchange(op, length=len(data) if data is not None else 0)
        return pickle.loads(self.broadcast_bytes(src, data, table[src][2], op))

    def record_error(self, text: str) -> None:
        """Leave this rank's error in the store for the next round, so peers can name it if that round fails."""
        store = self._store()
        if store is not None:
            try:
                store.set(f"error/{self.rounds + 1}/{self.rank}", text[-4000:])
            except Exception:
                pass

    # -- failure diagnosis ------------------------------------------------------------------------------------------

    def _collective(self, fn, op: int) -> None:
        try:
            with defer_sigint(), fence.control_wait():  # after a trip, peers end this wait by reaching the round
                fn()
        except Exception as exc:
            self.broken = self._diagnose(exc, op)
            raise self.broken from exc

    def _store(self) -> Any:
        if self.local:
            return None
        try:
            store = upstream.default_store()
        except Exception:
            return None
        return dist.PrefixStore(f"shardadopt-hpo/{id(self.group)}/", store)

    def _diagnose(self, exc: BaseException, op: int) -> PeerLostError:
        """Which ranks never reached this round: each survivor checks in, then waits a few seconds for the others."""
        what = f"control round {self.rounds} ({OP_NAMES.get(op, op)}{', ' + self.context if self.context else ''})"
        store = self._store()
        missing: list[int] = []
        errors: dict[int, str] = {}
        if store is None:
            missing = [r for r in range(self.world) if r != self.rank]
        else:
            try:
                store.set(f"alive/{self.rounds}/{self.rank}", "1")
                deadline = time.monotonic() + min(_CHECK_IN_WAIT, self.timeout)
                pending = [r for r in range(self.world) if r != self.rank]
                while pending and time.monotonic() < deadline:
                    pending = [r for r in pending if not store.check([f"alive/{self.rounds}/{r}"])]
                    if pending:
                        time.sleep(0.05)
                missing = pending
                for r in range(self.world):
                    if r != self.rank and store.check([f"error/{self.rounds}/{r}"]):
                        errors[r] = store.get(f"error/{self.rounds}/{r}").decode(errors="replace")
            except Exception:
                # The store lives with rank 0 (or the launcher's agent): unreachable means its host is gone too.
                missing = [0] if self.rank != 0 else [r for r in range(1, self.world)]
        if missing:
            who = (f"rank(s) {missing} did not reach {what}: process died, or stuck past the control timeout "
                   f"({self.timeout:.0f}s)")
        else:
            who = f"{what} failed although every rank checked in"
        details = "".join(f"\n  rank {r} had recorded: {text.strip().splitlines()[-1]}" for r, text in errors.items())
        return PeerLostError(f"shardadopt HPO control plane, rank {self.rank}: {who}: {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}{details}",
                             ranks=missing, errors=errors)


@contextmanager
def defer_sigint() -> Iterator[None]:
    """Hold Ctrl-C until the block finished: a round (or a trial's end, several rounds) interrupted half way would
    desynchronise the ranks. Nested blocks hold it until the outermost ends."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt
