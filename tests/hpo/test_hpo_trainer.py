"""``Trainer.hyperparameter_search(backend="optuna")`` on 2 gloo ranks, as torchrun runs it.

Each test launches its own rank processes (``shardadopt.testing.launch``: real exit codes; fault injection cannot
share a pool) and bounds them with a timeout that fails the test. One launch runs several searches on the tiny qwen3
checkpoint. The last test shows the hang without ``shardadopt.enable()``.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardadopt.testing.launch import launch, spawn
from shardadopt.upstream import registered_process_groups

pytestmark = pytest.mark.multiproc

N_TRIALS = 6
MAX_STEPS = 2
EVAL_STEPS = 1
PER_DEVICE_BATCH = 2


# -- what the ranks run ------------------------------------------------------------------------------------------------


def _trainer(model_path: str, out: str, callbacks=(), distributed: dict | None = None, model_init=None,
             **overrides):
    """A Trainer built as users build one for a search: ``model_init`` (default: load ``model_path``, sharded
    while loading with ``DistributedConfig(**distributed)`` when given) and these ``TrainingArguments``."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from shardadopt.testing.models import token_dataset

    settings = dict(output_dir=out, per_device_train_batch_size=PER_DEVICE_BATCH, max_steps=MAX_STEPS,
                    logging_steps=100, report_to=[], save_strategy="no", use_cpu=True, eval_strategy="steps",
                    eval_steps=EVAL_STEPS, disable_tqdm=True, seed=0)
    settings.update(overrides)
    load = {}
    if distributed:  # sharded while loading, the layout's DistributedConfig
        from transformers.distributed import DistributedConfig

        load = {"distributed_config": DistributedConfig(**distributed), "dtype": torch.float32}
    if model_init is None:
        def model_init(trial=None):
            return AutoModelForCausalLM.from_pretrained(model_path, **load)
    return Trainer(model_init=model_init, args=TrainingArguments(**settings), train_dataset=token_dataset(32),
                   eval_dataset=token_dataset(8, 1000), callbacks=list(callbacks))


def _space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-1, log=True)}


def _search(trainer, storage=None, **kwargs):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    extra = {"storage": storage, "study_name": "hpo"} if storage else {}
    return trainer.hyperparameter_search(
        backend="optuna", n_trials=kwargs.pop("n_trials", N_TRIALS), direction="minimize", hp_space=_space,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0),
        sampler=optuna.samplers.RandomSampler(seed=0), **extra, **kwargs)


