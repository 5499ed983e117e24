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

TRL also gathers rewards over every process and groups them by ``num_generations`` consecutive rows: the TP ranks'
copies of a batch are then grouped as one. That is right when each process's generation batch holds whole groups
and the statistics are per group; :func:`refuse_split_groups` and :func:`refuse_batch_statistics` refuse the
configurations where they are not, and :func:`refuse_vllm` refuses vLLM generation, whose weight sync cannot read a
model sharded at load time. :func:`before_trainer_init` / :func:`after_trainer_init` are what the patches call.

DistillationTrainer (on-policy: the student samples) seeds the same way and sizes its repeat sampler's blocks by the
process count inline (no config field to resize): :func:`before_distillation_init` /
:func:`after_distillation_init` seed by data-parallel rank and refuse ``gradient_accumulation_steps > 1`` where TP
ranks share batches (:func:`refuse_accumulated_generation`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardadopt.adopt.record import AdoptionError
from shardadopt.topology import Topology, TopologyError, topology

__all__ = ["GIVEN_BATCH_ATTR", "after_distillation_init", "after_trainer_init", "before_distillation_init",
           "before_trainer_init", "count_data_parallel_ranks", "model_init_sharding", "online_layout",
           "record_given_generation_batch", "refuse_accumulated_generation", "refuse_batch_statistics",
           "refuse_split_groups", "refuse_vllm", "seed_by_data_parallel_rank", "seeding", "sharded_layout"]

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


def refuse_split_groups(args: Any, layout: Topology) -> None:
    """Refuse (:class:`AdoptionError`) a config whose per-process generation batch does not hold whole groups of
    ``num_generations`` completions, on a model whose TP ranks share batches.

    TRL gathers the rewards of every process and groups ``num_generations`` consecutive rows; the ranks of a TP
    group contribute the same rows, so a group that spans processes (``per_device_train_batch_size=2,
    num_generations=4``) is built from copies of the TP group's rows, not from ``num_generations`` completions:
    wrong advantages, no error (TRL's own check counts the TP ranks as data-parallel and passes). Local.

    Args:
        args: the trainer's config.
        layout: the model's topology (:func:`online_layout`).
    """
    rows = args.per_device_train_batch_size * args.steps_per_generation
    generations = args.num_generations
    if rows % generations == 0:
        return
    per_device = generations * -(-args.per_device_train_batch_size // generations)
    steps = generations // math.gcd(rows, generations) * args.steps_per_generation
    raise AdoptionError(
        f"each process's generation batch (per_device_train_batch_size x steps_per_generation = "
        f"{args.per_device_train_batch_size} x {args.steps_per_generation} = {rows} rows) does not hold whole groups "
        f"of num_generations={generations} completions, and this model's tensor-parallel ranks share their batch "
        f"({layout.describe()}): TRL groups the rewards it gathers over every process, so each group would be built "
        f"from copies of the same rows and the advantages would be wrong. Use per_device_train_batch_size="
        f"{per_device} (a multiple of num_generations), or steps_per_generation={steps} so that "
        f"per_device_train_batch_size x steps_per_generation is a multiple of num_generations.")


def refuse_batch_statistics(args: Any, layout: Topology) -> None:
    """Refuse (:class:`AdoptionError`) advantages scaled by statistics over the whole gathered batch, on a model
    whose TP ranks share batches.

    TRL gathers the rewards of every process: the TP ranks' copies of a batch appear ``tp`` times, which leaves
    per-group means and standard deviations exact (each group is whole on one process, see
    :func:`refuse_split_groups`) but changes a standard deviation over the whole batch (Bessel's correction counts
    the copies): ``GRPOConfig(scale_rewards="batch")``, ``multi_objective_aggregation="normalize_then_sum"`` and
    ``RLOOConfig(normalize_advantages=True)`` would scale the advantages unlike DDP. Local.

    Args:
        args: the trainer's config.
        layout: the model's topology (:func:`online_layout`).
    """
    options = {
        "scale_rewards": ("batch", 'scale_rewards="group"'),
        "multi_objective_aggregation": ("normalize_then_sum", 'multi_objective_aggregation="sum_then_normalize"'),
        "normalize_advantages": (True, "normalize_advantages=False"),
    }
    for name, (value, fix) in options.items():
        if getattr(args, name, None) == value:
            raise AdoptionError(
                f"{name}={value!r} scales the advantages by a standard deviation over the whole batch TRL gathers "
                f"from every process, and this model's tensor-parallel ranks contribute copies of the same rows "
                f"({layout.describe()}): the statistic would count each row {layout.world_size // layout.dp_size} "
                f"times and differ from DDP's. Use {fix} (per-group statistics, exact here), or load the model "
                f"with DistributedConfig(fsdp_size=...) only.")


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
    ranks share batches, check the config unless :func:`before_trainer_init` did (a config TRL built, or a model TRL
    loaded from a path with a ``distributed_config`` in ``model_init_kwargs``) and seed each process by its
    data-parallel rank. Local.

    Args:
        trainer: the trainer, initialised.
        fitted: what :func:`before_trainer_init` returned.
    """
    layout = online_layout(trainer.model)
    if layout is None:
        return
    if not fitted:
        _fit_config(trainer.args, layout)
    seed_by_data_parallel_rank(trainer.args.seed, layout)


def refuse_accumulated_generation(args: Any, layout: Topology) -> None:
    """Refuse (:class:`AdoptionError`) ``gradient_accumulation_steps > 1`` for DistillationTrainer on a model whose
    TP ranks share batches.

    DistillationTrainer generates once per optimizer step on the first of its ``gradient_accumulation_steps``
    dataloader batches and reuses it; its repeat sampler repeats blocks of ``per_device_train_batch_size x processes
    x gradient_accumulation_steps`` prompts that many times so that the skipped batches are the repeats. Counted by
    processes, a block holds ``tp`` data-parallel windows: the step after the first trains the first window's
    prompts again where DDP moves on. Local.

    Args:
        args: the trainer's config.
        layout: the model's topology (:func:`online_layout`).
    """
    steps = args.gradient_accumulation_steps
    if steps <= 1:
        return
    raise AdoptionError(
        f"DistillationTrainer with gradient_accumulation_steps={steps} on a model whose tensor-parallel ranks share "
        f"their batch ({layout.describe()}): TRL sizes the blocks its sampler repeats by the process count, so the "
        f"ranks of a tensor-parallel group would count as data-parallel ranks and train some prompts again where "
        f"DDP moves on. Use gradient_accumulation_steps=1 with per_device_train_batch_size="
        f"{args.per_device_train_batch_size * steps} (the same batch per optimizer step), or load the model with "
        f"DistributedConfig(fsdp_size=...) only.")


def before_distillation_init(model: Any, config: Any) -> bool:
    """What DistillationTrainer's ``__init__`` needs before it runs on ``model`` with ``config`` (the user's
    arguments; either may be None, ``model`` a path): refusals. Local.

    Args:
        model: the trainer's ``model`` argument (the student).
        config: its ``args`` argument.

    Returns:
        Whether ``config`` was checked against the model's layout here (a given config and a loaded student);
        otherwise :func:`after_distillation_init` checks the config TRL holds against the student TRL holds.
    """
    from torch import nn

    if config is None:
        return False
    refuse_vllm(config, model)
    if not isinstance(model, nn.Module):  # a path: TRL loads it (sharded per model_init_kwargs) in __init__
        return False
    layout = online_layout(model)
    if layout is not None:
        refuse_accumulated_generation(config, layout)
    return True


def after_distillation_init(trainer: Any, checked: bool) -> None:
    """After DistillationTrainer's ``__init__`` seeded every process as a data-parallel rank: where its student's
    TP ranks share batches, check the config unless :func:`before_distillation_init` did (a config TRL built, or a
    student TRL loaded from a path) and seed each process by its data-parallel rank. Local.

    Args:
        trainer: the trainer, initialised.
        checked: what :func:`before_distillation_init` returned.
    """
    layout = online_layout(trainer.model)
    if layout is None:
        return
    if not checked:
        refuse_accumulated_generation(trainer.args, layout)
    seed_by_data_parallel_rank(trainer.args.seed, layout)


def _fit_config(config: Any, layout: Topology) -> None:
    """The generation batch by data-parallel ranks (first: a given ``generation_batch_size`` sets
    ``steps_per_generation``), then the refusals that read it."""
    count_data_parallel_ranks(config, layout)
    refuse_split_groups(config, layout)
    refuse_batch_statistics(config, layout)


def seeding(function: Any) -> str | None:
    """How a trainer's ``__init__`` (``function``) seeds its processes, for the patches' probes:
    ``"process"`` for ``set_seed(..., device_specific=True)`` (each process by its index), ``"data-parallel"`` for a
    ``set_seed`` call that reads a data-parallel rank or ``parallelism_config``, None for neither."""
    import ast

    from shardadopt.probing import calls, names, source_tree

    tree = source_tree(function)
    for call in calls(tree, "set_seed"):
        if names(call) & {"parallelism_config", "dp_rank", "data_parallel_rank", "dp_shard_rank"}:
            return "data-parallel"
        if any(k.arg == "device_specific" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords):
            return "process"
    return None
