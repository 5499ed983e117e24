"""``Trainer.hyperparameter_search(backend="optuna")`` over LoRA: ``model_init`` loads sharded and adds adapters.

What a user writes to tune LoRA's rank and alpha with the Trainer (the PEFT and Trainer docs' shapes): ``hp_space``
samples ``learning_rate``, ``r`` and ``lora_alpha``; ``model_init(trial)`` loads the checkpoint with
``DistributedConfig`` and wraps it with ``get_peft_model(model, LoraConfig(r=trial.suggest_categorical(...), ...))``
(with ``trial=None`` once when the Trainer is built: a default adapter). Each search runs several short trials on 2
ranks of one pool; the reference is the same search, same sampler seed, on the plain checkpoint in one process with
the same global batch (the Trainer on FSDP and TP loads equals one process, tests/trainer/test_trainer_parity.py; a TP
run,
one data-parallel rank, takes the whole global batch per device). Per trial: the parameters, per-step loss and grad
norm, the adapters after training and the objective equal the one-process trial's; the
adapters are bit-equal on every rank, only adapters train and the base weights are unchanged; the objective Optuna
recorded is the eval loss of that trial's adapter recomputed here in one process; and no earlier trial's model is
alive when the next one is built. On TP this needs the search to rebuild accelerate's state once the model exists
(upstream builds the Trainer's first accelerator before ``model_init`` ran, without the model's ``ParallelismConfig``,
and accelerate keeps that first state: the TP ranks trained on different batches; patch
``trainer-model-init-parallelism``).
"""

from __future__ import annotations

import pytest

from shardadopt.testing.layouts import distributed_sizes

pytest.importorskip("peft", reason="the adapter tests need peft (shardadopt[peft])")

pytestmark = pytest.mark.multiproc

N_TRIALS = 3
STEPS = 2
GLOBAL_BATCH = 4
EVAL_SAMPLES = 8
RANKS = (2, 4, 8)
ALPHAS = (4, 16)
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
MODEL = "qwen3"  # q/v/o colwise and rowwise, down_proj rowwise on TP


def hp_space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True),
            "r": trial.suggest_categorical("r", RANKS),
            "lora_alpha": trial.suggest_categorical("lora_alpha", ALPHAS)}


def lora_search(model_path: str, layout: str | None, out: str) -> dict:
    """The search on ``model_path`` sharded per ``layout`` over the pool's 2 ranks, or plain (``layout=None``) in
    one process without torch.distributed: per trial what this rank saw, and on rank 0 the study's trials."""
    import gc
    import weakref

    import optuna
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import shardadopt
    from shardadopt import upstream
    from shardadopt.testing import full
    from shardadopt.testing.models import token_dataset

    shardadopt.enable()
    try:
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        upstream.reset_accelerate_state()
        load = {"dtype": torch.float32}
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        dp = world
        if layout is not None:
            from transformers.distributed import DistributedConfig

            sizes, dp = distributed_sizes(layout, world)
            load["distributed_config"] = DistributedConfig(**sizes)
        built: list = []  # weak references to every model model_init returned
        alive_at_init: list[int] = []  # per model_init call: earlier models still alive

        def model_init(trial=None):
            gc.collect()
            alive_at_init.append(sum(ref() is not None for ref in built))
            model = AutoModelForCausalLM.from_pretrained(model_path, **load)
            if trial is None:  # the Trainer builds one model before any trial
                r, alpha = 8, 16
            else:
                r = trial.suggest_categorical("r", RANKS)
                alpha = trial.suggest_categorical("lora_alpha", ALPHAS)
            model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                     target_modules=TARGETS, task_type="CAUSAL_LM"))
            built.append(weakref.ref(model))
            return model

        class Record(TrainerCallback):
            def __init__(self):
                self.trials: list[dict] = []

            def on_train_begin(self, args, state, control, model=None, **kwargs):
                self.base = {n: _local(p).clone() for n, p in model.named_parameters() if "lora_" not in n}
                self.trials.append({
                    "params": dict(state.trial_params or {}), "log": [],
                    "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
                    "init": {n: full(p).detach().clone() for n, p in model.named_parameters() if "lora_" in n}})

            def on_log(self, args, state, control, logs=None, **kwargs):
                if "loss" in (logs or {}):
                    self.trials[-1]["log"].append({"loss": logs["loss"], "grad_norm": float(logs["grad_norm"])})

            def on_train_end(self, args, state, control, model=None, **kwargs):
                trial = self.trials[-1]
                trial["adapters"] = {n: full(p).detach().clone() for n, p in model.named_parameters()
                                     if "lora_" in n}
                trial["base_unchanged"] = all(torch.equal(_local(p), self.base[n])
                                              for n, p in model.named_parameters() if n in self.base)

            def on_evaluate(self, args, state, control, metrics=None, **kwargs):
                self.trials[-1]["eval_loss"] = metrics["eval_loss"]

        record = Record()
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=STEPS,
                                 lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                                 eval_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                                 per_device_eval_batch_size=EVAL_SAMPLES // dp)
        trainer = Trainer(model_init=model_init, args=args, train_dataset=token_dataset(STEPS * GLOBAL_BATCH),
                          eval_dataset=token_dataset(EVAL_SAMPLES, 1000), callbacks=[record])
        trainer.remove_callback(PrinterCallback)
        storage = f"sqlite:///{out}/study.db"
        best = trainer.hyperparameter_search(
            backend="optuna", hp_space=hp_space, n_trials=N_TRIALS, direction="minimize", storage=storage,
            study_name="lora", sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner())
        gc.collect()
        table = None
        if rank == 0:
            study = optuna.load_study(study_name="lora", storage=storage)
            table = [(t.number, t.state.name, t.params, t.value) for t in study.trials]
        return {"trials": record.trials, "table": table, "best": best, "alive_at_init": alive_at_init,
                "alive_after": sum(ref() is not None for ref in built)}
    finally:
        shardadopt.disable()


