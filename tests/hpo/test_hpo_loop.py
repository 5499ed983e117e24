"""``shardadopt.hpo.optimize`` + ``DistributedTrial`` in a hand-written loop, on 2 and 4 gloo ranks.

Every test runs a study whose objective does a real collective per step on the default group (the "training"),
so a rank that left the trial early would block the others; the pool's timeout turns that into a failure. Trial
states and parameters are compared with a single-process study on the same sampler seed, computed here.
"""

from __future__ import annotations

import time

import optuna
import pytest

pytestmark = pytest.mark.multiproc

STEPS = 4
N_TRIALS = 8


def _study(directions=None):
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    kwargs = {"directions": directions} if directions else {}
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3),
                               pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0), **kwargs)


def _curve(x: float, step: int) -> float:
    return (x - 0.3) ** 2 * (step + 1)


def _train_step(value: float) -> float:
    """A collective on the default (training) group: every rank must be here for any rank to go on."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _objective(seen: list, fail: dict | None = None, interrupt_trial: int | None = None, sleep: float = 0.0,
               skip_report: dict | None = None):
    """The objective every rank runs; ``seen`` collects (number, params, last step reached) on this rank."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        seen.append([trial.number, trial.params, -1])
        for step in range(STEPS):
            value = _train_step(_curve(x, step))
            time.sleep(sleep)
            seen[-1][2] = step
            if fail and fail["rank"] == rank and fail["trial"] == trial.number and step == 1:
                raise fail["type"](f"injected on rank {rank} in trial {trial.number}")
            if interrupt_trial == trial.number and rank == 0 and step == 1:
                raise KeyboardInterrupt
            if skip_report and skip_report["rank"] == rank and skip_report["trial"] == trial.number:
                return value  # a rank that leaves the trial on its own
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    return objective


def _states(study) -> list:
    return [[t.number, t.state.name, t.params] for t in study.trials]


def _run(n_trials=N_TRIALS, catch=(), timeout=None, **objective_kwargs):
    """On every rank: run the study, return (rank 0's trial table or None, what this rank saw, error info)."""
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize

    study = _study() if dist.get_rank() == 0 else None
    seen: list = []
    error = None
    start = time.monotonic()
    try:
        optimize(study, _objective(seen, **objective_kwargs), n_trials=n_trials, timeout=timeout, catch=catch,
                 control=ControlOptions(timeout=30))
    except BaseException as exc:  # KeyboardInterrupt included: the test checks every rank raised the same
        error = {"type": type(exc).__name__, "message": str(exc), "origin": getattr(exc, "shardadopt_rank", None)}
    table = None
    if study is not None:
        table = [[t.number, t.state.name, t.params, t.user_attrs, len(t.intermediate_values)] for t in study.trials]
    return {"table": table, "seen": seen, "error": error, "seconds": time.monotonic() - start}


