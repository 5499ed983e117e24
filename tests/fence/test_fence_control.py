"""The fence and the HPO control plane under the faults the last review named, and hangs.

On 2 gloo ranks: a rank killed right after it tripped a fence (its record is one atomic store request, so the peer
learns who failed at once instead of waiting out the store timeout); a rank that stops making progress without
raising inside an ``optimize`` trial (``time.sleep`` in user code after a training step: the trial fails as ``hang``
against it, the next trial trains as a single process on the same global batch does), and one that cannot be
interrupted (``os.read`` on a pipe with the hang signal blocked: every rank exits with ``HANG_EXIT_CODE`` within the
bound); a rank hanging in a sharded checkpoint save (``os.fsync`` blocking in DCP's writes, rank 1 or rank 0, the
one that publishes; and with the watchers' break of the groups late, so DCP gathers the ``HangError`` into its
``CheckpointException``): the trial fails once as ``hang`` naming that rank, the search goes on, the checkpoint
before resumes exactly; a rank whose trial close raises (a Ctrl-C deferred past the end round) still takes part in
the rebuild decision; ``ControlOptions(group=...)`` warns that the fence is off; the HPO control group is freed once
its world is destroyed (``rebuild_world``, ``shardadopt.lifecycle.cleanexit`` at exit), even while torch holds that
world's
object; a break leaves the control group whole even where the store's list of training listeners names its sockets'
ports (a closed listener's port the kernel gave to a control socket); the fence watcher survives a rebuild that it
starts into (a late thread start while the default group is destroyed).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from shardadopt.testing import fault_search
from shardadopt.testing.launch import launch, spawn

pytestmark = pytest.mark.multiproc

BOUND = 30.0  # seconds from the fault (or the hang timeout's expiry) to every rank out; measured: 1-5 s loaded
HANG_TIMEOUT = 5.0  # seconds; long enough for a first import of torch._dynamo on a loaded machine
FSDP = {"fsdp_size": 2}


# -- a rank killed right after its trip --------------------------------------------------------------------------------


def killed_after_trip() -> dict:
    """Rank 1 raises in a fenced section and its process dies right after its first store write (where the old
    trip, ``add`` then ``set``, had written only the count); rank 0 waits in an all-reduce."""
    import threading

    import torch
    import torch.distributed as dist

    from shardadopt import fence

    rank = dist.get_rank()
    if rank == 1:
        def dying(real):
            def call(self, *args):
                result = real(self, *args)
                if threading.current_thread() is threading.main_thread():
                    os._exit(17)
                return result
            return call

        for cls in (dist.TCPStore, dist.PrefixStore):
            for name in ("add", "compare_set"):
                setattr(cls, name, dying(getattr(cls, name)))
    started = time.time()
    try:
        with fence.fenced("a section"):
            if rank == 1:
                raise RuntimeError("injected on rank 1")
            dist.all_reduce(torch.ones(4))
    except fence.PeerFailedError as exc:
        return {"rank": exc.rank, "message": str(exc), "left": time.time() - started}
    raise AssertionError("rank 0 left the section without an error")


def test_a_rank_killed_right_after_tripping_is_named_at_once(tmp_path):
    ranks = launch(killed_after_trip, 2, tmp_path, timeout=120)
    assert ranks[1]["returncode"] == 17, ranks[1]
    assert ranks[0]["returncode"] == 0, ranks[0]["error"]
    seen = ranks[0]["result"]
    assert seen["rank"] == 1 and "injected on rank 1" in seen["message"], seen
    assert seen["left"] < BOUND


# -- a break that reaches one side of a gloo pair only ----------------------------------------------------------------


def _accepting_rank() -> int:
    """A fresh world (only the default group), and which rank's gloo listener accepted the pair's connection (it
    changes from run to run: gloo compares the two addresses)."""
    import torch.distributed as dist

    from shardadopt import fence
    from shardadopt.fence import breaking, records

    fence.rebuild_world()
    sockets = breaking.own_tcp_sockets()
    own = {port for _, port in breaking.training_listeners(sockets, records.default_base_store().port)}
    accepted = [None] * dist.get_world_size()
    dist.all_gather_object(accepted, any(s.state != breaking.LISTEN and s.port in own for s in sockets))
    assert accepted.count(True) == 1, accepted
    return accepted.index(True)


def _only_the_connecting_side_breaks() -> dict:
    """The rank that accepted the pair's connection raises in a fenced section and its break does nothing (what a
    rank does whose watcher comes too late, or that already left the collectives); its peer, the connecting side,
    waits in a broadcast from it. Its own break must end that wait. The accepting rank keeps its groups (and so its
    sockets) until its peer says it left, or 60 s."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardadopt import fence, upstream
    from shardadopt.fence import breaking

    rank, acceptor = dist.get_rank(), _accepting_rank()
    store, left_key = upstream.default_store(), f"connecting-side/{fence.generation()}/left"
    breaks = breaking.break_training_groups
    started = time.time()
    try:
        with fence.fenced("a section"):
            if rank == acceptor:
                breaking.break_training_groups = lambda **_: 0  # test instrumentation: this rank's break misses
                raise RuntimeError("injected on the accepting rank")
            dist.broadcast(torch.ones(4), src=acceptor)
        outcome = {"raised": None}
    except fence.PeerFailedError as exc:
        outcome = {"raised": "PeerFailedError", "rank": exc.rank, "left": time.time() - started}
        store.set(left_key, "1")
    except RuntimeError as exc:
        outcome = {"raised": str(exc)}
        try:
            store.wait([left_key], timedelta(seconds=60))
        except Exception:  # noqa: BLE001  (the peer never left: its result says how)
            pass
    finally:
        breaking.break_training_groups = breaks
    fence.rebuild_world()  # the pool's next case gets working groups
    return {"acceptor": acceptor, **outcome}


