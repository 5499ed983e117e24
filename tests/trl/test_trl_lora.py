"""LoRA through TRL on load-time-sharded models tracks the same run on the plain checkpoint under DDP.

``SFTTrainer(model=<sharded>, peft_config=LoraConfig(...))``, ``SFTTrainer(model=get_peft_model(<sharded>, ...))``
and ``DPOTrainer(model=<sharded>, peft_config=...)`` (TRL's reference: the base with the adapter disabled), every
rank seeded the same before the adapters are added, as TRL's docs call them, on 2 ranks (fsdp, tp, ep+fsdp) and 4
(HSDP, 2-D); the reference is the same call on the plain checkpoint under DDP over 2 ranks with the same global
batch (workers: ``shardadopt.testing.trl``). LoRA on TP before transformers 5.17 (plain TP shards; EP there is on
the TP mesh) is refused when the adapters are added, naming the fix. LoRA on the experts of Qwen3-MoE loaded expert
parallel (``down_proj`` in ``target_modules`` through TRL, both fused expert tensors in ``target_parameters``
through the plain ``Trainer``: peft adapts the fused expert tensors) tracks DDP too, adapters and their export
included. An adapter run stopped after a checkpoint and resumed by a new trainer equals the uninterrupted run (with
expert adapters too, through the ``Trainer``).
"""

from __future__ import annotations

import pytest

from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.trl import FP32_RTOL, MODELS, MOE_RTOL, STEPS, compare, refusal_problem, trl_log

pytestmark = pytest.mark.multiproc

needs_ep_mesh = pytest.mark.skipif(
    "ep_size" not in distributed_sizes("ep", 2)[0],
    reason="transformers before 5.21 shards experts on the TP mesh (no ep_size): expert LoRA is refused there "
    "(test_expert_lora_tracks_ddp)")


def check_lora_run(results: list[dict], trl_ddp, kind: str, how: str, layout: str, sizes: dict,
                   experts: str | None = None, accum: int = 1, dtype: str = "float32") -> None:
    """Every rank tracks the DDP run of the same LoRA call, or (TP before transformers 5.17) is refused."""
    from shardadopt.adapters import dtensor_tensor_parallel

    refused = "tp_size" in sizes and not dtensor_tensor_parallel()
    expected = None if refused else trl_ddp(kind, MODELS[layout], lora=how, experts=experts, accum=accum,
                                            dtype=dtype)
    rtol = MOE_RTOL if layout == "ep" else FP32_RTOL
    for rank, result in enumerate(results):
        problem = refusal_problem(result, "lora-tp") if refused else compare(result, expected, rtol)
        assert problem is None, f"{kind} {how} {layout} rank {rank}: {problem}"
        if not refused:
            check_one_reduction_per_step(result, f"{kind} {how} {layout} rank {rank}")


def check_one_reduction_per_step(result: dict, what: str) -> None:
    """Each LoRA factor's gradient is averaged over the data-parallel ranks by one mechanism (shardadopt's, not also
    the Trainer's own sync of transformers 5.25+): one all_reduce per optimizer step, none without data parallelism.
    A factor on expert tensors is averaged over the ranks holding the same experts only: none when one rank holds
    them (its gradient already sums the whole EP group's tokens, docs/expert-lora.md)."""
    reductions = result["adapter_grad_reductions"]
    replicas = result.get("expert_replicas", {})

    def want(name: str) -> int:
        return STEPS if (replicas.get(name, result["dp"])) > 1 else 0

    wrong = {name: (calls, want(name)) for name, calls in reductions.items() if calls != want(name)}
    assert reductions and not wrong, (
        f"{what}: LoRA gradients reduced other than expected in {STEPS} steps (dp={result['dp']}, expert "
        f"replicas {sorted(set(replicas.values()))}): {{factor: (calls, expected)}} {wrong}")


# ep: Qwen3-MoE with adapters on attention (with its experts: test_expert_lora_tracks_ddp)
@pytest.mark.parametrize("kind, how, layout", [("sft", "peft_config", "fsdp"), ("sft", "wrapped", "fsdp"),
                                               ("sft", "peft_config", "tp"), ("sft", "wrapped", "tp"),
                                               ("sft", "peft_config", "ep"), ("dpo", "peft_config", "fsdp"),
                                               ("dpo", "peft_config", "tp")])
def test_lora_tracks_ddp(pool2, tiny_models, trl_tokenizer, trl_ddp, kind, how, layout):
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, kind, layout, MODELS[layout], lora=how, timeout=300)
    check_lora_run(results, trl_ddp, kind, how, layout, distributed_sizes(layout, 2)[0])


