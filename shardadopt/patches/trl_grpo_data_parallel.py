"""TRL's GRPOTrainer counts data-parallel ranks on a model sharded at load time, and refuses what cannot work.

Upstream: not reported yet (proposal, ``patches/trl-grpo-data-parallel.diff``). trl 1.16's ``GRPOTrainer`` treats
every process as a data-parallel rank: ``__init__`` seeds process ``i`` with ``seed + i`` (``set_seed(args.seed,
device_specific=True)``) and ``GRPOConfig.__post_init__`` sizes the generation batch by ``world_size``. On a model
whose ranks are not all data parallel (``tp_size``, ``fsdp_size x tp_size``) the second TP group of a 2-D load
samples with ``seed + 2`` where DDP's second process has ``seed + 1`` (other completions than DDP at every step),
and with ``num_iterations > 1`` / ``steps_per_generation > 1`` the repeat sampler's blocks hold other prompts than
DDP's (``tp_size=2``, ``num_iterations=2``: a prompt trained twice where one process moves on). The wrappers
(:mod:`shardadopt.online`): ``GRPOConfig.__post_init__`` records the generation batch the user gave;
``GRPOTrainer.__init__`` refuses ``use_vllm`` on a sharded load and, where TP ranks share batches, a per-process
generation batch that splits groups, resizes the generation batch by data-parallel ranks, and after TRL's seeding
seeds each process by its data-parallel rank.

The probe reads ``GRPOTrainer.__init__``: ``set_seed(..., device_specific=True)`` is the gap (``needed``), seeding
by a data-parallel rank or ``parallelism_config`` the fix (``not-needed``). No ``needed_by``: the trainer is what the
wrapper changes, so an ``unsupported`` probe has nothing to refuse at ``prepare``; it warns.
"""

from __future__ import annotations

from collections.abc import Callable

from shardadopt import upstream
from shardadopt.registry import Patch, Probe, Target
from shardadopt.versions import supported

ID = "trl-grpo-data-parallel"
INIT = Target("trl.trainer.grpo_trainer", "GRPOTrainer.__init__")
CONFIG = Target("trl.trainer.grpo_config", "GRPOConfig.__post_init__")


def seeding_probe(trainer: str, sizer: str, init: Target) -> Callable[[], Probe]:
    """The probe of a TRL online trainer's data-parallel patch: it reads ``init`` (the trainer's ``__init__``);
    ``sizer`` names what sizes its generation batch by the process count, for the reason."""

    def probe() -> Probe:
        from shardadopt.online import seeding
        from shardadopt.probing import undecided

        found = seeding(upstream.upstream_method(init, f"{trainer} data-parallel probe"))
        if found == "data-parallel":
            return Probe(False, f"{trainer} seeds by data-parallel rank")
        if found is None:
            raise undecided(init.qualname, "set_seed(..., device_specific=True) (per-process seeds, the gap) nor "
                                           "seeding by a data-parallel rank (the fix)")
        return Probe(True, f"{trainer} seeds every process as a data-parallel rank (set_seed(..., "
                           f"device_specific=True)) and {sizer} sizes the generation batch by world_size: the ranks "
                           f"of a tensor-parallel group count as data-parallel ranks")

    return probe


def config_post_init(wrapped, instance, args, kwargs):
    """Wraps the config's ``__post_init__``: records the generation batch the user gave."""
    from shardadopt.online import record_given_generation_batch

    record_given_generation_batch(instance)
    return wrapped(*args, **kwargs)


def trainer_init(wrapped, instance, args, kwargs):
    """Wraps the trainer's ``__init__``: refusals and the generation batch before TRL runs, seeds after."""
    import inspect

    from shardadopt.online import after_trainer_init, before_trainer_init

    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    fitted = before_trainer_init(bound.get("model"), bound.get("args"))
    result = wrapped(*args, **kwargs)
    after_trainer_init(instance, fitted)
    return result


PATCH = Patch(
    id=ID,
    summary="TRL GRPOTrainer on TP/2-D loads: seeds and generation batch by data-parallel rank (DDP's); refused "
            "where groups would split across TP ranks or vLLM would sync sharded weights",
    upstream="proposal for trl main (not reported yet); patches/trl-grpo-data-parallel.diff",
    requires=supported("trl", "transformers", "accelerate"),
    wrappers={INIT: trainer_init, CONFIG: config_post_init},
    probe=seeding_probe("GRPOTrainer", "GRPOConfig", INIT),
)
