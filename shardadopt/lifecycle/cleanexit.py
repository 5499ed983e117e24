"""A sharded training job that succeeded exits 0 on every rank: gloo's threads let go of Python before finalisation.

ProcessGroupGloo runs every collective on worker threads. When a collective completes, the caller's ``wait()``
returns, and the worker then drops its reference to the work and with it the tensors; dropping a tensor that
Python also holds decrements its Python object, which takes the GIL (``decref`` in torch/csrc/PyInterpreter.cpp).
A worker that is not scheduled before the interpreter starts finalising (several ranks sharing few cores) takes the
GIL after finalisation began; CPython then ends the thread (``PyThread_exit_thread``), the unwind meets a
``noexcept`` destructor and C++ calls ``std::terminate``: ``terminate called without an active exception``,
SIGABRT on one rank, and torchrun SIGTERMs the others, cutting off whatever rank 0 still does after training.

``torch.distributed.destroy_process_group`` alone does not prevent it. ProcessGroupGloo's ``shutdown`` and
``abort`` do nothing to the workers; only its destructor drains the queue and joins them, and it runs when the last
reference goes, which for a model sharded at load time is during finalisation itself: the model's FSDP states
(``FSDPMeshInfo.shard_process_group``) and device meshes (``DeviceMesh._pg_registry``) hold the groups until then.
(pytorch/pytorch#179291 proposed an atexit ``destroy_process_group`` and was abandoned.)

:func:`release_process_groups` does, without any collective and without waiting for a peer:

1. destroys every registered process group served by gloo alone (the default group last, and only when every group
   is gloo): the registry entries go, and gloo's teardown is local;
2. drops what shardadopt bound to a world (``shardadopt.lifecycle.worldbound``: the HPO control groups, gloo backends
   outside torch's registry, even beside an NCCL default group left alone) and collects garbage, so groups that
   only reference cycles still hold are destructed now, their workers joined while the interpreter is whole;
3. sleeps with the GIL released until no other thread of this process is running or waiting to run (read from
   ``/proc/self/task``; a fixed short sleep elsewhere), at most ``timeout`` seconds: every worker that still has a
   tensor to drop gets the GIL while Python is fully alive.

Groups with an NCCL backend are left as upstream leaves them. ``ProcessGroupNCCL::shutdown`` flushes with
``ncclCommFinalize`` and waits for it (torch 2.15), and ``ncclCommAbort`` has been a collective call in
some NCCL versions (torch's own comment in ``destroy_process_group``): either may wait on a peer that left early or
died, which is the hang this must never add; aborting instead can drop data a peer still receives. A successful job
on NCCL that wants its communicators closed calls ``dist.destroy_process_group()`` itself, on every rank, as
torchtitan does.

:func:`arm_at_exit` runs it at interpreter exit, and only when the exit is successful: no uncaught exception
(``sys.last_value`` unset). A rank that raises, is interrupted or killed leaves its groups exactly as upstream does,
so it never waits for anything at exit; torchtitan destroys its process groups only in the ``else`` branch of its
``try`` for the same reason. ``sys.exit(code)`` raises no uncaught exception and counts as successful; what runs is
local and bounded either way.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import warnings

from shardadopt.lifecycle import worldbound

__all__ = ["arm_at_exit", "armed", "exiting_successfully", "release_process_groups"]

DEFAULT_TIMEOUT = 5.0
_ARMED_PID: int | None = None  # the process whose exit is armed (forked children inherit atexit handlers)
_LOCK = threading.Lock()


def exiting_successfully() -> bool:
    """Whether the interpreter is exiting without an uncaught exception (meaningful in an atexit handler).

    Returns:
        False when an exception went uncaught (``sys.last_exc``/``sys.last_value`` set), else True.
    """
    return getattr(sys, "last_value", None) is None and getattr(sys, "last_exc", None) is None


def _gloo_only(group) -> bool:
    import torch.distributed as dist

    config = dist.get_backend_config(group)  # "gloo", or "cpu:gloo,cuda:nccl"-style pairs
    return {pair.rsplit(":", 1)[-1].strip() for pair in config.split(",")} == {"gloo"}


def _destroy_gloo_groups() -> int:
    import torch.distributed as dist

    from shardadopt import upstream

    if not dist.is_initialized():
        return 0
    default = dist.group.WORLD
    destroyed = 0
    for group in [g for g in upstream.registered_process_groups() if g is not default]:
        if _gloo_only(group):
            dist.destroy_process_group(group)
            destroyed += 1
    # Destroying the default group destroys every group: only when no other backend is left.
    if default is not None and upstream.registered_process_groups() == [default] and _gloo_only(default):
        dist.destroy_process_group()
        destroyed += 1
    return destroyed


def _busy_threads() -> list[int] | None:
    """Native ids of this process's other threads that are running, runnable or in the kernel (not sleeping);
    None where ``/proc/self/task`` is not available."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    busy = []
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        # S: sleeping (an idle gloo worker waits on its queue); I: idle; Z/X: ended. A thread waiting for the GIL
        # is woken whenever the GIL is released, so while this sleeps it shows as R until it has run.
        if state not in (b"S", b"I", b"Z", b"X"):
            busy.append(int(tid))
    return busy