def _recorder():
    """A callback recording, on this rank, each trial's parameters and evaluations, and the number of process groups
    once the trial's model is built."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.trials = []
            self.process_groups = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.trials.append([state.trial_params and dict(state.trial_params), 0])
            self.process_groups.append(len(registered_process_groups()))

        def on_evaluate(self, args, state, control, **kwargs):
            self.trials[-1][1] += 1

    return Recorder()


def _raise_on(rank: int, trial_number: int, error: type):
    import torch.distributed as dist
    from transformers import TrainerCallback

    class Raiser(TrainerCallback):
        trial = -1

        def on_train_begin(self, args, state, control, **kwargs):
            self.trial += 1

        def on_evaluate(self, args, state, control, **kwargs):
            if dist.get_rank() == rank and self.trial == trial_number:
                raise error(f"injected on rank {rank} in trial {trial_number}")

    return Raiser()


def _table(storage: str) -> list:
    import optuna

    study = optuna.load_study(study_name="hpo", storage=storage)
    return [(t.number, t.state.name, t.params, dict(t.intermediate_values), t.user_attrs) for t in study.trials]


def searches(model_path: str, out: str) -> dict:
    """Prune, errors (caught and not), timeout, two objectives, then prune with FSDP and TP model_init."""
    import torch.distributed as dist

    import shardadopt

    shardadopt.enable()
    from transformers import TrainerCallback

    rank = dist.get_rank()
    result: dict = {}

    recorder = _recorder()
    storage = f"sqlite:///{out}/prune.db"
    best = _search(_trainer(model_path, out, [recorder]), storage=storage)
    result["prune"] = {"best": best, "seen": recorder.trials, "table": _table(storage) if rank == 0 else None}

    storage = f"sqlite:///{out}/caught.db"
    _search(_trainer(model_path, out, [_raise_on(1, 1, ValueError)]), storage=storage, n_trials=3,
            catch=(ValueError,))
    result["caught"] = _table(storage) if rank == 0 else None

    try:
        _search(_trainer(model_path, out, [_raise_on(1, 0, ValueError)]), n_trials=2)
        result["uncaught"] = None
    except ValueError as exc:
        result["uncaught"] = (str(exc), getattr(exc, "shardadopt_rank", None))

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.25)

    storage = f"sqlite:///{out}/timeout.db"
    start = time.monotonic()
    _search(_trainer(model_path, out, [Slow()]), storage=storage, n_trials=20, timeout=1.0)
    result["timeout"] = {"seconds": time.monotonic() - start, "table": _table(storage) if rank == 0 else None}
    import optuna

    multi = _trainer(model_path, out).hyperparameter_search(
        backend="optuna", n_trials=2, direction=["minimize", "maximize"], hp_space=_space,
        compute_objective=lambda metrics: (metrics["eval_loss"], -metrics["eval_loss"]),
        sampler=optuna.samplers.RandomSampler(seed=0))
    result["multi"] = sorted((run.run_id, tuple(run.objective)) for run in multi)
    result.update(sharded_searches(model_path, out))
    return result


def sharded_searches(model_path: str, out: str) -> dict:
    """The prune search with a model_init that shards while loading: FSDP, then TP."""
    import torch.distributed as dist

    import shardadopt
    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.layouts import distributed_sizes

    shardadopt.enable()
    result = {}
    for layout in ("fsdp", "tp"):
        sizes, dp = distributed_sizes(layout, dist.get_world_size())
        forget_accelerate_state()
        recorder = _recorder()
        storage = f"sqlite:///{out}/{layout}.db"
        best = _search(_trainer(model_path, out, [recorder], distributed=sizes), storage=storage)
        result[layout] = {"best": best, "seen": recorder.trials, "dp": dp, "groups": recorder.process_groups,
                          "table": _table(storage) if dist.get_rank() == 0 else None}
    return result


def killed(model_path: str, out: str, control_timeout: float) -> None:
    """Rank 1 SIGKILLs itself in the middle of trial 0; rank 0 must raise, not hang."""
    import torch.distributed as dist

    import shardadopt

    shardadopt.enable()
    from transformers import TrainerCallback

    class Kill(TrainerCallback):
        trial = -1

        def on_train_begin(self, args, state, control, **kwargs):
            self.trial += 1

        def on_step_end(self, args, state, control, **kwargs):
            if dist.get_rank() == 1 and self.trial == 0 and state.global_step == 1:
                Path(out, "killed_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    _search(_trainer(model_path, out, [Kill()]), n_trials=2, control_timeout=control_timeout)


KILL_STEPS, SAVE_STEPS = 6, 2  # the retry study's trials: max_steps, save_steps


def failure_kinds(model_path: str, out: str) -> None:
    """A search whose model_init refuses trial 1 (config_error) and makes trial 2's loss NaN (nan_loss)."""
    import optuna
    import torch
    from transformers import AutoModelForCausalLM

    import shardadopt

    shardadopt.enable()
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    def model_init(trial=None):
        if trial is not None and trial.number == 1:
            raise ValueError("learning rate does not fit this model")
        model = AutoModelForCausalLM.from_pretrained(model_path)
        if trial is not None and trial.number == 2:
            with torch.no_grad():
                model.get_input_embeddings().weight.fill_(float("nan"))
        return model

    _trainer(model_path, f"{out}/kinds", model_init=model_init).hyperparameter_search(
        backend="optuna", n_trials=3, direction="minimize", hp_space=_space, study_name="kinds",
        sampler=optuna.samplers.RandomSampler(seed=1), pruner=optuna.pruners.NopPruner(),
        catch=(ValueError, FloatingPointError))


