"""Durable studies: storage resolution, failure kinds, space versions, heartbeats, requeue and the hpo CLI."""

from __future__ import annotations

import json
import time
import uuid

import optuna
import pytest
from optuna.storages import RDBStorage
from optuna.storages.journal import JournalStorage
from optuna.trial import TrialState

from shardadopt import upstream
from shardadopt.cli import main
from shardadopt.hpo import failures
from shardadopt.hpo.durability import ATTR_HEARTBEAT, TrialHeartbeat, record_failure, requeue, stale_trials
from shardadopt.hpo.failures import ATTR_KIND, ATTR_RETRY_OF
from shardadopt.hpo.provenance import (
    SpaceVersionMismatch,
    check_space_version,
    params_hash,
    reproducibility_attrs,
    space_version,
)
from shardadopt.hpo.storage import StorageError, default_sampler, resolve_storage
from shardadopt.testing.services import POSTGRES_URL, needs_postgres

POSTGRES = POSTGRES_URL

optuna.logging.set_verbosity(optuna.logging.WARNING)




@pytest.fixture(params=["journal", pytest.param("postgres", marks=needs_postgres)])
def storage(request, tmp_path):
    if request.param == "journal":
        return resolve_storage(f"journal://{tmp_path}/study.log")
    return resolve_storage(POSTGRES, heartbeat_interval=1, grace_period=2)


@pytest.fixture
def study(storage):
    name = f"test-{uuid.uuid4().hex[:10]}"
    study = optuna.create_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    yield study
    optuna.delete_study(study_name=name, storage=storage)


# -- storage ------------------------------------------------------------------------------------------------------

def test_default_storage_is_a_journal_file_under_output_dir(tmp_path):
    storage = resolve_storage(None, output_dir=str(tmp_path / "run"))
    assert isinstance(storage, JournalStorage)
    optuna.create_study(study_name="s", storage=storage).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert (tmp_path / "run" / "optuna-journal.log").exists()
    # the study survives the process: a new storage object on the same file sees the trials
    reloaded = optuna.load_study(study_name="s", storage=resolve_storage(None, output_dir=str(tmp_path / "run")))
    assert len(reloaded.trials) == 2


def test_journal_path_forms(tmp_path):
    assert isinstance(resolve_storage(str(tmp_path / "a.log")), JournalStorage)
    assert isinstance(resolve_storage(f"journal://{tmp_path}/b.journal"), JournalStorage)


@needs_postgres
def test_postgres_url_gets_rdb_storage_with_heartbeats():
    storage = resolve_storage(POSTGRES, heartbeat_interval=7, grace_period=30)
    assert isinstance(storage, RDBStorage)
    assert storage.get_heartbeat_interval() == 7
    assert storage.engine.pool.size() == 2


@pytest.mark.parametrize("url, fragment", [
    ("ftp://somewhere/study", "unsupported storage"),
    ("postgresql://postgres@127.0.0.1:1/test", "cannot open the study database"),
    ("journal://", "has no file path"),
    ("journal:///no/such/directory/study.log", "does not exist"),
])
def test_bad_storage_urls_fail_clearly(url, fragment):
    with pytest.raises(StorageError, match=fragment):
        resolve_storage(url)


@needs_postgres
def test_wrong_database_name_fails_before_training():
    with pytest.raises(StorageError, match="check the host, port, database name"):
        resolve_storage("postgresql://postgres@127.0.0.1:5432/no_such_database_xyz")


def test_no_storage_and_no_output_dir_is_an_error():
    with pytest.raises(StorageError, match="no storage given"):
        resolve_storage(None)


def test_default_sampler_spells_out_parallel_settings():
    sampler = default_sampler(seed=3)
    assert isinstance(sampler, optuna.samplers.TPESampler)
    # upstream-private: TPESampler has no getters for its options
    assert sampler._constant_liar is True and sampler._multivariate is True


# -- failure kinds --------------------------------------------------------------------------------------------------

class DistBackendError(RuntimeError):
    """Same name as torch.distributed's, which is what classify() looks for."""


