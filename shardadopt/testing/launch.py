"""Rank processes started as torchrun starts them, one ``python`` per rank, for tests that need real exit codes.

:class:`~shardadopt.testing.RankPool` reuses its workers; a test whose ranks die, hang or exit on purpose (fault
injection) starts its own with :func:`launch` or :func:`spawn`. Each rank joins one gloo process group and runs a
module-level function; its result (pickled) or traceback and its log land in the test's ``workdir``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardadopt.testing.pool import RankTimeout, free_port

STACKS_SIGNAL = signal.SIGUSR2  # the fence's hang interrupt is SIGUSR1
QUIET = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
         "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
_CALL = "SHARDADOPT_LAUNCH_CALL"


def spawn(entry: Callable[..., Any], nproc: int, workdir: Path, **kwargs: Any) -> list[subprocess.Popen]:
    """Start ``entry(**kwargs)`` on ``nproc`` ranks with torchrun's environment; the caller waits for them.

    Args:
        entry: a module-level function; each rank imports its module (this process's ``sys.path``) and calls it.
        nproc: the number of ranks.
        workdir: where rank ``r`` writes ``rank{r}.log`` and its result ``rank{r}.pkl`` or error ``rank{r}.err``.
        **kwargs: ``entry``'s keyword arguments (JSON-serialisable).

    Returns:
        The rank processes, in rank order.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    call = json.dumps({"module": entry.__module__, "entry": entry.__name__, "workdir": str(workdir),
                       "kwargs": kwargs})
    code = f"import sys; sys.path[:] = {sys.path!r}; from shardadopt.testing.launch import _rank_main; _rank_main()"
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, **QUIET, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{_CALL: call})
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(workdir / f"rank{rank}.log", "w")))  # noqa: SIM115
    return procs


def launch(entry: Callable[..., Any], nproc: int, workdir: Path, timeout: float, **kwargs: Any) -> list[dict]:
    """Run ``entry(**kwargs)`` on ``nproc`` ranks (:func:`spawn`) and wait for every rank to exit.

    Args:
        entry, nproc, workdir, **kwargs: as for :func:`spawn`.
        timeout: seconds for all ranks together; past it every rank dumps its threads' stacks into its log and is
            killed.

    Returns:
        Per rank: ``returncode``, ``result`` (what ``entry`` returned, or None) and ``error`` (its traceback, or None).

    Raises:
        RankTimeout: a rank did not exit within ``timeout`` (the message holds the ranks' logs).
    """
    procs = spawn(entry, nproc, workdir, **kwargs)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(STACKS_SIGNAL)  # every thread's stack into the rank's log
        time.sleep(3)
        for proc in procs:
            proc.kill()
            proc.wait()
        logs = "\n".join((workdir / f"rank{r}.log").read_text()[-12000:] for r in range(nproc))
        raise RankTimeout(f"{entry.__name__} did not finish within {timeout:.0f}s (hang):\n{logs}") from None
    results = []
    for rank, proc in enumerate(procs):
        result_file, error_file = workdir / f"rank{rank}.pkl", workdir / f"rank{rank}.err"
        results.append({"returncode": proc.returncode,
                        "result": pickle.loads(result_file.read_bytes()) if result_file.exists() else None,
                        "error": error_file.read_text() if error_file.exists() else None})
    return results


def _rank_main() -> None:
    """A rank's main: join the gloo group, run the entry, write its result or traceback, exit without teardown."""
    import importlib

    import torch
    import torch.distributed as dist

    call = json.loads(os.environ[_CALL])
    out, rank = Path(call["workdir"]), int(os.environ["RANK"])
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # launch() asks a rank that did not finish where it was
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        entry = getattr(importlib.import_module(call["module"]), call["entry"])
        result = entry(**call["kwargs"])
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        code = 0
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        code = 1
    # Skip process-group and interpreter teardown, on success and on error alike: a rank whose groups upstream leaves
    # in place (plain DDP, a failing rank) may abort in finalisation ("terminate called without an active
    # exception", SIGABRT: transformers-sharded-clean-exit leaves those exits as upstream's), and these tests assert
    # the semantics under test and each rank's own exit code, not upstream's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