def test_the_connecting_side_of_a_gloo_pair_breaks_it_alone(pool2):
    results = pool2.run(_only_the_connecting_side_breaks, timeout=120)
    acceptor = results[0]["acceptor"]
    assert results[acceptor]["raised"] == "injected on the accepting rank", results
    waiting = results[1 - acceptor]
    assert waiting["raised"] == "PeerFailedError" and waiting["rank"] == acceptor, results
    assert waiting["left"] < BOUND, waiting


def blocked_where_no_break_reaches(how: str) -> dict:
    """Rank 1 raises in a fenced section and stays alive (slow to leave: its sockets stay open) while rank 0 waits
    where no break reaches it: ``broadcast`` from rank 1 with both ranks' breaks doing nothing, or ``new_group``'s
    rendezvous (a store wait, which no process group's break ends)."""
    import torch
    import torch.distributed as dist

    from shardadopt import fence
    from shardadopt.fence import breaking

    rank = dist.get_rank()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if how == "broadcast":
        breaking.break_training_groups = lambda **_: 0  # test instrumentation: no break reaches the collective
    started = time.time()
    try:
        with fence.fenced("a section"):
            if rank == 1:
                raise RuntimeError("injected on rank 1")
            if how == "broadcast":
                dist.broadcast(torch.ones(4), src=1)
            else:
                dist.new_group(backend="gloo")
    except RuntimeError:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until rank 0 is gone
            try:
                os.kill(pids[0], 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        return {"tripped": started, "peer gone": time.time()}
    return {"left": time.time() - started}


@pytest.mark.parametrize("how", ["broadcast", "new_group"])
def test_a_rank_left_blocked_after_the_break_exits_to_be_restarted(tmp_path, how):
    from shardadopt import fence

    ranks = launch(blocked_where_no_break_reaches, 2, tmp_path, timeout=240, how=how)
    log = (tmp_path / "rank0.log").read_text()
    assert ranks[0]["returncode"] == fence.HANG_EXIT_CODE, (ranks[0], log[-3000:])
    assert "is still blocked in" in log and "breaking its process groups again" in log, log[-3000:]
    assert "stayed blocked in" in log, log[-3000:]
    assert ranks[1]["returncode"] == 0, ranks[1]["error"]
    seen = ranks[1]["result"]
    assert seen["peer gone"] - seen["tripped"] < BOUND, seen


def _slow_peer_after_a_trip() -> dict:
    """Trial 0: rank 1 raises at once and waits in the trial's end round on the control plane; rank 0 runs slow user
    code (15 s, no collective) before its training breaks. The waiting rank must not be taken for one left blocked
    by the break (it waits for its peer, who comes)."""
    import optuna
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rank = dist.get_rank()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1)) if rank == 0 else None
    trials = []

    def objective(trial):
        if trial.number == 0:
            if rank == 1:
                raise RuntimeError("injected on rank 1")
            time.sleep(15)
        losses = _train_until(trial, None, None)
        trials.append((trial.number, trial.params["lr"], losses))
        return losses[-1]

    optimize(study, objective, n_trials=2, catch=(RuntimeError,),
             control=ControlOptions(timeout=fault_search.CONTROL_TIMEOUT))
    table = [(t.number, t.state.name, t.params, dict(t.user_attrs)) for t in study.trials] if study else None
    return {"table": table, "trials": trials}


