"""The fence and the HPO control plane against rank count, with lightweight ranks (no models).

    python benchmarks/fence_scale.py [--ranks 8 16 32 64] [--repeats 3] [--steady 10]

Ranks are processes forked from this one after its imports (pages shared, so 64 ranks fit in a few GiB), joined in
one gloo world over loopback on a TCPStore this process hosts, as torchrun's agent hosts its store. Per rank count,
medians over ``--repeats`` runs of one ``shardadopt.hpo.optimize`` study of 2 trials in which every rank loops over
``all_reduce`` of a small tensor; in trial 0 the last rank raises after 50 of them, the others are blocked in the
next one:

- ``req/s``: store requests per second from the fence and control plane (every Python-level ``TCPStore`` call,
  counted in each rank), summed over ranks, while every rank sits in a fault-free fenced trial for ``--steady``
  seconds with the default hang timeout (900 s) - the steady load a long trial puts on the store;
- ``out s``: seconds from the fault to the slowest rank leaving its blocked all-reduce;
- ``next s``: seconds from the fault to the slowest rank starting trial 1 (the failure agreed, recorded, the process
  groups rebuilt and a new control group created);
- ``rebuild s``: the slowest rank's ``rebuild_world``.

Then the store's own capacity on this machine (``check`` requests per second from 8 client processes), which is
what serves torchrun's rendezvous, and a least-squares line through each column extrapolated to 512 ranks.
Ranks share the machine's cores with everything else running: compare numbers from one run only.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from datetime import timedelta

import optuna
import torch
import torch.distributed as dist

from shardadopt import fence
from shardadopt.hpo import optimize
from shardadopt.testing import free_port

_COUNTED = ("set", "get", "check", "wait", "multi_get", "multi_set", "compare_set", "add", "delete_key")
ITERATIONS = 50  # all-reduces per trial; the last rank raises after them in trial 0


class _Fault(RuntimeError):
    pass


def _count_store_requests(counter: list[int]) -> None:
    """Benchmark instrumentation: count every Python-level TCPStore request of this process."""
    for name in _COUNTED:
        real = getattr(dist.TCPStore, name)

        def counted(self, *args, _real=real, **kwargs):
            counter[0] += 1
            return _real(self, *args, **kwargs)

        setattr(dist.TCPStore, name, counted)


def _rank(rank: int, world: int, port: int, steady: float, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    requests = [0]
    _count_store_requests(requests)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    spent = []
    original = fence.rebuild_world

    def timed_rebuild() -> None:
        start = time.monotonic()
        original()
        spent.append(time.monotonic() - start)

    fence.rebuild_world = timed_rebuild  # measurement only: the benchmark's wrapper around the public function
    marks: dict = {"started": {}}
    study = optuna.create_study() if rank == 0 else None

    def objective(trial):
        marks["started"][trial.number] = time.time()
        trial.suggest_float("x", 0, 1)
        tensor = torch.ones(8)
        if trial.number == 2:  # the steady phase: a fault-free fenced trial, store requests counted
            before = requests[0]
            time.sleep(steady)
            marks["steady"] = requests[0] - before
            return 0.0
        try:
            for _ in range(ITERATIONS):
                dist.all_reduce(tensor)
            if trial.number == 0 and rank == world - 1:
                marks["fault"] = time.time()
                raise _Fault("injected")
            if trial.number == 0:
                dist.all_reduce(tensor)  # blocked: the last rank never comes
            return 0.0
        except _Fault:
            raise
        except Exception:
            marks["out"] = time.time()
            raise

    optimize(study, objective, n_trials=3, catch=(RuntimeError,))
    results.put((rank, {"started": marks["started"], "fault": marks.get("fault"), "out": marks.get("out"),
                        "steady": marks.get("steady", 0), "rebuild": sum(spent)}))
    os._exit(0)  # skip teardown: every rank of a big forked world would wait in destructors


def _run(world: int, steady: float) -> dict:
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, steady, results), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    server = dist.TCPStore("127.0.0.1", port, world, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    seen = {}
    deadline = time.monotonic() + 600
    while len(seen) < world and time.monotonic() < deadline:
        try:
            rank, result = results.get(timeout=5)
            seen[rank] = result
        except Exception:  # noqa: BLE001
            if not any(p.is_alive() for p in procs):
                break
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    del server
    if len(seen) < world:
        raise RuntimeError(f"{world} ranks: only {len(seen)} answered")
    fault = seen[world - 1]["fault"]
    return {"req/s": sum(r["steady"] for r in seen.values()) / steady,
            "out s": max(r["out"] for r in seen.values() if r["out"] is not None) - fault,
            "next s": max(r["started"][1] for r in seen.values()) - fault,
            "rebuild s": max(r["rebuild"] for r in seen.values())}


def _hammer(port: int, seconds: float, results: multiprocessing.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60), wait_for_workers=False)
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        store.check(["k"])
        count += 1
    results.put(count)
    os._exit(0)


def store_capacity(clients: int = 8, seconds: float = 3.0) -> float:
    """Requests per second the TCPStore (torchrun's rendezvous store) serves to ``clients`` processes."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(port, seconds, results)) for _ in range(clients)]
    for proc in procs:
        proc.start()
    total = sum(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join()
    del server
    return total / seconds


def _fit(xs: list[int], ys: list[float], at: int) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my + slope * (at - mx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steady", type=float, default=10.0)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; medians of {args.repeats}")
    columns = ("req/s", "out s", "next s", "rebuild s")
    print(f"{'ranks':>6} " + " ".join(f"{c:>10}" for c in columns))
    table = {}
    for world in args.ranks:
        runs = [_run(world, args.steady) for _ in range(args.repeats)]
        table[world] = {c: statistics.median(r[c] for r in runs) for c in columns}
        print(f"{world:>6} " + " ".join(f"{table[world][c]:>10.2f}" for c in columns), flush=True)
    if len(table) > 1:
        xs = sorted(table)
        print(f"{'512*':>6} " + " ".join(f"{_fit(xs, [table[x][c] for x in xs], 512):>10.2f}" for c in columns)
              + "   (* least-squares line through the rows above)")
    print(f"TCPStore capacity: {store_capacity():.0f} requests/s (8 client processes, check requests)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