def _local(param):
    """This rank's local values of a parameter (a DTensor's shard, or the tensor)."""
    from torch.distributed.tensor import DTensor

    from shardadopt import upstream

    return upstream.dtensor_local(param.detach()) if isinstance(param, DTensor) else param.detach()


def eval_loss_in_one_process(model_path: str, params: dict, adapters: dict) -> float:
    """The eval loss of a trial's trained adapter, on the plain checkpoint in this process."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardadopt.testing.models import token_dataset

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                           LoraConfig(r=params["r"], lora_alpha=params["lora_alpha"], lora_dropout=0.0,
                                      target_modules=TARGETS, task_type="CAUSAL_LM"))
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and not [n for n in missing if "lora_" in n], (unexpected, missing)
    data = token_dataset(EVAL_SAMPLES, 1000)
    ids = torch.stack([data[i]["input_ids"] for i in range(EVAL_SAMPLES)])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    """The search on the plain checkpoint in this process, with the same global batch: the Trainer on these loads
    equals one process (tests/trainer/test_trainer_parity.py), and so does the DDP search of the plain checkpoint."""
    return lora_search(tiny_models[MODEL], None, str(tmp_path_factory.mktemp("hpo-lora-single")))


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_lora_search_trials_equal_the_plain_search(pool2, tiny_models, reference, tmp_path, layout):
    import torch

    from shardadopt.adapters import dtensor_tensor_parallel

    sizes, _ = distributed_sizes(layout, 2)
    if "tp_size" in sizes and not dtensor_tensor_parallel():
        pytest.skip("LoRA on TP is refused before transformers 5.17 "
                    "(tests/adapters/test_adapters.py checks the refusal)")
    results = pool2.run(lora_search, tiny_models[MODEL], layout, str(tmp_path), timeout=600)
    first = results[0]
    expected = reference
    assert [row[:3] for row in first["table"]] == [row[:3] for row in expected["table"]]
    assert all(state == "COMPLETE" for _, state, _, _ in first["table"])
    assert len({(p["r"], p["lora_alpha"]) for _, _, p, _ in first["table"]}) > 1, "trials differ in r/alpha"
    for rank, result in enumerate(results):
        # each trial's model_init finds no earlier model alive (the one the Trainer built at construction included)
        assert result["alive_at_init"] == [0] * (N_TRIALS + 1), result["alive_at_init"]
        assert result["alive_after"] == 0
        assert len(result["trials"]) == N_TRIALS
        for number, (trial, ref) in enumerate(zip(result["trials"], first["trials"])):
            assert trial["params"] == ref["params"] == first["table"][number][2]
            assert trial["base_unchanged"], f"rank {rank} trial {number}: a base weight changed"
            assert trial["trainable"] and all("lora_" in n for n in trial["trainable"]), trial["trainable"]
            for key in ("init", "adapters"):
                assert sorted(trial[key]) == sorted(ref[key])
                for name, value in trial[key].items():
                    assert torch.equal(value, ref[key][name]), f"trial {number}: {key} {name} differs on rank {rank}"
            assert trial["log"] == ref["log"] and trial["eval_loss"] == ref["eval_loss"]
    for number, (trial, ref) in enumerate(zip(first["trials"], expected["trials"])):
        r = trial["params"]["r"]
        assert all(v.shape[0] == r or v.shape[1] == r for v in trial["adapters"].values())
        for name, value in ref["init"].items():
            assert torch.equal(trial["init"][name], value), f"trial {number}: initial {name} differs from the reference"
        for got, want in zip(trial["log"], ref["log"], strict=True):
            assert got == pytest.approx(want, rel=1e-5), f"trial {number}: {trial['log']} vs {ref['log']}"
        for name, value in ref["adapters"].items():
            # Adam turns reduction-order noise in a near-zero gradient entry into a step-sized difference: 1 of 512
            # entries differs by a few 1e-5 of the factor's scale on some CPUs; an unreduced gradient is off by ~lr.
            torch.testing.assert_close(trial["adapters"][name], value, rtol=1e-4,
                                       atol=max(1e-6, 1e-3 * value.abs().max().item()),
                                       msg=lambda m, n=number, k=name: f"trial {n}: adapter {k} after training: {m}")
        assert first["table"][number][3] == pytest.approx(expected["table"][number][3], rel=1e-5)
        # the objective Optuna recorded is the eval loss of this trial's adapter
        recomputed = eval_loss_in_one_process(tiny_models[MODEL], trial["params"], trial["adapters"])
        assert first["table"][number][3] == trial["eval_loss"] == pytest.approx(recomputed, rel=1e-5)
    assert first["best"] == results[1]["best"]
    assert first["best"].run_id == str(min(first["table"], key=lambda row: row[3])[0])