def test_a_rank_waiting_for_a_slow_peer_after_a_trip_is_left_to_wait(pool2):
    results = pool2.run(_slow_peer_after_a_trip, timeout=240)
    table = results[0]["table"]
    assert [state for _, state, _, _ in table] == ["FAIL", "COMPLETE"], table
    assert table[0][3]["failure_rank"] == 1, table[0][3]
    for result in results:
        (number, lr, losses), = result["trials"]
        assert number == 1 and lr == table[1][2]["lr"]
        assert losses == pytest.approx(fault_search.reference(lr, len(results)), rel=1e-5, abs=1e-6)


# -- hangs ------------------------------------------------------------------------------------------------------------


def _train_until(trial, stall, at: int | None) -> list[float]:
    """``fault_search.ddp_losses`` at the trial's learning rate; ``stall()`` in user code after step ``at``, while
    the other ranks go on into the next step's collectives; ``at=-1``: before the model is wrapped, while the other
    ranks wait in DDP's first collective (nobody made more progress than anybody)."""
    lr = fault_search.suggest_lr(trial)
    if at is None:
        return fault_search.ddp_losses(lr)
    return fault_search.ddp_losses(lr, "model_init" if at == -1 else "user", at, lambda where, step: stall())


def _hanging_search(hang: dict | None, marks_file: str | None = None) -> dict:
    """On ``hang["rank"]`` in trial 0, after step ``hang.get("at", 1)``, user code stops making progress: ``sleep``
    (interruptible) or ``read`` (``os.read`` on a pipe with every signal blocked: Python cannot interrupt it)."""
    import optuna
    import torch._dynamo.utils  # noqa: F401  # upstream-private: imported here, not first inside trial 0
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize

    # DDP's first construction imports torch's compiler stack (torch._dynamo.utils): on a loaded machine that took
    # longer than HANG_TIMEOUT inside trial 0, and the hang interrupt left the import half done ("module
    # 'torch._dynamo' has no attribute 'utils'"). This test's HANG_TIMEOUT (5 s, the default is 900 s) is about the
    # user's stalled code, not a first import of torch's.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rank = dist.get_rank()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1)) if rank == 0 else None
    marks: dict = {"trials": [], "started": []}

    def stall() -> None:
        marks["hang_at"] = time.time()
        if marks_file is not None:
            with open(marks_file, "w") as f:
                f.write(str(marks["hang_at"]))
        if hang["how"] == "sleep":
            time.sleep(10**6)
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        read, _ = os.pipe()
        os.read(read, 1)

    def objective(trial):
        marks["started"].append((trial.number, time.time()))
        here = hang is not None and trial.number == 0 and rank == hang["rank"]
        losses = _train_until(trial, stall, hang.get("at", 1) if here else None)
        marks["trials"].append((trial.number, trial.params["lr"], losses))
        return losses[-1]

    optimize(study, objective, n_trials=2, catch=(RuntimeError,),
             control=ControlOptions(timeout=fault_search.CONTROL_TIMEOUT, hang_timeout=HANG_TIMEOUT))
    table = [(t.number, t.state.name, t.params, dict(t.user_attrs)) for t in study.trials] if study else None
    return {"table": table, **marks}


@pytest.mark.parametrize("rank,at", [(1, 1), (0, 1), (1, -1)])
def test_a_rank_hanging_in_a_trial_fails_it_as_hang_and_the_search_goes_on(pool2, rank, at):
    results = pool2.run(_hanging_search, {"rank": rank, "how": "sleep", "at": at}, timeout=240)
    table = results[0]["table"]
    assert [state for _, state, _, _ in table] == ["FAIL", "COMPLETE"], table
    attrs = table[0][3]
    assert attrs["failure_kind"] == "hang" and attrs["failure_rank"] == rank, attrs
    assert f"rank(s) [{rank}] made no progress" in attrs["failure_message"], attrs
    hang_at = results[rank]["hang_at"]
    for result in results:
        left = dict(result["started"])[1] - hang_at
        assert HANG_TIMEOUT <= left < HANG_TIMEOUT + BOUND, f"left the hung trial {left:.1f}s after the hang"
        (number, lr, losses), = result["trials"]
        assert number == 1 and lr == table[1][2]["lr"]
        assert losses == pytest.approx(fault_search.reference(lr, len(results)), rel=1e-5, abs=1e-6)


