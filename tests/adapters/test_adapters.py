"""PEFT LoRA on load-time-sharded models (2 ranks), through the ordinary accelerate loop, equals one process.

Each layout trains a few optimizer steps with gradient accumulation and clipping: per-step loss and grad norm, the
adapter gradients of the last step and the adapter weights after training equal a one-process run on the same
global batches; the adapters are equal on every rank and the base weights unchanged. The adapter each run exports
with ``save_pretrained`` (every rank) loads in one process with equal outputs, and back onto a sharded base
(``shardadopt.testing.lora.training.check_lora_training``). transformers before 5.17 refuses LoRA on TP (checked there).
"""

from __future__ import annotations

import pytest

from shardadopt.testing.layouts import distributed_sizes
from shardadopt.testing.lora.common import ATTENTION, TARGETS
from shardadopt.testing.lora.training import check_lora_training, reference_cache

pytest.importorskip("peft", reason="the adapter tests need peft (shardadopt[peft])")

pytestmark = pytest.mark.multiproc

# EP: Qwen3-MoE with adapters on attention (LoRA on its expert tensors: tests/adapters/test_expert_lora.py)
MODELS = {"fsdp": "llama", "tp": "qwen3", "ep": "qwen3moe"}
DORA = {"use_dora": True}
DORA_HEAD = {**DORA, "modules_to_save": ["lm_head"]}


@pytest.fixture(scope="module")
def references(tiny_models):
    return reference_cache(tiny_models)


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_lora_training_matches_single_process(pool2, tiny_models, references, tmp_path, layout):
    sizes, dp = distributed_sizes(layout, 2)
    model = MODELS[layout]
    check_lora_training(pool2, tiny_models[model], model, sizes, dp, references, str(tmp_path))


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep"])
def test_dora_and_modules_to_save_train_like_one_process(pool2, tiny_models, references, tmp_path, layout):
    """DoRA (``use_dora=True``) with ``modules_to_save=["lm_head"]`` (EP: DoRA alone). DoRA's magnitude vector (one
    entry per output feature; colwise TP: sharded like the output, rowwise: whole, its weight norm summed over the TP
    group; FSDP: peft's own forward on the unsharded weight) starts as the whole base weight's norm; peft's copy of
    the head (FSDP: lm_head, tied to the embedding, in an FSDP unit; TP: plan ``colwise_gather_output``) is whole;
    both are averaged over the data-parallel ranks and exported whole."""
    sizes, dp = distributed_sizes(layout, 2)
    model = MODELS[layout]
    # Qwen3-MoE's lm_head (not tied) is an FSDP unit of its own: refused in modules_to_save (the refusal tests)
    overrides = DORA if model == "qwen3moe" else DORA_HEAD
    expected = references(model, dp, ATTENTION if model == "qwen3moe" else TARGETS, overrides)["grads"]
    assert any("lora_magnitude_vector" in n for n in expected)
    assert any(".modules_to_save." in n for n in expected) == ("modules_to_save" in overrides)
    check_lora_training(pool2, tiny_models[model], model, sizes, dp, references, str(tmp_path), overrides)


