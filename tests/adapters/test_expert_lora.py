"""LoRA on the fused expert tensors of an expert-parallel Qwen3-MoE (``ep_size=2, fsdp_size=2``, 2 ranks) equals one
process (``shardadopt.adapters.experts``, docs/expert-lora.md); training also on OLMoE (the sweep's tiny checkpoint).

A user's config as peft 0.21 reads it (``target_modules=[..., "down_proj"]``: peft adapts the experts' fused
``down_proj`` through ``target_parameters``) and an explicit ``target_parameters`` on both expert tensors train
through the accelerate loop like one process on the same global batches: per-step loss and grad norm, every adapter
gradient (experts included), the adapters after training, the export loaded in one process and back onto an EP load.
Each piece has an assertion that fails without it, checked once by hand (docs/expert-lora.md): the gradient scaling
(expert gradients are the EP group's sum: without it they are off by ~20%, caught by the gradient comparison), this
rank's slice of the factors (rows of ``lora_A``, strided columns of ``lora_B``: the slice test compares each rank's
local shard with the one-process factors), and the export (the file equals the one-process adapter bit for bit).
``save_state``/``load_state`` resumes bit for bit. What cannot be laid out is refused by name; transformers 5.15 (EP
on the TP mesh) refuses.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Any

import pytest

from shardadopt.testing.layouts import distributed_sizes
from shardadopt.testing.lora.common import ACCUM, ATTENTION, SEED, STEPS, TARGETS

pytest.importorskip("peft", reason="the adapter tests need peft (shardadopt[peft])")

pytestmark = pytest.mark.multiproc

BOTH = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
CONFIGS = {  # name -> (target_modules, more LoraConfig options)
    "down_proj": (TARGETS, None),  # the user's natural form: peft adapts experts.down_proj
    "target_parameters": (ATTENTION, BOTH),
}


# name-to-expert targeting (peft 0.22 maps target_modules names to expert tensors on these, qwen2_moe included, and
# keeps them for the shared / dense Linear layers too): qwen2_moe, qwen3_moe and a DeepSeek-style model (GLM-4-MoE:
# shared experts, a dense first layer, a sigmoid router with correction bias), the sweep's tiny checkpoints
TARGETING = ("qwen2_moe", "qwen3_moe", "glm4_moe")


def _ep_layout_with_ep_mesh() -> bool:
    from transformers.distributed import DistributedConfig

    return "ep_size" in DistributedConfig.__dataclass_fields__


needs_ep_mesh = pytest.mark.skipif(
    not _ep_layout_with_ep_mesh(),
    reason="transformers before 5.21 shards experts "
    "on the TP mesh (no ep_size): expert LoRA is refused there (tested below)",
)


@pytest.fixture(scope="module")
def moe_models(tiny_models) -> dict[str, str]:
    """Qwen3-MoE (``shardadopt.testing.models``) and OLMoE: the architecture sweep's tiny checkpoint
    (``shardadopt.testing.archs``, 3 layers, 4 experts), written next to the other tiny models."""
    from shardadopt.testing.archs import write_tiny

    root = os.path.dirname(tiny_models["qwen3"])
    return {"qwen3moe": tiny_models["qwen3moe"], **{t: write_tiny(t, root) for t in ("olmoe", *TARGETING)}}


@pytest.fixture(scope="module")
def references(moe_models):
    from shardadopt.testing.lora.training import train_lora_reference

    cache: dict[tuple[str, str], Any] = {}

    def get(model: str, config: str) -> dict[str, Any]:
        if (model, config) not in cache:
            targets, overrides = CONFIGS[config]
            _, dp = distributed_sizes("ep", 2)
            cache[model, config] = train_lora_reference(moe_models[model], dp, targets, overrides=overrides)
        return cache[model, config]

    return get


@needs_ep_mesh
@pytest.mark.parametrize(
    "model, config", [("qwen3moe", "down_proj"), ("qwen3moe", "target_parameters"), ("olmoe", "down_proj")]
)
def test_expert_lora_trains_like_one_process(pool2, moe_models, references, tmp_path, model, config):
    from transformers import AutoConfig

    from shardadopt.testing.lora.training import (
        assert_export_matches_one_process,
        assert_matches_one_process,
        train_lora_rank,
    )

    targets, overrides = CONFIGS[config]
    sizes, dp = distributed_sizes("ep", 2)
    export = str(tmp_path / "adapter")
    path = moe_models[model]
    results = pool2.run(train_lora_rank, path, sizes, dp, export, targets, STEPS, ACCUM, overrides, timeout=600)
    assert "error" not in results[0], results[0]["error"]
    expected = references(model, config)
    experts = [n for n in expected["grads"] if ".experts." in n]
    layers = AutoConfig.from_pretrained(path).num_hidden_layers
    assert len(experts) == layers * 2 * (1 if config == "down_proj" else 2), experts  # layers x lora_A/B x tensors
    assert all(float(expected["grads"][n].abs().max()) > 0 for n in experts if "lora_B" in n)
    assert_matches_one_process(results, expected)
    assert_export_matches_one_process(results, path, export)


def _slices_rank(path: str, sizes: dict[str, Any], export_dir: str) -> dict[str, Any]:
    """Expert factors initialised with nonzero ``lora_B`` (``init_lora_weights=False``): this rank's local shards and
    experts, the logits, then the export and a fresh EP load with it (local shards and logits)."""
    import torch
    import torch.distributed as dist
    from peft import PeftModel, get_peft_model

    import shardadopt
    from shardadopt.adapters.experts import checkpoint_views
    from shardadopt.testing.lora.common import load_model, lora_config, probe_batch

    def shards(model) -> dict[str, Any]:
        return {
            n: p.to_local().detach().clone() for n, p in model.named_parameters() if ".experts." in n and "lora_" in n
        }

    shardadopt.enable()
    try:
        torch.manual_seed(SEED + 1000 * dist.get_rank())  # every rank seeded differently: rank 0's values count
        base = load_model(path, sizes)
        torch.manual_seed(SEED if dist.get_rank() == 0 else SEED + 1)
        model = get_peft_model(base, lora_config(init_lora_weights=False, **BOTH))
        local = base.model.layers[0].mlp.experts.get_base_layer().down_proj.to_local().shape[0]
        first = dist.get_rank() * local  # ep rank = global rank on 2 ranks
        with torch.no_grad():
            logits = model(input_ids=probe_batch()).logits
        local_shards = shards(model)
        experts_factors = {n: p for n, p in model.named_parameters() if ".experts." in n and "lora_" in n}
        with checkpoint_views(experts_factors) as viewed:  # what DCP writes
            checkpoint = {n: v.detach().full_tensor() for n, v in viewed.items()}
        model.save_pretrained(export_dir)
        reloaded = PeftModel.from_pretrained(load_model(path, sizes), export_dir)
        with torch.no_grad():
            reloaded_logits = reloaded(input_ids=probe_batch()).logits
        return {
            "experts": list(range(first, first + local)),
            "shards": local_shards,
            "checkpoint": checkpoint,
            "logits": logits,
            "reloaded_shards": shards(reloaded),
            "reloaded_logits": reloaded_logits,
        }
    finally:
        shardadopt.disable()


@needs_ep_mesh
def test_expert_factor_slices_export_and_reload_match_one_process(pool2, tiny_models, tmp_path):
    """Each rank holds exactly its experts' rows of ``lora_A`` and strided columns of ``lora_B`` of the one-process
    factors (peft: expert ``e`` owns rows ``e*r..e*r+r-1`` and columns ``k*E + e``), whatever its own seed; the
    forward with nonzero ``lora_B`` equals one process; ``save_pretrained`` writes the one-process adapter bit for bit
    (the ``lora_B`` columns interleaved back), and ``PeftModel.from_pretrained`` onto a fresh EP load reslices it."""
    import torch
    from peft import get_peft_model
    from safetensors.torch import load_file

    from shardadopt.testing.lora.common import adapter_params, load_model, lora_config, probe_batch

    sizes, _ = distributed_sizes("ep", 2)
    export = str(tmp_path / "adapter")
    results = pool2.run(_slices_rank, tiny_models["qwen3moe"], sizes, export, timeout=600)
    torch.manual_seed(SEED)
    one = get_peft_model(load_model(tiny_models["qwen3moe"], None), lora_config(init_lora_weights=False, **BOTH))
    expected = {n: v for n, v in adapter_params(one).items() if ".experts." in n}
    with torch.no_grad():
        logits = one(input_ids=probe_batch()).logits
    assert len(expected) == 8 and all(float(v.abs().max()) > 0 for v in expected.values())
    rank = one.peft_config["default"].r
    for result in results:
        experts = result["experts"]
        for shards in (result["shards"], result["reloaded_shards"]):
            assert sorted(shards) == sorted(expected)
            for name, value in expected.items():
                if ".lora_A." in name:  # (r * E, in): expert-major rows
                    want = value[experts[0] * rank : (experts[-1] + 1) * rank]
                else:  # (out, r * E): the expert index fastest
                    want = value.reshape(value.shape[0], rank, -1)[:, :, experts].reshape(value.shape[0], -1)
                assert torch.equal(shards[name], want), f"experts {experts}: {name} is not their slice"
        torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["reloaded_logits"], result["logits"], rtol=0, atol=0)
        # DCP checkpoints hold peft's order whatever the EP size: lora_B (out, r * E) as (out, r, E)
        assert sorted(result["checkpoint"]) == sorted(expected)
        for name, value in expected.items():
            want = value if ".lora_A." in name else value.reshape(value.shape[0], rank, -1)
            assert torch.equal(result["checkpoint"][name], want), f"{name}: the checkpoint is not in peft's order"
    written = load_file(os.path.join(export, "adapter_model.safetensors"))
    from peft.utils import get_peft_model_state_dict

    for key, value in get_peft_model_state_dict(one).items():
        if ".experts." in key:
            assert torch.equal(written[key], value), f"{key}: the export is not the one-process adapter"


def _refusal_rank(path: str, sizes: dict[str, Any], overrides: dict[str, Any]) -> str | None:
    """``get_peft_model`` with ``overrides`` on a sharded load: the error it raises, or None."""
    import torch
    from peft import get_peft_model

    import shardadopt
    from shardadopt.testing.lora.common import load_model, lora_config

    shardadopt.enable()
    try:
        base = load_model(path, sizes)
        torch.manual_seed(SEED)
        try:
            get_peft_model(base, lora_config(**overrides))
        except ValueError as exc:  # AdapterLayoutError
            return f"{type(exc).__name__}: {exc}"
        return None
    finally:
        shardadopt.disable()


REFUSED = [  # (case, layout, LoraConfig options, what the error names)
    ("router", "ep", {"target_modules": ["q_proj", "gate"]}, "2-D parameter weight of Qwen3MoeTopKRouter"),
    ("all-linear", "ep", {"target_modules": "all-linear"}, "2-D parameter weight of Qwen3MoeTopKRouter"),
    ("dora", "ep", {"use_dora": True, **BOTH}, "use_dora / lora_bias with target_parameters"),
    ("experts-fsdp-only", "fsdp", {}, "not sharded by expert on an ep mesh"),
]


@pytest.mark.parametrize("case, layout, overrides, message", REFUSED, ids=[c[0] for c in REFUSED])
def test_expert_lora_refused_by_name(pool2, tiny_models, case, layout, overrides, message):
    if layout == "ep" and not _ep_layout_with_ep_mesh() and case != "dora":
        message = "before 5.17"  # EP on the TP mesh: the TP refusal (or the plain experts one) comes first
    sizes, _ = distributed_sizes(layout, 2)
    for error in pool2.run(_refusal_rank, tiny_models["qwen3moe"], sizes, overrides, timeout=600):
        assert error and error.startswith("AdapterLayoutError"), error
        assert message in error, error


@pytest.mark.skipif(_ep_layout_with_ep_mesh(), reason="transformers 5.21+ has ep_size (trained above)")
def test_expert_lora_refused_on_ep_over_the_tp_mesh(pool2, tiny_models):
    """transformers before 5.21 (EP on the TP mesh, experts as plain local tensors): refused by name at
    get_peft_model, on every rank."""
    sizes, _ = distributed_sizes("ep", 2)
    for error in pool2.run(_refusal_rank, tiny_models["qwen3moe"], sizes, {}, timeout=600):
        assert error and error.startswith("AdapterLayoutError"), error
        assert "before 5.17" in error or "not sharded by expert on an ep mesh" in error, error


def _resume_rank(path: str, sizes: dict[str, Any], dp: int, directory: str, steps: int, save_after: int):
    """The accelerate loop with expert LoRA, ``save_state`` after ``save_after`` steps; then a fresh load with
    adapters initialised from another seed, ``load_state`` and the remaining steps. Both runs' losses and adapters."""
    from shardadopt.testing.lora.common import load_model, lora_config
    from shardadopt.testing.lora.resume import straight_and_resumed

    def build() -> Any:
        from peft import get_peft_model

        return get_peft_model(load_model(path, sizes), lora_config(target_modules=list(ATTENTION), **BOTH))

    return straight_and_resumed(build, dp, steps, directory, save_after)


