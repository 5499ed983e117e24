"""TRL's DistillationTrainer seeds by data-parallel rank on a model sharded at load time, and refuses what cannot work.

Upstream: not reported yet (proposal, ``patches/trl-distillation-data-parallel.diff``). trl 1.16's
``DistillationTrainer`` (on-policy: the student samples its completions) treats every process as a data-parallel
rank, as GRPO does: ``__init__`` seeds process ``i`` with ``seed + i`` (``set_seed(args.seed,
device_specific=True)``), and its repeat sampler sizes its blocks by ``accelerator.num_processes``. On a student whose
ranks are not all data parallel (``fsdp_size x tp_size``) the second TP group samples with ``seed + 2`` where DDP's
second process has ``seed + 1`` (measured: step-1 loss 4.6e-4 off DDP's on the tests' tiny Qwen3), and with
``gradient_accumulation_steps > 1`` the sampler's blocks hold ``tp`` data-parallel windows (prompts trained again
where DDP moves on). The wrapper (:mod:`shardadopt.online`) refuses ``use_vllm`` on a sharded student and, where TP
ranks share batches, ``gradient_accumulation_steps > 1`` (naming the per-device batch that trains the same batch),
and after TRL's seeding seeds each process by its data-parallel rank.

The probe reads ``DistillationTrainer.__init__``: ``set_seed(..., device_specific=True)`` is the gap (``needed``),
seeding by a data-parallel rank or ``parallelism_config`` the fix (``not-needed``), as for
``trl-grpo-data-parallel``. No ``needed_by``: the trainer is what the wrapper changes; an ``unsupported`` probe warns.
"""

from __future__ import annotations

from shardadopt.patches.trl_grpo_data_parallel import seeding_probe
from shardadopt.registry import Patch, Target
from shardadopt.versions import supported

ID = "trl-distillation-data-parallel"
INIT = Target("trl.trainer.distillation_trainer", "DistillationTrainer.__init__")


def trainer_init(wrapped, instance, args, kwargs):
    """Wraps the trainer's ``__init__``: refusals before TRL runs, seeds after."""
    import inspect

    from shardadopt.online import after_distillation_init, before_distillation_init

    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    checked = before_distillation_init(bound.get("model"), bound.get("args"))
    result = wrapped(*args, **kwargs)
    after_distillation_init(instance, checked)
    return result


PATCH = Patch(
    id=ID,
    summary="TRL DistillationTrainer on TP/2-D students: seeds by data-parallel rank (DDP's); refused where "
            "gradient accumulation would repeat prompts or vLLM would sync sharded weights",
    upstream="proposal for trl main (not reported yet); patches/trl-distillation-data-parallel.diff",
    requires=supported("trl", "transformers", "accelerate"),
    wrappers={INIT: trainer_init},
    probe=seeding_probe("DistillationTrainer", "its train sampler", INIT),
)
