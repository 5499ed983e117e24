"""TRL's private names that shardadopt reads: patch targets and the functions their probes parse.

Checked on trl 1.16.0.
"""

from __future__ import annotations

from shardadopt.upstream.base import Target

# ``DistillationTrainer._compute_loss``, whose chunked divergence loss reads the student's and the teacher's
# ``lm_head.weight`` itself (``get_output_embeddings()``), which the ``trl-distillation-plain-tp-head`` probe reads.
# Checked on trl 1.16.0.
DISTILLATION_COMPUTE_LOSS = Target("trl.trainer.distillation_trainer", "DistillationTrainer._compute_loss")

# The methods of TRL's online trainers inside which they gather, slice and count by process (the
# ``trl-*-data-parallel`` patches run them under a data-parallel view, shardadopt.online.view): generation and
# scoring (``_prepare_inputs``, which calls ``_generate_and_score_completions``), the loss (``compute_loss``), and
# DistillationTrainer's train sampler (``_get_train_sampler``, reached from ``get_train_dataloader``). The scoring
# method and the sampler are what the patches' probes read (slicing by ``process_index``, blocks sized by
# ``num_processes``). Checked on trl 1.16.0.
GRPO_PREPARE_INPUTS = Target("trl.trainer.grpo_trainer", "GRPOTrainer._prepare_inputs")
GRPO_SCORE = Target("trl.trainer.grpo_trainer", "GRPOTrainer._generate_and_score_completions")
RLOO_PREPARE_INPUTS = Target("trl.trainer.rloo_trainer", "RLOOTrainer._prepare_inputs")
RLOO_SCORE = Target("trl.trainer.rloo_trainer", "RLOOTrainer._generate_and_score_completions")
DISTILLATION_PREPARE_INPUTS = Target("trl.trainer.distillation_trainer", "DistillationTrainer._prepare_inputs")
DISTILLATION_TRAIN_SAMPLER = Target("trl.trainer.distillation_trainer", "DistillationTrainer._get_train_sampler")