def uninterruptible_hang(marks_file: str) -> dict:
    return _hanging_search({"rank": 1, "how": "read"}, marks_file)


def test_a_rank_hanging_where_python_cannot_interrupt_it_makes_every_rank_exit(tmp_path):
    from shardadopt import fence

    marks = tmp_path / "hang_at"
    procs = spawn(uninterruptible_hang, 2, tmp_path, marks_file=str(marks))
    exited = {}
    deadline = time.monotonic() + 240
    while len(exited) < 2 and time.monotonic() < deadline:
        for rank, proc in enumerate(procs):
            if rank not in exited and proc.poll() is not None:
                exited[rank] = (proc.returncode, time.time())
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = [(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2)]
    assert sorted(exited) == [0, 1], logs
    hang_at = float(marks.read_text())
    for rank, (code, at) in exited.items():
        assert code == fence.HANG_EXIT_CODE, (rank, code, logs[rank])
        assert at - hang_at < HANG_TIMEOUT + BOUND
    assert "could not be interrupted" in logs[0], logs[0]


# -- a hang inside a sharded checkpoint save -----------------------------------------------------------------------


def _hang_in_save(path: str, root: str, hanging: int, late_break: bool) -> dict:
    """In trial 0 (FSDP-sharded tiny qwen3): a complete checkpoint at step 1, one more step (the reference loss),
    then a save at step 2 in which ``os.fsync`` stops answering on rank ``hanging`` (a filesystem that blocks,
    inside DCP's writes) while the other rank goes on into DCP's closing collectives. Trial 1 resumes from the
    latest complete checkpoint. ``late_break``: the watchers' break of the groups comes only after DCP's
    collectives (what a loaded machine does now and then): DCP then gathers the hung rank's ``HangError`` and raises
    its ``CheckpointException``, a ``BaseException``, on every rank."""
    import optuna
    import torch
    import torch.distributed as dist

    import shardadopt
    from shardadopt import checkpoint
    from shardadopt.fence import breaking
    from shardadopt.hpo import ControlOptions, optimize
    from shardadopt.selftest import checkpoint as steps

    shardadopt.enable()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rank = dist.get_rank()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1)) if rank == 0 else None
    marks: dict = {}
    fsync, breaks = os.fsync, breaking.break_training_groups
    # Imports and the first load outside the search: under this test's 5 s hang timeout, one rank still importing
    # transformers on a loaded machine while the other trains is taken for hung (an import counts no progress); real
    # jobs keep the 900 s default.
    steps.build(path, FSDP)

    def blocked_fsync(fd: int) -> None:
        marks.setdefault("hang_at", time.time())
        time.sleep(10**6)

    def objective(trial):
        trial.suggest_float("lr", 0.01, 0.1)  # recorded; the model's optimizer has its own
        torch.manual_seed(0 if trial.number == 0 else 1)  # trial 1: the checkpoint's RNG state must win
        model, optimizer, scheduler = steps.build(path, FSDP)
        if trial.number == 1:
            marks["started"] = time.time()
            marks["published"] = sorted(n for n in os.listdir(root) if not n.startswith("."))
            latest = checkpoint.latest(root)
            if latest is None:  # trial 0 failed before its first save: the table says why
                raise RuntimeError(f"no complete checkpoint in {root}")
            marks["latest"] = os.path.basename(latest)
            checkpoint.load(latest, model, optimizer, scheduler)
            marks["resumed"] = steps.train_steps(model, optimizer, scheduler, FSDP, 1)
            return marks["resumed"][-1]
        steps.train_steps(model, optimizer, scheduler, FSDP, 1)
        checkpoint.save(f"{root}/step-1", model, optimizer, scheduler, step=1)
        marks["expected"] = steps.train_steps(model, optimizer, scheduler, FSDP, 1)
        if rank == hanging:
            os.fsync = blocked_fsync  # test instrumentation: this rank's filesystem stops answering
        if late_break:
            breaking.break_training_groups = lambda **_: 0  # test instrumentation: the watchers act late
        try:
            checkpoint.save(f"{root}/step-2", model, optimizer, scheduler, step=2)
        except BaseException as exc:
            marks["raised"] = type(exc).__name__
            raise
        finally:
            os.fsync, breaking.break_training_groups = fsync, breaks
        return marks["expected"][-1]

    optimize(study, objective, n_trials=2, catch=(RuntimeError,),
             control=ControlOptions(timeout=fault_search.CONTROL_TIMEOUT, hang_timeout=HANG_TIMEOUT))
    table = [(t.number, t.state.name, dict(t.user_attrs)) for t in study.trials] if study else None
    return {"table": table, **marks}


