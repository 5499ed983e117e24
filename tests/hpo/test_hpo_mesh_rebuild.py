"""2-D device meshes after ``rebuild_world()``: the trial after a fault computes on the rebuilt process groups.

torch's DTensor caches sharding propagation by device mesh, and meshes compare equal by rank layout and dim names,
not by process group; torch also numbers process groups from 0 again once the default group is destroyed. Before
the fix, a mesh built after a rebuild hit cache entries of the previous generation's mesh: the next trial's tensors
lived on the destroyed mesh, whose group names were gone ("Could not resolve the process group registered under
the name 10" while the next trial's model loaded) or named new, unrelated groups. ``rebuild_world`` empties those
caches now.

One 4-rank pool for the module, in user shape:

- a custom loop (both dependency sets): a 2-D (fsdp x tp) mesh built before ``shardadopt.hpo.optimize`` and built
  again when ``shardadopt.fence.generation()`` changes, as the README says; rank 1 raises in trial 0 after a
  tensor-parallel product; trial 1's product must equal the one computed in one process;
- ``Trainer.hyperparameter_search`` with a ``model_init`` loading ``DistributedConfig(fsdp_size=2, tp_size=2)``
  (transformers 5.18+): a forward hook raises on rank 1 in trial 0; trial 1 trains, and its logged losses equal a
  fresh search's running the same parameters (enqueued) without a fault.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.multiproc

CONTROL_TIMEOUT = 600.0
BOUND = 30.0  # seconds from the fault to every rank in the next trial (measured: a few seconds on 2 loaded cores)
MAX_STEPS = 3
PER_DEVICE_BATCH = 2


class InjectedFault(RuntimeError):
    pass


# -- a custom loop keeping a mesh of its own ---------------------------------------------------------------------------

def _factors(scale: float):
    import torch

    g = torch.Generator().manual_seed(3)
    return scale * torch.randn(4, 6, generator=g), torch.randn(6, 8, generator=g)


def _product_in_one_process(scale: float):
    a, b = _factors(scale)
    return a @ b


def _custom_loop_search() -> dict:
    """On every rank: a search whose objective multiplies tensor-parallel DTensors on a 2-D mesh of its own."""
    import optuna
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardadopt import fence
    from shardadopt.hpo import ControlOptions, optimize

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rank = dist.get_rank()
    mesh = {"generation": fence.generation(), "mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))}
    seen: dict = {"products": []}

    def objective(trial):
        scale = trial.suggest_float("scale", 0.5, 2.0)
        if mesh["generation"] != fence.generation():  # the groups were rebuilt: a mesh of the new ones
            mesh.update(generation=fence.generation(),
                        mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp")))
        a, b = _factors(scale)
        # a's columns and b's rows split over tp: the local products are partial sums over the tp group
        product = distribute_tensor(a, mesh["mesh"], [Replicate(), Shard(1)]) @ \
            distribute_tensor(b, mesh["mesh"], [Replicate(), Shard(0)])
        full = product.full_tensor()
        if trial.number == 0 and rank == 1:
            seen["fault_at"] = time.time()
            raise InjectedFault("injected on rank 1 after a tensor-parallel product")
        seen["products"].append((trial.number, scale, full.tolist(), product.device_mesh is mesh["mesh"]))
        return float(full.sum())

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=2)) if rank == 0 else None
    optimize(study, objective, n_trials=2, catch=(InjectedFault,), control=ControlOptions(timeout=CONTROL_TIMEOUT))
    seen["table"] = [(t.number, t.state.name, t.params, dict(t.user_attrs)) for t in study.trials] if study else None
    return seen


def test_custom_mesh_rebuilt_after_a_fault_computes_on_the_new_groups(pool4):
    import torch

    results = pool4.run(_custom_loop_search, timeout=300)
    table = results[0]["table"]
    assert [state for _, state, _, _ in table] == ["FAIL", "COMPLETE"], table
    assert table[0][3]["failure_rank"] == 1 and "injected on rank 1" in table[0][3]["failure_message"]
    for rank, seen in enumerate(results):
        ((number, scale, product, on_its_mesh),) = [entry for entry in seen["products"] if entry[0] == 1]
        assert scale == table[1][2]["scale"]
        assert on_its_mesh, f"rank {rank}: the product lives on an earlier generation's mesh"
        torch.testing.assert_close(torch.tensor(product), _product_in_one_process(scale))


# -- Trainer.hyperparameter_search with a 2-D model_init --------------------------------------------------------------

def _space(trial) -> dict:
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)}


def _trainer_search(model_path: str, out: str, name: str, fault: bool, n_trials: int,
                    enqueue: dict | None = None) -> dict:
    """On every rank: one search; per trial its parameters, logged losses and start time; the fault time."""
    import optuna
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.distributed import DistributedConfig

    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.models import token_dataset

    rank = dist.get_rank()
    forget_accelerate_state()
    marks: dict = {"trials": []}

    def model_init(trial=None):
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=2, tp_size=2))
        if fault and trial is not None and trial.number == 0 and rank == 1:
            calls = {"n": 0}

            def hook(module, args, output):
                calls["n"] += 1
                if calls["n"] == 2:  # the second step's forward
                    marks["fault_at"] = time.time()
                    raise InjectedFault("injected on rank 1 in a forward hook")

            model.get_input_embeddings().register_forward_hook(hook)
        return model

    class Losses(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["trials"].append({"params": dict(state.trial_params or {}), "losses": [], "began": time.time()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                marks["trials"][-1]["losses"].append(logs["loss"])

    args = TrainingArguments(output_dir=f"{out}/{name}", per_device_train_batch_size=PER_DEVICE_BATCH,
                             max_steps=MAX_STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model_init=model_init, args=args, train_dataset=token_dataset(16),
                      eval_dataset=token_dataset(4, 1000), callbacks=[Losses()])
    storage = f"sqlite:///{out}/{name}.db"
    if enqueue is not None and rank == 0:
        optuna.create_study(storage=storage, study_name=name).enqueue_trial(enqueue)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trainer.hyperparameter_search(
        backend="optuna", n_trials=n_trials, direction="minimize", storage=storage, study_name=name,
        hp_space=_space,
        sampler=optuna.samplers.RandomSampler(seed=0), catch=(InjectedFault,), control_timeout=CONTROL_TIMEOUT)
    if rank == 0:
        study = optuna.load_study(study_name=name, storage=storage)
        marks["table"] = [(t.number, t.state.name, t.params, dict(t.user_attrs)) for t in study.trials]
    return marks


def _trainer_searches(model_path: str, out: str) -> dict:
    import shardadopt

    shardadopt.enable()
    try:
        got = _trainer_search(model_path, out, "faulted", True, 2)
        fresh = _trainer_search(model_path, out, "fresh", False, 1, enqueue=got["trials"][-1]["params"])
        return {"got": got, "fresh": fresh}
    finally:
        shardadopt.disable()


def test_trainer_search_with_a_2d_model_init_recovers_from_a_fault(pool4, tiny_models, tmp_path):
    from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes

    try:
        distributed_sizes("2d", 4)
    except LayoutUnsupported as exc:
        pytest.skip(str(exc))
    results = pool4.run(_trainer_searches, tiny_models["qwen3"], str(tmp_path), timeout=500)
    table = results[0]["got"]["table"]
    assert [state for _, state, _, _ in table] == ["FAIL", "COMPLETE"], table
    attrs = table[0][3]
    assert attrs["failure_rank"] == 1 and "injected on rank 1 in a forward hook" in attrs["failure_message"], attrs
    fault_at = results[1]["got"]["fault_at"]
    for rank, result in enumerate(results):
        next_trial = result["got"]["trials"][-1]
        assert next_trial["params"] == table[1][2]
        assert 0 <= next_trial["began"] - fault_at < BOUND, f"rank {rank} began the next trial late"
        (fresh,) = result["fresh"]["trials"]
        assert fresh["params"] == next_trial["params"]
        assert len(next_trial["losses"]) == MAX_STEPS
        assert next_trial["losses"] == pytest.approx(fresh["losses"], rel=1e-5), \
            f"rank {rank}: the trial after the fault trains as a fresh search does"