@needs_ep_mesh
def test_expert_lora_save_state_load_state_resumes_exactly(pool2, tiny_models, tmp_path):
    """``accelerator.save_state`` after 2 of 4 steps, ``load_state`` into a fresh load whose adapters start from
    another seed: the losses and every adapter (expert factors included) bit for bit as the uninterrupted run."""
    import torch

    sizes, dp = distributed_sizes("ep", 2)
    for result in pool2.run(
        _resume_rank, tiny_models["qwen3moe"], sizes, dp, str(tmp_path / "state"), 4, 2, timeout=600
    ):
        assert len(result["straight"]) == 4 and result["resumed"] == result["straight"][2:], result
        assert any(".experts." in n for n in result["params"])
        for name, value in result["params"].items():
            assert torch.equal(result["resumed_params"][name], value), f"{name} differs from the uninterrupted run"


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
@pytest.mark.parametrize("model", TARGETING)
def test_expert_targeting_trains_like_one_process_or_names_the_target_modules_that_do(pool2, moe_models, tmp_path,
                                                                                       model, layout):
    """The user's ``target_modules=[q, v, o, down_proj]`` on qwen2_moe, qwen3_moe and GLM-4-MoE, as the installed peft
    maps the names (0.22: ``down_proj`` is the experts' fused tensor and the shared / dense Linear layers; 0.21: one
    or the other): trains like one process on the same global batches (the export loads in one process), or, where
    the experts are not sharded by expert (an ``fsdp_size`` load), is refused by name with the ``target_modules`` that
    train the Linear layers without the experts, and those train like one process. EP before transformers 5.21 (on
    the TP mesh, before 5.17 for LoRA): refused by name."""
    from shardadopt.testing.lora.training import (
        assert_export_matches_one_process,
        assert_matches_one_process,
        train_lora_rank,
        train_lora_reference,
    )

    sizes, dp = distributed_sizes(layout, 2)
    path = moe_models[model]
    targets = TARGETS
    results = pool2.run(train_lora_rank, path, sizes, dp, str(tmp_path / "a"), targets, STEPS, ACCUM, timeout=600)
    error = results[0].get("error")
    if layout == "ep" and not _ep_layout_with_ep_mesh():  # EP on the TP mesh: LoRA on TP is refused first
        assert error and "before 5.17" in error, error
        return
    if error is not None:
        assert layout == "fsdp", error
        assert all(r["error"] == error for r in results) and error.startswith("AdapterLayoutError"), error
        assert "not sharded by expert on an ep mesh" in error, error
        named = re.search(r"target_modules=(\[[^\]]*\])", error)
        assert named, f"the refusal names no target_modules that work: {error}"
        targets = tuple(ast.literal_eval(named.group(1)))
        assert set(ATTENTION) <= set(targets) and "down_proj" not in targets, targets
        results = pool2.run(train_lora_rank, path, sizes, dp, str(tmp_path / "b"), targets, STEPS, ACCUM,
                            timeout=600)
        assert "error" not in results[0], results[0]["error"]
    expected = train_lora_reference(path, dp, targets)
    # routed tokens sum in another order on EP: qwen2_moe's attention gradients (max 3.4e-3) came 1.4e-7 off one
    # process at most with peft 0.21.2 / transformers 5.25 (losses and norms within 1e-7 relative)
    assert_matches_one_process(results, expected, grad_atol=1e-6)
    assert_export_matches_one_process(results, path, str(tmp_path / ("b" if error else "a")))