@pytest.mark.parametrize("hanging,late_break", [(1, False), (0, False), (1, True)])
def test_a_rank_hanging_in_a_sharded_save_fails_the_trial_once_and_loses_nothing(pool2, tiny_models, tmp_path,
                                                                                 hanging, late_break):
    results = pool2.run(_hang_in_save, tiny_models["qwen3"], str(tmp_path), hanging, late_break, timeout=300)
    table = results[0]["table"]
    assert [state for _, state, _ in table] == ["FAIL", "COMPLETE"], table
    attrs = table[0][2]
    assert attrs["failure_kind"] == "hang" and attrs["failure_rank"] == hanging, attrs
    assert f"rank(s) [{hanging}] made no progress" in attrs["failure_message"], attrs
    hang_at = results[hanging]["hang_at"]
    for rank, result in enumerate(results):
        assert result["raised"] == ("HangError" if rank == hanging else "PeerFailedError"), (rank, result["raised"])
        left = result["started"] - hang_at
        assert HANG_TIMEOUT <= left < HANG_TIMEOUT + BOUND, f"left the hung save {left:.1f}s after the hang"
        assert result["published"] == ["step-1"] and result["latest"] == "step-1", result
        assert result["resumed"] == result["expected"], "the checkpoint before the hung save resumes exactly"


# -- the scale benchmark ---------------------------------------------------------------------------------------------


def test_the_scale_benchmark_runs_and_counts_the_beats(tmp_path):
    """``benchmarks/fence_scale.py`` at its smallest (2 forked ranks, one run): every column measured, the fault and
    the hang within their bounds, and the steady store load what the monitor's beat rate says (one ``set`` per rank
    per tick of ``hang_timeout / 4``; none in a few seconds with the default 900 s, whose tick is 30 s)."""
    import json
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(repo, "benchmarks", "fence_scale.py")
    out = tmp_path / "scale.json"
    hang_timeout, world = 2.0, 2
    done = subprocess.run([sys.executable, script, "--ranks", str(world), "--repeats", "1", "--steady", "1",
                           "--hang-timeout", str(hang_timeout), "--capacity-seconds", "0.2", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())["table"][str(world)]
    tick = max(hang_timeout / 4, 0.25)
    assert 0 < row["out s"] < BOUND and 0 < row["next s"] < BOUND and 0 < row["rebuild s"] < BOUND, row
    assert hang_timeout <= row["hang s"] < hang_timeout + 4 * tick + BOUND, row
    assert row["req/s"] <= world, row  # at most one beat per rank in the window
    assert 0.5 * world / tick <= row["req/s hang"] <= 1.5 * world / tick, row


# -- the end of a trial: one decision for every rank -------------------------------------------------------------------


def _interrupted_close() -> dict:
    """Trial 0: rank 0 raises after a while; rank 1 returns and gets Ctrl-C while it waits in the end round (the
    control plane defers it past the round, so rank 1's close raises after the trial ended everywhere)."""
    import threading

    import optuna
    import torch.distributed as dist

    from shardadopt import fence
    from shardadopt.hpo import ControlOptions, optimize

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rank = dist.get_rank()
    study = optuna.create_study() if rank == 0 else None

    def objective(trial):
        trial.suggest_float("lr", 0.01, 0.1)
        if rank == 0:
            time.sleep(3)
            raise fault_search.InjectedFault("injected on rank 0")
        threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,)).start()
        return 1.0

    before = fence.generation()
    error = None
    # Ctrl-C raises KeyboardInterrupt, as in a terminal: a non-interactive shell starts background jobs (.ci/run runs
    # both sets' tests that way) with SIGINT ignored, and Python keeps it ignored
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        optimize(study, objective, n_trials=2, catch=(fault_search.InjectedFault,), control=ControlOptions(timeout=15))
    except BaseException as exc:  # noqa: BLE001
        error = type(exc).__name__
    finally:
        signal.signal(signal.SIGINT, ignored)
    return {"error": error, "rebuilt": fence.generation() - before}


