"""GRPO/RLOO on a model TRL loads itself from a path, sharded by the ``distributed_config`` in the config's
``model_init_kwargs`` (``GRPOTrainer(model="<path>", args=GRPOConfig(model_init_kwargs={"distributed_config":
DistributedConfig(tp_size=2)}))``: TRL 1.16 calls ``from_pretrained(path, **model_init_kwargs)``, and the reference
model for ``beta > 0`` too). shardadopt sees the model only once TRL has loaded it, so it fits the config to the
loaded model's layout after TRL's ``__init__`` (generation batch by data-parallel ranks, the refusal of partial groups
that reads it, the data-parallel view) and refuses ``use_vllm=True`` from the config before TRL loads anything or
starts vLLM.

Reference: one process on the plain checkpoint, loaded by TRL from the same path (``tp_size=2`` has one
data-parallel rank). Before the fix the config the user gave was fitted only for a model given loaded: with
``num_iterations=2`` the third step trained the first prompt again (grad norm 2.20 where one process gives 2.49),
and a generation batch of half a group (which TRL refuses in one process) trained instead of being refused.
"""

from __future__ import annotations

import pytest

from shardadopt.testing.trl import MODELS, refusal_problem
from shardadopt.testing.trl_online import RTOL, online_log, tracks

pytestmark = pytest.mark.multiproc

# TRL's reference model (loaded sharded from model_init_kwargs too) and old log-probs reused for a second pass
CONFIG = {"beta": 0.04, "num_iterations": 2}


def test_path_loaded_tp_tracks_one_process(pool2, tiny_models, trl_tokenizer):
    results = pool2.run(online_log, tiny_models, trl_tokenizer, "grpo", "tp", MODELS["tp"], from_path=True,
                        timeout=400, **CONFIG)
    if results[0]["plain_head_shard"]:  # transformers 5.15/5.16: TRL's fused LM head on a plain TP shard
        for rank, result in enumerate(results):
            problem = refusal_problem(result, "fused-head")
            assert problem is None, f"rank {rank}: {problem}"
        return
    reference = online_log(tiny_models, trl_tokenizer, "grpo", None, MODELS["tp"], world=1, from_path=True,
                           **CONFIG)
    assert results[0]["dp"] == 1
    for rank, result in enumerate(results):
        assert result.get("completions") == reference["completions"], f"rank {rank}: other completions"
        problem = tracks(result, reference, RTOL["rloo"])  # beta > 0: see RTOL
        assert problem is None, f"path-loaded tp rank {rank}: {problem}"


REFUSED = [
    # refused from the config, before TRL loads the model or starts vLLM
    ("fsdp", {"use_vllm": True}, "vllm"),
    ("tp", {"use_vllm": True}, "vllm"),
    # refused once TRL has loaded the model and shardadopt can read its layout
    ("tp", {"per_device_train_batch_size": 2}, "partial-groups"),
]


@pytest.mark.parametrize(("layout", "config", "cause"), REFUSED, ids=[f"{c[0]}-{c[2]}" for c in REFUSED])
def test_path_loaded_refused_by_name(pool2, tiny_models, trl_tokenizer, layout, config, cause):
    results = pool2.run(online_log, tiny_models, trl_tokenizer, "grpo", layout, MODELS[layout], from_path=True,
                        timeout=300, **config)
    for rank, result in enumerate(results):
        problem = refusal_problem(result, cause)
        assert problem is None, f"path-loaded {layout} {config} rank {rank}: {problem}"