def test_expert_lora_tracks_ddp(pool2, tiny_models, trl_tokenizer, trl_ddp):
    """``SFTTrainer(peft_config=LoraConfig(target_modules=[q, v, o, "down_proj"]))`` on Qwen3-MoE loaded
    ``ep_size=2, fsdp_size=2``: peft puts ``down_proj`` on the fused expert tensors, laid out by expert. Loss, grad
    norm and every adapter factor after training (experts included) and its export equal the DDP run's; expert
    factors are reduced only over the ranks holding the same experts (here none). Before transformers 5.21 (EP on
    the TP mesh): refused by name."""
    from shardadopt.adapters import dtensor_tensor_parallel

    sizes = distributed_sizes("ep", 2)[0]
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, "sft", "ep", MODELS["ep"], lora="peft_config",
                        experts="down_proj", timeout=400)
    if "ep_size" not in sizes:
        cause = "experts-tp-mesh" if dtensor_tensor_parallel() else "lora-tp"
        for rank, result in enumerate(results):
            assert refusal_problem(result, cause) is None, f"rank {rank}: {refusal_problem(result, cause)}"
        return
    check_expert_lora_run(results, trl_ddp, "sft", "peft_config", "down_proj", expert_factors=4)


@needs_ep_mesh
def test_trainer_expert_lora_tracks_ddp(pool2, tiny_models, trl_tokenizer, trl_ddp):
    """The plain ``Trainer`` on ``get_peft_model(<Qwen3-MoE loaded ep_size=2, fsdp_size=2>, LoraConfig(
    target_modules=[q, v, o], target_parameters=[experts' gate_up_proj and down_proj]))``, as transformers' docs
    call it, accumulating 2 batches per step: loss, grad norm, every adapter factor after training and
    ``save_pretrained``'s file equal the same Trainer's on the plain checkpoint under DDP (same global batches); one
    gradient all_reduce per step for the attention factors, none for the expert ones (one rank per expert group).

    Both runs load the checkpoint in float64 (``experts_implementation="eager"``: CPU ``grouped_mm`` has no
    float64): in fp32 the EP run's other summation order, amplified by Adam on elements whose gradient is near its
    eps, put this case at the edge of ``params_close`` on one CPU and over it on another (docs/expert-lora.md).
    The fp32 ``grouped_mm`` path is compared in ``test_expert_lora_tracks_ddp`` and
    ``tests/adapters/test_expert_lora.py``."""
    results = pool2.run(trl_log, tiny_models, trl_tokenizer, "trainer", "ep", MODELS["ep"], lora="wrapped",
                        experts="parameters", accum=2, dtype="float64", timeout=400)
    check_expert_lora_run(results, trl_ddp, "trainer", "wrapped", "parameters", expert_factors=8, accum=2,
                          dtype="float64")


def check_expert_lora_run(results: list[dict], trl_ddp, kind: str, how: str, experts: str,
                          expert_factors: int, accum: int = 1, dtype: str = "float32") -> None:
    """Every rank of an expert-LoRA run (``experts`` as :func:`shardadopt.testing.trl.lora_config` reads it) tracks
    the DDP run: its log (:func:`check_lora_run`), its ``expert_factors`` factors on expert tensors and every other
    one after training, and the file ``save_pretrained`` wrote (the trained factors, bit for bit); both ranks hold the
    same adapter."""
    import torch

    from shardadopt.testing.lora.common import params_close

    check_lora_run(results, trl_ddp, kind, how, "ep", distributed_sizes("ep", 2)[0], experts=experts, accum=accum,
                   dtype=dtype)
    for part in ("adapter", "export"):  # the export: the file rank 0 wrote
        expected = trl_ddp(kind, MODELS["ep"], lora=how, experts=experts, part=part, accum=accum, dtype=dtype)
        on_experts = [name for name in expected if ".experts." in name]
        assert len(on_experts) == expert_factors, f"{part}: lora_A/lora_B on the expert tensors: {on_experts}"
        for rank, result in enumerate(results if part == "adapter" else results[:1]):
            assert sorted(result[part]) == sorted(expected), f"rank {rank} {part}: {sorted(result[part])[:4]}"
            bad = [n for n, v in expected.items() if not params_close(result[part][n], v)]
            assert not bad, f"rank {rank}: {part} differs from the DDP run's after training: {bad[:3]}"
            for name, value in result[part].items():
                assert torch.equal(value, results[0][part][name]), f"{part} {name}: rank {rank} vs rank 0"
    # the file holds the trained factors themselves, bit for bit
    trained = {name.replace(".default.", "."): value for name, value in results[0]["adapter"].items()}
    assert sorted(trained) == sorted(results[0]["export"]), (sorted(trained)[:2], sorted(results[0]["export"])[:2])
    assert all(torch.equal(value, trained[name]) for name, value in results[0]["export"].items())
    for result in results:
        assert set(result["expert_replicas"]) == {n for n in result["adapter_grad_reductions"] if ".experts." in n}