def test_a_rank_whose_close_raises_still_rebuilds_with_the_others(pool2):
    results = pool2.run(_interrupted_close, timeout=120)
    assert results[1]["error"] == "KeyboardInterrupt", results
    assert results[0]["error"] == "PeerLostError", results  # rank 1 left the study; rank 0 is told within 15 s
    assert [r["rebuilt"] for r in results] == [1, 1], results
    after = pool2.run(fault_search.search, None, (), 1, timeout=120)  # the rebuilt world trains on both ranks
    assert [state for _, state, _, _ in after[0]["table"]] == ["COMPLETE"]


def trip_rebuild_trip() -> dict:
    """A fenced section that rank 1 fails at once, ``rebuild_world``, then a second section that rank 0 fails. Rank
    1's watcher thread starts late, while its main thread is in the rebuild with the default group destroyed. Counts
    the fence's own store connections (``records.connect``) and how many were open when each section began."""
    import threading

    import torch
    import torch.distributed as dist

    from shardadopt import fence
    from shardadopt.fence import records, watcher

    rank = dist.get_rank()
    watcher_errors: list[str] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: watcher_errors.append(f"{args.thread.name}: {args.exc_value!r}")
    errors, alive, opened = [], [], []
    connect = records.connect
    initialise = dist.init_process_group
    connections = {"started": 0, "open": 0}

    def counted_connect(*args):  # store connections of the fence's own (each one took seconds at 16+ ranks)
        connections["started"] += 1
        if rank == 1 and threading.current_thread().name == "shardadopt-fence watcher":
            time.sleep(0.3)  # test instrumentation: a slow watcher start (a loaded machine, many ranks)
        store = connect(*args)
        connections["open"] += 1
        return store

    records.connect = counted_connect
    if rank == 1:  # test instrumentation: a slow initialisation (a loaded machine, many ranks)
        dist.init_process_group = lambda *args, **kwargs: (time.sleep(1.0), initialise(*args, **kwargs))[1]
    try:
        for failing in (1, 0):
            try:
                with fence.fenced("a section"):
                    opened.append(connections["open"])  # the section starts once this process's are open
                    dist.all_reduce(torch.ones(2))
                    if rank == failing:
                        raise fault_search.InjectedFault(f"injected on rank {failing}")
                    dist.all_reduce(torch.ones(2))  # blocked: the failing rank never comes
            except (fault_search.InjectedFault, fence.PeerFailedError) as exc:
                errors.append(type(exc).__name__)
            fence.rebuild_world()
            time.sleep(0.5)  # the watcher's delayed start is over
            alive.append(watcher.WATCHER.thread.is_alive())
        total = torch.ones(2)
        dist.all_reduce(total)
    finally:
        threading.excepthook = hook
        records.connect = connect
        dist.init_process_group = initialise
    return {"errors": errors, "watcher_errors": watcher_errors, "alive": alive, "sum": total.tolist(),
            "opened": opened, "connections": connections["started"]}


def test_the_fence_watcher_survives_a_rebuild(tmp_path):
    ranks = launch(trip_rebuild_trip, 2, tmp_path, timeout=120)
    assert [r["returncode"] for r in ranks] == [0, 0], [r["error"] for r in ranks]
    results = [r["result"] for r in ranks]
    assert results[0]["errors"] == ["PeerFailedError", fault_search.InjectedFault.__name__], results
    assert results[1]["errors"] == [fault_search.InjectedFault.__name__, "PeerFailedError"], results
    assert [r["watcher_errors"] for r in results] == [[], []], results  # it never asks for the destroyed group
    assert [r["alive"] for r in results] == [[True, True]] * 2, results  # watching the rebuilt generation
    assert [r["sum"] for r in results] == [[2.0, 2.0]] * 2
    # two store connections per process (the watcher's, the hang monitors'), opened before the first section ran,
    # never again: not per section, not per rebuilt generation
    assert [(r["opened"], r["connections"]) for r in results] == [([2, 2], 2)] * 2, results


# -- a given control group; the control group's lifetime -----------------------------------------------------------


