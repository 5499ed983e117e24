"""``transformers-tp-heads-refused``: a ``tp_size`` that does not divide the attention heads a TP plan splits colwise
is refused at load, on every rank, with an error that names the model, its head counts, ``tp_size`` and the fix,
instead of a reshape error at the first forward (PaliGemma's one key/value head on ``tp_size=2``).

The core check runs on tiny models built on the meta device; the loads run on 2 gloo ranks: a tiny PaliGemma (a VLM:
the plan comes from its text config) and a tiny Llama with one key/value head, refused with the patch, and the
Llama loaded without it, whose first forward fails as users met it.
"""

from __future__ import annotations

import pytest

import shardadopt
from shardadopt.loadtime import UnsupportedShardingError, indivisible_heads, refuse_indivisible_heads
from shardadopt.testing.archs import IMAGE_TEXT, tiny_config, write_tiny

ID = "transformers-tp-heads-refused"
# a tiny Llama with 4 query heads of 16
LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             head_dim=16)


def _meta_llama(num_key_value_heads: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA, num_key_value_heads=num_key_value_heads))


def _meta_paligemma():
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(tiny_config("paligemma", task=IMAGE_TEXT))


def test_a_multi_query_vlm_is_refused_with_its_heads_and_the_fix():
    model = _meta_paligemma()
    with pytest.raises(UnsupportedShardingError) as raised:
        refuse_indivisible_heads(model, {"tp_size": 2})
    message = str(raised.value)
    assert message.startswith("PaliGemmaForConditionalGeneration (paligemma) cannot be loaded with tp_size=2"), message
    assert "2 does not divide num_key_value_heads=1 (model.language_model.layers.0.self_attn.k_proj" in message
    assert "num_attention_heads=4" in message  # the model's heads, the divisible ones too
    assert "Tensor parallelism cannot split these heads: shard it with fsdp_size=2 instead of tp_size." in message


@pytest.mark.parametrize(("kv_heads", "tp_size", "refused"), [(1, 2, True), (2, 2, False), (2, 4, True), (4, 4, False)])
def test_text_models_are_checked_against_their_key_value_heads(kv_heads, tp_size, refused):
    model = _meta_llama(kv_heads)  # 4 query heads
    bad = indivisible_heads(model, model.tp_plan, tp_size)
    assert bool(bad) == refused, bad
    assert {field for _, field, _ in bad} <= {"num_key_value_heads"}
    if refused:
        with pytest.raises(UnsupportedShardingError, match=rf"Use a tp_size that divides {kv_heads}"
                                                           if kv_heads > 1 else "cannot split these heads"):
            refuse_indivisible_heads(model, {"tp_size": tp_size})
    else:
        refuse_indivisible_heads(model, {"tp_size": tp_size})


def test_the_plan_given_in_the_config_replaces_the_models():
    """``DistributedConfig(tp_plan=...)`` is the plan transformers applies: one that leaves the key/value projections
    whole (or replicates heads with 5.25's ``unit_colwise``) splits no key/value head."""
    model = _meta_llama(1)
    refuse_indivisible_heads(model, {"tp_size": 2, "tp_plan": {"model.layers.*.mlp.up_proj": "colwise",
                                                               "model.layers.*.mlp.down_proj": "rowwise"}})
    refuse_indivisible_heads(model, {"tp_size": 2, "tp_plan": {"model.layers.*.self_attn.k_proj": "unit_colwise"}})
    with pytest.raises(UnsupportedShardingError):
        refuse_indivisible_heads(model, {"tp_size": 2, "tp_plan": {"model.layers.*.self_attn.v_proj": "colwise"}})


@pytest.mark.parametrize("config", [None, {"fsdp_size": 2}, {"tp_size": 1}])
def test_no_tensor_parallelism_is_not_checked(config):
    refuse_indivisible_heads(_meta_llama(1), config)


def test_probe_follows_upstream():
    """transformers 5.15 .. 5.25 split the heads without checking them: the patch applies."""
    import transformers.distributed.mixin  # noqa: F401  (the patch's target module)

    try:
        state = {s.id: s for s in shardadopt.enable(only=[ID])}[ID]
    finally:
        shardadopt.disable()
    assert state.state == "applied", state.reason


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny PaliGemma (one key/value head, as the type's default config) and a tiny Llama with one key/value head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tp-heads")
    llama = root / "llama-mqa"
    LlamaForCausalLM(LlamaConfig(**LLAMA, num_key_value_heads=1)).save_pretrained(llama)
    return {"paligemma": write_tiny("paligemma", root, task=IMAGE_TEXT), "llama": str(llama)}


def load_tp2(path: str, exclude: tuple[str, ...]) -> str:
    """On every rank: load ``path`` with ``tp_size=2`` after ``shardadopt.enable(exclude=exclude)`` and run one
    forward on a batch of 2 rows (token ids only: the load, not the images, is under test); what was raised, or
    ``"ran"``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    shardadopt.enable(exclude=exclude)
    try:
        vlm = AutoConfig.from_pretrained(path).model_type == "paligemma"
        auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2))
        model(input_ids=torch.arange(1, 33).reshape(2, 16))
        return "ran"
    except Exception as exc:  # noqa: BLE001  (the test compares what each rank raised)
        return f"{type(exc).__name__}: {exc}"
    finally:
        shardadopt.disable()


@pytest.mark.multiproc
@pytest.mark.parametrize("model", ["paligemma", "llama"])
def test_every_rank_refuses_the_load_with_the_same_error(pool2, checkpoints, model):
    outcomes = pool2.run(load_tp2, checkpoints[model], (), timeout=180)
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0].startswith("UnsupportedShardingError: "), outcomes[0]
    assert "cannot be loaded with tp_size=2" in outcomes[0] and "num_key_value_heads=1" in outcomes[0], outcomes[0]


@pytest.mark.multiproc
def test_without_the_patch_the_first_forward_fails(pool2, checkpoints):
    outcomes = pool2.run(load_tp2, checkpoints["llama"], (ID,), timeout=180)
    assert all(o.startswith("RuntimeError: shape ") and "is invalid" in o for o in outcomes), outcomes
