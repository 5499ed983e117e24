"""The watcher: one daemon thread per process that acts on a trip, and the hang monitor beside it.

The watcher waits on its rank's wake key on a store connection of its own (the main thread's store calls never queue
behind it). On a trip while a fence is armed it breaks this rank's training groups, interrupts a hung main thread
(``SIGUSR1`` raising ``HangError``) and, as a backstop, breaks again or exits with ``HANG_EXIT_CODE`` when the main
thread stays in one ``torch.distributed`` call. The monitor publishes this rank's progress beat every tick and, once
stalled, decides the hang (``hang_decision``). Design and bounds: ``docs/fence.md``.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from shardadopt.fence import breaking, frames, hang_decision, progress_hooks, records
from shardadopt.fence.errors import HANG_KIND, HangError
from shardadopt.fence.state import BREAK_LOCK, STATE

if TYPE_CHECKING:
    from shardadopt.fence.section import Fence

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: a hung rank could not be interrupted; restart the job (requeue retries the trial)
BREAK_GRACE = 5.0  # seconds a rank's main thread may stay in one torch.distributed call after a trip's break
_HANG_SIGNAL = signal.SIGUSR1


@contextmanager
def control_wait() -> Iterator[None]:
    """A collective of a protected group (the HPO control plane) runs inside this block: a rank waiting there
    after a trip waits for its peers to reach the round, not in a training collective the break missed."""
    STATE.control_waits += 1
    try:
        yield
    finally:
        STATE.control_waits -= 1


class Watcher:
    """This process's side channel: the armed fences, the watcher thread, the hang monitor."""

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
                self.store, self.rank = records.default_base_store(), fence.rank
                self.ready.clear()
                self.thread = threading.Thread(target=self._watch, name="shardadopt-fence watcher", daemon=True)
                self.thread.start()
        # A fault before this rank's watcher waits in the store is seen only once it does: every rank's watcher
        # must break its side of the gloo pairs before any blocked peer gets out. So the section starts once the
        # connections are open (once per process: milliseconds, or seconds when many ranks connect at once).
        self.ready.wait(records.CONNECT_TIMEOUT.total_seconds())
        if math.isfinite(fence.hang_timeout):
            self._install_handler()
            if self.monitor is None:
                progress_hooks.reset()  # counted from the section's start, which every rank enters together
                stop = threading.Event()
                thread = threading.Thread(target=self._monitor, args=(stop, fence.generation),
                                          name="shardadopt-fence hang monitor", daemon=True)
                self.monitor = (thread, stop)
                thread.start()
        try:  # a peer's break reaches the connections it opened to this rank's listeners too
            breaking.publish_listeners(records.default_base_store())
        except Exception:  # noqa: BLE001  (store gone: the trip that follows finds out)
            pass
        if STATE.tripped == fence.generation:  # a peer tripped this generation while no fence was armed here
            breaking.break_training_groups()

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
            connection = records.connect(self.store)
            self.monitor_store = records.connect(self.store)
        except Exception:  # noqa: BLE001  (store unreachable: the job is ending)
            return
        finally:
            self.ready.set()
        # This thread never asks torch.distributed for the rank or the store: between a rebuild's destroy and init
        # the default group does not exist, and the rank and the base store are the same in every generation.
        store, blocking = (connection, True) if connection is not None else (self.store, False)
        while not self.exiting:
            generation = STATE.generation
            if not records.wait_for_wake(store, blocking, generation, self.rank) or self.exiting:  # gone, or exit
                return
            value = records.read_trip(store, generation)
            if value is not None:
                self._tripped(generation, value, connection)
                self._see_the_break_through(generation, connection)
            with self.generation_changed:
                self.generation_changed.wait_for(lambda seen=generation: STATE.generation != seen or self.exiting)

    def release(self) -> None:
        """At interpreter exit: wake the watcher and let it end, so no thread is inside the store client while
        Python finalises (that aborted the process: ``terminate called without an active exception``)."""
        self.exiting = True
        thread = self.thread
        if thread is None or not thread.is_alive():
            return
        try:
            self.store.set(records.wake_key(STATE.generation, self.rank), "1")
        except Exception:  # noqa: BLE001  (the store is gone: the wait has ended already)
            pass
        with self.generation_changed:
            self.generation_changed.notify_all()
        thread.join(timeout=5)

    def _tripped(self, generation: int, value: bytes, connection: Any) -> None:
        trip = records.parse_trip(value)
        with BREAK_LOCK:
            if generation != STATE.generation:
                return
            STATE.tripped = generation
            with self.lock:
                armed = bool(self.armed)
            if armed:
                breaking.break_training_groups(store=connection)
        if trip.kind == HANG_KIND and armed:
            self._resolve_hang(generation, trip.hung, trip.message, connection)

    def _see_the_break_through(self, generation: int, store: Any) -> None:
        """After a trip: while a fence armed at the trip stays armed, a main thread found in the same
        ``torch.distributed`` call (same frame, same instruction) at two checks ``BREAK_GRACE`` seconds apart is
        blocked in a collective the break did not reach: break again (the peers' listeners published since then
        included); still there ``BREAK_GRACE`` seconds later, nothing here can end the wait but the process: exit
        with ``HANG_EXIT_CODE``. Waits on the control plane (``control_wait``) are the peers' to end."""
        with self.lock:
            tripped_in = list(self.armed)
        grace, seen, strikes = BREAK_GRACE, frames.main_thread_call(), 0
        while tripped_in:
            with self.generation_changed:
                if self.generation_changed.wait_for(
                        lambda: STATE.generation != generation or self.exiting, timeout=grace):
                    return
            with self.lock:
                if not any(f in self.armed for f in tripped_in):
                    return
            call = frames.main_thread_call()
            if call is None or call != seen or STATE.control_waits:
                seen, strikes = call, 0
                continue
            strikes += 1
            where = f"{call[0].f_code.co_name} ({call[0].f_code.co_filename}:{call[0].f_lineno})"
            if strikes == 1:
                print(f"shardadopt.fence: rank {self.rank} is still blocked in {where} {grace:.0f}s after the "
                      "fence was tripped; breaking its process groups again", file=sys.stderr, flush=True)
                with BREAK_LOCK:
                    if STATE.generation != generation:  # rebuilt meanwhile: the new groups are not broken
                        return
                    breaking.break_training_groups(store=store)
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
                    store.set(records.key(generation, "interrupted", rank), "1")
                    return
            _exit_hung(f"rank {rank} is hung ({message}) and its main thread could not be interrupted")
        try:
            store.wait([records.key(generation, "interrupted", r) for r in hung], timedelta(seconds=ack))
        except Exception:  # noqa: BLE001  (timed out, or the store is gone)
            _exit_hung(f"{message}; rank(s) {hung} could not be interrupted within {ack:.0f}s")

    # -- the hang monitor thread ---------------------------------------------------------------------------------

    def _monitor(self, stop: threading.Event, generation: int) -> None:
        store = self.monitor_store if self.monitor_store is not None else self.store
        rank, world = self.rank, dist.get_world_size()
        count, changed, beat = progress_hooks.count(), time.monotonic(), 0
        seen: hang_decision.Seen = {}
        settings = self.hang_settings()
        while settings is not None:
            timeout, tick, what = settings
            now = time.monotonic()
            if progress_hooks.count() != count:
                count, changed = progress_hooks.count(), now
            stalled = now - changed >= timeout
            in_torch = stalled and frames.waiting_in_torch_distributed()
            beat += 1
            try:
                store.set(records.key(generation, "beat", rank),
                          hang_decision.format_beat(hang_decision.Beat(beat, count, stalled, in_torch)))
                # groups created inside the section (a trial's device mesh); never waits for a break or a rebuild.
                # Not at the first beat: arm() publishes as it starts this thread.
                if beat > 1:
                    breaking.publish_listeners(store, blocking=False)
                if stalled and STATE.tripped != generation:
                    seen = self._decide(store, generation, rank, world, count, in_torch, timeout, tick, what, seen)
            except Exception:  # noqa: BLE001  (the store is gone: the job is ending)
                return
            if stop.wait(tick):
                return
            settings = self.hang_settings()

    @staticmethod
    def _decide(store: Any, generation: int, rank: int, world: int, count: int, in_torch: bool,
                timeout: float, tick: float, what: str, seen: hang_decision.Seen) -> hang_decision.Seen:
        """This rank is stalled: read every rank's beat and, when the ranks are hung, write the trip naming them
        (``compare_set``: one decision wins). Returns what this decision saw, for the next one."""
        keys = [records.key(generation, "beat", r) for r in range(world)]
        values = store.multi_get(keys) if store.check(keys) else \
            [store.get(k) if store.check([k]) else None for k in keys]
        verdict, seen = hang_decision.decide(rank, count, in_torch, values, seen, time.monotonic(), tick, timeout,
                                             what)
        if verdict is not None:
            store.compare_set(records.trip_key(generation), "",
                              records.format_trip(verdict.hung[0], HANG_KIND, verdict.message, verdict.hung))
            records.wake_all(store, generation)
        return seen


def _on_hang_signal(signum: int, frame: Any) -> None:
    message = WATCHER.pending_hang
    if message is None:  # not ours: the signal's default action (terminate), as without shardadopt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    WATCHER.pending_hang = None
    WATCHER.interrupted.set()
    raise HangError(message)


def _exit_hung(message: str) -> None:
    print(f"shardadopt.fence: {message}; exiting with code {HANG_EXIT_CODE} so the job is restarted",
          file=sys.stderr, flush=True)
    os._exit(HANG_EXIT_CODE)


WATCHER = Watcher()