def _given_group() -> dict:
    import warnings

    import optuna
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize
    from shardadopt.hpo.channel import FenceOffWarning

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    group = dist.new_group(backend="gloo")
    study = optuna.create_study() if dist.get_rank() == 0 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimize(study, lambda trial: trial.suggest_float("x", 0, 1), n_trials=1, control=ControlOptions(group=group))
    dist.destroy_process_group(group)
    return [str(w.message) for w in caught if issubclass(w.category, FenceOffWarning)]


def test_a_given_control_group_warns_that_the_fence_is_off(pool2):
    for messages in pool2.run(_given_group, timeout=120):
        assert len(messages) == 1 and "without the fault fence" in messages[0], messages


def _control_group_freed(how: str) -> bool:
    """A search whose objective trains DDP, then the world destroyed and garbage collected: is the control group
    object gone? ``how``: "rebuild", ``fence.rebuild_world``; "exit", ``cleanexit.release_process_groups`` (what
    runs at a successful exit); "exit beside nccl", the same where the release leaves the default group alone, as it
    leaves an NCCL one. The destroyed world's Python object is held throughout, as torch holds it:
    ``torch.distributed.nn.functional``, imported when a DDP model is built, binds the world current at its import as
    default arguments; the control group must not live as long as that object."""
    import gc
    import weakref

    import optuna
    import torch.distributed as dist

    from shardadopt import fence
    from shardadopt.hpo import optimize
    from shardadopt.hpo.channel import control_group, control_groups, control_timeout
    from shardadopt.lifecycle import cleanexit

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study() if dist.get_rank() == 0 else None
    optimize(study, lambda trial: fault_search.ddp_losses(fault_search.suggest_lr(trial))[-1], n_trials=1)
    world = dist.group.WORLD  # noqa: F841  (held, as torch may hold it)
    group = weakref.ref(control_group(control_timeout()))
    assert group() in control_groups()
    if how == "rebuild":
        fence.rebuild_world()  # destroys every group, then a fresh world for the pool's next case
    else:
        if how == "exit beside nccl":  # test instrumentation: no NCCL on CPU; the default group reads as not gloo
            cleanexit._gloo_only = lambda group: False
        cleanexit.release_process_groups()
        assert dist.is_initialized() == (how == "exit beside nccl")
    gc.collect()
    assert control_groups() == []
    return group() is None


def test_the_control_group_is_freed_with_its_world(pool2):
    assert pool2.run(_control_group_freed, "rebuild", timeout=120) == [True, True]


@pytest.mark.parametrize("how", ["exit", "exit beside nccl"])
def test_the_release_at_exit_frees_the_control_group(tmp_path, how):
    ranks = launch(_control_group_freed, 2, tmp_path, timeout=120, how=how)
    assert [(r["returncode"], r["result"]) for r in ranks] == [(0, True)] * 2, [r["error"] for r in ranks]


def _stale_entries_name_the_control_sockets() -> dict:
    """A training listener published earlier in a generation closes and the kernel gives its port to a control-group
    socket: the store's list of training listeners still names that port, so a peer's break would take the control
    connection for a training one. Made certain here: every rank publishes each of its control sockets' own ends as
    training listeners. A break must leave the control group whole (the next control broadcast arrives); then a
    fresh world for the pool's next case."""
    import torch
    import torch.distributed as dist

    from shardadopt import fence
    from shardadopt.fence import breaking, records
    from shardadopt.hpo import channel

    group = channel.control_group(channel.control_timeout())
    kept = breaking.protection().inodes
    control = [s for s in breaking.own_tcp_sockets() if s.inode in kept and s.state != breaking.LISTEN]
    store = records.default_base_store()
    store.append(breaking._listeners_key(fence.generation()),
                 "".join(f"{breaking._HOST}/{s.address}:{s.port};" for s in control))
    dist.barrier()  # every rank's entries are in before any rank breaks
    fence.break_training_groups()
    value = torch.tensor([float(dist.get_rank() + 1)])
    group.broadcast(value, 1).wait()
    fence.rebuild_world()
    return {"control sockets": len(control), "broadcast": value.item()}


def test_stale_listener_entries_do_not_break_the_control_group(pool2):
    for result in pool2.run(_stale_entries_name_the_control_sockets, timeout=120):
        assert result["control sockets"] >= 1, result  # the pair (and nothing was mistaken for it)
        assert result["broadcast"] == 2.0, result  # rank 1's value arrived over the control group


