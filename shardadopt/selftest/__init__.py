"""``shardadopt selftest``: run each capability on real worker processes and compare it with one process.

A scenario computes a single-process reference in the launcher process, runs on ``nproc`` ranks of a
``RankPool`` and compares rank 0's result with the reference. Scenarios that need the same world size share one
pool, so imports are paid once per world size.

Only the PASS/FAIL table goes to the terminal: the output of every rank and of the reference computations
(upstream warnings and the like) goes to a log file whose path is printed first; the log of each failed scenario
follows the table.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardadopt.selftest.scenario import Context, Scenario
from shardadopt.testing import RankError, RankPool, RankTimeout, tiny_checkpoints


@dataclass
class Outcome:
    scenario: str
    ok: bool
    seconds: float
    detail: str
    skipped: bool = False  # the scenario cannot run on this world size: neither passed nor failed


def _scenarios() -> list[Scenario]:
    from shardadopt.selftest import accelerate, checkpoint, hpo, loading, trainer

    return [*loading.SCENARIOS, *accelerate.SCENARIOS, *trainer.SCENARIOS, *hpo.SCENARIOS, *checkpoint.SCENARIOS]


LOG_TAIL_LINES = 40  # of a failed scenario's log, shown after the table


def run_selftest(nproc: int = 2, device: str = "cpu", only: Sequence[str] | None = None,
                 timeout: float = 300.0, out: Any = None, backend: str | None = None) -> list[Outcome]:
    out = out or sys.stdout
    # Loading bars from every rank would bury the table.
    quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    os.environ.update(quiet)
    scenarios = _scenarios()
    if only:
        unknown = set(only) - {s.name for s in scenarios}
        if unknown:
            raise ValueError(f"unknown scenario(s) {sorted(unknown)}; known: {[s.name for s in scenarios]}")
        scenarios = [s for s in scenarios if s.name in only]
    fd, log = tempfile.mkstemp(prefix="shardadopt-selftest-", suffix=".log")
    os.close(fd)
    print(f"worker output: {log}", file=out, flush=True)
    outcomes: list[Outcome] = []
    failed_logs: list[tuple[str, int, int]] = []  # scenario, start and end offsets in the log
    with tempfile.TemporaryDirectory(prefix="shardadopt-selftest-") as root:
        ctx = Context(models=tiny_checkpoints(root), nproc=nproc, device=device)
        pool: RankPool | None = None
        try:
            for scenario in scenarios:
                reason = scenario.unsupported(nproc)
                if reason:
                    outcomes.append(Outcome(scenario.name, True, 0.0, reason, skipped=True))
                    print(_row(outcomes[-1]), file=out, flush=True)
                    continue
                start, begin = time.monotonic(), os.path.getsize(log)
                _note(log, f"=== {scenario.name}")
                try:
                    with _to_log(log):
                        expected = scenario.reference(ctx)
                    if pool is None:
                        pool = RankPool(nproc, device=device, backend=backend, env=quiet, log=log)
                    result = pool.run(scenario.run, ctx, timeout=timeout)[0]
                    problem = scenario.compare(result, expected)
                    outcome = Outcome(scenario.name, problem is None, time.monotonic() - start,
                                      problem or scenario.description)
                except (RankError, RankTimeout) as exc:
                    pool = None  # the pool shut itself down; the next scenario gets a fresh one
                    outcome = Outcome(scenario.name, False, time.monotonic() - start, str(exc))
                except Exception:
                    outcome = Outcome(scenario.name, False, time.monotonic() - start, traceback.format_exc())
                outcomes.append(outcome)
                if not outcome.ok:
                    failed_logs.append((scenario.name, begin, os.path.getsize(log)))
                print(_row(outcome), file=out, flush=True)
        finally:
            if pool is not None:
                pool.close()
    for name, begin, end in failed_logs:
        print(f"\n--- {name}: last {LOG_TAIL_LINES} lines of its log ({log}) ---", file=out)
        print(_tail(log, begin, end, LOG_TAIL_LINES), file=out, flush=True)
    return outcomes


@contextlib.contextmanager
def _to_log(log: str) -> Any:
    """The launcher's own output (reference computations) into the log as well."""
    with open(log, "a") as handle, contextlib.redirect_stdout(handle), contextlib.redirect_stderr(handle):
        yield


def _note(log: str, line: str) -> None:
    with open(log, "a") as handle:
        handle.write(line + "\n")


def _tail(log: str, begin: int, end: int, lines: int) -> str:
    with open(log, "rb") as handle:
        handle.seek(begin)
        text = handle.read(end - begin).decode(errors="replace")
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _row(outcome: Outcome) -> str:
    first, *rest = outcome.detail.strip().splitlines() or [""]
    status = "SKIP" if outcome.skipped else "PASS" if outcome.ok else "FAIL"
    text = f"{status}  {outcome.scenario:<28} {outcome.seconds:6.1f}s  {first}"
    if not outcome.ok and rest:
        text += "\n" + "\n".join("      " + line for line in rest)
    return text
