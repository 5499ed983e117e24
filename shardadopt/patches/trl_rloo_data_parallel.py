"""TRL's RLOOTrainer counts data-parallel ranks on a model sharded at load time, and refuses what cannot work.

Upstream: not reported yet (proposal, ``patches/trl-rloo-data-parallel.diff``). trl 1.16's ``RLOOTrainer`` treats
every process as a data-parallel rank: ``__init__`` seeds process ``i`` with ``seed + i`` (``set_seed(args.seed,
device_specific=True)``) and ``RLOOConfig.__post_init__`` sizes the generation batch by ``world_size``. On a model
whose ranks are not all data parallel (``tp_size``, ``fsdp_size x tp_size``) the second TP group of a 2-D load
samples with ``seed + 2`` where DDP's second process has ``seed + 1`` (other completions than DDP at every step),
and with ``num_iterations > 1`` / ``steps_per_generation > 1`` the repeat sampler's blocks hold other prompts than
DDP's (``tp_size=2``, ``num_iterations=2``: a prompt trained twice where one process moves on). The wrappers
(:mod:`shardadopt.online`): ``RLOOConfig.__post_init__`` records the generation batch the user gave;
``RLOOTrainer.__init__`` refuses ``use_vllm`` on a sharded load and, where TP ranks share batches, a per-process
generation batch that splits groups, resizes the generation batch by data-parallel ranks, and after TRL's seeding
seeds each process by its data-parallel rank.

The probe reads ``RLOOTrainer.__init__``: ``set_seed(..., device_specific=True)`` is the gap (``needed``), seeding
by a data-parallel rank or ``parallelism_config`` the fix (``not-needed``). Probe and wrappers are
``trl-grpo-data-parallel``'s. No ``needed_by``: the trainer is what the
wrapper changes, so an ``unsupported`` probe has nothing to refuse at ``prepare``; it warns.
"""

from __future__ import annotations

from shardadopt.patches.trl_grpo_data_parallel import config_post_init, seeding_probe, trainer_init
from shardadopt.registry import Patch, Target
from shardadopt.versions import supported

ID = "trl-rloo-data-parallel"
INIT = Target("trl.trainer.rloo_trainer", "RLOOTrainer.__init__")
CONFIG = Target("trl.trainer.rloo_config", "RLOOConfig.__post_init__")

PATCH = Patch(
    id=ID,
    summary="TRL RLOOTrainer on TP/2-D loads: seeds and generation batch by data-parallel rank (DDP's); refused "
            "where groups would split across TP ranks or vLLM would sync sharded weights",
    upstream="proposal for trl main (not reported yet); patches/trl-rloo-data-parallel.diff",
    requires=supported("trl", "transformers", "accelerate"),
    wrappers={INIT: trainer_init, CONFIG: config_post_init},
    probe=seeding_probe("RLOOTrainer", "RLOOConfig", INIT),
)
