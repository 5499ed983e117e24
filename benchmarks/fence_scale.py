"""The fault fence and the HPO control plane against rank count, with lightweight ranks (no models).

    python benchmarks/fence_scale.py [--ranks 4 8 16 32 64] [--repeats 3] [--steady 4] [--hang-timeout 2]
                                     [--json out.json]

Ranks are processes forked from this one after its imports (pages shared: 64 ranks fit in a few GiB), joined in one
gloo world over loopback on one ``TCPStore`` hosted by another forked process, as torchrun's agent hosts its
rendezvous store. Every rank runs two ``shardadopt.hpo.optimize`` searches of 3 trials each; a trial's objective
loops over a forward of a ``Linear(8, 8)``, an ``all_reduce`` of 8 floats and a short sleep (the accelerator's work):

- search 1, default hang timeout (``$SHARDADOPT_HANG_TIMEOUT`` or 900 s): trial 0 runs ``--steady`` seconds
  fault-free (**req/s**, the steady store load of a long trial); in trial 1 the last rank raises while every other
  rank is blocked in the next ``all_reduce`` (**out s**: from the raise to the slowest rank leaving its blocked
  collective; **next s**: to the slowest rank starting trial 2, i.e. the failure agreed in the control plane,
  recorded, the world rebuilt);
- search 2, ``--hang-timeout`` seconds: trial 0 is the steady phase again (**req/s hang**: the load with a short
  hang timeout, whose monitor beats every ``timeout/4`` s), in trial 1 the last rank stops making progress
  (``time.sleep``, interruptible) while the others block in the next ``all_reduce`` (**hang s**: from the stall to
  the slowest rank out of the trial; the documented bound is ``hang_timeout + 4 ticks``).

**rebuild s**: the slowest rank's ``shardadopt.fence.rebuild_world`` (median of the two per run). **start s**: fork
to every rank in the world (gloo's own connection set-up, not shardadopt's).

Store requests are counted in every rank by wrapping the Python methods of ``TCPStore`` and ``PrefixStore``
(``set``, ``get``, ``check``, ``wait``, ``multi_get``, ``multi_set``, ``compare_set``, ``add``, ...): every request
shardadopt makes (its calls all go through Python, the watcher's blocking ``wait`` counted once) and none of
torch's own from C++ (gloo's rendezvous when a group is created, which a job pays at start-up anyway: about
``world`` requests per rank per group). Then the store's own capacity on this machine (``check`` requests per
second from 8 client processes: what serves torchrun's rendezvous), and a least-squares line through each column
extrapolated to 512 ranks. Medians over ``--repeats``. Ranks share the machine's cores with everything else running:
compare numbers from one run only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import optuna
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh  # imported before the fork: every rank shares it

from shardadopt import fence
from shardadopt.fence.watcher import Watcher
from shardadopt.hpo import ControlOptions, channel, optimize

_COUNTED = ("set", "get", "check", "wait", "multi_get", "multi_set", "compare_set", "add", "delete_key",
            "num_keys", "append")
STEP_SLEEP = 0.02  # seconds of "work" per iteration of a trial
WARM_ITERATIONS = 20  # iterations of a fault trial before the fault
COLUMNS = ("start s", "req/s", "req/s hang", "out s", "next s", "hang s", "rebuild s")
STEPS = ("trip", "break", "agree", "destroy", "init", "control", "command", "arm", "start", "mesh", "model_init")


class _Fault(RuntimeError):
    pass


def _count_store_requests(counter: list[int]) -> None:
    """Benchmark instrumentation: count every Python-level store request of this process."""
    for cls in (dist.TCPStore, dist.PrefixStore):
        for name in _COUNTED:
            real = getattr(cls, name, None)
            if real is None:
                continue

            def counted(self, *args, _real=real, **kwargs):
                counter[0] += 1
                return _real(self, *args, **kwargs)

            setattr(cls, name, counted)


def _instrument(events: list[tuple[str, float]]) -> None:
    """Benchmark instrumentation: timestamps of every step between a fault and the next trial (wall clock: the
    parent compares ranks), wrapped around the functions that take them."""

    def mark(name: str) -> None:
        events.append((name, time.time()))

    tripped = Watcher._tripped

    def timed_tripped(self, *args, **kwargs):
        mark("seen")  # the watcher read the trip record
        try:
            return tripped(self, *args, **kwargs)
        finally:
            mark("broken")  # ... and broke this rank's training groups

    Watcher._tripped = timed_tripped
    arm = Watcher.arm

    def timed_arm(self, *args, **kwargs):
        try:
            return arm(self, *args, **kwargs)
        finally:
            mark("armed")  # the next trial's fence armed on this rank

    Watcher.arm = timed_arm
    broadcast_object = channel.Channel.broadcast_object

    def timed_broadcast_object(self, src, obj, op):
        result = broadcast_object(self, src, obj, op)
        if op == channel.OP_COMMAND:
            mark("command")  # rank 0's next command (the next trial's START) arrived
        return result

    channel.Channel.broadcast_object = timed_broadcast_object
    exchange = channel.Channel.exchange

    def timed_exchange(self, op, *args, **kwargs):
        table = exchange(self, op, *args, **kwargs)
        if op in (channel.OP_END, channel.OP_FINISH):
            mark("ended" if op == channel.OP_END else "agreed")
        return table

    channel.Channel.exchange = timed_exchange
    def timed(real: Any, after: str) -> Any:
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            mark(after)
            return result

        return call

    for module, name, after in ((dist, "destroy_process_group", "destroyed"), (dist, "init_process_group", "init"),
                                (fence, "rebuild_world", "rebuilt"), (channel, "control_group", "control")):
        setattr(module, name, timed(getattr(module, name), after))


def _search(world: int, steady: float, mode: str, hang_timeout: float | None, requests: list[int],
            marks: dict) -> None:
    """One search of 3 trials: steady, then the last rank raises (``mode="fault"``) or stalls (``"hang"``), then a
    fault-free trial whose start ends the measurement."""
    rank = dist.get_rank()
    study = optuna.create_study() if rank == 0 else None
    layer = torch.nn.Linear(8, 8)

    def objective(trial):
        marks[f"{mode} started {trial.number}"] = time.time()
        trial.suggest_float("x", 0, 1)
        if trial.number == 2 and mode == "fault":  # after the rebuild: what a trial creates again (mesh, model)
            start = time.time()
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")) if world >= 4 else None
            marks[f"{mode} mesh"] = time.time()
            model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
            marks[f"{mode} model_init"] = time.time()
            marks[f"{mode} mesh s"], marks[f"{mode} model_init s"] = marks[f"{mode} mesh"] - start, \
                marks[f"{mode} model_init"] - marks[f"{mode} mesh"]
            del mesh, model
        tensor = torch.ones(8)
        iterations = int(steady / STEP_SLEEP) if trial.number == 0 else WARM_ITERATIONS
        before = requests[0]
        start = time.monotonic()
        for _ in range(iterations):
            layer(tensor)  # a forward call: progress for the hang monitor
            dist.all_reduce(tensor)
            time.sleep(STEP_SLEEP)
        if trial.number == 0:
            marks[f"{mode} req/s"] = (requests[0] - before) / (time.monotonic() - start)
        if trial.number != 1:
            return 0.0
        if rank == world - 1:
            marks[f"{mode} at"] = time.time()
            if mode == "hang":
                time.sleep(10**6)  # stops making progress; the hang monitor interrupts it
            raise _Fault("injected")
        try:
            layer(tensor)  # the next step's forward: these ranks went further than the last one
            dist.all_reduce(tensor)  # blocked: the last rank never comes
        except Exception:
            marks[f"{mode} out"] = time.time()
            raise
        raise AssertionError("the blocked all_reduce returned")

    control = ControlOptions(hang_timeout=hang_timeout)
    optimize(study, objective, n_trials=3, catch=(RuntimeError,), control=control)
    if rank == 0:
        states = [t.state.name for t in study.trials]
        kind = study.trials[1].user_attrs.get("failure_kind")
        expected = "hang" if mode == "hang" else "error"
        if states != ["COMPLETE", "FAIL", "COMPLETE"] or kind != expected:
            raise AssertionError(f"{mode}: trials {states}, failure kind {kind!r} (expected {expected!r})")


def _rank(rank: int, world: int, port: int, steady: float, hang_timeout: float, forked: float,
          results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    requests = [0]
    _count_store_requests(requests)
    marks: dict = {}
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=300))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
        dist.barrier()
        marks["ready"] = time.time() - forked
        spent = []
        original = fence.rebuild_world

        def timed_rebuild() -> None:
            start = time.monotonic()
            original()
            spent.append(time.monotonic() - start)

        fence.rebuild_world = timed_rebuild  # measurement only: the benchmark's wrapper around the public function
        events: list[tuple[str, float]] = []
        _instrument(events)
        _search(world, steady, "fault", None, requests, marks)
        marks["events"] = list(events)
        _search(world, steady, "hang", hang_timeout, requests, marks)
        marks["rebuild"] = spent
        marks["floor"] = _floor()
        results.put((rank, marks))
    except BaseException as exc:  # noqa: BLE001  (reported by the parent)
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
    results.close()
    results.join_thread()  # the answer is written before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip teardown: every rank of a big forked world would wait in destructors


def _floor() -> tuple[float, float]:
    """The floor of a recovery at this world size, measured in the same world: a bare new gloo process group over
    every rank (the rendezvous and connections any rebuild must make) and one barrier on it."""
    dist.barrier()
    start = time.time()
    group = dist.new_group(backend="gloo")
    dist.barrier(group=group)
    return start, time.time()


def _serve(world: int | None, stop: Any, ports: Any) -> None:
    """The store's host (torchrun's agent): a process of its own, so this one stays single-threaded and forks
    cleanly (a child forked while the server's thread held a lock deadlocked in it). It binds a port of the
    kernel's choosing and reports it: a port picked free beforehand can be taken by another process in between."""
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    ports.put(server.port)
    stop.wait()
    del server
    os._exit(0)


def _host_store(ctx: Any, world: int | None) -> tuple[int, Any, Any]:
    stop, ports = ctx.Event(), ctx.Queue()
    host = ctx.Process(target=_serve, args=(world, stop, ports), daemon=True)
    host.start()
    return ports.get(timeout=120), stop, host


def run_world(world: int, steady: float, hang_timeout: float, timeout: float = 600.0) -> dict:
    """One run of ``world`` ranks; the columns of the table, and each rank's out times."""
    ctx = multiprocessing.get_context("fork")
    port, stop, host = _host_store(ctx, world)
    results = ctx.Queue()
    forked = time.time()
    procs = [ctx.Process(target=_rank, args=(r, world, port, steady, hang_timeout, forked, results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < world and time.monotonic() < deadline:
        try:
            rank, marks = results.get(timeout=2)
            seen[rank] = marks
        except Exception:  # noqa: BLE001  (queue.Empty: check that someone is still alive)
            if not any(p.is_alive() for p in procs):
                break
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    stop.set()
    host.join(timeout=10)
    errors = {r: m["error"] for r, m in seen.items() if "error" in m}
    if len(seen) < world or errors:
        raise RuntimeError(f"{world} ranks: {len(seen)} answered; errors: {errors}")
    ranks = list(seen.values())
    row = {"start s": max(m["ready"] for m in ranks),
           "req/s": sum(m["fault req/s"] for m in ranks),
           "req/s hang": sum(m["hang req/s"] for m in ranks),
           "rebuild s": statistics.median(max(m["rebuild"][i] for m in ranks) for i in range(2))}
    row.update(breakdown(seen, world))
    for mode, column in (("fault", "out s"), ("hang", "hang s")):
        at = seen[world - 1][f"{mode} at"]
        outs = sorted(m[f"{mode} out"] - at for m in ranks if f"{mode} out" in m)
        row[column] = outs[-1]
        row[f"{mode} outs"] = outs
        if mode == "fault":
            row["next s"] = max(m["fault started 2"] for m in ranks) - at
    return row


def breakdown(seen: dict[int, dict], world: int) -> dict[str, float]:
    """Where the fault's recovery time goes: for each step, when the slowest rank finished it (seconds after the
    fault), as increments over the step before; and the floor measured in the same world."""
    at = seen[world - 1]["fault at"]

    def slowest(name: str) -> float:
        times = []
        for marks in seen.values():
            found = [t for event, t in marks["events"] if event == name and t >= at]
            if found:
                times.append(min(found))
        return max(times) - at if times else float("nan")

    done = {"seen": slowest("seen"), "broken": slowest("broken"), "ended": slowest("ended"),
            "agreed": slowest("agreed"), "destroyed": slowest("destroyed"), "rebuilt": slowest("rebuilt"),
            "control": slowest("control"), "command": slowest("command"), "armed": slowest("armed"),
            "next": max(m["fault started 2"] for m in seen.values()) - at}
    if done["control"] != done["control"]:  # no control group created after the rebuild: it was kept
        done["control"] = done["rebuilt"]
    done["out"] = max([m["fault out"] - at for m in seen.values() if "fault out" in m] + [done["broken"]])
    row = {"trip": done["seen"], "break": done["out"] - done["seen"], "agree": done["agreed"] - done["out"],
           "destroy": done["destroyed"] - done["agreed"], "init": done["rebuilt"] - done["destroyed"],
           "control": done["control"] - done["rebuilt"], "command": done["command"] - done["control"],
           "arm": done["armed"] - done["command"], "start": done["next"] - done["armed"],
           "mesh": max(m.get("fault mesh s", 0.0) for m in seen.values()),
           "model_init": max(m.get("fault model_init s", 0.0) for m in seen.values())}
    row["floor s"] = max(m["floor"][1] for m in seen.values()) - min(m["floor"][0] for m in seen.values())
    return row


def _hammer(port: int, seconds: float, results: multiprocessing.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60), wait_for_workers=False)
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        store.check(["k"])
        count += 1
    results.put(count)
    results.close()
    results.join_thread()
    os._exit(0)


def store_capacity(clients: int = 8, seconds: float = 3.0) -> float:
    """Requests per second the TCPStore (torchrun's rendezvous store) serves to ``clients`` processes."""
    ctx = multiprocessing.get_context("fork")
    port, stop, host = _host_store(ctx, None)
    results = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(port, seconds, results)) for _ in range(clients)]
    for proc in procs:
        proc.start()
    total = sum(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join()
    stop.set()
    host.join(timeout=10)
    return total / seconds


def fit(xs: list[int], ys: list[float], at: int) -> float:
    """The least-squares line through (xs, ys), at ``at``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my + slope * (at - mx)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steady", type=float, default=4.0, help="seconds of each steady phase")
    parser.add_argument("--hang-timeout", type=float, default=2.0, help="search 2's hang timeout (seconds)")
    parser.add_argument("--capacity-seconds", type=float, default=3.0)
    parser.add_argument("--json", help="write the table and every run here")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; medians of {args.repeats}; "
          f"hang timeout {args.hang_timeout:g}s (bound {args.hang_timeout + 4 * max(args.hang_timeout / 4, 0.25):g}s)")
    print(f"{'ranks':>6} " + " ".join(f"{c:>10}" for c in COLUMNS), flush=True)
    table: dict[int, dict] = {}
    runs: dict[int, list] = {}
    for world in args.ranks:
        load = os.getloadavg()[0]
        runs[world] = [run_world(world, args.steady, args.hang_timeout) for _ in range(args.repeats)]
        table[world] = {c: statistics.median(r[c] for r in runs[world]) for c in COLUMNS + STEPS + ("floor s",)}
        table[world]["ratio"] = statistics.median(r["next s"] / r["floor s"] for r in runs[world])
        table[world]["load"] = (load, os.getloadavg()[0])
        print(f"{world:>6} " + " ".join(f"{table[world][c]:>10.3f}" for c in COLUMNS), flush=True)
    print("\nfault to every rank in the next trial, step by step (seconds the slowest rank spent in each after the "
          "one before; medians), against the floor measured in the same world (a bare new gloo group + barrier):")
    print(f"{'ranks':>6} " + " ".join(f"{c:>10}" for c in STEPS + ("next s", "floor s", "next/floor", "load")))
    for world in args.ranks:
        row = table[world]
        print(f"{world:>6} " + " ".join(f"{row[c]:>10.3f}" for c in STEPS + ("next s", "floor s"))
              + f" {row['ratio']:>9.1f}x {row['load'][0]:>4.1f}-{row['load'][1]:.1f}")
    extrapolated = None
    if len(table) > 1:
        xs = sorted(table)
        extrapolated = {c: fit(xs, [table[x][c] for x in xs], 512) for c in COLUMNS}
        print(f"{'512*':>6} " + " ".join(f"{extrapolated[c]:>10.3f}" for c in COLUMNS)
              + "   (* least-squares line through the rows above)")
    xs = sorted(table)
    loads = [v for x in xs for v in table[x]["load"]]
    print("docs/benchmarks.md (ranks " + ", ".join(map(str, xs)) + f", load {min(loads):.0f}-{max(loads):.0f}): "
          "fault to every rank out " + ", ".join(f"{table[x]['out s']:.2g}" for x in xs) + " s; `rebuild_world` "
          + ", ".join(f"{table[x]['rebuild s']:.2g}" for x in xs) + " s; fault to every rank in the next trial "
          + ", ".join(f"{table[x]['next s']:.2g}" for x in xs) + " s, "
          + ", ".join(f"{table[x]['ratio']:.1f}x" for x in xs) + " the floor (a new gloo group + barrier: "
          + ", ".join(f"{table[x]['floor s']:.2g}" for x in xs) + " s)")
    capacity = store_capacity(seconds=args.capacity_seconds)
    print(f"TCPStore capacity: {capacity:.0f} requests/s (8 client processes, check requests)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    report = {"table": {str(k): v for k, v in table.items()}, "runs": {str(k): v for k, v in runs.items()},
              "extrapolated_512": extrapolated, "store_capacity_per_s": capacity,
              "hang_timeout": args.hang_timeout, "steady_s": args.steady, "repeats": args.repeats}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
