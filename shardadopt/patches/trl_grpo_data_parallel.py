"""TRL's GRPOTrainer counts data-parallel ranks on a model sharded at load time, and refuses what cannot work.

Upstream: not reported yet (proposal, ``upstream-fixes/trl-grpo-data-parallel.diff``). trl 1.16's ``GRPOTrainer`` treats
every process as a data-parallel rank: ``__init__`` seeds process ``i`` with ``seed + i`` (``set_seed(args.seed,
device_specific=True)``), ``GRPOConfig.__post_init__`` sizes the generation batch by ``world_size``, and scoring
gathers the rewards of every process and slices the advantages by ``process_index``. On a model whose ranks are
not all data parallel (``tp_size``, ``fsdp_size x tp_size``) the TP ranks' copies of a batch count as other ranks'
rows: the second TP group of a 2-D load samples with ``seed + 2`` where DDP's second process has ``seed + 1``, the
repeat sampler's blocks hold other prompts than DDP's, a group of ``num_generations`` that spans processes is built
from copies, and ``scale_rewards="batch"`` counts each row ``tp`` times. The wrappers
(:mod:`shardadopt.online.trainers`, :mod:`shardadopt.online.view`): ``GRPOConfig.__post_init__`` records the
generation batch the user gave;
``GRPOTrainer.__init__`` refuses ``use_vllm`` on a sharded load and, where TP ranks share batches, resizes the
generation batch by data-parallel ranks, seeds each process by its data-parallel rank after TRL's seeding and gives
the trainer a data-parallel view; ``_prepare_inputs`` and ``compute_loss`` run under it (the accelerator's
``process_index``/``num_processes``/``gather``/``reduce`` and the module's ``gather``/``gather_object`` by
data-parallel rank, one copy per model replica).

The probe reads ``GRPOTrainer.__init__`` and ``_generate_and_score_completions``: ``set_seed(...,
device_specific=True)`` or advantages sliced by ``process_index`` is the gap (``needed``), seeding by a
data-parallel rank or ``parallelism_config`` with no slice by process the fix (``not-needed``). No ``needed_by``:
the trainer is what the wrapper changes, so an ``unsupported`` probe has nothing to refuse at ``prepare``; it warns.
"""

from __future__ import annotations

from collections.abc import Callable

from shardadopt import upstream
from shardadopt.online.view import gather, gather_object, scoped
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

MODULE = "trl.trainer.grpo_trainer"
INIT = Target(MODULE, "GRPOTrainer.__init__")
CONFIG = Target("trl.trainer.grpo_config", "GRPOConfig.__post_init__")


def seeding_probe(trainer: str, sizer: str, init: Target, counts: Target, counted: str) -> Callable[[], Probe]:
    """The probe of a TRL online trainer's data-parallel patch: it reads ``init`` (the trainer's ``__init__``) for
    its seeding and ``counts`` for a read of ``accelerator.<counted>`` (a slice or a size by process); ``sizer``
    names what sizes its generation batch by the process count, for the reason."""

    def probe() -> Probe:
        from shardadopt.online.trainers import seeding
        from shardadopt.upstream.probing import names, source_tree, undecided

        where = f"{trainer} data-parallel probe"
        found = seeding(upstream.upstream_method(init, where))
        if found is None:
            raise undecided(init.qualname, "set_seed(..., device_specific=True) (per-process seeds, the gap) nor "
                                           "seeding by a data-parallel rank (the fix)")
        by_process = counted in names(source_tree(upstream.upstream_method(counts, where)))
        if found == "data-parallel" and not by_process:
            return Probe(False, f"{trainer} seeds and counts by data-parallel rank")
        gaps = []
        if found == "process":
            gaps.append(f"{trainer} seeds every process as a data-parallel rank (set_seed(..., device_specific=True)) "
                        f"and {sizer} sizes the generation batch by world_size")
        if by_process:
            gaps.append(f"{counts.qualname} counts by accelerator.{counted} (over every process)")
        return Probe(True, f"{'; '.join(gaps)}: the ranks of a tensor-parallel group count as data-parallel ranks")

    return probe


def data_parallel_wrappers(module: str, trainer: str, prepare_inputs: Target,
                           objects_only: bool = False) -> dict[Target, Callable]:
    """The wrappers that run a TRL online trainer's generation, scoring and loss under its data-parallel view
    (:mod:`shardadopt.online.view`): ``prepare_inputs``, ``<trainer>.compute_loss`` and the module's ``gather``
    (not with ``objects_only``: a module that imports only ``gather_object``) and ``gather_object``."""
    wrappers: dict[Target, Callable] = {prepare_inputs: scoped, Target(module, f"{trainer}.compute_loss"): scoped,
                                        Target(module, "gather_object"): gather_object}
    if not objects_only:
        wrappers[Target(module, "gather")] = gather
    return wrappers


def config_post_init(wrapped, instance, args, kwargs):
    """Wraps the config's ``__post_init__``: records the generation batch the user gave."""
    from shardadopt.online.trainers import record_given_generation_batch

    record_given_generation_batch(instance)
    return wrapped(*args, **kwargs)


def trainer_init(wrapped, instance, args, kwargs):
    """Wraps the trainer's ``__init__``: refusals and the generation batch before TRL runs, seeds and the
    data-parallel view after."""
    import inspect

    from shardadopt.online.trainers import after_trainer_init, before_trainer_init

    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    fitted = before_trainer_init(bound.get("model"), bound.get("args"))
    result = wrapped(*args, **kwargs)
    after_trainer_init(instance, fitted)
    return result


PATCH = Patch(
    id="trl-grpo-data-parallel",
    summary="TRL GRPOTrainer on TP/2-D loads: seeds, generation batch, gathers and advantage slices by "
            "data-parallel rank (DDP's); refused where vLLM would sync sharded weights",
    upstream="proposal for trl main (not reported yet)",
    requires=supported("trl", "transformers", "accelerate"),
    wrappers={INIT: trainer_init, CONFIG: config_post_init,
              **data_parallel_wrappers(MODULE, "GRPOTrainer", upstream.GRPO_PREPARE_INPUTS)},
    probe=seeding_probe("GRPOTrainer", "GRPOConfig", INIT, upstream.GRPO_SCORE, "process_index"),
)
