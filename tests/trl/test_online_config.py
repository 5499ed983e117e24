"""The generation-batch arithmetic of ``trl-grpo-data-parallel`` / ``trl-rloo-data-parallel``
(shardadopt.online.trainers) on
TRL's own configs, in one process: a layout of 2 data-parallel ranks x 2 tensor-parallel ranks (4 processes) gets the
generation batch TRL gives DDP over 2 processes with the same config, the value the user gave kept. The trainers
themselves, on 2 and 4 ranks: ``tests/trl/test_online.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from shardadopt.adopt import AdoptionError  # noqa: E402
from shardadopt.online.trainers import (  # noqa: E402
    count_data_parallel_ranks,
    refuse_partial_groups,
    refuse_split_eval_groups,
)
from shardadopt.parallel.topology import Topology  # noqa: E402

# rank 2 of fsdp_size=2 x tp_size=2: data-parallel rank 1 of 2
LAYOUT_2D = Topology(source="transformers", world_size=4, rank=2, dp_shard_size=2, dp_shard_rank=1, tp_size=2)


def _config(kind: str, world: int, **given):
    """A GRPOConfig/RLOOConfig built under ``shardadopt.enable()`` (which records what the user gave) as TRL builds
    it on ``world`` processes."""
    from unittest import mock

    import shardadopt

    shardadopt.enable(only=[f"trl-{kind}-data-parallel"])
    try:
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: F401  (the patch waits for both)

        config_class = GRPOConfig if kind == "grpo" else RLOOConfig
        # TrainingArguments.world_size: the process count TRL sizes the generation batch by
        with mock.patch.object(config_class, "world_size", world):
            return config_class(output_dir="unused", use_cpu=True, bf16=False, report_to=[], num_generations=4,
                                **given)
    finally:
        shardadopt.disable()


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("given", [
    {"per_device_train_batch_size": 4},
    {"per_device_train_batch_size": 4, "steps_per_generation": 2},
    {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    {"per_device_train_batch_size": 2, "generation_batch_size": 8},
], ids=lambda g: ",".join(f"{k}={v}" for k, v in g.items()))
def test_generation_batch_is_ddps_over_the_data_parallel_ranks(kind, given):
    ddp = _config(kind, 2, **given)
    sharded = _config(kind, 4, **given)
    assert (sharded.generation_batch_size, sharded.steps_per_generation) != (  # TRL counts the 4 processes
        ddp.generation_batch_size, ddp.steps_per_generation)
    count_data_parallel_ranks(sharded, LAYOUT_2D)
    assert (sharded.generation_batch_size, sharded.steps_per_generation) == (
        ddp.generation_batch_size, ddp.steps_per_generation)
    count_data_parallel_ranks(sharded, LAYOUT_2D)  # idempotent: a second trainer on the same config
    assert (sharded.generation_batch_size, sharded.steps_per_generation) == (
        ddp.generation_batch_size, ddp.steps_per_generation)


def test_a_given_generation_batch_the_global_batch_does_not_divide_is_refused():
    config = _config("grpo", 4, per_device_train_batch_size=4, generation_batch_size=16)
    layout = Topology(source="transformers", world_size=4, rank=0, dp_shard_size=1, tp_size=4)
    count_data_parallel_ranks(config, layout)  # 16 = 4 rows x 1 data-parallel rank x 4 steps
    assert config.steps_per_generation == 4
    # a config built where TRL saw one process (TRL's own check passed there): 4 rows do not fill 2 ranks x 4
    config = _config("grpo", 1, per_device_train_batch_size=4, generation_batch_size=4)
    with pytest.raises(AdoptionError, match="generation_batch_size=4 is not a multiple of the global batch"):
        count_data_parallel_ranks(config, LAYOUT_2D)


def test_a_generation_batch_of_partial_groups_over_the_data_parallel_ranks_is_refused():
    """per_device_train_batch_size=2, num_generations=4 on tp_size=2 (one data-parallel rank): TRL's check counts 2
    processes (4 rows) and passes, DDP over the one data-parallel rank has 2 rows and TRL refuses it there; on 2-D
    (2 data-parallel ranks) the same config is a whole group spanning the ranks, which trains."""
    tp_only = Topology(source="transformers", world_size=2, rank=1, tp_size=2, tp_rank=1)
    config = _config("grpo", 2, per_device_train_batch_size=2)
    count_data_parallel_ranks(config, tp_only)
    with pytest.raises(AdoptionError, match=r"2 x 1 x 1 = 2 rows .* TRL refuses it under DDP over 1 process.*"
                                            r"steps_per_generation=2"):
        refuse_partial_groups(config, tp_only)
    with pytest.raises(ValueError, match="must be divisible by num_generations"):  # what TRL says in one process
        _config("grpo", 1, per_device_train_batch_size=2)
    config = _config("grpo", 4, per_device_train_batch_size=2)
    count_data_parallel_ranks(config, LAYOUT_2D)
    refuse_partial_groups(config, LAYOUT_2D)  # 2 x 2 ranks: one group across the data-parallel ranks


def test_an_eval_batch_of_split_groups_over_the_data_parallel_ranks_is_refused():
    """TRL checks per_device_eval_batch_size x processes against the evaluation generations; over the data-parallel
    ranks (DDP's check) 1 x 2 rows do not hold a group of 4, though 1 x 4 processes do."""
    evaluating = {"do_eval": True, "eval_strategy": "steps", "per_device_train_batch_size": 4}
    config = _config("grpo", 4, per_device_eval_batch_size=1, **evaluating)  # TRL's check passes: 1 x 4
    with pytest.raises(AdoptionError, match=r"per_device_eval_batch_size x data-parallel ranks = 1 x 2"):
        refuse_split_eval_groups(config, LAYOUT_2D)
    with pytest.raises(ValueError, match="global eval batch size"):  # what TRL says under DDP over 2
        _config("grpo", 2, per_device_eval_batch_size=1, **evaluating)
    refuse_split_eval_groups(_config("grpo", 4, per_device_eval_batch_size=2, **evaluating), LAYOUT_2D)
    refuse_split_eval_groups(_config("grpo", 4, per_device_eval_batch_size=1, per_device_train_batch_size=4),
                             LAYOUT_2D)  # no evaluation
