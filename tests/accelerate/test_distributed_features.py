"""``DistributedConfig``'s FSDP policy, pipeline and EP-implementation options with accelerate, PEFT and Trainer.

``ep_implementation`` (``all_to_all``, ``all_reduce``) trains like one process on the same global batch;
``fsdp_cpu_offload``, ``fsdp_mixed_precision``, ``pp_size > 1`` and DeepGEMM Mega MoE are refused at ``prepare``
(a model or a PEFT model) and in ``Trainer.train`` (which 5.25 prepares past adoption, in evaluation mode) with an
error that names the option and what to load instead; an evaluation-only ``Trainer.evaluate()`` of such a load runs
upstream's path. Releases without these options skip (with the reason).
"""

from __future__ import annotations

import pytest
import transformers
from transformers.distributed import DistributedConfig

from shardadopt.selftest.accelerate import compare_training, train_rank, train_reference

FIELDS = DistributedConfig.__dataclass_fields__


def _has(name: str):
    return pytest.mark.skipif(name not in FIELDS,
                              reason=f"transformers {transformers.__version__}'s DistributedConfig has no {name}")


def prepare_outcome(path: str, sizes: dict, how: str) -> str:
    """On every rank: load ``path`` with ``sizes`` after ``enable()`` and hand it to ``how`` (``accelerate``:
    ``Accelerator.prepare``; ``peft``: a LoRA model to ``prepare``; ``trainer``: ``Trainer.train``); what it raised."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import shardadopt
    from shardadopt.selftest.trainer import TokenDataset
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(**sizes))
        if how == "peft":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        if how == "trainer":
            with tempfile.TemporaryDirectory() as out:
                args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1, use_cpu=True,
                                         report_to=[], save_strategy="no", disable_tqdm=True)
                Trainer(model=model, args=args, train_dataset=TokenDataset(4)).train()
        else:
            fresh_accelerator(cpu=True).prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return "trained" if how == "trainer" else "prepared"
    except Exception as exc:  # noqa: BLE001  (the test compares what each rank raised)
        return f"{type(exc).__name__}: {exc}"
    finally:
        shardadopt.disable()


REFUSED = [
    pytest.param({"fsdp_size": 2, "fsdp_cpu_offload": True}, "AdoptionError: DistributedConfig(fsdp_cpu_offload=True)",
                 "load without it", marks=_has("fsdp_cpu_offload"), id="fsdp_cpu_offload"),
    pytest.param({"fsdp_size": 2, "fsdp_mixed_precision": True},
                 "AdoptionError: DistributedConfig(fsdp_mixed_precision=True)", 'mixed_precision="bf16"',
                 marks=_has("fsdp_mixed_precision"), id="fsdp_mixed_precision"),
    pytest.param({"pp_size": 2}, "TopologyError: DistributedConfig(pp_size=2)", "Supported: fsdp_size, tp_size",
                 marks=_has("pp_size"), id="pp_size"),
    pytest.param({"fsdp_size": 2, "ep_implementation": "deepgemm_megamoe"},
                 "AdoptionError: DistributedConfig(ep_implementation='deepgemm_megamoe')",
                 'load with ep_implementation="all_to_all"', marks=_has("ep_implementation"), id="deepgemm_megamoe"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["accelerate", "peft", "trainer"])
@pytest.mark.parametrize("sizes, names, fix", REFUSED)
def test_unsupported_option_is_refused_by_name(pool2, tiny_models, sizes, names, fix, how):
    outcomes = pool2.run(prepare_outcome, tiny_models["qwen3"], sizes, how, timeout=180)
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0].startswith(names) and fix in outcomes[0], outcomes[0]


EVAL_SAMPLES = 8


def evaluate_then_train(path: str, sizes: dict | None, dtype: str = "float32") -> tuple[float, str]:
    """On every rank (or, with ``sizes=None``, in one process on the plain checkpoint loaded in ``dtype``): load
    ``path`` with ``sizes`` after ``enable()``, ``Trainer.evaluate()``, then ``Trainer.train()``; the eval loss and
    "trained" or what training raised."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments

    import shardadopt
    from shardadopt.selftest.trainer import TokenDataset
    from shardadopt.testing.accelerator import forget_accelerate_state

    shardadopt.enable()
    try:
        kwargs = {} if sizes is None else {"distributed_config": DistributedConfig(**sizes)}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kwargs)
        forget_accelerate_state()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                     max_steps=1, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
            trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(4),
                              eval_dataset=TokenDataset(EVAL_SAMPLES))
            trainer.remove_callback(PrinterCallback)
            loss = trainer.evaluate()["eval_loss"]
            try:
                trainer.train()
            except Exception as exc:  # noqa: BLE001  (the test compares what each rank raised)
                return loss, f"{type(exc).__name__}: {exc}"
            return loss, "trained"
    finally:
        shardadopt.disable()


