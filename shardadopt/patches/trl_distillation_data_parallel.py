"""TRL's DistillationTrainer counts data-parallel ranks on a model sharded at load time, and refuses what cannot
work.

Upstream: not reported yet (proposal, ``upstream-fixes/trl-distillation-data-parallel.diff``). trl 1.16's
``DistillationTrainer`` (on-policy: the student samples its completions) treats every process as a data-parallel
rank, as GRPO does: ``__init__`` seeds process ``i`` with ``seed + i`` (``set_seed(args.seed,
device_specific=True)``), its repeat sampler sizes its blocks by ``accelerator.num_processes``, and the loss
normalises by a token count gathered over every process divided by the process count. On a student whose ranks are
not all data parallel (``fsdp_size x tp_size``) the second TP group samples with ``seed + 2`` where DDP's second
process has ``seed + 1`` (measured: step-1 loss 4.6e-4 off DDP's on the tests' tiny Qwen3), and with
``gradient_accumulation_steps > 1`` the sampler's blocks hold ``tp`` data-parallel windows (``tp_size=2``, 2 x 2
accumulated: step 2 trained step 1's prompts again, loss 0.02356 where one process gives 0.02580). The wrappers
(:mod:`shardadopt.online.trainers`, :mod:`shardadopt.online.view`) refuse ``use_vllm`` on a sharded student and,
where TP ranks share batches, seed each process by its data-parallel rank after TRL's seeding and run the train sampler,
``_prepare_inputs`` and ``compute_loss`` under the trainer's data-parallel view (blocks, gathers and counts by
data-parallel rank).

The probe reads ``DistillationTrainer.__init__`` and ``_get_train_sampler``: ``set_seed(...,
device_specific=True)`` or blocks sized by ``num_processes`` is the gap (``needed``), seeding by a data-parallel
rank or ``parallelism_config`` with no size by process the fix (``not-needed``), as for ``trl-grpo-data-parallel``.
No ``needed_by``: the trainer is what the wrapper changes; an ``unsupported`` probe warns.
"""

from __future__ import annotations

from shardadopt import upstream
from shardadopt.online.view import scoped
from shardadopt.patches.trl_grpo_data_parallel import data_parallel_wrappers, seeding_probe
from shardadopt.patching.contract import Patch, Target
from shardadopt.upstream.versions import supported

MODULE = "trl.trainer.distillation_trainer"
INIT = Target(MODULE, "DistillationTrainer.__init__")


def trainer_init(wrapped, instance, args, kwargs):
    """Wraps the trainer's ``__init__``: the vLLM refusal before TRL runs, seeds and the data-parallel view
    after."""
    import inspect

    from shardadopt.online.trainers import after_distillation_init, before_distillation_init

    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    before_distillation_init(bound.get("model"), bound.get("args"))
    result = wrapped(*args, **kwargs)
    after_distillation_init(instance)
    return result


PATCH = Patch(
    id="trl-distillation-data-parallel",
    summary="TRL DistillationTrainer on TP/2-D students: seeds, sampler blocks, gathers and loss normalisation by "
            "data-parallel rank (DDP's); refused where vLLM would sync sharded weights",
    upstream="proposal for trl main (not reported yet)",
    requires=supported("trl", "transformers", "accelerate"),
    wrappers={INIT: trainer_init, upstream.DISTILLATION_TRAIN_SAMPLER: scoped,
              Target(MODULE, "DistillationTrainer.get_train_dataloader"): scoped,
              **data_parallel_wrappers(MODULE, "DistillationTrainer", upstream.DISTILLATION_PREPARE_INPUTS,
                                       objects_only=True)},
    probe=seeding_probe("DistillationTrainer", "its train sampler", INIT, upstream.DISTILLATION_TRAIN_SAMPLER,
                        "num_processes"),
)