def _settle(timeout: float) -> bool:
    """Sleep (the GIL released) until no other thread is busy in three samples in a row; False on timeout."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 3:
        busy = _busy_threads()
        if busy is None:
            time.sleep(min(0.1, timeout))
            return True
        quiet = 0 if busy else quiet + 1
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def release_process_groups(timeout: float = DEFAULT_TIMEOUT) -> int:
    """Destroy this process's gloo process groups and let torch's communication threads let go of Python objects;
    the number of groups destroyed.

    Call it last, on every rank of a job that finished successfully (what :func:`arm_at_exit` does at exit):
    afterwards torch.distributed is no longer initialised where every group was gloo. Local: no collective, and it
    never waits for a peer; groups with an NCCL backend are left alone (see the module docstring). ``timeout``
    bounds the wait for busy threads.

    Args:
        timeout: seconds to wait, at most, for torch's threads to drop their last tensors.

    Returns:
        The number of process groups destroyed.
    """
    destroyed = _destroy_gloo_groups()
    worldbound.world_destroyed(exiting=True)  # the HPO control groups: gloo, outside torch's registry
    gc.collect()  # groups only reference cycles hold are destructed (workers joined) while Python is whole
    _settle(timeout)
    return destroyed


def _at_exit(timeout: float) -> None:
    if _ARMED_PID != os.getpid() or not exiting_successfully():
        return
    try:
        release_process_groups(timeout)
    except Exception as exc:  # noqa: BLE001  (an exit that succeeded must not end in a traceback)
        warnings.warn(f"shardadopt: releasing process groups at exit failed ({type(exc).__name__}: {exc}); "
                      "exiting as upstream would", RuntimeWarning, stacklevel=1)


def arm_at_exit(timeout: float = DEFAULT_TIMEOUT) -> None:
    """Run :func:`release_process_groups` when this process exits successfully (no uncaught exception).

    Idempotent per process. shardadopt arms it when transformers shards a model while loading (patch
    ``transformers-sharded-clean-exit``); call it yourself for models sharded by hand.

    Args:
        timeout: passed to :func:`release_process_groups` at exit.
    """
    global _ARMED_PID
    with _LOCK:
        if _ARMED_PID == os.getpid():
            return
        _ARMED_PID = os.getpid()
    atexit.register(_at_exit, timeout)


def armed() -> bool:
    """Whether this process releases its process groups when it exits successfully.

    Returns:
        True once :func:`arm_at_exit` was called in this process.
    """
    return _ARMED_PID == os.getpid()