def sharded_search(model_path: str, out: str, storage: str, study_name: str, pace: float = 0.0) -> dict:
    """The issue's snippet: Trainer built with a model_init that shards while loading and checkpoints every
    SAVE_STEPS, searched on a shared storage. ``pace``: seconds each step takes longer (the test kills the job
    while it trains). Returns each trial's first step and its logged loss per step."""
    import optuna
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.distributed import DistributedConfig

    import shardadopt

    shardadopt.enable()
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    def model_init(trial=None):
        return AutoModelForCausalLM.from_pretrained(model_path, distributed_config=DistributedConfig(fsdp_size=2),
                                                    dtype=torch.float32)

    class Record(TrainerCallback):
        def __init__(self):
            self.trials = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.trials.append({"params": dict(state.trial_params or {}), "start": state.global_step,
                                "losses": {}})

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(pace)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                self.trials[-1]["losses"][state.global_step] = logs["loss"]

    record = Record()
    trainer = _trainer(model_path, f"{out}/{study_name}", [record], model_init=model_init, max_steps=KILL_STEPS,
                       save_strategy="steps", save_steps=SAVE_STEPS, eval_strategy="no", logging_steps=1)
    trainer.hyperparameter_search(
        backend="optuna", n_trials=1, direction="minimize", hp_space=_space, storage=storage,
        study_name=study_name, sampler=optuna.samplers.RandomSampler(seed=0), heartbeat_interval=0.5,
        data_snapshot="snap-1", space_version="v1")
    return {"trials": record.trials}


def retry_and_reference(model_path: str, out: str, storage: str) -> dict:
    """The requeued retry, then the same parameters uninterrupted (enqueued by the test in study 'reference')."""
    return {name: sharded_search(model_path, out, storage, name)["trials"] for name in ("retry", "reference")}


def upstream(model_path: str, out: str) -> None:
    """The prune search without shardadopt.enable(): upstream's path."""
    _search(_trainer(model_path, out), storage=f"sqlite:///{out}/upstream.db")


# -- tests -------------------------------------------------------------------------------------------------------------


def test_trainer_searches_prune_fail_timeout_and_sharded_model_init(tiny_models, tmp_path):
    ranks = launch(searches, 2, tmp_path, timeout=400, model_path=tiny_models["qwen3"], out=str(tmp_path))
    assert [r["returncode"] for r in ranks] == [0, 0], [r["error"] for r in ranks]
    r0, r1 = ranks[0]["result"], ranks[1]["result"]

    _assert_pruned_in_step(r0["prune"], r1["prune"], data_parallel=2)

    # an error on rank 1 only, caught: trial 1 FAIL with the error, the study goes on
    caught = r0["caught"]
    assert [state for _, state, *_ in caught][:2] == ["COMPLETE", "FAIL"] and len(caught) == 3
    assert caught[2][1] in {"COMPLETE", "PRUNED"}
    attrs = caught[1][4]
    assert attrs["failure_rank"] == 1 and "injected on rank 1 in trial 1" in attrs["failure_message"]

    # not caught: every rank raises the same error type, rank 0 names rank 1
    assert r0["uncaught"] == ("injected on rank 1 in trial 0", 1)
    assert r1["uncaught"] == ("injected on rank 1 in trial 0", None)

    # timeout: every rank leaves after the trial running when it expired
    timeout = r0["timeout"]
    assert 1 <= len(timeout["table"]) < 20
    per_trial = timeout["seconds"] / len(timeout["table"])
    assert all(r["result"]["timeout"]["seconds"] < 1.0 + 2 * per_trial + 2.0 for r in ranks)

    # several objectives: no pruning (as upstream), the Pareto front on every rank
    assert r0["multi"] == r1["multi"] and len(r0["multi"]) >= 1
    assert all(len(values) == 2 for _, values in r0["multi"])

    # model_init shards while loading (FSDP, then TP): the same guarantees, and the trials' models share one mesh
    # (transformers 5.18+ would add a process group per mesh dimension per trial: transformers-reuse-device-mesh)
    for layout in ("fsdp", "tp"):
        _assert_pruned_in_step(r0[layout], r1[layout], data_parallel=r0[layout]["dp"])
        for rank in (r0, r1):
            assert len(set(rank[layout]["groups"])) == 1, f"{layout}: process groups per trial {rank[layout]['groups']}"


