"""A pool of worker processes that form one torch.distributed process group, started once and reused.

Starting ranks costs seconds of imports each time; tests and ``shardadopt selftest`` start a pool once and run
many functions on it. Functions are pickled by reference, so they must be importable module-level functions.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

_STOP = "stop"
# On a timeout the pool asks the silent ranks for their threads' stacks before it kills them: the fence's hang
# interrupt is SIGUSR1, so the dump takes the other user signal.
_STACKS_SIGNAL = signal.SIGUSR2
_STACKS_WAIT = 3.0  # seconds a rank gets to write its stacks
# Starts with a fresh port when another process took the free one before rank 0 listened on it (starting ranks
# takes seconds on a loaded machine; seen on a machine shared by several test runs).
_PORT_ATTEMPTS = 3


class RankError(RuntimeError):
    """A function raised on one or more ranks; ``failures`` maps rank -> formatted traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        details = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        super().__init__(f"raised on rank(s) {sorted(failures)}:\n{details}")


class RankTimeout(TimeoutError):
    """Some ranks did not answer in time; the pool was shut down."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, sys_path: list[str], backend: str, device: str,
            env: dict[str, str], log: str | None, stacks: str, inbox: Any, outbox: Any) -> None:
    if log is not None:  # file descriptors, so C++ and warnings output follows too
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    stacks_file = open(stacks, "w")  # noqa: SIM115  (kept open for the life of the process: faulthandler writes it)
    faulthandler.register(_STACKS_SIGNAL, file=stacks_file, all_threads=True)
    faulthandler.enable(file=stacks_file, all_threads=True)  # a rank killed by SIGSEGV & co. leaves its stack
    sys.path[:] = sys_path
    os.environ.update(env)
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.distributed as dist

    # transformers and accelerate bind each process to cuda:LOCAL_RANK, so on CUDA LOCAL_RANK is the rank's GPU
    # (ranks share GPUs round-robin when there are more ranks than GPUs: gloo only, NCCL refuses a shared GPU).
    local_rank = rank % torch.cuda.device_count() if device == "cuda" else rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(int(env.get("SHARDADOPT_THREADS_PER_RANK", "1")))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        outbox.put((rank, "ready", None))
    except Exception:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while True:
        try:
            task = inbox.get()  # unpickling imports the function's module, which may fail
            if task == _STOP:
                break
            fn, args, kwargs = task
            result = fn(*args, **kwargs)
            _flush()  # the task's output is in the log before its answer
            # the queue pickles in a feeder thread, where an error is printed and the answer lost: pickle here
            ForkingPickler.dumps(result)
            outbox.put((rank, "ok", result))
        except BaseException:
            _flush()
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def signal_name(returncode: int) -> str:
    """``SIGSEGV (signal 11)`` for a process killed by a signal (negative return code), else ``exit code N``."""
    if returncode < 0:
        try:
            return f"{signal.Signals(-returncode).name} (signal {-returncode})"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:  # the rank has not started yet
        return 0


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


class RankPool:
    """``nproc`` ranks in one process group (gloo on CPU, nccl on CUDA by default), reused across ``run`` calls.

    ``backend="gloo"`` with ``device="cuda"`` lets more ranks than GPUs share them (CUDA tensors through gloo).

    ``log``: a file every rank appends its stdout and stderr to (default: the launcher's). A ``run`` returns
    after each rank flushed its output.

    >>> with RankPool(2) as pool:
    ...     results = pool.run(my_module.fn, arg)   # fn(arg) on every rank; list of the ranks' return values
    """

    def __init__(self, nproc: int, *, device: str = "cpu", backend: str | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 180.0,
                 log: str | os.PathLike | None = None):
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        backend = backend or default_backend(device)
        if (device, backend) not in {("cpu", "gloo"), ("cuda", "gloo"), ("cuda", "nccl")}:
            raise ValueError(f"backend {backend!r} cannot run ranks on {device!r}; use gloo on cpu, gloo or nccl on "
                             f"cuda")
        self.nproc = nproc
        self.backend = backend
        for attempt in range(_PORT_ATTEMPTS):
            self._launch(device, env, log)
            try:
                self._collect("start", start_timeout)
                return
            except RankError as exc:  # the port free_port() found was taken before rank 0 listened on it
                if attempt + 1 == _PORT_ATTEMPTS or not any("EADDRINUSE" in tb for tb in exc.failures.values()):
                    raise

    def _launch(self, device: str, env: dict[str, str] | None, log: str | os.PathLike | None) -> None:
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(self.nproc)]
        self._outbox = ctx.Queue()
        port = free_port()
        self._stacks_dir = tempfile.TemporaryDirectory(prefix="shardadopt-pool-stacks-")
        self._stacks = [os.path.join(self._stacks_dir.name, f"rank{rank}.txt") for rank in range(self.nproc)]
        self._procs = [
            ctx.Process(target=_worker, daemon=True, name=f"shardadopt-rank{rank}",
                        args=(rank, self.nproc, port, list(sys.path), self.backend, device, dict(env or {}),
                              None if log is None else os.fspath(log), self._stacks[rank], self._inboxes[rank],
                              self._outbox))
            for rank in range(self.nproc)
        ]
        for proc in self._procs:
            proc.start()
        self._broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; the ranks' return values, in rank order."""
        if self._broken:
            raise RuntimeError("this RankPool was shut down after an earlier failure; start a new one")
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace: float | None = None  # after a failure, peers often wait in a collective forever: 10 s only
        while len(results) + len(failures) < self.nproc:
            end = deadline if grace is None else min(deadline, grace)
            try:
                rank, kind, payload = self._outbox.get(timeout=max(min(end - time.monotonic(), 1.0), 0.01))
            except queue.Empty:
                missing = sorted(set(range(self.nproc)) - set(results) - set(failures))
                dead = [r for r in missing if not self._procs[r].is_alive()]
                if dead:  # a killed rank never answers: fail now instead of waiting out the timeout
                    failures.update({r: self._death(r) for r in dead})
                    grace = grace if grace is not None else time.monotonic() + 10.0
                    continue
                if time.monotonic() < end:
                    continue
                stacks = self._dump_stacks(missing)
                self.close(force=True)
                if failures:
                    failures.update({r: "did not finish after another rank failed (pool shut down); its threads:\n"
                                     + stacks[r] for r in missing})
                    raise RankError(failures) from None
                details = "".join(f"\n--- rank {r}, its threads ---\n{stacks[r]}" for r in missing)
                raise RankTimeout(f"{what}: rank(s) {missing} gave no answer within {timeout:.0f}s{details}") from None
            if kind == "error":
                failures[rank] = payload
                grace = grace if grace is not None else time.monotonic() + 10.0
            else:
                results[rank] = payload
        if failures:
            self.close(force=True)
            raise RankError(failures)
        return [results[r] for r in range(self.nproc)]

    def _death(self, rank: int) -> str:
        """How ``rank`` died: its signal by name and, when faulthandler caught it, the stack it died in."""
        code = self._procs[rank].exitcode
        how = f"died of {signal_name(code)}" if code is not None and code < 0 else f"exited ({signal_name(code or 0)})"
        try:
            with open(self._stacks[rank], errors="replace") as f:
                dump = f.read()
        except FileNotFoundError:  # the worker's first step creates it: the process died while it was spawned
            return (f"process {how} before the pool's worker started in it (no stack file). A spawned process "
                    "imports the launching script again as its main module first, so this is usually a script that "
                    "starts the pool at module level: put that code under `if __name__ == \"__main__\":`. The "
                    "process's own error is in the launcher's stderr.")
        text = f"process {how} without answering"
        fatal = dump.rfind("Fatal Python error")
        return text + (f"; its stack (faulthandler):\n{dump[fatal:].rstrip()}" if fatal >= 0 else "")

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's Python stack of each of ``ranks`` (what a hang looked like), before the pool kills them."""
        sizes = {}
        for r in ranks:
            sizes[r] = _size(self._stacks[r])
            try:
                os.kill(self._procs[r].pid, _STACKS_SIGNAL)
            except (ProcessLookupError, TypeError):
                pass
        deadline = time.monotonic() + _STACKS_WAIT
        while time.monotonic() < deadline and any(_size(self._stacks[r]) == sizes[r] for r in ranks):
            time.sleep(0.1)
        time.sleep(0.2)  # let a dump in progress finish
        stacks = {}
        for r in ranks:
            text = ""
            if _size(self._stacks[r]) > sizes[r]:
                with open(self._stacks[r]) as f:
                    f.seek(sizes[r])
                    text = f.read()
            stacks[r] = text or "(no stacks: the process did not answer the signal)"
        return stacks

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        self._broken = True
        if not force:
            for inbox in self._inboxes:
                inbox.put(_STOP)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self._procs = []
        self._stacks_dir.cleanup()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)
