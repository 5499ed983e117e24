"""Several torchrun jobs on one durable study: shared trials, a killed job's trial retried and resumed, failure
kinds that are never retried, space versions, bad storage. Each job is a RankPool(2) (its own process group);
the jobs meet only through the storage (PostgreSQL, or one journal file)."""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings

import optuna
import pytest
from optuna.trial import TrialState

from shardadopt.hpo.durability import requeue
from shardadopt.hpo.failures import ATTR_KIND, ATTR_RETRY_OF
from shardadopt.hpo.storage import resolve_storage
from shardadopt.testing import RankPool
from shardadopt.testing.services import POSTGRES_URL, needs_postgres

POSTGRES = POSTGRES_URL
STEPS = 3
HEARTBEAT = 0.3  # seconds between heartbeats of a running trial
GRACE = 2.0  # seconds without a heartbeat before requeue calls a trial dead

optuna.logging.set_verbosity(optuna.logging.WARNING)




# -- what every rank of a job runs ---------------------------------------------------------------------------------

def _job(storage: str, study_name: str, n_trials: int, *, seed: int = 0, root: str | None = None,
         die_in_trial: int | None = None, misbehave: bool = False, space_version: str = "v1",
         allow_space_mismatch: bool = False, meet: str | None = None) -> dict:
    """Attach to the study and run ``n_trials``; returns what this rank saw and the error it ended with.

    ``root``: checkpoint every step under ``trial_checkpoint_dir(trial, root)`` and resume from
    ``resume_checkpoint(trial, root)``. ``die_in_trial``: in this job's n-th trial, after two complete
    checkpoints, both ranks SIGKILL themselves half way through the third save. ``misbehave``: this job's trials
    0/1/2 return NaN / raise InvalidConfigError while sampling / get SIGTERM on rank 0. ``meet``: a folder where
    two jobs' trials wait for each other after their first checkpoint (both alive at once).
    """
    import signal

    import torch
    import torch.distributed as dist

    from shardadopt import checkpoint
    from shardadopt.hpo import (
        ControlOptions,
        DurabilityOptions,
        InvalidConfigError,
        StudySpec,
        optimize,
        resume_checkpoint,
        trial_checkpoint_dir,
    )
    from shardadopt.hpo.storage import default_sampler

    rank = dist.get_rank()
    seen: list = []  # [trial number, params, steps reported]
    started = [0]  # this job's trials so far

    def objective(trial):
        index, started[0] = started[0], started[0] + 1
        x = trial.suggest_float("x", -1.0, 1.0)
        y = trial.suggest_int("y", 0, 10_000)
        if misbehave and index == 1:
            raise InvalidConfigError(f"y={y} does not fit the model")
        seen.append([trial.number, trial.params, []])
        start = 0
        directory = trial_checkpoint_dir(trial, root) if root else None
        if directory and (last := resume_checkpoint(trial, root)) is not None:
            start = checkpoint.read_info(last).step + 1
        value = float("nan")
        for step in range(start, STEPS):
            t = torch.tensor([(x - 0.2) ** 2 + y * 1e-6 + 0.1 * step])
            dist.all_reduce(t)  # a collective on the training group, as a real step would be
            value = t.item() / dist.get_world_size()
            trial.report(value, step)
            seen[-1][2].append(step)
            if misbehave and index == 2 and step == 1 and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler preempts this job
            if directory:
                with checkpoint.staged(os.path.join(directory, f"step-{step}"), step=step) as stage:
                    if rank == 0:
                        torch.save({"x": x, "step": step}, os.path.join(stage, "state.pt"))
                    if die_in_trial == index and step == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                if meet and step == start:
                    _meet(meet, trial.number)
        return float("nan") if misbehave and index == 0 else value

    error = None
    try:
        optimize(StudySpec(storage=storage, study_name=study_name, sampler=default_sampler(seed=seed)), objective,
                 n_trials=n_trials, catch=(ArithmeticError, ValueError),
                 durability=DurabilityOptions(space_version=space_version, allow_space_mismatch=allow_space_mismatch,
                                              heartbeat_interval=HEARTBEAT, data_snapshot="snap-1"),
                 control=ControlOptions(timeout=30))
    except BaseException as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    return {"seen": seen, "error": error}


def _meet(folder: str, number: int, peers: int = 2, timeout: float = 60.0) -> None:
    """Both ranks: announce this trial in ``folder`` and wait until ``peers`` trials are there."""
    import torch.distributed as dist

    os.makedirs(folder, exist_ok=True)
    if dist.get_rank() == 0:
        open(os.path.join(folder, str(number)), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) < peers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"trial {number}: the other trial never came ({os.listdir(folder)})")
        time.sleep(0.05)


# -- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jobs():
    """Two independent 2-rank jobs (two process groups)."""
    with RankPool(2) as a, RankPool(2) as b:
        yield a, b


