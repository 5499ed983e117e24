"""An Optuna search restarted by ``torchrun --max-restarts``: the study goes on where the dead attempt left it.

One torchrun job (``shardadopt/testing/torchrun_hpo_worker.py``, 2 ranks, a tiny Qwen3 sharded while loading, a
sqlite study) runs ``shardadopt.hpo.optimize`` (3 trials) and then ``Trainer.hyperparameter_search`` (2 trials);
in each, rank 1 SIGKILLs itself inside trial 1's third training step, so the job takes three attempts. Each search
must end with its number of finished trials, the killed trial failed as a transient failure and retried once (never
running at once with its retry), the retry resuming from the killed trial's last complete checkpoint, and every
finished trial's value equal to its parameters run uninterrupted (the same ranks run them again at the end). The
bookkeeping itself (``shardadopt.hpo.restart.resume_search``) is checked attempt by attempt on an in-memory study.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

import shardadopt.testing
from shardadopt import upstream
from shardadopt.hpo.failures import ATTR_KIND, ATTR_RETRY_OF, COMM_ERROR, PREEMPTED, TRANSIENT
from shardadopt.hpo.restart import ATTR_ATTEMPT, ATTR_JOB, resume_search
from shardadopt.lifecycle.restarts import Attempt

WORKER = Path(shardadopt.testing.__file__).with_name("torchrun_hpo_worker.py")
TIMEOUT = 900  # seconds for the job's three attempts (under 2 minutes on 2 idle cores)
N_TRIALS = {"optimize": 3, "trainer": 2}  # the worker's budgets
KILL_TRIAL, SAVE_EVERY = 1, 2  # the worker kills in trial 1's third step; its checkpoints come every 2 steps


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiproc
def test_searches_restarted_by_torchrun_retry_the_killed_trial_and_end_as_uninterrupted(tiny_models, tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "--max-restarts", "2", str(WORKER), "--model", tiny_models["qwen3"],
               "--work", str(tmp_path), "--storage", f"sqlite:///{tmp_path}/hpo.db", "--study", "restarted"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    tables = json.loads((tmp_path / "hpo.json").read_text())
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    for search, n_trials in N_TRIALS.items():
        assert (tmp_path / f"killed-{search}").exists(), f"rank 1 did not kill itself in the {search} search"
        trials = tables[f"restarted-{search}"]
        states = [t["state"] for t in trials]
        assert states.count("COMPLETE") == n_trials and states.count("FAIL") == 1 and len(states) == n_trials + 1, \
            (search, states)
        killed = trials[KILL_TRIAL]
        assert killed["state"] == "FAIL" and killed["attrs"][ATTR_KIND] in TRANSIENT, (search, killed)
        (retry,) = [t for t in trials if t["attrs"].get(ATTR_RETRY_OF) == KILL_TRIAL]
        assert retry["state"] == "COMPLETE" and retry["params"] == killed["params"]
        assert retry["start"] >= killed["complete"], "the retry ran while the killed trial was still running"
        assert retry["attrs"][ATTR_ATTEMPT] > killed["attrs"][ATTR_ATTEMPT]
        assert retry["attrs"]["resume_from"] == killed["attrs"]["checkpoint_dir"]
        first_steps = {s["trial"]: s["step"] for s in starts if s["search"] == f"restarted-{search}"}
        assert first_steps[retry["number"]] == SAVE_EVERY, "the retry did not resume from the last complete checkpoint"
        # every finished trial ends with the value of its parameters run uninterrupted
        reference = {json.dumps(t["params"], sort_keys=True): t["value"]
                     for t in tables[f"restarted-{search}-reference"]}
        assert len(reference) == n_trials
        for trial in trials:
            if trial["state"] == "COMPLETE":
                assert trial["value"] == reference[json.dumps(trial["params"], sort_keys=True)], (search, trial)


def _add(study: optuna.Study, state: TrialState, lr: float, job: str, attempt: int | None, **attrs) -> int:
    attrs.update({ATTR_JOB: job} if attempt is None else {ATTR_JOB: job, ATTR_ATTEMPT: attempt})
    study.add_trial(create_trial(state=state, params={"lr": lr}, distributions={"lr": FloatDistribution(0, 1)},
                                 value=0.5 if state == TrialState.COMPLETE else None, user_attrs=attrs))
    return study.trials[-1].number


def _run(study: optuna.Study, number: int, attempt: int, state: TrialState) -> None:
    """The waiting trial ``number`` taken by ``attempt`` and left in ``state`` (a zombie when RUNNING)."""
    storage, trial_id = upstream.study_storage(study), upstream.trial_id(study.trials[number])
    storage.set_trial_state_values(trial_id, TrialState.RUNNING)
    storage.set_trial_user_attr(trial_id, ATTR_ATTEMPT, attempt)
    if state != TrialState.RUNNING:
        storage.set_trial_state_values(trial_id, state, [0.5] if state == TrialState.COMPLETE else None)


def test_resume_search_fails_dead_trials_retries_each_once_and_counts_the_budget():
    study = optuna.create_study()
    job = "job-a"
    _add(study, TrialState.COMPLETE, 0.1, job, 1)
    _add(study, TrialState.FAIL, 0.2, job, 1, **{ATTR_KIND: COMM_ERROR, "checkpoint_dir": "trial-1-x"})
    other = _add(study, TrialState.RUNNING, 0.3, "job-b", 1)  # another job's live trial: never touched

    assert resume_search(study, Attempt(1, job)).retried == {}  # a first attempt settles nothing
    second = resume_search(study, Attempt(2, job))
    assert second.retried == {1: 3} and second.interrupted == [] and second.done == 1
    retry = study.trials[3]
    assert retry.state == TrialState.WAITING and retry.system_attrs["fixed_params"] == {"lr": 0.2}
    assert retry.user_attrs[ATTR_RETRY_OF] == 1 and retry.user_attrs["resume_from"] == "trial-1-x"
    assert study.trials[other].state == TrialState.RUNNING

    _run(study, 3, 2, TrialState.COMPLETE)  # attempt 2 runs the retry, then dies in a new trial (rank 0 too)
    _add(study, TrialState.RUNNING, 0.4, job, 2)
    third = resume_search(study, Attempt(3, job))
    assert third.interrupted == [4] and third.retried == {4: 5} and third.done == 2, third
    assert study.trials[4].state == TrialState.FAIL and study.trials[4].user_attrs[ATTR_KIND] == PREEMPTED
    fourth = resume_search(study, Attempt(4, job))  # attempt 3 died before its first trial: nothing twice
    assert fourth.retried == {} and fourth.done == 2 and set(fourth.skipped) == {1, 4}, fourth

    _run(study, 5, 4, TrialState.RUNNING)  # the retry dies too: failed, never retried again
    fifth = resume_search(study, Attempt(5, job))
    assert fifth.interrupted == [5] and fifth.retried == {} and fifth.done == 3, fifth
    assert "already a retry" in fifth.skipped[5]
    assert study.trials[other].state == TrialState.RUNNING