@pytest.mark.parametrize("exc, before, kind", [
    (failures.InvalidConfigError("lr < 0"), False, failures.CONFIG_ERROR),
    (ValueError("bad value for warmup"), True, failures.CONFIG_ERROR),
    (ValueError("shape mismatch in step 3"), False, failures.ERROR),
    (failures.NonFiniteLossError("nan"), False, failures.NAN_LOSS),
    (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), False, failures.OOM),
    (DistBackendError("NCCL communicator was aborted"), False, failures.COMM_ERROR),
    (RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"), False, failures.COMM_ERROR),
    (failures.PreemptedError("SIGTERM"), False, failures.PREEMPTED),
    (KeyError("x"), False, failures.ERROR),
])
def test_classify(exc, before, kind):
    assert failures.classify(exc, before_training=before) == kind


def test_check_finite():
    assert failures.check_finite(1.5) == 1.5
    for bad in (float("nan"), float("inf"), None):
        with pytest.raises(failures.NonFiniteLossError, match="diverged"):
            failures.check_finite(bad)


# -- space versions and provenance --------------------------------------------------------------------------------

def space_a(trial):
    return {"lr": trial.suggest_float("lr", 1e-5, 1e-1, log=True)}


def space_b(trial):
    return {"lr": trial.suggest_float("lr", 1e-6, 1e-1, log=True)}


def test_space_version_hashes_source_or_takes_explicit():
    assert space_version(space_a) == space_version(space_a)
    assert space_version(space_a) != space_version(space_b)
    assert space_version(space_a, explicit="v3") == "v3"
    with pytest.raises(ValueError, match="explicit space_version"):
        space_version(len)  # a builtin has no Python source


def test_space_version_mismatch_is_refused_unless_opted_in(study):
    check_space_version(study, "v1")
    check_space_version(study, "v1")  # same version attaches
    with pytest.raises(SpaceVersionMismatch, match="created with search-space version 'v1'.*'v2'"):
        check_space_version(study, "v2")
    check_space_version(study, "v2", allow_mismatch=True)


def test_params_hash_is_order_independent_and_value_sensitive():
    assert params_hash({"a": 1, "b": 0.5}) == params_hash({"b": 0.5, "a": 1})
    assert params_hash({"a": 1, "b": 0.5}) != params_hash({"a": 1, "b": 0.25})


def test_reproducibility_attrs():
    attrs = reproducibility_attrs(space="v1", world_size=4, topology="fsdp=2,tp=2", data_snapshot="ds-7")
    assert attrs["space_version"] == "v1" and attrs["world_size"] == 4 and attrs["data_snapshot"] == "ds-7"
    assert set(attrs["versions"]) >= {"torch", "transformers", "accelerate", "optuna", "python"}
    json.dumps(attrs)  # storable as a user attribute


# -- heartbeats and requeue -----------------------------------------------------------------------------------------

def _running(study, params, heartbeat_age=None):
    trial = study.ask()
    for name, value in params.items():
        trial.suggest_float(name, value, value) if isinstance(value, float) else trial.suggest_int(name, value, value)
    if heartbeat_age is not None:
        upstream.study_storage(study).set_trial_user_attr(upstream.trial_id(trial), ATTR_HEARTBEAT,
                                                          time.time() - heartbeat_age)
    return trial


def _failed(study, params, kind):
    trial = _running(study, params, heartbeat_age=0)
    record_failure(study, upstream.trial_id(trial), kind, f"simulated {kind}")
    return trial


def test_heartbeat_thread_refreshes_the_trial(study):
    trial = _running(study, {"x": 0.5})
    storage, trial_id = upstream.study_storage(study), upstream.trial_id(trial)
    with TrialHeartbeat(storage, trial_id, interval=0.2):
        first = storage.get_trial(trial_id).user_attrs[ATTR_HEARTBEAT]
        time.sleep(0.7)
        later = storage.get_trial(trial_id).user_attrs[ATTR_HEARTBEAT]
    assert later > first
    attrs = storage.get_trial(trial_id).user_attrs
    assert attrs["pid"] > 0 and attrs["host"]