# option -> the model it is loaded on and the dtype one process computes in: FSDP2's bf16 parameter policy
# all-gathers bf16 parameters and computes in bf16
EVALUATED = [
    pytest.param({"fsdp_size": 2, "fsdp_mixed_precision": True}, "qwen3", "bfloat16",
                 "AdoptionError: DistributedConfig(fsdp_mixed_precision=True)", marks=_has("fsdp_mixed_precision"),
                 id="fsdp_mixed_precision"),
    pytest.param({"fsdp_size": 2, "ep_implementation": "deepgemm_megamoe"}, "qwen3moe", "float32",
                 "AdoptionError: DistributedConfig(ep_implementation='deepgemm_megamoe')",
                 marks=_has("ep_implementation"), id="deepgemm_megamoe"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("sizes, model, dtype, refused", EVALUATED)
def test_evaluate_runs_and_train_is_refused(pool2, tiny_models, sizes, model, dtype, refused):
    """Evaluation alone is upstream's path (Trainer.evaluate prepares the model in evaluation mode): the same eval
    loss as one process on the global eval set; train() on the same Trainer is still refused by name.
    (``fsdp_cpu_offload`` is not evaluated here: upstream's own evaluation pins the offloaded shards, which needs
    CUDA, on a CPU-only machine; ``pp_size > 1`` stays refused at evaluation too: upstream's pipeline stages return
    no loss to evaluate.)"""
    expected, _ = evaluate_then_train(tiny_models[model], None, dtype)
    for loss, trained in pool2.run(evaluate_then_train, tiny_models[model], sizes, timeout=300):
        assert loss == pytest.approx(expected, rel=1e-6), (loss, expected)
        assert trained.startswith(refused), trained


# all_to_all exchanges tokens over ep_size=2 x fsdp_size=2 (two data-parallel ranks); all_reduce needs every rank of
# the expert group to hold the same batch (upstream refuses it unless ep_size == tp_size): ep_size=2 x tp_size=2.
EP_LAYOUTS = {"all_to_all": ({"ep_size": 2, "fsdp_size": 2}, 2), "all_reduce": ({"ep_size": 2, "tp_size": 2}, 1)}


@pytest.mark.multiproc
@_has("ep_implementation")
@pytest.mark.parametrize("implementation", sorted(EP_LAYOUTS))
def test_ep_implementation_matches_single_process(pool2, tiny_models, implementation):
    sizes, dp = EP_LAYOUTS[implementation]
    results = pool2.run(train_rank, tiny_models["qwen3moe"], {**sizes, "ep_implementation": implementation}, dp,
                        timeout=300)
    expected = train_reference(tiny_models["qwen3moe"], dp)
    for result in results:
        problem = compare_training(result, expected)
        assert problem is None, problem


def lora_outcome(path: str, targets: list[str]) -> str:
    """On every rank: a ``tp_size=2`` load of ``path`` after ``enable()``, LoRA on ``targets`` added with peft's
    ``get_peft_model``; "laid out" with the number of LoRA layers, or what it raised."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import shardadopt

    shardadopt.enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_size=2))
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
        return f"laid out: {sum(1 for n, _ in model.named_modules() if n.endswith('.lora_A'))} LoRA layers"
    except Exception as exc:  # noqa: BLE001  (the test compares what each rank raised)
        return f"{type(exc).__name__}: {exc}"
    finally:
        shardadopt.disable()


@pytest.mark.multiproc
def test_lora_on_unit_tp_plans_is_refused_by_name(pool2, tmp_path_factory):
    """transformers 5.25's ``unit_colwise`` plan (MiniCPM5-MoE's k/v projections: whole heads per rank, replicated
    over a second mesh dim) is not a layout the adapters know: LoRA on it is refused naming the plan and the fix;
    on the same model, LoRA on its colwise / rowwise projections is laid out."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "minicpm5_moe" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no minicpm5_moe (its unit_* TP plans)")
    from shardadopt.testing.archs import write_tiny

    path = write_tiny("minicpm5_moe", tmp_path_factory.mktemp("minicpm5"))
    refused = pool2.run(lora_outcome, path, ["k_proj", "v_proj"], timeout=180)
    assert len(set(refused)) == 1, refused
    assert refused[0].startswith("AdapterLayoutError") and "'unit_colwise'" in refused[0], refused[0]
    assert "leave this module out of target_modules" in refused[0], refused[0]
    laid_out = pool2.run(lora_outcome, path, ["q_gate_proj", "o_proj"], timeout=180)
    assert len(set(laid_out)) == 1, laid_out
    assert laid_out[0].startswith("laid out: ") and not laid_out[0].startswith("laid out: 0 "), laid_out[0]


@pytest.mark.multiproc
@pytest.mark.skipif("enable_expert_parallel" not in FIELDS,
                    reason=f"transformers {transformers.__version__}'s DistributedConfig has no enable_expert_parallel")
def test_enable_expert_parallel_matches_single_process(pool2, tiny_models):
    """``tp_size=2, enable_expert_parallel=True``: expert parallelism as transformers before 5.21 spells it (the
    experts on the TP mesh), deprecated since and still accepted (``ep_size=tp_size`` with an empty TP plan): the two
    ranks share one batch and train like one process."""
    results = pool2.run(train_rank, tiny_models["qwen3moe"], {"tp_size": 2, "enable_expert_parallel": True}, 1,
                        timeout=300)
    expected = train_reference(tiny_models["qwen3moe"], 1)
    for result in results:
        problem = compare_training(result, expected)
        assert problem is None, problem
