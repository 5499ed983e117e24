"""accelerate ``save_state``/``load_state``/``save_model`` and ``Trainer`` checkpoints for load-time-sharded models.

First pool: the uninterrupted runs (and the same calls without the patches, which fail), ending with a Trainer
run killed in the middle of writing checkpoint-4. Second, fresh pool: the resumed runs. References are the
uninterrupted runs of the same configuration, compared bit for bit.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardadopt import checkpoint
from shardadopt.patches.accelerate_sharded_checkpoint import PATCH as ACCELERATE_PATCH
from shardadopt.patches.trainer_sharded_checkpoint import PATCH as TRAINER_PATCH
from shardadopt.selftest import checkpoint as scenario
from shardadopt.testing import RankError, RankPool, RankTimeout
from shardadopt.testing.accelerator import fresh_accelerator

ACCELERATE_ID, TRAINER_ID = ACCELERATE_PATCH.id, TRAINER_PATCH.id

pytestmark = pytest.mark.multiproc
# TP through accelerate needs the adoption's data split (tested there); EP only where it is DTensor-based (5.19+):
# 5.15 spells EP as TP with plain per-rank shards, which save_model cannot export (tested in test_checkpoint.py)
ACCELERATE_LAYOUTS = ["fsdp", "ep"] if "ep_size" in scenario.LAYOUTS["ep"][1] else ["fsdp"]
ACCELERATE_SAVES, ACCELERATE_TOTAL = 3, 5


# -- accelerate ----------------------------------------------------------------------------------------------------

def accelerate_setup(path: str, distributed: dict, project_dir: str | None = None):
    """Accelerator + sharded model + AdamW + scheduler + a shuffled dataloader, all through ``prepare``
    (the sharded model is adopted by the accelerate-adopt-sharded-model patch)."""
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    from shardadopt.testing import token_batch

    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2) \
        if project_dir else None
    # the seedable sampler is accelerate's way to make the shuffled order part of the saved state
    accelerator = fresh_accelerator(cpu=True, project_config=config,
                                    dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0)
    model, optimizer, scheduler = scenario.build(path, distributed)
    data = list(token_batch(3, 32))
    loader = torch.utils.data.DataLoader(data, batch_size=scenario.PER_DP_RANK_BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, loader, scheduler


def accelerate_step(accelerator, model, optimizer, scheduler, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def accelerate_uninterrupted(path: str, distributed: dict, project_dir: str, export_dir: str) -> dict:
    import shardadopt

    shardadopt.enable()
    accelerator, model, optimizer, loader, scheduler = accelerate_setup(path, distributed, project_dir)
    trace = []
    for step, ids in zip(range(ACCELERATE_TOTAL), loader):
        trace.append(accelerate_step(accelerator, model, optimizer, scheduler, ids))
        if step < ACCELERATE_SAVES:  # three saves with total_limit=2: the oldest complete one is rotated away
            accelerator.save_state()
            rng = torch.rand(2).tolist()  # what a restored RNG must draw next
    state = accelerator.get_state_dict(model)
    accelerator.save_model(model, export_dir, max_shard_size="100KB")
    return {"trace": trace, "params": scenario.full_params(model), "state_dict": state, "rng": rng,
            "checkpoints": sorted(os.listdir(os.path.join(project_dir, "checkpoints")))}


def accelerate_resume(path: str, distributed: dict, project_dir: str) -> dict:
    import shardadopt

    shardadopt.enable()
    accelerator, model, optimizer, loader, scheduler = accelerate_setup(path, distributed, project_dir)
    accelerator.load_state()  # the latest complete checkpoint_N, written after ACCELERATE_SAVES steps
    rng = torch.rand(2).tolist()
    remaining = zip(range(ACCELERATE_TOTAL - ACCELERATE_SAVES), accelerator.skip_first_batches(loader,
                                                                                             ACCELERATE_SAVES))
    trace = [accelerate_step(accelerator, model, optimizer, scheduler, ids) for _, ids in remaining]
    return {"trace": trace, "params": scenario.full_params(model), "rng": rng}


def accelerate_unpatched(path: str, distributed: dict, directory: str) -> dict:
    import shardadopt

    shardadopt.enable(exclude=[ACCELERATE_ID])
    try:
        accelerator, model, optimizer, loader, scheduler = accelerate_setup(path, distributed)
        accelerate_step(accelerator, model, optimizer, scheduler, next(iter(loader)))
        state = accelerator.get_state_dict(model)
        saved = scenario.full_optimizer_state(model, optimizer.optimizer)
        outcome = {"dtensors": sum(type(v).__name__ == "DTensor" for v in state.values())}
        try:
            accelerator.save_state(directory)
            accelerator, model, optimizer, *_ = accelerate_setup(path, distributed)
            accelerator.load_state(directory)
        except Exception as exc:
            return {**outcome, "error": f"{type(exc).__name__}: {exc}"}
        restored = scenario.full_optimizer_state(model, optimizer.optimizer)
        wrong = [n for n in saved if any(not torch.equal(v, restored[n][k]) for k, v in saved[n].items())]
        return {**outcome, "error": None, "wrong": wrong}
    finally:
        shardadopt.enable()


# -- Trainer -------------------------------------------------------------------------------------------------------

def trainer_for(path: str, distributed: dict, out: str, model_init: bool = False, **overrides):
    """``model_init=True``: built as for hyperparameter_search, with a model_init that shards while loading."""
    from transformers import Trainer, TrainingArguments

    from shardadopt.testing.models import token_dataset

    load = {"model_init": lambda: scenario.load_model(path, distributed)} if model_init else \
        {"model": scenario.load_model(path, distributed)}
    options = dict(output_dir=out, per_device_train_batch_size=2, max_steps=6, logging_steps=1,
                   save_strategy="steps", save_steps=2, use_cpu=True, report_to=[], learning_rate=1e-2,
                   lr_scheduler_type="linear", seed=7, disable_tqdm=True)
    options.update(overrides)
    return Trainer(**load, args=TrainingArguments(**options), train_dataset=token_dataset(64),
                   eval_dataset=token_dataset(64) if "eval_strategy" in overrides else None)


def stop_at(step: int):
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= step:
                control.should_training_stop = True

    return Stop()


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def trainer_run(path: str, distributed: dict, out: str, stop: int | None = None, resume=None,
                export: str | None = None, crash_at_save: int | None = None, model_init: bool = False,
                **overrides) -> dict:
    import torch.distributed as dist

    import shardadopt

    shardadopt.enable()
    trainer = trainer_for(path, distributed, out, model_init, **overrides)
    if stop:
        trainer.add_callback(stop_at(stop))
    if crash_at_save:
        from torch.distributed.checkpoint import filesystem

        original = filesystem.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            result = original(self, plan, planner)
            if dist.get_rank() == 1 and trainer.state.global_step == crash_at_save:
                result.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        filesystem.FileSystemWriter.write_data = write_then_die
    import torch.distributed.checkpoint as dcp

    read, load = [], dcp.load  # what each DCP read of the resume asks for: the weights once, then the optimizer

    def recording_load(state_dict, *args, **kwargs):
        read.append(sorted(state_dict))
        return load(state_dict, *args, **kwargs)

    dcp.load = recording_load
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        dcp.load = load
    if export:
        trainer.save_model(export)
    return {"losses": losses(trainer), "params": scenario.full_params(trainer.model),
            "best": trainer.state.best_model_checkpoint, "dcp_reads": read,
            "checkpoints": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))}


def trainer_unpatched(path: str, distributed: dict, out: str) -> dict[str, str | None]:
    import shardadopt

    shardadopt.enable(exclude=[TRAINER_ID])
    errors: dict[str, str | None] = {}
    try:
        for model_init in (False, True):
            try:
                trainer_for(path, distributed, out, model_init, max_steps=2)
                errors["model_init" if model_init else "model"] = None
            except ValueError as exc:
                errors["model_init" if model_init else "model"] = str(exc)
    finally:
        shardadopt.enable()
    return errors


def checkpoint_params(path: str, distributed: dict, directory: str) -> dict:
    model = scenario.load_model(path, distributed)
    checkpoint.load_sharded_state(directory, model)
    return scenario.full_params(model)


# -- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("integrations"))


@pytest.fixture(scope="module")
def first(tiny_models, root):
    """Everything run in the first pool; the pool ends killed by a crash in the middle of a Trainer save."""
    results: dict = {"accelerate": {}}
    path, distributed = tiny_models["qwen3"], scenario.LAYOUTS["fsdp"][1]
    pool = RankPool(2)
    try:
        results["accelerate_unpatched"] = pool.run(accelerate_unpatched, path, distributed,
                                                   os.path.join(root, "unpatched"), timeout=120)[0]
        for layout in ACCELERATE_LAYOUTS:
            model, dist_kwargs = scenario.LAYOUTS[layout]
            results["accelerate"][layout] = pool.run(
                accelerate_uninterrupted, tiny_models[model], dist_kwargs, os.path.join(root, "acc", layout),
                os.path.join(root, "acc-export", layout), timeout=120)[0]
        results["trainer_unpatched"] = pool.run(trainer_unpatched, path, distributed,
                                                os.path.join(root, "t-unpatched"), timeout=120)[0]
        results["trainer"] = pool.run(trainer_run, path, distributed, os.path.join(root, "t-full"),
                                      export=os.path.join(root, "t-export"), save_total_limit=2, timeout=180)[0]
        results["trainer_stopped"] = pool.run(trainer_run, path, distributed, os.path.join(root, "t-stop"),
                                              stop=4, timeout=180)[0]
        results["trainer_init_stopped"] = pool.run(trainer_run, path, distributed, os.path.join(root, "t-init"),
                                                   stop=4, model_init=True, timeout=180)[0]
        with pytest.raises((RankError, RankTimeout)):
            pool.run(trainer_run, path, distributed, os.path.join(root, "t-crash"), crash_at_save=4, timeout=90)
    finally:
        pool.close(force=True)
    return results


@pytest.fixture(scope="module")
def second(first):
    with RankPool(2) as pool:
        yield pool


def assert_params_equal(got: dict, expected: dict) -> None:
    differ = [n for n, p in expected.items() if not torch.equal(got[n], p)]
    assert not differ, f"{len(differ)} parameters differ, e.g. {differ[:3]}"


# -- accelerate tests ----------------------------------------------------------------------------------------------

def test_accelerate_upstream_cannot_save_sharded_state(first):
    unpatched = first["accelerate_unpatched"]
    # upstream either fails, or saves rank 0's optimizer shards for every rank and restores the wrong state
    assert unpatched["error"] is not None or unpatched["wrong"], "upstream save_state/load_state round-tripped"
    assert unpatched["dtensors"] > 0, "upstream get_state_dict should return DTensor shards"


@pytest.mark.parametrize("layout", ACCELERATE_LAYOUTS)
def test_accelerate_save_state_resumes_exactly(layout, tiny_models, root, first, second):
    expected = first["accelerate"][layout]
    # total_limit=2: of checkpoint_0..2 the two newest complete ones remain
    assert expected["checkpoints"] == ["checkpoint_1", "checkpoint_2"]
    model, distributed = scenario.LAYOUTS[layout]
    result = second.run(accelerate_resume, tiny_models[model], distributed, os.path.join(root, "acc", layout),
                        timeout=120)[0]
    assert result["rng"] == expected["rng"], "load_state did not restore the RNG"
    assert result["trace"] == expected["trace"][ACCELERATE_SAVES:], "losses after load_state differ"
    assert_params_equal(result["params"], expected["params"])


@pytest.mark.parametrize("layout", ACCELERATE_LAYOUTS)
def test_accelerate_full_state_dict_and_save_model(layout, tiny_models, root, first):
    from transformers import AutoConfig, AutoModelForCausalLM

    expected = first["accelerate"][layout]
    assert set(expected["state_dict"]) >= set(expected["params"])
    for name, value in expected["params"].items():
        assert type(expected["state_dict"][name]) is torch.Tensor and torch.equal(expected["state_dict"][name], value)
    export = os.path.join(root, "acc-export", layout)
    AutoConfig.from_pretrained(tiny_models[scenario.LAYOUTS[layout][0]]).save_pretrained(export)
    plain = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert_params_equal(dict(plain.named_parameters()), expected["params"])


def test_accelerate_load_state_refuses_partial(tiny_models, root, first, second, tmp_path):
    # a staging directory as a killed save leaves it (state written, no completion marker)
    complete = os.path.join(root, "acc", "fsdp", "checkpoints", "checkpoint_2")
    partial = str(tmp_path / ".checkpoint_3.partial")
    import shutil

    shutil.copytree(complete, partial)
    os.remove(os.path.join(partial, checkpoint.MARKER))
    errors = second.run(accelerate_load_error, tiny_models["qwen3"], scenario.LAYOUTS["fsdp"][1], partial)
    assert all("not a complete checkpoint" in e and "interrupted" in e for e in errors), errors


def accelerate_load_error(path: str, distributed: dict, directory: str) -> str:
    import shardadopt

    shardadopt.enable()
    accelerator, *_ = accelerate_setup(path, distributed)
    try:
        accelerator.load_state(directory)
    except checkpoint.IncompleteCheckpointError as exc:
        return str(exc)
    return "loaded"


ACCELERATE_STEPS = 3  # accumulate() calls before the save: accelerator.step at the save


def accelerate_hand_sharded(seed: int = 0):
    """An FSDP MLP sharded by hand over the whole world, its AdamW and scheduler, prepared by an Accelerator."""
    from shardadopt.testing.models import hand_sharded_mlp

    accelerator = fresh_accelerator(cpu=True)
    torch.manual_seed(seed)
    model = hand_sharded_mlp("fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def accelerate_save_hand_sharded(directory: str) -> dict:
    import shardadopt

    shardadopt.enable()
    accelerator, model, optimizer, scheduler = accelerate_hand_sharded()
    for _ in range(ACCELERATE_STEPS):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 4)).square().mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state(directory)
    return {"step": accelerator.step, "params": scenario.full_params(model)}


def accelerate_load_hand_sharded(directory: str) -> dict:
    import warnings

    import shardadopt

    shardadopt.enable()
    accelerator, model, optimizer, scheduler = accelerate_hand_sharded(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(directory)
    return {"step": accelerator.step, "params": scenario.full_params(model),
            "warnings": [str(w.message) for w in caught if "resharded" in str(w.message)]}


def test_accelerate_load_state_into_a_larger_world_restores_step_on_every_process(tmp_path, second):
    """A checkpoint save_state wrote from one process, loaded by two (resharded): every process gets the saved
    step (process 1 has no RNG file to read it from), the weights, and a warning that says which RNG states were
    restored."""
    directory = str(tmp_path / "one-process")
    with RankPool(1) as pool:
        (saved,) = pool.run(accelerate_save_hand_sharded, directory, timeout=120)
    assert saved["step"] == ACCELERATE_STEPS
    results = second.run(accelerate_load_hand_sharded, directory, timeout=120)
    assert [r["step"] for r in results] == [ACCELERATE_STEPS, ACCELERATE_STEPS]
    for result in results:
        assert_params_equal(result["params"], saved["params"])
    (warning0,), (warning1,) = results[0]["warnings"], results[1]["warnings"]
    assert "RNG states were restored (from process 0" in warning0, warning0
    assert "RNG states were not restored (the saved run had no process 1)" in warning1, warning1


# -- Trainer tests -------------------------------------------------------------------------------------------------

def test_trainer_upstream_refuses_or_cannot_resume(first):
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.19"):
        for how, error in first["trainer_unpatched"].items():  # model= and model_init= alike
            assert error and "Resuming is not supported for models sharded at load time" in error, how


def test_trainer_checkpoints_and_total_limit(first):
    full = first["trainer"]
    assert list(full["losses"]) == [1, 2, 3, 4, 5, 6]
    assert full["checkpoints"] == ["checkpoint-4", "checkpoint-6"]  # save_total_limit=2
    stopped = first["trainer_stopped"]
    assert stopped["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert [stopped["losses"][s] for s in (1, 2, 3, 4)] == [full["losses"][s] for s in (1, 2, 3, 4)]


def test_trainer_resume_from_checkpoint_4_in_fresh_processes(tiny_models, root, first, second):
    result = second.run(trainer_run, tiny_models["qwen3"], scenario.LAYOUTS["fsdp"][1], os.path.join(root, "t-stop"),
                        resume=os.path.join(root, "t-stop", "checkpoint-4"), timeout=180)[0]
    full = first["trainer"]
    assert result["dcp_reads"] == [["model"], ["optimizer"]], "the weights are read once, the optimizer alone"
    assert {s: result["losses"][s] for s in (5, 6)} == {s: full["losses"][s] for s in (5, 6)}
    assert_params_equal(result["params"], full["params"])


def test_trainer_with_a_sharding_model_init_checkpoints_and_resumes(tiny_models, root, first, second):
    """Trainer(model_init=...) whose model_init shards while loading, as hyperparameter_search needs it: the same
    checkpoints as model=, and resume_from_checkpoint=True in fresh processes continues exactly."""
    stopped, full = first["trainer_init_stopped"], first["trainer"]
    assert stopped["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    assert stopped["losses"] == {s: full["losses"][s] for s in (1, 2, 3, 4)}
    result = second.run(trainer_run, tiny_models["qwen3"], scenario.LAYOUTS["fsdp"][1], os.path.join(root, "t-init"),
                        resume=True, model_init=True, timeout=180)[0]
    assert {s: result["losses"][s] for s in (5, 6)} == {s: full["losses"][s] for s in (5, 6)}
    assert_params_equal(result["params"], full["params"])


def test_trainer_crash_mid_save_resumes_previous(tiny_models, root, first, second):
    crashed = os.path.join(root, "t-crash")
    assert sorted(os.listdir(crashed)) == [".checkpoint-4.partial", "checkpoint-2"]
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="interrupted.*checkpoint-2"):
        checkpoint.read_info(os.path.join(crashed, ".checkpoint-4.partial"))
    result = second.run(trainer_run, tiny_models["qwen3"], scenario.LAYOUTS["fsdp"][1], crashed, resume=True,
                        timeout=180)[0]
    full = first["trainer"]
    assert {s: result["losses"][s] for s in (3, 4, 5, 6)} == {s: full["losses"][s] for s in (3, 4, 5, 6)}
    assert_params_equal(result["params"], full["params"])


def test_trainer_final_save_model_is_consolidated(tiny_models, root, first):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(os.path.join(root, "t-export"), dtype=torch.float32)
    assert_params_equal(dict(plain.named_parameters()), first["trainer"]["params"])


def test_trainer_load_best_model_at_end(tiny_models, root, first, second):
    path, distributed = tiny_models["qwen3"], scenario.LAYOUTS["fsdp"][1]
    out = os.path.join(root, "t-best")
    result = second.run(trainer_run, path, distributed, out, model_init=True, max_steps=4, eval_strategy="steps",
                        eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                        greater_is_better=False, save_total_limit=1, timeout=180)[0]
    assert result["best"] and os.path.basename(result["best"]) in result["checkpoints"]
    best = second.run(checkpoint_params, path, distributed, result["best"], timeout=120)[0]
    assert_params_equal(result["params"], best)