def test_requeue_fails_stale_and_retries_transient_once(study):
    stale = _running(study, {"x": 0.1}, heartbeat_age=1000)
    fresh = _running(study, {"x": 0.2}, heartbeat_age=1)
    comm = _failed(study, {"x": 0.3}, failures.COMM_ERROR)
    nan = _failed(study, {"x": 0.4}, failures.NAN_LOSS)
    bad_config = _failed(study, {"x": 0.5}, failures.CONFIG_ERROR)
    oom = _failed(study, {"x": 0.6}, failures.OOM)

    report = requeue(study, grace_period=300)

    assert report.failed_stale == [stale.number]
    assert set(report.retried) == {stale.number, comm.number}
    assert set(report.skipped) == {nan.number, bad_config.number, oom.number}
    by_number = {t.number: t for t in study.get_trials()}
    assert by_number[stale.number].state == TrialState.FAIL
    assert by_number[stale.number].user_attrs[ATTR_KIND] == failures.PREEMPTED
    assert by_number[fresh.number].state == TrialState.RUNNING
    for old, new in report.retried.items():
        assert by_number[new].state == TrialState.WAITING
        assert by_number[new].user_attrs[ATTR_RETRY_OF] == old
        assert by_number[new].user_attrs["params_hash"] == params_hash(by_number[old].params)

    # idempotent: nothing new on a second run
    again = requeue(study, grace_period=300)
    assert again.failed_stale == [] and again.retried == {}
    assert len(study.get_trials()) == len(by_number)


def test_a_retry_is_never_retried(study):
    original = _failed(study, {"x": 0.7}, failures.PREEMPTED)
    first = requeue(study, grace_period=300)
    retry_number = first.retried[original.number]
    retry = study.ask()  # the worker picks up the enqueued retry
    assert retry.number == retry_number and retry.suggest_float("x", 0, 1) == 0.7
    record_failure(study, upstream.trial_id(retry), failures.PREEMPTED, "preempted again")
    second = requeue(study, grace_period=300)
    assert second.retried == {}
    assert "already a retry" in second.skipped[retry_number]


def test_live_trials_with_equal_params_checkpoint_apart_and_a_retry_resumes_from_the_dead_one(study, tmp_path):
    """Two running trials with the same parameters get separate directories; requeue points the dead one's
    retry at its last complete checkpoint, and the retry writes into a third directory."""
    from shardadopt import checkpoint
    from shardadopt.hpo import resume_checkpoint, trial_checkpoint_dir

    dead, twin = _running(study, {"x": 0.25}, heartbeat_age=1000), _running(study, {"x": 0.25}, heartbeat_age=0)
    dirs = {trial.number: trial_checkpoint_dir(trial, tmp_path) for trial in (dead, twin)}
    assert len(set(dirs.values())) == 2, dirs
    for step in (1, 2):  # both write at once; the twin's saves must not land in the dead trial's directory
        for trial in (dead, twin):
            with checkpoint.staged(f"{dirs[trial.number]}/step-{step}", step=step) as stage:
                (tmp_path / stage / "who").write_text(str(trial.number))
    (tmp_path / dirs[dead.number] / "step-2" / checkpoint.MARKER).unlink()  # died while publishing step 2
    assert resume_checkpoint(twin, tmp_path).endswith("step-2")

    report = requeue(study, grace_period=300)
    assert list(report.retried) == [dead.number], report.as_dict()
    retry = study.ask()
    assert retry.number == report.retried[dead.number] and retry.suggest_float("x", 0, 1) == 0.25
    resumed = resume_checkpoint(retry, tmp_path)
    assert resumed == f"{dirs[dead.number]}/step-1" and (tmp_path / resumed / "who").read_text() == str(dead.number)
    assert trial_checkpoint_dir(retry, tmp_path) not in dirs.values()


def test_stale_trials_ignores_fresh_ones(study):
    _running(study, {"x": 0.9}, heartbeat_age=5)
    assert stale_trials(study, grace_period=60) == []


# -- CLI ------------------------------------------------------------------------------------------------------------