def _assert_pruned_in_step(rank0: dict, rank1: dict, data_parallel: int) -> None:
    """Finished, >= 1 pruned, and each rank ran each trial exactly as far as optuna recorded it."""
    table = rank0["table"]
    assert len(table) == N_TRIALS and any(state == "PRUNED" for _, state, *_ in table), table
    assert rank1["seen"] == rank0["seen"], "both ranks ran the same trials, evaluated as often"
    for (number, state, params, values, _), (seen_params, evaluations) in zip(table, rank0["seen"]):
        assert seen_params == params
        assert len(values) == evaluations, f"trial {number}: {evaluations} evaluations, {len(values)} reports"
        assert state == "PRUNED" or (state == "COMPLETE" and evaluations == MAX_STEPS // EVAL_STEPS), table
        # steps are training examples seen: optimizer steps x per-device batch x data-parallel ranks
        assert sorted(values) == [EVAL_STEPS * k * PER_DEVICE_BATCH * data_parallel
                                  for k in range(1, len(values) + 1)]
    assert rank1["best"] == rank0["best"], "every rank gets the best run"
    complete = [(values[max(values)], number) for number, state, _, values, _ in table if state == "COMPLETE"]
    assert rank0["best"].run_id == str(min(complete)[1])


def test_sigkilled_rank_makes_the_survivor_raise_promptly_and_record_the_trial(tiny_models, tmp_path):
    """Rank 1 dies mid-training while rank 0 waits in a training all-reduce: rank 0 raises within seconds (not the
    600 s control timeout) and records the trial as FAIL / comm_error against rank 1."""
    import optuna

    from shardadopt.hpo.storage import DEFAULT_JOURNAL_NAME, resolve_storage

    control_timeout = 600.0
    ranks = launch(killed, 2, tmp_path, timeout=180, model_path=tiny_models["qwen3"], out=str(tmp_path),
                   control_timeout=control_timeout)
    assert ranks[1]["returncode"] == -signal.SIGKILL
    assert ranks[0]["returncode"] == 1
    error = ranks[0]["error"]
    assert "PeerLostError" in error and "rank(s) [1]" in error, error
    killed_at = float((tmp_path / "killed_at").read_text())
    raised_at = (tmp_path / "rank0.err").stat().st_mtime  # written as the error left the search
    assert raised_at - killed_at < 30, "bounded by the fence and the check-in wait, not by the control timeout"
    storage = resolve_storage(f"journal://{tmp_path / DEFAULT_JOURNAL_NAME}")
    (trial,) = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage).trials
    assert trial.state.name == "FAIL" and trial.user_attrs["failure_kind"] == "comm_error", trial.user_attrs
    assert trial.user_attrs["failure_rank"] == 1