@pytest.fixture(params=["journal", pytest.param("postgres", marks=needs_postgres)])
def shared(request, tmp_path):
    """(storage URL, study name) of a fresh study; deleted afterwards."""
    name = f"multijob-{uuid.uuid4().hex[:10]}"
    url = f"journal://{tmp_path}/study.log" if request.param == "journal" else POSTGRES
    yield url, name
    try:
        optuna.delete_study(study_name=name, storage=resolve_storage(url, heartbeat_interval=None))
    except KeyError:  # never created (the test refused to attach)
        pass


def _load(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=resolve_storage(url, heartbeat_interval=None))


def _concurrently(*calls):
    """Run ``pool.run(fn, *args, **kwargs)`` calls from threads at once; their results in order."""
    results: list = [None] * len(calls)

    def run(i, pool, fn, args, kwargs):
        try:
            results[i] = pool.run(fn, *args, timeout=120, **kwargs)
        except BaseException as exc:  # reported below, in the test's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, *call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads), "a job did not finish"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _in_step(job: list[dict]) -> list:
    """Both ranks of a job ran the same trials, parameters and steps; rank 0's view."""
    assert job[0]["seen"] == job[1]["seen"] and job[0]["error"] == job[1]["error"], job
    return job[0]["seen"]


# -- tests ---------------------------------------------------------------------------------------------------------

def test_two_jobs_share_one_study(jobs, shared):
    url, name = shared
    n = 4
    job_a, job_b = _concurrently((jobs[0], _job, (url, name, n), {"seed": 1}),
                                 (jobs[1], _job, (url, name, n), {"seed": 2}))
    seen_a, seen_b = _in_step(job_a), _in_step(job_b)
    assert job_a[0]["error"] is None and job_b[0]["error"] is None, (job_a[0], job_b[0])
    numbers_a, numbers_b = [s[0] for s in seen_a], [s[0] for s in seen_b]
    assert len(numbers_a) == n and len(numbers_b) == n
    assert sorted(numbers_a + numbers_b) == list(range(2 * n)), (numbers_a, numbers_b)  # each trial once

    trials = _load(url, name).get_trials()
    assert len(trials) == 2 * n and all(t.state == TrialState.COMPLETE for t in trials)
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(params)) == len(params), params  # no duplicate suggestions across the jobs
    by_number = {s[0]: s for s in seen_a + seen_b}
    for t in trials:
        assert t.params == by_number[t.number][1] and by_number[t.number][2] == list(range(STEPS))
        attrs = t.user_attrs
        assert attrs["space_version"] == "v1" and attrs["world_size"] == 2 and attrs["data_snapshot"] == "snap-1"
        assert attrs["versions"]["optuna"] == optuna.__version__ and "git_sha" in attrs
        assert attrs["params_hash"] and attrs["heartbeat"] > 0 and attrs["pid"] > 0


@needs_postgres
def test_killed_job_is_requeued_once_and_the_retry_resumes_beside_a_fresh_trial_with_equal_params(jobs, tmp_path):
    """A job dies mid-trial; requeue enqueues its retry, and a fresh trial with the same parameters is enqueued
    too. Two jobs run both at once: each live trial writes into its own directory, the retry resumes from the
    dead trial's last complete checkpoint, the fresh one starts from scratch, the dead trial's files stay as
    they were."""
    from shardadopt.hpo.durability import ATTR_CHECKPOINT_DIR, ATTR_RESUME_FROM

    name = f"multijob-kill-{uuid.uuid4().hex[:10]}"
    root = str(tmp_path / "ckpt")
    try:
        with RankPool(2) as doomed:
            with pytest.raises(Exception, match="died of SIGKILL"):  # both ranks SIGKILLed themselves
                doomed.run(_job, POSTGRES, name, 1, root=root, die_in_trial=0, timeout=60)
        study = _load(POSTGRES, name)
        (dead,) = study.get_trials()
        assert dead.state == TrialState.RUNNING  # a zombie until someone notices
        dead_dir = os.path.join(root, dead.user_attrs[ATTR_CHECKPOINT_DIR])
        dead_files = sorted(os.listdir(dead_dir))
        assert "step-0" in dead_files and "step-1" in dead_files and "step-2" not in dead_files
        assert any(n.startswith(".") or n.endswith(".partial") for n in dead_files), dead_files  # interrupted save

        deadline = time.monotonic() + 30
        report = requeue(study, grace_period=GRACE)
        while not report.failed_stale and time.monotonic() < deadline:  # heartbeats stopped with the job
            time.sleep(0.5)
            report = requeue(study, grace_period=GRACE)
        assert report.failed_stale == [dead.number] and list(report.retried) == [dead.number], report.as_dict()
        failed = study.get_trials()[dead.number]
        assert failed.state == TrialState.FAIL and failed.user_attrs[ATTR_KIND] == "preempted"
        again = requeue(study, grace_period=GRACE)
        assert not again.failed_stale and not again.retried, again.as_dict()  # idempotent
        study.enqueue_trial(dead.params)  # a fresh trial that happens to have the same parameters

        meet = str(tmp_path / "meet")
        job_a, job_b = _concurrently((jobs[0], _job, (POSTGRES, name, 1), {"root": root, "meet": meet}),
                                     (jobs[1], _job, (POSTGRES, name, 1), {"root": root, "meet": meet}))
        runs = {number: steps for number, _, steps in _in_step(job_a) + _in_step(job_b)}
        retry_number = report.retried[dead.number]
        (fresh_number,) = set(runs) - {retry_number}
        assert runs == {retry_number: [2], fresh_number: [0, 1, 2]}, runs  # the retry resumed after step 1
        trials = study.get_trials()
        retry, fresh = trials[retry_number], trials[fresh_number]
        assert retry.state == fresh.state == TrialState.COMPLETE and retry.params == fresh.params == dead.params
        assert retry.user_attrs[ATTR_RETRY_OF] == dead.number and ATTR_RETRY_OF not in fresh.user_attrs
        assert retry.user_attrs[ATTR_RESUME_FROM] == dead.user_attrs[ATTR_CHECKPOINT_DIR]
        dirs = [t.user_attrs[ATTR_CHECKPOINT_DIR] for t in (dead, retry, fresh)]
        assert len(set(dirs)) == 3, dirs
        assert sorted(os.listdir(dead_dir)) == dead_files
        assert sorted(os.listdir(os.path.join(root, dirs[1]))) == ["step-2"]
        assert sorted(os.listdir(os.path.join(root, dirs[2]))) == ["step-0", "step-1", "step-2"]
        assert not requeue(study, grace_period=GRACE).retried
    finally:
        try:
            optuna.delete_study(study_name=name, storage=resolve_storage(POSTGRES, heartbeat_interval=None))
        except KeyError:
            pass