@pytest.mark.parametrize("layout", ["hsdp", "2d"])
def test_lora_four_ranks_track_ddp(request, tiny_models, trl_tokenizer, trl_ddp, layout):
    """``SFTTrainer(peft_config=...)`` on HSDP (``dp_replicate_size=2, fsdp_size=2``) and 2-D (``fsdp_size=2,
    tp_size=2``) loads over 4 ranks, against DDP over 2 with the same global batch."""
    try:
        sizes, _ = distributed_sizes(layout, 4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    pool = request.getfixturevalue("pool4")
    results = pool.run(trl_log, tiny_models, trl_tokenizer, "sft", layout, MODELS[layout], world=4,
                       lora="peft_config", timeout=400)
    check_lora_run(results, trl_ddp, "sft", "peft_config", layout, sizes)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("how", ["sft", "trainer"])
def test_adapter_run_resumes_exactly(pool2, tiny_models, trl_tokenizer, tmp_path, how, layout):
    """``SFTTrainer(peft_config=...)`` and ``Trainer`` on a ``get_peft_model`` model, stopped after checkpoint-2 and
    resumed with ``train(resume_from_checkpoint=True)`` by a new trainer on a fresh load (adapters initialised from
    another seed): the resumed steps' losses and grad norms and the final adapters equal the uninterrupted run's,
    on every rank."""
    from shardadopt.adapters import dtensor_tensor_parallel
    from shardadopt.testing.trl import resume_log

    results = pool2.run(resume_log, tiny_models, trl_tokenizer, how, layout, MODELS[layout], str(tmp_path),
                        timeout=600)
    if layout == "tp" and not dtensor_tensor_parallel():
        for result in results:
            assert refusal_problem(result, "lora-tp") is None, result
        return
    check_resumed_exactly(results, tiny_models[MODELS[layout]])


@needs_ep_mesh
def test_trainer_expert_adapter_run_resumes_exactly(pool2, tiny_models, trl_tokenizer, tmp_path):
    """``Trainer`` on a ``get_peft_model`` Qwen3-MoE loaded ``ep_size=2, fsdp_size=2`` with LoRA on both fused
    expert tensors (``target_parameters``), stopped after checkpoint-2 and resumed by a new trainer on a fresh load:
    as :func:`test_adapter_run_resumes_exactly`, bit for bit, expert factors included."""
    from shardadopt.testing.trl import resume_log

    results = pool2.run(resume_log, tiny_models, trl_tokenizer, "trainer", "ep", MODELS["ep"], str(tmp_path),
                        experts="parameters", timeout=600)
    assert all(any(".experts." in n for n in r.get("straight", {}).get("adapter", {})) for r in results), results
    check_resumed_exactly(results, tiny_models[MODELS["ep"]])


def check_resumed_exactly(results: list[dict], path: str) -> None:
    """Each rank's resumed run (:func:`shardadopt.testing.trl.resume_log`) equals its uninterrupted run: losses,
    grad norms and final adapters bit for bit, the same on every rank; checkpoint-2 and the final ``save_model``
    hold an ordinary PEFT adapter that one process loads onto the plain checkpoint at ``path``, and no base
    weights."""
    import torch

    from shardadopt.checkpoint.state import _saved_shapes as saved_shapes

    for rank, result in enumerate(results):
        assert "refused" not in result, result["refused"]
        straight, stopped, resumed = result["straight"], result["stopped"], result["resumed"]
        assert (stopped["global_step"], straight["global_step"], resumed["global_step"]) == (2, 4, 4)
        assert len(straight["log"]) == 4 and stopped["log"] == straight["log"][:2], (stopped["log"], straight["log"])
        assert resumed["log"] == straight["log"], f"rank {rank}: resumed {resumed['log']} vs {straight['log']}"
        assert sorted(resumed["adapter"]) == sorted(straight["adapter"]) and resumed["adapter"]
        for name, value in straight["adapter"].items():
            assert torch.equal(resumed["adapter"][name], value), f"rank {rank}: {name} differs after the resume"
            assert torch.equal(value, results[0]["straight"]["adapter"][name]), f"{name}: rank {rank} vs rank 0"
        assert not any(torch.equal(stopped["adapter"][n], v) for n, v in straight["adapter"].items()), \
            "some adapter factor did not change in the last two steps"
    # what the Trainer wrote, as upstream writes it for an adapter run: checkpoint-2 and the final save_model hold an
    # ordinary PEFT adapter (full tensors) that one process loads onto the plain checkpoint
    first = results[0]
    for run, directory, adapter in (("checkpoint-2", first["stopped"]["checkpoint"], first["stopped"]["adapter"]),
                                    ("save_model", first["resumed"]["final"], first["resumed"]["adapter"])):
        loaded = one_process_adapter(path, directory)
        assert sorted(loaded) == sorted(adapter), f"{run}: {sorted(loaded)[:2]} vs {sorted(adapter)[:2]}"
        for name, value in adapter.items():
            assert torch.equal(loaded[name], value), f"{run}: {name} differs from the trained adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(first["stopped"]["files"])
    # and, as upstream's adapter checkpoints, not the frozen base weights (the resume loads them from the model)
    weights = [k for k in saved_shapes(first["stopped"]["checkpoint"]) if k.startswith("model")]
    assert weights and all("lora_" in k for k in weights), [k for k in weights if "lora_" not in k][:3]


def one_process_adapter(path: str, directory: str) -> dict:
    """The LoRA factors of the adapter in ``directory`` loaded with ``PeftModel.from_pretrained`` in this process."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), directory)
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
