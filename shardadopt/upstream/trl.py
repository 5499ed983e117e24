"""TRL's private names that shardadopt reads: patch targets and the functions their probes parse.

Checked on trl 1.16.0.
"""

from __future__ import annotations

from shardadopt.upstream.base import Target

# ``DistillationTrainer._compute_loss``, whose chunked divergence loss reads the student's and the teacher's
# ``lm_head.weight`` itself (``get_output_embeddings()``), which the ``trl-distillation-plain-tp-head`` probe reads.
# Checked on trl 1.16.0.
DISTILLATION_COMPUTE_LOSS = Target("trl.trainer.distillation_trainer", "DistillationTrainer._compute_loss")