def test_failure_kinds_and_which_are_retried(jobs, tmp_path):
    url, name = f"journal://{tmp_path}/study.log", "kinds"
    job = jobs[0].run(_job, url, name, 5, misbehave=True, timeout=60)
    seen = _in_step(job)
    # trial 2 got SIGTERM at step 1: it ends as preempted on every rank, and the study stops there
    assert job[0]["error"]["type"] == "PreemptedError", job[0]
    assert [s[2] for s in seen] == [[0, 1, 2], [0, 1]]  # trial 1 never trained (its config was refused)
    study = _load(url, name)
    kinds = {t.number: (t.state.name, t.user_attrs.get(ATTR_KIND)) for t in study.get_trials()}
    assert kinds == {0: ("FAIL", "nan_loss"), 1: ("FAIL", "config_error"), 2: ("FAIL", "preempted")}, kinds
    report = requeue(study, grace_period=GRACE)
    assert list(report.retried) == [2] and set(report.skipped) == {0, 1}, report.as_dict()
    assert not requeue(study, grace_period=GRACE).retried


def test_space_version_mismatch_is_refused(jobs, tmp_path):
    url, name = f"journal://{tmp_path}/study.log", "versions"
    first = jobs[0].run(_job, url, name, 1, timeout=60)
    assert first[0]["error"] is None and len(_in_step(first)) == 1
    refused = jobs[0].run(_job, url, name, 1, space_version="v2", timeout=60)
    assert _in_step(refused) == [] and refused[0]["error"]["type"] == "SpaceVersionMismatch"
    assert "'v1'" in refused[0]["error"]["message"] and "allow_space_mismatch" in refused[0]["error"]["message"]
    mixed = jobs[0].run(_job, url, name, 1, space_version="v2", allow_space_mismatch=True, timeout=60)
    assert mixed[0]["error"] is None and len(_in_step(mixed)) == 1


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:1/nowhere", "nosuchdb://host/x"])
def test_bad_storage_fails_every_rank_before_training(jobs, url):
    job = jobs[1].run(_job, url, "never", 2, timeout=60)
    for rank in job:
        assert rank["seen"] == [] and rank["error"]["type"] == "StorageError", rank


def test_concurrency_warning_counts_running_trials(tmp_path):
    from shardadopt.hpo import ConcurrencyWarning, attach_study

    url = f"journal://{tmp_path}/study.log"
    study = attach_study(url, study_name="busy")
    for _ in range(3):
        study.ask()  # three workers elsewhere are running trials
    with pytest.warns(ConcurrencyWarning, match="4 concurrent trials"):
        attach_study(url, study_name="busy", n_trials=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConcurrencyWarning)
        attach_study(url, study_name="busy", n_trials=100)


def test_trainer_retry_resumes_from_the_last_complete_checkpoint_only(tmp_path):
    from shardadopt.checkpoint import MARKER
    from shardadopt.hpo.trainer_backend import last_complete_checkpoint

    run = tmp_path / "run-abc"
    assert last_complete_checkpoint(str(run)) is None
    (run / "checkpoint-10").mkdir(parents=True)
    (run / "checkpoint-10" / "trainer_state.json").write_text("{}")  # upstream's, written last: complete
    (run / "checkpoint-20").mkdir()  # upstream's, interrupted before trainer_state.json
    (run / "checkpoint-30" / "state").mkdir(parents=True)  # shardadopt's, no completion marker
    assert last_complete_checkpoint(str(run)) == str(run / "checkpoint-10")
    (run / "checkpoint-30" / MARKER).write_text("{}")
    assert last_complete_checkpoint(str(run)) == str(run / "checkpoint-30")
