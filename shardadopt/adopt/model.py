"""An Accelerator adopts a model that is already sharded: registered as it is, everything around it following its
topology.

``Accelerator.prepare`` knows how to shard a plain model (DDP, its FSDP plugin, its TP path); a model that arrives
sharded needs the opposite: no DDP wrap, no re-sharding, no ``.to()``; each rank's parameters (EP experts included)
keep their loaded values (strided plain TP shards get contiguous storage: fused AdamW mis-updates views), except
whole plain copies on a TP load that differ from rank 0's (``replicas``: DDP's broadcast). Mixed
precision and ``torch.compile`` still apply (upstream's ``evaluation_mode`` path does exactly that).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import nn

from shardadopt import upstream
from shardadopt.adopt.context import shares_batches
from shardadopt.adopt.data import dp_owners, shard_dataloader, world_dp_ranks
from shardadopt.adopt.frozen_units import keep_frozen_units_gathered
from shardadopt.adopt.record import AdoptionError, adoption_kwargs, adoption_record
from shardadopt.adopt.refusals import refuse_fused_lm_head_on_plain_shards, refuse_unsupported_distributed_features
from shardadopt.adopt.replicas import broadcast_plain_replicas
from shardadopt.parallel.optimizer_ready import make_shards_contiguous
from shardadopt.parallel.topology import topology


def is_sharded_model(model: Any, override: Mapping[str, int] | None = None) -> bool:
    """Whether ``model`` was sharded at load time by transformers or by hand (DTensor parameters / FSDP2).

    Args:
        model: anything ``prepare`` is given (not a module: False).
        override: explicit topology sizes (:class:`AdoptionKwargs` ``topology``).

    Returns:
        True for a sharded module.
    """
    if not isinstance(model, nn.Module):
        return False
    return topology(model, override).is_sharded


def adopt_model(accelerator: Any, model: nn.Module, prepare: Any = None) -> nn.Module:
    """Register the sharded ``model`` with ``accelerator`` without touching its parameters. Dataloaders this
    accelerator prepared before are re-split by data-parallel rank. Collective the first time (every rank's
    data-parallel rank is gathered).

    Args:
        accelerator: the ``Accelerator``.
        model: the sharded model (a peft model around one too: its LoRA layers must be laid out).
        prepare: upstream's ``prepare_model`` (bound), called with ``device_placement=False,
            evaluation_mode=True`` so that mixed precision, compile and bookkeeping happen as upstream does them,
            and no wrapping, moving or re-sharding; None: the model is only registered.

    Returns:
        The prepared model (``model`` itself without ``prepare``).

    Raises:
        AdoptionError: for a model, Accelerator or dataloader that does not fit the model's topology.
    """
    refuse_unsupported_distributed_features(model)
    kwargs = adoption_kwargs(accelerator)
    topo = topology(model, kwargs.topology)
    if "peft" in sys.modules:  # LoRA layers not laid out by shardadopt.adapters would train wrong: refuse them
        from shardadopt.adapters import check_adapters

        check_adapters(model)
    if "trl" in sys.modules:
        refuse_fused_lm_head_on_plain_shards(model)
    if accelerator.num_processes != topo.world_size:
        # accelerate on a machine without GPUs and without cpu=True treats each torchrun process as a job of its
        # own: every rank would see the whole dataset, write every checkpoint and log as rank 0.
        raise AdoptionError(
            f"the model is sharded over {topo.world_size} processes, but this Accelerator runs "
            f"{accelerator.num_processes} ({accelerator.distributed_type}). On a machine without GPUs pass "
            f"Accelerator(cpu=True) (Trainer: TrainingArguments(use_cpu=True)) so the torchrun processes join one job.")
    state = adoption_record(accelerator)
    previous = state.layout
    if previous is not None and (previous.dp_size, previous.dp_rank) != (topo.dp_size, topo.dp_rank):
        raise AdoptionError(
            f"this Accelerator already adopted a model laid out as {previous.describe()}; the new model is "
            f"{topo.describe()}. One Accelerator splits data one way: use models with the same data-parallel "
            f"layout, or one Accelerator per layout.")
    # transformers 5.15's TP keeps row-parallel shards as plain strided views, which torch's fused AdamW mis-updates
    # (shardadopt.upstream.torchprobe): own contiguous storage, same Parameter objects, so an optimizer built before
    # prepare() keeps stepping them.
    make_shards_contiguous(model)
    # what DDP's wrap does: a TP group's whole plain copies (a fresh classification head) are rank 0's
    broadcast_plain_replicas(model, topo)
    if kwargs.keep_frozen_units_gathered or kwargs.keep_frozen_units_gathered_across_steps:
        keep_frozen_units_gathered(model, across_steps=kwargs.keep_frozen_units_gathered_across_steps)
    if prepare is not None:
        model = prepare(model, device_placement=False, evaluation_mode=True)
    elif model not in upstream.accelerator_models(accelerator):
        upstream.accelerator_models(accelerator).append(model)
    state.topologies[id(model)] = topo
    state.models.append(model)
    if state.owners is None:
        state.dp_ranks = world_dp_ranks(topo)
        state.owners = dp_owners(topo, state.dp_ranks)
    if not shares_batches(accelerator, topo):  # the ranks of one CP group take the same batches
        for loader in upstream.accelerator_dataloaders(accelerator):
            shard_dataloader(loader, topo, state.dp_ranks)
    return model