# the adapter active in each step; saved after 2: fsdp with "default" trained and inactive then, tp with "default"
# not trained yet (no optimizer state to restore: it starts fresh after loading, as in the uninterrupted run)
RESUME_PLANS = {"fsdp": ("default", "b", "default", "b"), "tp": ("b", "b", "default", "b")}


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_lora_save_state_load_state_resumes_exactly(pool2, tiny_models, tmp_path, layout):
    """Two adapters trained in turn (``set_adapter``), ``accelerator.save_state`` after 2 steps, ``load_state``
    into a fresh model: losses and both adapters bit for bit as the uninterrupted run; the checkpoint's model state
    is the adapters alone (both of them, byte for byte: the frozen base is left out), with the optimizer's."""
    import torch

    from shardadopt.adapters import dtensor_tensor_parallel
    from shardadopt.testing.lora.common import is_adapter
    from shardadopt.testing.lora.resume import resume_lora_rank

    sizes, dp = distributed_sizes(layout, 2)
    if "tp_size" in sizes and not dtensor_tensor_parallel():
        pytest.skip("LoRA on TP is refused before transformers 5.17 (test_lora_training_matches_single_process)")
    for result in pool2.run(resume_lora_rank, tiny_models[MODELS[layout]], sizes, dp, str(tmp_path / "state"),
                            RESUME_PLANS[layout]):
        assert result["resumed"] == result["straight"][2:], result
        for name, value in result["params"].items():
            assert torch.equal(result["resumed_params"][name], value), f"{name} differs from the uninterrupted run"
        entries = result["model_entries"]
        assert entries and all(is_adapter(k) for k in entries), [k for k in entries if not is_adapter(k)][:3]
        assert any(".lora_A.default." in k for k in entries) and any(".lora_A.b." in k for k in entries)
        assert sum(entries.values()) == result["adapter_bytes"]
        trained = set(RESUME_PLANS[layout][:2])  # optimizer state: for the adapters trained before the save
        for adapter in ("default", "b"):
            assert any(f".lora_B.{adapter}." in k for k in result["optimizer_entries"]) == (adapter in trained)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_adapters_equal_one_process_init_whatever_each_rank_seeded(pool2, tiny_models, layout):
    """Every rank seeded differently (rank 0 like the one-process run), two adapters (get_peft_model, add_adapter):
    every factor equals the one-process initialisation on every rank, sharded factors included (TP: the fan is the
    global shape's, independent of the TP size)."""
    import torch

    from shardadopt.adapters import dtensor_tensor_parallel
    from shardadopt.testing.lora.cases import adapter_case, initial_adapters

    sizes, _ = distributed_sizes(layout, 2)
    if "tp_size" in sizes and not dtensor_tensor_parallel():
        pytest.skip("LoRA on TP is refused before transformers 5.17 (test_lora_training_matches_single_process)")
    expected = initial_adapters(tiny_models[MODELS[layout]])
    assert any(".second." in n for n in expected)
    for rank, result in enumerate(pool2.run(adapter_case, tiny_models[MODELS[layout]], sizes, "seeds-differ")):
        assert sorted(result["init"]) == sorted(expected)
        for name, value in expected.items():
            assert torch.equal(result["init"][name], value), f"rank {rank}: initial {name} differs from one process"


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_several_adapters_train_switch_export_and_reload_like_one_process(pool2, tiny_models, tmp_path, layout):
    """Two adapters as peft's docs use them (``get_peft_model``, ``add_adapter("b")``, ``set_adapter`` back and
    forth, only the active one training), ``add_weighted_adapter`` (refused on TP), ``save_pretrained`` (all
    adapters: default at the root, "b" in a subfolder), ``PeftModel.from_pretrained`` + ``load_adapter`` in one
    process and onto a sharded base, ``delete_adapter`` and ``add_adapter`` again under the same name: against one
    process on the same global batches (``shardadopt.testing.lora.several.check_several_adapters``)."""
    from shardadopt.testing.lora.several import check_several_adapters

    sizes, dp = distributed_sizes(layout, 2)
    check_several_adapters(pool2, tiny_models[MODELS[layout]], sizes, dp, str(tmp_path))


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_nora_init_trains_like_one_process(pool2, tiny_models, references, tmp_path, layout):
    """``init_lora_weights="nora"`` (peft 0.22: the default factors with ``lora_A``'s columns normalised, no base
    weight read) is allowed and trains like one process with the same initialisation."""
    from peft.tuners.lora.layer import LoraLayer

    if not hasattr(LoraLayer, "nora_init"):
        pytest.skip("this peft has no NoRA initialisation (0.21 raises 'Unknown initialization' in one process too)")
    sizes, dp = distributed_sizes(layout, 2)
    check_lora_training(pool2, tiny_models[MODELS[layout]], MODELS[layout], sizes, dp, references, str(tmp_path),
                        overrides={"init_lora_weights": "nora"})


REFUSED = [  # (case, layout, what the error names)
    ("pissa", "fsdp", "init_lora_weights='pissa'"),
    ("astra", "fsdp", "init_lora_weights='astra' (computed from the whole base weight and the activations"),
    ("gather-output-plan", "tp", "tensor-parallel plan 'colwise_gather_output'"),
    ("save-sharded-module", "tp", "modules_to_save of a module with tensor-parallel plan 'colwise'"),
    ("save-fsdp-unit", "fsdp", "modules_to_save of a module that is an FSDP unit of its own"),
    ("added-before-enable", "fsdp", "were added without shardadopt laying them out"),
    ("merge", "fsdp", "merging LoRA adapters into a model sharded at load time is not supported"),
]


@pytest.mark.parametrize("case, layout, message", REFUSED, ids=[c for c, _, _ in REFUSED])
def test_unsupported_adapter_combinations_are_refused_by_name(pool2, tiny_models, case, layout, message):
    from shardadopt.adapters import dtensor_tensor_parallel
    from shardadopt.testing.lora.cases import adapter_case

    sizes, _ = distributed_sizes(layout, 2)
    messages = [message]
    if "tp_size" in sizes and not dtensor_tensor_parallel():  # TP layouts: refused for the release where it applies
        messages.append("tensor parallelism on transformers before 5.17")
    for result in pool2.run(adapter_case, tiny_models[MODELS[layout]], sizes, case):
        assert result["error"] and result["error"].startswith("AdapterLayoutError"), result
        assert any(m in result["error"] for m in messages), result


@pytest.mark.parametrize("option", ["keep_frozen_units_gathered", "keep_frozen_units_gathered_across_steps"])
def test_lora_with_frozen_units_gathered_trains_like_one_process(pool2, tiny_models, references, tmp_path, option):
    """``AdoptionKwargs(keep_frozen_units_gathered=True)`` (the base's FSDP units stay unsharded from forward to
    backward and across a step's micro-batches), or kept across steps too, trains exactly like one process too
    (without it: test_lora_training_matches_single_process)."""
    sizes, dp = distributed_sizes("fsdp", 2)
    check_lora_training(pool2, tiny_models["llama"], "llama", sizes, dp, references, str(tmp_path),
                        adoption={option: True})