def test_hpo_cli_status_requeue_best_export(study, storage, capsys, tmp_path):
    url = f"journal://{tmp_path}/study.log" if isinstance(storage, JournalStorage) else POSTGRES
    for x in (0.3, 0.1, 0.2):
        study.enqueue_trial({"x": x})
        study.optimize(lambda t: t.suggest_float("x", 0, 1) ** 2, n_trials=1)
    _running(study, {"x": 0.9}, heartbeat_age=1000)

    assert main(["hpo", "status", "--storage", url, "--study", study.study_name, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["states"] == {"COMPLETE": 3, "RUNNING": 1}
    assert status["running"][0]["heartbeat_age_s"] >= 1000
    assert status["best"][0]["params"] == {"x": 0.1}

    assert main(["hpo", "requeue", "--storage", url, "--study", study.study_name, "--grace-period", "60",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["failed_stale"] == [3] and list(result["retried"]) == ["3"]
    assert main(["hpo", "requeue", "--storage", url, "--study", study.study_name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["retried"] == {}

    assert main(["hpo", "best", "--storage", url, "--study", study.study_name, "--top", "2", "--json"]) == 0
    assert [r["params"]["x"] for r in json.loads(capsys.readouterr().out)] == [0.1, 0.2]

    out_csv = tmp_path / "history.csv"
    assert main(["hpo", "export", "--storage", url, "--study", study.study_name, "--format", "csv",
                 "--output", str(out_csv)]) == 0
    lines = out_csv.read_text().splitlines()
    assert lines[0].startswith("number,state,values") and len(lines) == 1 + 5
    assert main(["hpo", "export", "--storage", url, "--study", study.study_name]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 5


def test_load_study_ignores_other_studies_deleted_meanwhile(monkeypatch):
    """Another client of the same storage deletes its study while ``load_study`` (or ``load_companion``) opens one:
    the wanted study loads, and a missing one is still named with the studies there (listing summaries read every
    study's trials, and an RDB storage raised KeyError for the deleted one: CI's two sets share one PostgreSQL
    database)."""
    from shardadopt.hpo import reseed, storage

    deleted = set()

    class DeletedMeanwhile(optuna.storages.InMemoryStorage):  # the storage a URL resolves to, as other clients see it
        def get_all_trials(self, study_id, deepcopy=True, states=None):
            if self.get_study_name_from_id(study_id) in deleted:  # listed, then deleted before its trials were read
                raise KeyError("Record does not exist.")
            return super().get_all_trials(study_id, deepcopy=deepcopy, states=states)

    url = POSTGRES_URL
    shared = DeletedMeanwhile()
    for name in ("deleted-meanwhile", "kept"):
        optuna.create_study(study_name=name, storage=shared).optimize(lambda t: t.suggest_float("x", 0, 1), 1)
    deleted.add("deleted-meanwhile")
    monkeypatch.setattr(storage, "resolve_storage", lambda url, heartbeat_interval=None: shared)
    assert [t.value for t in storage.load_study(url, "kept").trials] == [t.value for t in
                                                                        optuna.load_study(study_name="kept",
                                                                                          storage=shared).trials]
    with pytest.raises(ValueError, match=r"no study named 'nope' .*\['deleted-meanwhile', 'kept'\]"):
        storage.load_study(url, "nope")
    # the re-runs' companion study (shardadopt hpo reseed / report): none yet, then the one created
    assert reseed.load_companion(shared, "kept") is None
    optuna.create_study(study_name=reseed.companion_name("kept"), storage=shared)
    assert reseed.load_companion(shared, "kept").study_name == reseed.companion_name("kept")


def test_hpo_cli_unknown_study_and_bad_url(tmp_path, capsys):
    url = f"journal://{tmp_path}/empty.log"
    assert main(["hpo", "status", "--storage", url, "--study", "nope"]) == 2
    assert "no study named 'nope'" in capsys.readouterr().err
    assert main(["hpo", "status", "--storage", "ftp://x/y", "--study", "nope"]) == 2
    assert "unsupported storage" in capsys.readouterr().err