def _meshes_freed() -> dict:
    """A mesh ``reuse_device_mesh`` cached (what a sharding ``from_pretrained`` does on transformers 5.18+), then
    ``rebuild_world``: is the old world's mesh gone, and does the same layout build afresh on the new world?"""
    import gc
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardadopt import fence, loadtime

    builds = []

    def build():
        builds.append(1)
        return None, init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))

    layout = {"fsdp_size": 2}
    _, mesh = loadtime.reuse_device_mesh(layout, build)
    reused = loadtime.reuse_device_mesh(layout, build)[1] is mesh
    old = weakref.ref(mesh)
    del mesh
    fence.rebuild_world()
    gc.collect()
    freed = old() is None
    _, new = loadtime.reuse_device_mesh(layout, build)
    total = torch.ones(1)
    dist.all_reduce(total, group=new.get_group())
    loadtime.forget_device_meshes()  # the pool's later tests build their own (transformers' dim names)
    return {"reused": reused, "freed": freed, "builds": len(builds), "sum": total.item()}


def test_a_rebuilt_world_drops_the_cached_device_meshes(pool2):
    for result in pool2.run(_meshes_freed, timeout=120):
        assert result == {"reused": True, "freed": True, "builds": 2, "sum": 2.0}, result


def _stale_mesh() -> dict:
    """A 2-D mesh kept across ``rebuild_world`` (a custom loop that forgot to build it again), and the same mesh
    built on the new world: do the new groups take the old ones' names, so that the stale mesh resolves to them?"""
    from torch.distributed.device_mesh import init_device_mesh

    from shardadopt import fence

    old = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    before = [group.group_name for group in old.get_all_groups()]
    fence.rebuild_world()
    new = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    after = [group.group_name for group in new.get_all_groups()]
    try:
        stale = old.get_group("tp")
    except Exception as exc:  # noqa: BLE001
        stale = f"{type(exc).__name__}: {exc}"
    return {"before": before, "after": after, "new group": stale is new.get_group("tp"), "stale": str(stale)}


def test_a_mesh_kept_across_a_rebuild_does_not_resolve_to_a_new_group(pool2):
    for result in pool2.run(_stale_mesh, timeout=120):
        # the world's group is the world again; every other name is new, so the stale one resolves to nothing
        assert result["before"][0] == result["after"][0] and not set(result["before"][1:]) & set(result["after"]), \
            result
        assert not result["new group"] and "Could not resolve" in result["stale"], result


# -- errors in transit ------------------------------------------------------------------------------------------------


def test_an_error_whose_class_a_peer_cannot_load_arrives_as_remote_error(tmp_path, monkeypatch):
    from shardadopt.hpo import errors

    (tmp_path / "only_on_the_raising_rank.py").write_text("class LocalFault(RuntimeError):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_on_the_raising_rank

    packed = errors.pack(only_on_the_raising_rank.LocalFault("disk full"), 1)
    monkeypatch.delitem(sys.modules, "only_on_the_raising_rank")
    (tmp_path / "only_on_the_raising_rank.py").unlink()
    received = errors.unpack(packed, 0)
    assert isinstance(received, errors.RemoteError) and received.type_name == "LocalFault"
    assert "disk full" in str(received) and received.shardadopt_rank == 1


def test_an_error_whose_str_raises_still_travels():
    from shardadopt.hpo import errors

    class Unprintable(RuntimeError):
        def __str__(self):
            raise ValueError("no text")

    packed = errors.pack(Unprintable(), 0)
    assert packed.summary == "Unprintable"


def test_reading_the_sockets_leaves_their_blocking_mode_alone_under_a_default_timeout():
    """The fence reads its TCP sockets through duplicates of their fds; a Python socket built while
    ``socket.setdefaulttimeout`` is set would switch the shared file to non-blocking under gloo and the store."""
    import fcntl
    import socket

    from shardadopt.fence import breaking

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    previous = socket.getdefaulttimeout()
    modes = {sock: fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) for sock in (server, client, accepted)}
    try:
        socket.setdefaulttimeout(5.0)
        ports = {s.port for s in breaking.own_tcp_sockets()}
        assert {server.getsockname()[1], client.getsockname()[1]} <= ports, ports
        assert {sock: fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) for sock in modes} == modes
    finally:
        socket.setdefaulttimeout(previous)
        for sock in (accepted, client, server):
            sock.close()
