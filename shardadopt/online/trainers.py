"""TRL's online trainers (GRPO, RLOO, Distillation) count data-parallel ranks, not processes, on a model sharded at
load time.

TRL treats every process as a data-parallel rank: it seeds process ``i`` with ``seed + i``
(``set_seed(args.seed, device_specific=True)``) and sizes the generation batch by the process count
(``generation_batch_size = per_device_train_batch_size * world_size * steps_per_generation``). The ranks of a
tensor-parallel group hold one model replica on one batch, so on ``fsdp_size=2, tp_size=2`` (4 processes, 2
data-parallel ranks) the second TP group samples with ``seed + 2`` where DDP's second process has ``seed + 1``, and
with ``num_iterations > 1`` or ``steps_per_generation > 1`` the repeat sampler's blocks hold twice the prompts DDP's
do (other prompts trained at each step). :func:`count_data_parallel_ranks` and :func:`seed_by_data_parallel_rank`
give the trainer the numbers DDP's process of the same data-parallel rank has.

TRL also gathers rewards, counts and statistics over every process, slices by process index and sizes its sampler
by the process count, where the ranks of a TP group contribute copies of the same rows: after ``__init__``
:func:`after_trainer_init` / :func:`after_distillation_init` give the trainer a data-parallel view
(:mod:`shardadopt.online.view`) under which its methods gather, slice and count by data-parallel rank, so groups
that span processes, batch-wide advantage statistics and DistillationTrainer's accumulation train as under DDP.
:func:`refuse_partial_groups` and :func:`refuse_split_eval_groups` refuse a generation or evaluation batch of
partial groups that DDP's check would refuse (TRL checks it by process count), and :func:`refuse_vllm` vLLM
generation, whose weight sync cannot read a model sharded at load time. :func:`before_trainer_init` /
:func:`after_trainer_init` are what the patches call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardadopt.adopt.record import AdoptionError
from shardadopt.parallel.topology import Topology, TopologyError, topology

__all__ = ["GIVEN_BATCH_ATTR", "after_distillation_init", "after_trainer_init", "before_distillation_init",
           "before_trainer_init", "count_data_parallel_ranks", "model_init_sharding", "online_layout",
           "record_given_generation_batch", "refuse_partial_groups", "refuse_split_eval_groups", "refuse_vllm",
           "seed_by_data_parallel_rank", "seeding", "sharded_layout"]

# On a GRPOConfig/RLOOConfig: (generation_batch_size, steps_per_generation) as the user gave them, before TRL's
# __post_init__ derived the missing one from the process count (shardadopt.enable() records it).
GIVEN_BATCH_ATTR = "_shardadopt_given_generation_batch"


def sharded_layout(model: Any) -> Topology | None:
    """The topology of ``model`` when it is sharded at load time (or by hand), else None (a plain model, a model id
    TRL loads itself, a layout shardadopt cannot read). Local: no collective."""
    from torch import nn

    if not isinstance(model, nn.Module):
        return None
    try:
        layout = topology(model)
    except TopologyError:
        return None
    return layout if layout.is_sharded else None


def online_layout(model: Any) -> Topology | None:
    """The topology of ``model`` when its ranks are not all data parallel (a tensor-parallel group of more than one
    rank: ``tp_size``, 2-D), where TRL's per-process arithmetic needs data-parallel ranks; else None.

    Args:
        model: what the trainer was given or holds.

    Returns:
        The topology, or None.
    """
    layout = sharded_layout(model)
    return layout if layout is not None and layout.dp_size < layout.world_size else None


def count_data_parallel_ranks(args: Any, layout: Topology) -> None:
    """Make a ``GRPOConfig``/``RLOOConfig`` that TRL sized by the process count size its generation batch by the
    data-parallel ranks, as under DDP with one process per data-parallel rank.

    The value the user gave is kept (recorded by ``shardadopt.enable()`` before TRL's ``__post_init__``): a given
    ``generation_batch_size`` gets ``steps_per_generation = generation_batch_size // (per_device_train_batch_size *
    dp_size)``; otherwise ``steps_per_generation`` (given, or TRL's default ``gradient_accumulation_steps``) stays and
    ``generation_batch_size = per_device_train_batch_size * dp_size * steps_per_generation``. Idempotent.

    Args:
        args: the trainer's config, after its ``__post_init__``.
        layout: the model's topology (:func:`online_layout`).

    Raises:
        AdoptionError: a given ``generation_batch_size`` that the data-parallel global batch does not divide.
    """
    given_batch, _ = getattr(args, GIVEN_BATCH_ATTR, (None, None))
    global_batch = args.per_device_train_batch_size * layout.dp_size
    if given_batch is not None:
        if given_batch % global_batch:
            raise AdoptionError(
                f"generation_batch_size={given_batch} is not a multiple of the global batch "
                f"per_device_train_batch_size x data-parallel ranks = {args.per_device_train_batch_size} x "
                f"{layout.dp_size} ({layout.describe()}; the ranks of a tensor-parallel group share one batch). "
                f"Give generation_batch_size={global_batch * max(1, given_batch // global_batch)}, or "
                f"steps_per_generation instead.")
        args.steps_per_generation = given_batch // global_batch
    args.generation_batch_size = global_batch * args.steps_per_generation


def model_init_sharding(args: Any) -> dict[str, int]:
    """The sharding sizes above 1 that a config's ``model_init_kwargs["distributed_config"]`` asks for (a
    ``DistributedConfig`` or its dict form), with which TRL loads a model given as a path (``model="org/name"``:
    ``from_pretrained(path, **model_init_kwargs)``, sharded at load time); empty without one. Local.

    Args:
        args: a TRL trainer config.

    Returns:
        ``{"tp_size": 2, ...}``: every ``*_size`` above 1.
    """
    from shardadopt.loadtime.sizes import config_sizes

    init = getattr(args, "model_init_kwargs", None)
    config = init.get("distributed_config") if isinstance(init, Mapping) else None
    if config is None:
        return {}
    return {name: value for name, value in config_sizes(config).items()
            if name.endswith("_size") and isinstance(value, int) and value > 1}


def refuse_vllm(args: Any, model: Any) -> None:
    """Refuse (:class:`AdoptionError`) ``use_vllm=True`` for a model sharded at load time: given loaded, or given
    as a path that TRL loads with a sharding ``distributed_config`` in ``model_init_kwargs`` (refused before TRL
    loads it or starts vLLM).

    TRL syncs the trained weights into vLLM by reading each parameter whole: it gathers them only through
    accelerate's FSDP plugin (``summon_full_params`` / ``full_tensor()``) or DeepSpeed ZeRO-3, which a model sharded
    at load time does not go through; every other parameter is sent as ``param.data``, which here is this rank's
    DTensor shard under the full parameter's name. And on CPU processes (gloo) vLLM cannot run at all: its weight
    transfer is NCCL (CUDA). Local.

    Args:
        args: the trainer's config.
        model: what the trainer was given.
    """
    if not getattr(args, "use_vllm", False):
        return
    layout = sharded_layout(model)
    if layout is not None:
        described = layout.describe()
    elif isinstance(model, str) and (sizes := model_init_sharding(args)):
        sizes = ", ".join(f"{name}={value}" for name, value in sizes.items())
        described = f"{model!r} loaded by TRL with model_init_kwargs distributed_config {sizes}"
    else:
        return
    raise AdoptionError(
        f"use_vllm=True cannot train a model sharded at load time ({described}): TRL copies the trained "
        f"weights into vLLM whole only through accelerate's FSDP plugin or DeepSpeed ZeRO-3, and this model's "
        f"parameters are DTensor shards that it would send as they are (each rank's piece under the full "
        f"parameter's name); on CPU processes (gloo) vLLM has no weight transfer at all (NCCL only). Set "
        f"use_vllm=False: TRL then samples with model.generate, which shardadopt keeps in agreement inside each "
        f"tensor-parallel group. For vLLM, load the plain checkpoint and let accelerate shard it (FSDP plugin).")


def seed_by_data_parallel_rank(seed: int, layout: Topology) -> None:
    """Seed this process as TRL seeds DDP's process ``dp_rank`` (``set_seed(seed, device_specific=True)`` there):
    every rank of a TP group gets the same stream, each data-parallel rank its own. Local.

    Args:
        seed: the config's ``seed``.
        layout: the model's topology (:func:`online_layout`).
    """
    from accelerate.utils import set_seed

    set_seed(seed + layout.dp_rank)


def record_given_generation_batch(config: Any) -> None:
    """Remember the ``generation_batch_size``/``steps_per_generation`` the user gave a ``GRPOConfig``/``RLOOConfig``,
    before its ``__post_init__`` derives the missing one from the process count. Local.

    Args:
        config: the config, before ``__post_init__`` runs.
    """
    setattr(config, GIVEN_BATCH_ATTR, (config.generation_batch_size, config.steps_per_generation))


def before_trainer_init(model: Any, config: Any) -> bool:
    """What a GRPO/RLOO trainer's ``__init__`` needs before it runs on ``model`` with ``config`` (the arguments the
    user passed; either may be None or, for ``model``, a model id): refusals, then the generation batch by
    data-parallel ranks. Local.

    Args:
        model: the trainer's ``model`` argument.
        config: its ``args`` argument.

    Returns:
        Whether ``config`` was fitted to the model's layout here (a given config and a loaded model); otherwise
        :func:`after_trainer_init` fits the config TRL holds to the model TRL holds.
    """
    from torch import nn

    if config is None:
        return False
    refuse_vllm(config, model)
    if not isinstance(model, nn.Module):  # a path: TRL loads it (sharded per model_init_kwargs) in __init__
        return False
    layout = online_layout(model)
    if layout is not None:
        _fit_config(config, layout)
    return True


def after_trainer_init(trainer: Any, fitted: bool) -> None:
    """After a GRPO/RLOO trainer's ``__init__`` seeded every process as a data-parallel rank: where its model's TP
    ranks share batches, fit the config unless :func:`before_trainer_init` did (a config TRL built, or a model TRL
    loaded from a path with a ``distributed_config`` in ``model_init_kwargs``), seed each process by its
    data-parallel rank and give the trainer its data-parallel view (:func:`shardadopt.online.view.attach_view`).
    A collective where the TP ranks share batches (every rank builds the trainer).

    Args:
        trainer: the trainer, initialised.
        fitted: what :func:`before_trainer_init` returned.
    """
    layout = online_layout(trainer.model)
    if layout is None:
        return
    if not fitted:
        _fit_config(trainer.args, layout)
    _count_by_data_parallel_rank(trainer, layout)


def before_distillation_init(model: Any, config: Any) -> None:
    """What DistillationTrainer's ``__init__`` needs before it runs on ``model`` with ``config`` (the user's
    arguments; either may be None, ``model`` a path): the vLLM refusal. Local.

    Args:
        model: the trainer's ``model`` argument (the student).
        config: its ``args`` argument.
    """
    if config is not None:
        refuse_vllm(config, model)


def after_distillation_init(trainer: Any) -> None:
    """After DistillationTrainer's ``__init__`` seeded every process as a data-parallel rank: where its student's
    TP ranks share batches (given loaded, or loaded by TRL from a path), seed each process by its data-parallel rank
    and give the trainer its data-parallel view, under which its sampler's blocks, gathers and loss normalisation
    count data-parallel ranks (``gradient_accumulation_steps > 1`` included). A collective there.

    Args:
        trainer: the trainer, initialised.
    """
    layout = online_layout(trainer.model)
    if layout is not None:
        _count_by_data_parallel_rank(trainer, layout)


def refuse_split_eval_groups(args: Any, layout: Topology) -> None:
    """Refuse (:class:`AdoptionError`) an evaluation batch that does not hold whole groups of evaluation
    generations over the data-parallel ranks, as TRL's config check refuses it under DDP (TRL checks
    ``per_device_eval_batch_size x processes``, which counts the TP ranks, and would pass). Local.

    Args:
        args: a ``GRPOConfig``/``RLOOConfig`` that evaluates (``do_eval`` and an ``eval_strategy``).
        layout: the model's topology (:func:`online_layout`).
    """
    if not (args.do_eval and args.eval_strategy != "no"):  # TRL's own condition
        return
    generations = getattr(args, "num_generations_eval", None) or args.num_generations
    rows = args.per_device_eval_batch_size * layout.dp_size
    if rows % generations:
        raise AdoptionError(
            f"the global eval batch per_device_eval_batch_size x data-parallel ranks = "
            f"{args.per_device_eval_batch_size} x {layout.dp_size} ({layout.describe()}; the ranks of a "
            f"tensor-parallel group share one batch) does not hold whole groups of {generations} evaluation "
            f"generations (TRL refuses this under DDP over {layout.dp_size} processes). Use a "
            f"per_device_eval_batch_size whose product with {layout.dp_size} is a multiple of {generations}.")


def refuse_partial_groups(args: Any, layout: Topology) -> None:
    """Refuse (:class:`AdoptionError`) a generation batch that, counted over the data-parallel ranks, does not hold
    whole groups of ``num_generations``, as TRL's config check refuses it under DDP (TRL checks the batch counted
    over every process, which the TP ranks pass: ``tp_size=2``, ``per_device_train_batch_size=2``,
    ``num_generations=4`` is one data-parallel rank's 2 rows, half a group). Local.

    Args:
        args: the trainer's config, its generation batch counted by :func:`count_data_parallel_ranks`.
        layout: the model's topology (:func:`online_layout`).
    """
    generations = args.num_generations
    if args.generation_batch_size % generations == 0:
        return
    import math

    global_batch = args.per_device_train_batch_size * layout.dp_size
    steps = generations // math.gcd(global_batch, generations)
    raise AdoptionError(
        f"the generation batch per_device_train_batch_size x data-parallel ranks x steps_per_generation = "
        f"{args.per_device_train_batch_size} x {layout.dp_size} x {args.steps_per_generation} = "
        f"{args.generation_batch_size} rows does not hold whole groups of num_generations={generations} "
        f"completions ({layout.describe()}; the ranks of a tensor-parallel group share one batch): TRL refuses it "
        f"under DDP over {layout.dp_size} process(es). Use steps_per_generation={steps * args.steps_per_generation}"
        f" or a per_device_train_batch_size whose product with {layout.dp_size} x steps_per_generation is a "
        f"multiple of {generations}.")


def _fit_config(config: Any, layout: Topology) -> None:
    """The generation batch by data-parallel ranks (a given ``generation_batch_size`` sets
    ``steps_per_generation``), and the groups checked over them."""
    count_data_parallel_ranks(config, layout)
    refuse_partial_groups(config, layout)
    refuse_split_eval_groups(config, layout)


def _count_by_data_parallel_rank(trainer: Any, layout: Topology) -> None:
    from shardadopt.online.view import attach_view

    seed_by_data_parallel_rank(trainer.args.seed, layout)
    attach_view(trainer, layout)


def seeding(function: Any) -> str | None:
    """How a trainer's ``__init__`` (``function``) seeds its processes, for the patches' probes:
    ``"process"`` for ``set_seed(..., device_specific=True)`` (each process by its index), ``"data-parallel"`` for a
    ``set_seed`` call that reads a data-parallel rank or ``parallelism_config``, None for neither."""
    import ast

    from shardadopt.upstream.probing import calls, names, source_tree

    tree = source_tree(function)
    for call in calls(tree, "set_seed"):
        if names(call) & {"parallelism_config", "dp_rank", "data_parallel_rank", "dp_shard_rank"}:
            return "data-parallel"
        if any(k.arg == "device_specific" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords):
            return "process"
    return None