@pytest.mark.parametrize("gathered", [False, True, "across_steps"],
                         ids=["upstream", "frozen-units-gathered", "gathered-across-steps"])
@pytest.mark.parametrize("model", ["llama", "qwen3"])  # tied embeddings (head kept gathered by upstream) and not
def test_lora_step_issues_the_collectives_the_layout_needs(pool2, tiny_models, model, gathered):
    """Per optimizer step of LoRA on an fsdp_size=2 load (2 micro-batches): the adapters' gradients are averaged by
    one all_reduce (all factors together, not one per factor); the frozen base issues no reduce-scatter; each FSDP
    parameter group is all-gathered once per micro-batch's forward, and the decoder layers, which upstream reshards
    after forward, once more in its backward, unless ``keep_frozen_units_gathered`` keeps them: then once per
    optimizer step in all (kept gathered across the micro-batches too), or, kept across steps too, once in the first
    step and never again. Counts, not times (``CommDebugMode``)."""
    from shardadopt.testing.lora.collectives import count_lora_step_collectives

    sizes, dp = distributed_sizes("fsdp", 2)
    for rank, result in enumerate(pool2.run(count_lora_step_collectives, tiny_models[model], sizes, dp, gathered)):
        groups, accum, layers, kept = result["groups"], result["accum"], result["layers"], result["kept"]
        assert result["units"] == result["frozen_units"] and groups > layers >= 2, result
        assert (result["held"] > 0) == bool(gathered), result
        assert kept == groups if gathered else kept < groups - layers, result
        for step, counts in enumerate(result["per_step"]):
            what = f"rank {rank} step {step} ({result})"
            assert counts["adapter_averages"] == 1, f"{what}: adapter gradients averaged in {counts} all_reduces"
            assert counts["reduce_scatter"] == 0, f"{what}: frozen units reduce-scattered"
            # kept gathered: every group once per step (the first micro-batch's forward), whatever the accumulation.
            # Upstream, per micro-batch: every group in forward, and the groups resharded after forward again in
            # backward, the layers at least (their input gradient needs the weights), the embedding too when
            # FSDP2's backward prefetch gathers it (qwen3), though it has no backward
            if gathered:
                expected = groups if step == 0 or gathered is True else 0
                assert counts["all_gather"] == expected, f"{what}: {counts['all_gather']} all-gathers, not {expected}"
            else:
                backward = counts["all_gather"] / accum - groups
                assert layers <= backward <= groups - kept, f"{what}: {backward} all-gathers per backward"


def test_trainer_lora_with_frozen_units_gathered_trains_alike_with_fewer_all_gathers(pool2, tiny_models, tmp_path):
    """A Trainer user turns the option on with ``keep_frozen_units_gathered(model)`` after ``get_peft_model`` (the
    Trainer builds its own Accelerator): the plain transformers Trainer (accumulation 2, clipping) on an fsdp_size=2
    load logs the same losses and grad norms as without it, and each optimizer step all-gathers every FSDP parameter
    group once (the layout's need), where upstream gathers more."""
    from shardadopt.testing.lora.collectives import trainer_lora_run

    sizes, dp = distributed_sizes("fsdp", 2)
    runs = {gathered: pool2.run(trainer_lora_run, tiny_models["llama"], sizes, dp, gathered,
                                str(tmp_path / str(gathered)), timeout=300) for gathered in (False, True)}
    for rank, (upstream_run, kept) in enumerate(zip(runs[False], runs[True])):
        assert kept["held"] > 0 and upstream_run["held"] == 0, (rank, kept, upstream_run)
        assert len(kept["log"]) == len(kept["per_step"]) == 2, (rank, kept)
        assert kept["log"] == upstream_run["log"], f"rank {rank}: {kept['log']} != {upstream_run['log']}"
        for step, (before, after) in enumerate(zip(upstream_run["per_step"], kept["per_step"])):
            what = f"rank {rank} step {step}: {after} kept, {before} upstream, {kept['groups']} groups"
            assert after["all_gather"] == kept["groups"] < before["all_gather"], what
            assert after["reduce_scatter"] == before["reduce_scatter"] == 0, what


def test_average_gradients_issues_one_all_reduce_per_set_and_dtype(pool2):
    """``shardadopt.adapters.average_gradients``: every gradient equals the mean over the ranks of its group (computed
    here from every rank's gradients), with one all_reduce per (parameters, group) set and dtype: a world set of
    fp32 and fp64 gradients (2) and a subgroup set (1); a parameter without gradient is skipped."""
    import torch

    from shardadopt.testing.lora.collectives import average_gradient_sets

    for rank, result in enumerate(pool2.run(average_gradient_sets)):
        assert result["calls"] == result["issued"] == 3 and result["untouched"], result
        for index, grad in enumerate(result["grads"]):
            mean = torch.stack([grads[index] for grads in result["rank_grads"]]).mean(0)
            torch.testing.assert_close(grad, mean, rtol=0, atol=0, msg=f"rank {rank} gradient {index}")