def _reference(n_trials=N_TRIALS, fail_trial: int | None = None) -> list:
    """The same study in one process, with plain optuna (the rank-1 failure becomes a plain failure)."""
    study = _study()

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        for step in range(STEPS):
            if trial.number == fail_trial and step == 1:
                raise ValueError("reference failure")
            trial.report(_curve(x, step), step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return _curve(x, STEPS - 1)

    study.optimize(objective, n_trials=n_trials, catch=(ValueError,))
    return _states(study)


def _assert_in_step(results: list, failed: dict | None = None) -> None:
    """Every rank ran the same trials with the same parameters and left each at the same step. In the trial where
    ``failed["rank"]`` raised (after its step's collective returned on that rank), a peer may be one step behind: it
    was still finishing that collective when the fence broke it, which is where the fence promises to stop it."""
    first = results[failed["rank"]]["seen"] if failed else results[0]["seen"]
    for rank, result in enumerate(results):
        seen = result["seen"]
        assert [trial[:2] for trial in seen] == [trial[:2] for trial in first], f"rank {rank} saw {seen}, not {first}"
        for (number, _, step), (_, _, want) in zip(seen, first):
            allowed = {want - 1, want} if failed and number == failed["trial"] else {want}
            assert step in allowed, f"rank {rank} left trial {number} at step {step}, not {sorted(allowed)}: {seen}"


def test_pruning_matches_single_process_study(pool2):
    results = pool2.run(_run, timeout=120)
    assert all(r["error"] is None for r in results), results
    _assert_in_step(results)
    table = results[0]["table"]
    assert [row[:3] for row in table] == _reference()
    assert sum(row[1] == "PRUNED" for row in table) >= 1, table
    # every rank left each trial at the step optuna recorded last for it
    for (number, _, _, _, reported), (seen_number, _, last_step) in zip(table, results[0]["seen"]):
        assert seen_number == number and reported == last_step + 1


def test_error_on_one_rank_fails_the_trial_and_study_goes_on_when_caught(pool2):
    results = pool2.run(_run, catch=(ValueError,), fail={"rank": 1, "trial": 2, "type": ValueError}, timeout=120)
    assert all(r["error"] is None for r in results), results
    _assert_in_step(results, failed={"rank": 1, "trial": 2, "type": ValueError})
    table = results[0]["table"]
    assert [row[:3] for row in table] == _reference(fail_trial=2)
    failed = table[2]
    assert failed[1] == "FAIL"
    assert failed[3]["failure_rank"] == 1 and "injected on rank 1 in trial 2" in failed[3]["failure_message"]
    assert failed[3]["failure_kind"] == "error"


def test_error_on_one_rank_not_caught_raises_on_every_rank(pool2):
    results = pool2.run(_run, catch=(KeyError,), fail={"rank": 1, "trial": 2, "type": ValueError}, timeout=120)
    _assert_in_step(results, failed={"rank": 1, "trial": 2, "type": ValueError})
    assert [r["error"]["type"] for r in results] == ["ValueError", "ValueError"]
    assert all("injected on rank 1 in trial 2" in r["error"]["message"] for r in results)
    assert results[0]["error"]["origin"] == 1, "rank 0's copy names the rank the error came from"
    assert results[1]["error"]["origin"] is None, "rank 1 re-raises its own exception object"
    assert [row[1] for row in results[0]["table"]][-1] == "FAIL" and len(results[0]["table"]) == 3


def test_timeout_mid_trial_ends_every_rank_after_that_trial(pool2):
    # each trial takes >= 4 x 0.15 s; the timeout expires during trial 1 (or 2 on a slow machine, or during trial 0
    # on a loaded one, whose trial then ends the study) (the pool's own keyword is `timeout`: the study's goes
    # positionally)
    results = pool2.run(_run, None, (), 0.9, sleep=0.15, timeout=120)
    assert all(r["error"] is None for r in results), results
    _assert_in_step(results)
    table = results[0]["table"]
    assert 1 <= len(table) <= 4, table
    assert all(row[1] in {"COMPLETE", "PRUNED"} for row in table)
    per_trial = results[0]["seconds"] / len(table)
    assert all(r["seconds"] < 0.9 + 2 * per_trial + 1.0 for r in results), (results[0]["seconds"], per_trial)


def test_keyboard_interrupt_on_rank0_stops_every_rank(pool2):
    results = pool2.run(_run, interrupt_trial=1, timeout=120)
    _assert_in_step(results)
    assert [r["error"]["type"] for r in results] == ["KeyboardInterrupt", "KeyboardInterrupt"]
    assert [row[1] for row in results[0]["table"]] == ["COMPLETE", "FAIL"]


def test_diverging_ranks_fail_the_trial_not_the_job(pool2):
    results = pool2.run(_run, catch=(RuntimeError,), skip_report={"rank": 1, "trial": 1}, timeout=120)
    assert all(r["error"] is None for r in results), results
    table = results[0]["table"]
    assert table[1][1] == "FAIL" and "different paths" in table[1][3]["failure_message"]
    assert len(table) == N_TRIALS


def _stop_and_multi_objective():
    import torch.distributed as dist

    from shardadopt.hpo import optimize

    rank = dist.get_rank()
    study = _study() if rank == 0 else None
    counts = []

    def objective(trial):
        counts.append(trial.number)
        _train_step(1.0)
        return trial.suggest_float("x", 0, 1)

    optimize(study, objective, n_trials=10, callbacks=[lambda s, t: t.number == 2 and s.stop()])
    stopped = (len(study.trials) if study else None, list(counts))

    multi = _study(directions=["minimize", "maximize"]) if rank == 0 else None
    multi_seen = []

    def two(trial):
        x = trial.suggest_float("x", 0, 1)
        multi_seen.append((trial.number, trial.multi_objective))
        return _train_step(x), _train_step(1 - x)

    optimize(multi, two, n_trials=3)
    multi_states = [t.state.name for t in multi.trials] if multi else None

    try:
        optimize(study, objective, n_trials=2, n_jobs=2)
        n_jobs_error = None
    except ValueError as exc:
        n_jobs_error = str(exc)
    try:  # the keyword arguments that moved into option objects name their new home
        optimize(study, objective, n_trials=2, control_timeout=30, storage="journal:///x.log")
        moved_error = None
    except TypeError as exc:
        moved_error = str(exc)
    return stopped, multi_seen, multi_states, n_jobs_error, moved_error


def test_study_stop_multi_objective_and_n_jobs(pool2):
    results = pool2.run(_stop_and_multi_objective, timeout=120)
    (total, counts), multi_seen, multi_states, n_jobs_error, moved_error = results[0]
    assert total == 3 and counts == [0, 1, 2]
    assert results[1][0][1] == [0, 1, 2], "the worker stopped with rank 0's study.stop()"
    assert multi_states == ["COMPLETE"] * 3
    assert results[1][1] == multi_seen == [(0, True), (1, True), (2, True)]
    assert all("n_jobs=2" in r[3] for r in results)
    assert "instead of control_timeout=, pass control=ControlOptions(timeout=...)" in moved_error
    assert "instead of storage=, pass StudySpec(storage=...) as the study" in moved_error
    assert all(r[4] == moved_error for r in results), "every rank raises it, before any collective"


def _standalone():
    """optuna-integration style: rank 0 drives study.optimize, the others loop; DistributedTrial as a context."""
    import torch.distributed as dist

    from shardadopt.hpo import DistributedTrial

    rank = dist.get_rank()
    log = []

    def objective(trial):
        with DistributedTrial(trial if rank == 0 else None, timeout=30) as t:
            lr = t.suggest_float("lr", 1e-4, 1e-1, log=True)
            try:
                t.suggest_int("bad", 5, 1)  # invalid on rank 0: every rank must get the same ValueError
            except ValueError as exc:
                log.append(("suggest error", type(exc).__name__, getattr(exc, "shardadopt_rank", None)))
            t.set_user_attr("rank0_value", rank * 10)
            log.append((t.number, t.params, t.user_attrs, t.distributions["lr"].log))
            return _train_step(lr)

    if rank == 0:
        study = _study()
        study.optimize(objective, n_trials=2)
        stored = [(t.number, t.params, t.user_attrs) for t in study.trials]
    else:
        for _ in range(2):
            objective(None)
        stored = None
    return log, stored


def test_standalone_distributed_trial_is_consistent(pool2):
    (log0, stored), (log1, _) = pool2.run(_standalone, timeout=60)
    assert [entry[:2] if entry[0] == "suggest error" else entry for entry in log0] == \
        [entry[:2] if entry[0] == "suggest error" else entry for entry in log1]
    assert log0[0] == ("suggest error", "ValueError", None) and log1[0] == ("suggest error", "ValueError", 0)
    assert [(n, p, a) for n, p, a, _ in (e for e in log0 if e[0] != "suggest error")] == stored
    assert stored[0][2] == {"rank0_value": 0}, "user attrs carry rank 0's value on every rank"


def _checkpoint_dir_on_some_ranks(root: str):
    """An objective that asks for its checkpoint directory on one rank only (rank 0 in trial 0, rank 1 in trial 1),
    then trains and reports on every rank, and resumes on rank 1 alone: none of it may be a collective."""
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize, resume_checkpoint, trial_checkpoint_dir

    rank = dist.get_rank()
    study = _study() if rank == 0 else None
    asked = {}

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        if rank == trial.number % 2:
            asked[trial.number] = trial_checkpoint_dir(trial, root)
        if rank == 1:
            assert resume_checkpoint(trial, root) is None
        value = _train_step(_curve(x, 0))
        trial.report(value, 0)
        return value

    optimize(study, objective, n_trials=2, control=ControlOptions(timeout=30))
    recorded = {t.number: t.user_attrs["checkpoint_dir"] for t in study.trials} if study else None
    return asked, recorded


def test_trial_checkpoint_dir_is_no_collective(pool2, tmp_path):
    (asked0, recorded), (asked1, _) = pool2.run(_checkpoint_dir_on_some_ranks, str(tmp_path), timeout=120)
    assert sorted(asked0) == [0] and sorted(asked1) == [1]
    asked = asked0 | asked1
    assert {number: str(tmp_path / name) for number, name in recorded.items()} == asked, (recorded, asked)
    assert len(set(asked.values())) == 2


def test_four_ranks_error_on_last_rank(pool4):
    results = pool4.run(_run, catch=(ValueError,), fail={"rank": 3, "trial": 2, "type": ValueError}, timeout=180)
    assert all(r["error"] is None for r in results), results
    _assert_in_step(results, failed={"rank": 3, "trial": 2, "type": ValueError})
    table = results[0]["table"]
    assert [row[:3] for row in table] == _reference(fail_trial=2)
    assert table[2][3]["failure_rank"] == 3


def _stuck(control_timeout: float):
    """Rank 1 stops answering (busy, not dead) in trial 1 while rank 0 waits for its report."""
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize

    rank = dist.get_rank()
    study = _study() if rank == 0 else None

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        if rank == 1 and trial.number == 1:
            time.sleep(2 * control_timeout + 1)  # past rank 0's timeout and its check-in wait
        trial.report(x, 0)
        return x

    start = time.monotonic()
    try:
        optimize(study, objective, n_trials=3, control=ControlOptions(timeout=control_timeout))
    except Exception as exc:
        from shardadopt.fence import watcher

        return {"type": type(exc).__name__, "message": str(exc), "ranks": getattr(exc, "ranks", None),
                "seconds": time.monotonic() - start, "armed": len(watcher.WATCHER.armed)}
    return None


def test_stuck_peer_becomes_an_error_naming_it():
    """Own processes: after a control timeout the process group is not reusable."""
    from shardadopt.testing import RankPool

    control_timeout = 3.0
    with RankPool(2) as pool:
        rank0, rank1 = pool.run(_stuck, control_timeout, timeout=120)
    assert rank0["type"] == "PeerLostError" and rank0["ranks"] == [1], rank0
    assert "rank(s) [1] did not reach control round" in rank0["message"] and "report()" in rank0["message"]
    assert rank0["seconds"] < control_timeout + 5 + 5, "the survivor leaves within the control timeout"
    assert rank1["type"] == "PeerLostError", "the stuck rank, once awake, raises too instead of hanging"
    # no trial fence is left armed (its hang monitor and its backstop would outlive the search)
    assert rank0["armed"] == rank1["armed"] == 0, (rank0, rank1)