def _hpo_cli(*args: str) -> dict:
    """``shardadopt hpo ... --json`` as users run it."""
    done = subprocess.run([sys.executable, "-m", "shardadopt", "hpo", *args, "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_trainer_failure_kinds_are_recorded_and_never_retried(tiny_models, tmp_path):
    """config_error (model_init refuses) and nan_loss (NaN loss) land on the default journal; requeue skips them."""
    ranks = launch(failure_kinds, 2, tmp_path / "procs", timeout=240, model_path=tiny_models["qwen3"],
                   out=str(tmp_path))
    assert [r["returncode"] for r in ranks] == [0, 0], [r["error"] for r in ranks]
    import optuna

    from shardadopt.hpo.storage import DEFAULT_JOURNAL_NAME, resolve_storage

    storage = f"journal://{tmp_path}/kinds/{DEFAULT_JOURNAL_NAME}"  # the default: a journal under output_dir
    study = optuna.load_study(study_name="kinds", storage=resolve_storage(storage))
    kinds = {t.number: (t.state.name, t.user_attrs.get("failure_kind")) for t in study.trials}
    assert kinds == {0: ("COMPLETE", None), 1: ("FAIL", "config_error"), 2: ("FAIL", "nan_loss")}, kinds
    report = _hpo_cli("requeue", "--storage", storage, "--study", "kinds")
    assert not report["retried"] and set(report["skipped"]) == {"1", "2"}, report


def test_sigkilled_trial_is_requeued_by_the_cli_and_resumes_from_its_last_complete_checkpoint(tiny_models, tmp_path):
    """The issue's snippet (Trainer built with a sharding model_init, checkpoints every 2 steps) trains on 2 ranks;
    both are SIGKILLed mid-trial; `shardadopt hpo requeue` requeues the trial; a second search runs the retry
    from the dead trial's last complete checkpoint, and its losses from there on equal an uninterrupted run of
    the same parameters (computed here: study 'reference')."""
    import optuna

    from shardadopt.checkpoint import MARKER
    from shardadopt.hpo.storage import resolve_storage
    from shardadopt.hpo.trainer_backend import last_complete_checkpoint

    storage = f"journal://{tmp_path}/hpo.log"
    out = tmp_path / "retry"
    procs = spawn(sharded_search, 2, tmp_path / "first", model_path=tiny_models["qwen3"], out=str(tmp_path),
                  storage=storage, study_name="retry", pace=1.0)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob(f"trial-*/checkpoint-{SAVE_STEPS}/{MARKER}")):  # the first save is complete
            assert all(p.poll() is None for p in procs), (tmp_path / "first" / "rank0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
    finally:
        for proc in procs:  # the machine goes away: no handler runs
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    study = optuna.load_study(study_name="retry", storage=resolve_storage(storage))
    (dead,) = study.trials
    assert dead.state.name == "RUNNING", "a zombie until requeue notices"
    assert dead.user_attrs["data_snapshot"] == "snap-1" and dead.user_attrs["space_version"] == "v1"
    dead_dir = out / dead.user_attrs["checkpoint_dir"]
    last = last_complete_checkpoint(str(dead_dir))
    resumed_at = int(last.rsplit("-", 1)[1])
    assert 0 < resumed_at < KILL_STEPS, last

    deadline = time.monotonic() + 60
    while not (report := _hpo_cli("requeue", "--storage", storage, "--study", "retry", "--grace-period", "3"))[
            "retried"]:  # the heartbeats stopped with the job
        assert time.monotonic() < deadline, report
        time.sleep(0.5)
    assert report["failed_stale"] == [dead.number] and list(report["retried"]) == [str(dead.number)], report
    reference = optuna.create_study(study_name="reference", storage=resolve_storage(storage))
    reference.enqueue_trial(dead.params)

    second = launch(retry_and_reference, 2, tmp_path / "second", timeout=300, model_path=tiny_models["qwen3"],
                    out=str(tmp_path), storage=storage)
    assert [r["returncode"] for r in second] == [0, 0], [r["error"] for r in second]
    assert second[0]["result"] == second[1]["result"], "both ranks ran the same trials, as far"
    ((retried,), (uninterrupted,)) = second[0]["result"]["retry"], second[0]["result"]["reference"]
    assert retried["params"] == uninterrupted["params"] == dead.params
    assert retried["start"] == resumed_at and uninterrupted["start"] == 0
    remaining = range(resumed_at + 1, KILL_STEPS + 1)
    assert list(retried["losses"]) == list(remaining), retried
    assert retried["losses"] == {step: uninterrupted["losses"][step] for step in remaining}

    retry = optuna.load_study(study_name="retry", storage=resolve_storage(storage)).trials[-1]
    assert retry.state.name == "COMPLETE" and retry.user_attrs["retry_of"] == dead.number
    assert retry.user_attrs["resume_from"] == dead.user_attrs["checkpoint_dir"]
    assert retry.user_attrs["checkpoint_dir"] != dead.user_attrs["checkpoint_dir"]  # the retry writes elsewhere
    assert last_complete_checkpoint(str(dead_dir)) == last
    assert not _hpo_cli("requeue", "--storage", storage, "--study", "retry", "--grace-period", "3")["retried"]


def test_without_enable_the_prune_search_hangs(tiny_models, tmp_path):
    """Upstream's path: rank 0 prunes, rank 1 (a FixedTrial) trains on; nothing moves after the first prune."""
    db = tmp_path / "upstream.db"
    procs = spawn(upstream, 2, tmp_path / "procs", model_path=tiny_models["qwen3"], out=str(tmp_path))
    try:
        deadline = time.monotonic() + 150
        pruned_at = None
        while time.monotonic() < deadline:
            states = _states(db)
            if pruned_at is None and "PRUNED" in states:
                pruned_at, after_prune = time.monotonic(), states
            if pruned_at is not None and time.monotonic() - pruned_at > 4:
                break
            assert all(p.poll() is None for p in procs), f"a rank exited (states {states}): no hang?"
            time.sleep(0.5)
        assert pruned_at is not None, "no trial was pruned"
        stuck = _states(db)
        assert all(p.poll() is None for p in procs), "the ranks must still be stuck"
        assert len(stuck) < N_TRIALS and stuck[:len(after_prune)] == after_prune
        assert stuck[len(after_prune):] in ([], ["RUNNING"]), f"no trial may finish after the prune: {stuck}"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _states(db: Path) -> list[str]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db) as connection:
            return [state for (state,) in connection.execute("SELECT state FROM trials ORDER BY number")]
    except sqlite3.OperationalError:  # tables not created yet
        return []


def test_world_size_above_one_without_torch_distributed_is_a_clear_error():
    from types import SimpleNamespace

    from shardadopt.hpo.trainer_backend import run_hp_search_optuna

    trainer = SimpleNamespace(args=SimpleNamespace(world_size=2, parallel_mode="ParallelMode.TPU"))
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised.*torchrun"):
        run_hp_search_optuna(trainer, 2, "minimize")
    with pytest.raises(ValueError, match="report_unit"):
        run_hp_search_optuna(trainer, 2, "minimize", report_unit="tokens")


def test_report_units():
    from types import SimpleNamespace

    from shardadopt.hpo.trainer_backend import _UNIT_ATTRIBUTE, report_step

    trainer = SimpleNamespace(args=None, state=SimpleNamespace(epoch=2.9999),
                              get_total_train_batch_size=lambda args: 12)
    assert report_step(trainer, 5) == 60, "default: examples seen = optimizer steps x total train batch"
    for unit, expected in (("steps", 5), ("epochs", 3), (lambda t: 7, 7), ("examples", 60)):
        setattr(trainer, _UNIT_ATTRIBUTE, unit)
        assert report_step(trainer, 5) == expected


def test_single_process_search_takes_the_same_path(tiny_models, tmp_path):
    """One process, no torch.distributed: the patched search still reports in examples and prunes."""
    import optuna

    import shardadopt
    from shardadopt.hpo.trial import DistributedTrial

    shardadopt.enable()
    try:
        recorder = _recorder()
        storage = f"sqlite:///{tmp_path}/single.db"
        trainer = _trainer(tiny_models["qwen3"], str(tmp_path), [recorder])
        best = _search(trainer, storage=storage)
        table = _table(storage)
    finally:
        shardadopt.disable()
    # upstream-private: Trainer keeps the search's trial as _trial and has no getter for it
    assert isinstance(trainer._trial, DistributedTrial)
    assert len(table) == N_TRIALS and any(state == "PRUNED" for _, state, *_ in table)
    for (_, _state, params, values, _), (seen_params, evaluations) in zip(table, recorder.trials):
        assert seen_params == params and len(values) == evaluations
        assert sorted(values) == [EVAL_STEPS * k * PER_DEVICE_BATCH for k in range(1, len(values) + 1)]
    assert best.run_id == str(optuna.load_study(study_name="hpo", storage=storage).best_trial.number)
