"""``Trainer.hyperparameter_search(backend="optuna")``: one rank fails mid-training, every rank recovers.

One launch of 2 gloo ranks (torchrun's environment) runs several searches on the tiny qwen3 checkpoint, each with a
fault on one rank in user shape: a callback raising in ``on_step_end`` / ``on_step_begin``, a forward hook
registered by ``model_init``, ``model_init`` itself, the train dataset's ``__getitem__``, a stateful callback
exported while Trainer writes a sharded checkpoint (rank 0, while rank 1 waits at the publication barrier); with a
plain model (DDP on the default group) and with FSDP- and TP-sharded ``model_init``. The control timeout is 600 s;
before the fix the peer of the failing rank sat in a training all-reduce for all of it. Each search asserts: every
rank out of the failed trial within ``BOUND`` seconds of the fault, the trial states and failure attributes, and the
next trial's logged losses equal those of a fresh search running the same parameters (enqueued) without a fault. The
last search does not catch the error: every rank raises promptly and exits non-zero. One search hangs instead of
raising (``time.sleep`` in ``on_step_end`` at step 3 on rank 1), one blocks in the Trainer's sharded save at step
4 (``os.fsync`` inside DCP's writes on rank 1, after checkpoint-2 was published) and one in the step-2 save on rank
0 (a stateful callback's ``state()``, while rank 1 waits for the publication), with ``hang_timeout=5``: the trial
fails as ``hang`` against that rank, a checkpoint published before the hang stays complete, and the search goes
on.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

from shardadopt.testing.launch import launch

pytestmark = pytest.mark.multiproc

BOUND = 30.0
CONTROL_TIMEOUT = 600.0
HANG_TIMEOUT = 5.0  # seconds without progress (the default, 900 s, fits real jobs)
MAX_STEPS = 4
PER_DEVICE_BATCH = 2


class InjectedFault(RuntimeError):
    pass


def _space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-1, log=True)}


def _losses():
    from transformers import TrainerCallback

    class Losses(TrainerCallback):
        """Per trial on this rank: logged training losses, and when the trial's training began."""

        def __init__(self):
            self.trials = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.trials.append({"params": dict(state.trial_params or {}), "losses": [], "began": time.time()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.trials[-1]["losses"].append(logs["loss"])

    return Losses()


def _fault_callback(rank: int, event: str, step: int, marks: dict, hang: bool = False):
    import torch.distributed as dist
    from transformers import TrainerCallback

    class Fault(TrainerCallback):
        trial = -1

        def on_train_begin(self, args, state, control, **kwargs):
            self.trial += 1

        def _maybe(self, state):
            if self.trial == 0 and dist.get_rank() == rank and state.global_step == step:
                marks["fault_at"] = time.time()
                if hang:  # stops making progress without raising (a stuck worker, a blocked filesystem)
                    time.sleep(10**6)
                raise InjectedFault(f"injected on rank {rank} in {event} at step {step}")

    def hook(self, args, state, control, **kwargs):
        self._maybe(state)

    setattr(Fault, event, hook)
    return Fault()


def _blocked_filesystem(rank: int, step: int, marks: dict):
    """From ``step`` of the first trial on, ``os.fsync`` stops answering on ``rank`` (a filesystem that blocks):
    the Trainer's sharded save at that step blocks in DCP's writes while the other rank waits in DCP's gather."""
    import os

    import torch.distributed as dist
    from transformers import TrainerCallback

    fsync = os.fsync

    def blocked(fd: int) -> None:
        marks["fault_at"] = time.time()
        os.fsync = fsync  # the next trial's filesystem answers again
        time.sleep(10**6)

    class Blocking(TrainerCallback):
        trial = -1

        def on_train_begin(self, args, state, control, **kwargs):
            self.trial += 1

        def on_step_end(self, args, state, control, **kwargs):  # the step's save comes right after this event
            if self.trial == 0 and dist.get_rank() == rank and state.global_step == step:
                os.fsync = blocked  # test instrumentation

    return Blocking()


def _search(model_path: str, out: str, name: str, fault: dict | None, catch: tuple, n_trials: int,
            layout: str | None, enqueue: dict | None = None) -> dict:
    """One search; what this rank saw (losses per trial, fault time, when each trial began, the error)."""
    import optuna
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.layouts import distributed_sizes
    from shardadopt.testing.models import token_dataset

    rank = dist.get_rank()
    marks: dict = {}
    load: dict = {}
    forget_accelerate_state()
    if layout is not None:
        from transformers.distributed import DistributedConfig

        load = {"distributed_config": DistributedConfig(**distributed_sizes(layout, dist.get_world_size())[0]),
                "dtype": torch.float32}
    kind = fault and fault["kind"]
    calls = {"trial": None}  # the trial whose model was built last (Trainer() builds one without a trial)

    def model_init(trial=None):
        calls["trial"] = trial.number if trial is not None else None
        if kind == "model_init" and calls["trial"] == 0 and rank == fault["rank"]:
            marks["fault_at"] = time.time()
            raise InjectedFault(f"injected on rank {rank} in model_init")
        model = AutoModelForCausalLM.from_pretrained(model_path, **load)
        if kind == "forward_hook" and calls["trial"] == 0 and rank == fault["rank"]:
            seen = {"n": 0}

            def hook(module, args, output):
                seen["n"] += 1
                if seen["n"] == fault["step"] + 1:
                    marks["fault_at"] = time.time()
                    raise InjectedFault(f"injected on rank {rank} in a forward hook")

            model.get_input_embeddings().register_forward_hook(hook)
        return model

    callbacks = [_losses()]
    if kind == "hang_write":
        callbacks.append(_blocked_filesystem(fault["rank"], fault["step"], marks))
    if kind in ("on_step_end", "on_step_begin"):
        callbacks.append(_fault_callback(fault["rank"], kind, fault["step"], marks))
    if kind == "hang_step_end":
        callbacks.append(_fault_callback(fault["rank"], "on_step_end", fault["step"], marks, hang=True))
    # The sharded checkpoint path, in the fresh run too (model weights only: transformers 5.24's Trainer refuses
    # optimizer checkpoints for a model_init that shards while loading)
    saves = layout is not None and name.startswith((f"{layout}_save", f"{layout}_hang_save"))
    if saves:
        from transformers.trainer_callback import ExportableState

        class Stateful(TrainerCallback, ExportableState):
            """A callback whose exported state Trainer writes into every checkpoint (on rank 0). Trainer asks for
            it when training begins too (``TrainerState``), before ``on_train_begin``: the fault waits for the save."""

            training = False

            def on_train_begin(self, args, state, control, **kwargs):
                self.training = True

            def state(self):
                if kind in ("save", "hang_save") and self.training and calls["trial"] == 0 and rank == fault["rank"]:
                    marks["fault_at"] = time.time()
                    if kind == "hang_save":
                        time.sleep(10**6)
                    raise InjectedFault(f"injected on rank {rank} in a stateful callback's state()")
                return {"args": {}, "attributes": {}}

        callbacks.append(Stateful())
    dataset = token_dataset(32)
    at = fault["step"] * PER_DEVICE_BATCH if kind == "dataset" else -1

    class Faulty(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            if rank == fault["rank"] and calls["trial"] == 0 and marks.setdefault("items", 0) == at:
                marks["fault_at"] = time.time()
                raise InjectedFault(f"injected on rank {rank} in dataset __getitem__")
            marks["items"] = marks.get("items", 0) + 1
            return dataset[i]

    args = TrainingArguments(output_dir=f"{out}/{name}", per_device_train_batch_size=PER_DEVICE_BATCH,
                             max_steps=MAX_STEPS, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0, **({"save_strategy": "steps", "save_steps": 2} if saves
                                        else {"save_strategy": "no"}))
    trainer = Trainer(model_init=model_init, args=args, train_dataset=Faulty() if kind == "dataset" else dataset,
                      eval_dataset=token_dataset(8, 1000), callbacks=callbacks)
    storage = f"sqlite:///{out}/{name}.db"
    if enqueue is not None and rank == 0:
        optuna.create_study(storage=storage, study_name=name).enqueue_trial(enqueue)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    error = None
    hangs = {"hang_timeout": HANG_TIMEOUT} if kind and kind.startswith("hang") else {}
    try:
        trainer.hyperparameter_search(
            backend="optuna", n_trials=n_trials, direction="minimize", hp_space=_space, storage=storage,
            study_name=name, sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner(),
            catch=catch, control_timeout=CONTROL_TIMEOUT, **hangs)
    except BaseException as exc:  # noqa: BLE001
        marks["exception"] = exc
        error = {"type": type(exc).__name__, "message": str(exc), "at": time.time(),
                 "origin": getattr(exc, "shardadopt_rank", None)}
    table = None
    if rank == 0:
        study = optuna.load_study(study_name=name, storage=storage)
        table = [(t.number, t.state.name, t.params, dict(t.user_attrs)) for t in study.trials]
    return {"trials": callbacks[0].trials, "fault_at": marks.get("fault_at"), "error": error, "table": table,
            "exception": marks.get("exception")}


def _checkpoints(root: str) -> list:
    """Every published ``checkpoint-N`` folder under ``root`` (any trial's run directory) and whether it is
    complete; staging folders are hidden (``.checkpoint-N.partial``) and not listed."""
    from shardadopt import checkpoint

    return sorted((path.name, checkpoint.is_complete(path)) for path in Path(root).rglob("checkpoint-*")
                  if path.is_dir() and not any(part.startswith(".") for part in path.relative_to(root).parts))


CAUGHT = [  # (name, layout, fault)
    ("plain_step_end", None, {"kind": "on_step_end", "rank": 1, "step": 3}),
    ("plain_model_init", None, {"kind": "model_init", "rank": 1}),
    ("fsdp_forward_hook", "fsdp", {"kind": "forward_hook", "rank": 0, "step": 2}),
    ("tp_dataset", "tp", {"kind": "dataset", "rank": 1, "step": 1}),
    ("fsdp_save", "fsdp", {"kind": "save", "rank": 0}),  # the sharded checkpoint at step 2 (rank 0 exports state)
    # rank 1's filesystem blocks in the Trainer's second sharded save (step 4), after checkpoint-2 was published
    ("fsdp_save_hang_write", "fsdp", {"kind": "hang_write", "rank": 1, "step": 4, "hang": True}),
    # rank 0 blocks in a stateful callback's state() while Trainer writes the step-2 checkpoint (rank 1 waits for it)
    ("fsdp_hang_save", "fsdp", {"kind": "hang_save", "rank": 0, "hang": True}),
    # the case: rank 1 stops making progress in on_step_end at step 3, without raising
    ("fsdp_hang_step_end", "fsdp", {"kind": "hang_step_end", "rank": 1, "step": 3, "hang": True}),
]


def faults(model_path: str, out: str) -> dict:
    """Every caught search with its fresh reference, then the uncaught one (re-raised: the process exits 1)."""
    import torch.distributed as dist

    import shardadopt

    shardadopt.enable()
    rank = dist.get_rank()
    result: dict = {}
    for name, layout, fault in CAUGHT:
        got = _search(model_path, out, name, fault, (RuntimeError,), 2, layout)
        if got.pop("exception") is not None:
            raise AssertionError(f"{name}: the search raised {got['error']}")
        fresh = _search(model_path, out, f"{name}_fresh", None, (), 1, layout, enqueue=got["trials"][-1]["params"])
        result[name] = {"got": got, "fresh": fresh["trials"]}
        if name in ("fsdp_save", "fsdp_hang_save", "fsdp_save_hang_write"):  # nothing partial of the failed trial
            result[name]["checkpoints"] = _checkpoints(f"{out}/{name}")
    Path(out, f"partial{rank}.pkl").write_bytes(pickle.dumps(result))
    uncaught = _search(model_path, out, "uncaught", {"kind": "on_step_begin", "rank": 0, "step": 2}, (), 2, None)
    exception = uncaught.pop("exception")
    Path(out, f"uncaught{rank}.pkl").write_bytes(pickle.dumps(uncaught))
    if exception is not None:
        raise exception
    return result


def test_fault_mid_training_fails_the_trial_and_every_rank_recovers(tiny_models, tmp_path):
    ranks = launch(faults, 2, tmp_path, timeout=900, model_path=tiny_models["qwen3"], out=str(tmp_path))
    # the last search did not catch the error: every rank raised it and exited non-zero
    assert [r["returncode"] for r in ranks] == [1, 1], [r["error"] for r in ranks]
    assert all("InjectedFault: injected on rank 0 in on_step_begin" in r["error"] for r in ranks), ranks[1]["error"]
    results = [pickle.loads((tmp_path / f"partial{r}.pkl").read_bytes()) for r in range(2)]
    for name, _layout, fault in CAUGHT:
        got = [results[r][name]["got"] for r in range(2)]
        table = got[0]["table"]
        assert [state for _, state, _, _ in table] == ["FAIL", "COMPLETE"], (name, table)
        attrs = table[0][3]
        kind, message = ("hang", f"rank(s) [{fault['rank']}] made no progress") if fault.get("hang") else \
            ("error", f"injected on rank {fault['rank']}")
        assert attrs["failure_rank"] == fault["rank"] and attrs["failure_kind"] == kind, (name, attrs)
        assert message in attrs["failure_message"], (name, attrs)
        fault_at = got[fault["rank"]]["fault_at"]
        for rank in range(2):
            next_trial = got[rank]["trials"][-1]
            assert next_trial["params"] == table[1][2]
            left = next_trial["began"] - fault_at
            assert 0 <= left < BOUND, f"{name}: rank {rank} began the next trial {left:.1f}s after the fault"
            (fresh,) = results[rank][name]["fresh"]
            assert fresh["params"] == next_trial["params"]
            assert len(next_trial["losses"]) == MAX_STEPS
            assert next_trial["losses"] == pytest.approx(fresh["losses"], rel=1e-5), \
                f"{name}: the trial after the fault trains as a fresh search does"
    # the failed (or hung) trial published nothing; the next trial's two checkpoints are complete
    for name in ("fsdp_save", "fsdp_hang_save"):
        assert results[0][name]["checkpoints"] == [("checkpoint-2", True), ("checkpoint-4", True)], name
    # the hung trial's checkpoint-2, published before the hang, is intact; its checkpoint-4 never appeared
    assert results[0]["fsdp_save_hang_write"]["checkpoints"] == [("checkpoint-2", True), ("checkpoint-2", True),
                                                                  ("checkpoint-4", True)]
    uncaught = [pickle.loads((tmp_path / f"uncaught{r}.pkl").read_bytes()) for r in range(2)]
    fault_at = uncaught[0]["fault_at"]
    for rank, seen in enumerate(uncaught):
        assert seen["error"]["type"] == "InjectedFault" and seen["error"]["origin"] == (None if rank == 0 else 0)
        assert 0 <= seen["error"]["at"] - fault_at < BOUND
    assert [state for _, state, _, _ in uncaught[0]["table"]] == ["FAIL"]
