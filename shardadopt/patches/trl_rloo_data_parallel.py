"""TRL's RLOOTrainer counts data-parallel ranks on a model sharded at load time, and refuses what cannot work.

Upstream: not reported yet (proposal, ``upstream-fixes/trl-rloo-data-parallel.diff``). trl 1.16's ``RLOOTrainer`` treats
every process as a data-parallel rank: ``__init__`` seeds process ``i`` with ``seed + i`` (``set_seed(args.seed,
device_specific=True)``), ``RLOOConfig.__post_init__`` sizes the generation batch by ``world_size``, and scoring
gathers the rewards of every process and slices the advantages by ``process_index``. On a model whose ranks are
not all data parallel (``tp_size``, ``fsdp_size x tp_size``) the second TP group of a 2-D load samples with
``seed + 2`` where DDP's second process has ``seed + 1``, the repeat sampler's blocks hold other prompts than DDP's,
a group of ``num_generations`` that spans processes is built from the TP ranks' copies, and
``normalize_advantages=True`` counts each row ``tp`` times. The wrappers (:mod:`shardadopt.online.trainers`,
:mod:`shardadopt.online.view`) are ``trl-grpo-data-parallel``'s: the generation batch the user gave recorded, vLLM
refused on a sharded load, the generation batch and seeds by data-parallel rank, and ``_prepare_inputs`` and
``compute_loss`` run under the trainer's data-parallel view (gathers, slices and counts by data-parallel rank).

The probe reads ``RLOOTrainer.__init__`` and ``_generate_and_score_completions``: ``set_seed(...,
device_specific=True)`` or advantages sliced by ``process_index`` is the gap (``needed``), seeding by a
data-parallel rank or ``parallelism_config`` with no slice by process the fix (``not-needed``). Probe and wrappers
are ``trl-grpo-data-parallel``'s. No ``needed_by``: the trainer is what the wrapper changes, so an ``unsupported``
probe has nothing to refuse at ``prepare``; it warns.
"""

from __future__ import annotations

from shardadopt import upstream
from shardadopt.patches.trl_grpo_data_parallel import (
    config_post_init,
    data_parallel_wrappers,
    seeding_probe,
    trainer_init,
)
from shardadopt.patching.contract import Patch, Target
from shardadopt.upstream.versions import supported

MODULE = "trl.trainer.rloo_trainer"
INIT = Target(MODULE, "RLOOTrainer.__init__")
CONFIG = Target("trl.trainer.rloo_config", "RLOOConfig.__post_init__")

PATCH = Patch(
    id="trl-rloo-data-parallel",
    summary="TRL RLOOTrainer on TP/2-D loads: seeds, generation batch, gathers and advantage slices by "
            "data-parallel rank (DDP's); refused where vLLM would sync sharded weights",
    upstream="proposal for trl main (not reported yet)",
    requires=supported("trl", "transformers", "accelerate"),
    wrappers={INIT: trainer_init, CONFIG: config_post_init,
              **data_parallel_wrappers(MODULE, "RLOOTrainer", upstream.RLOO_PREPARE_INPUTS)},
    probe=seeding_probe("RLOOTrainer", "RLOOConfig", INIT, upstream.RLOO_SCORE, "process_index"),
)
