"""accelerate adopts a model that is already sharded (at load time by transformers, or by hand).

``Accelerator.prepare`` knows how to shard a plain model (DDP, its FSDP plugin, its TP path); a model that arrives
sharded needs the opposite: leave it exactly as it is and make everything around it follow its topology.
:func:`adopt_model` does that and is what ``shardadopt.enable()`` routes ``prepare_model`` to; the other functions
here are the pieces, usable without any patching:

- the model: no DDP wrap, no re-sharding, no ``.to()``; each rank's parameters (EP experts included) keep their
  loaded values (strided plain TP shards get contiguous storage: fused AdamW mis-updates views). Mixed precision
  and ``torch.compile`` still apply (upstream's ``evaluation_mode`` path does exactly that);
- data: loaders prepared by the same accelerator, before or after the model, are split by data-parallel rank only
  (:func:`shard_dataloader`): the ranks of a TP group get identical batches;
- metrics: :func:`gather_for_metrics` keeps one copy of each sample (one rank per data-parallel rank);
- accumulation: :func:`no_sync` skips FSDP2 gradient reduction on non-final micro-steps;
- clipping: :func:`clip_grad_norm_` over any mix of meshes, counting plain-tensor shards right;
- optimizers: :func:`shardadopt.optim.split_param_groups_by_mesh`.

Configuration: :class:`AdoptionKwargs` in ``Accelerator(kwargs_handlers=[...])``; defaults need none.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import KwargsHandler
from torch import nn

from shardadopt import upstream
from shardadopt.optimizer_ready import make_shards_contiguous
from shardadopt.topology import Topology, TopologyError, topology

__all__ = ["AdoptionKwargs", "AdoptionError", "adopt_model", "adopted", "adoption_kwargs", "is_sharded_model",
           "shard_dataloader", "gather_for_metrics", "no_sync", "clip_grad_norm_"]

_STATE_ATTR = "_shardadopt_adoption"
_KWARGS_ATTR = "_shardadopt_kwargs"


@dataclass
class AdoptionKwargs(KwargsHandler):
    """How ``Accelerator`` adopts sharded models: pass in ``Accelerator(kwargs_handlers=[AdoptionKwargs(...)])``.

    ``topology``: explicit sizes for layouts the model cannot tell (``{"dp_replicate": .., "dp_shard": ..,
    "tp": .., "ep": ..}``; see :func:`shardadopt.topology`). ``reshard_checkpoints``: whether ``load_state`` may
    load a checkpoint saved with another layout or world size, resharding weights and optimizer state through
    DCP (default on; off refuses it with ``shardadopt.checkpoint.CheckpointMismatchError``). ``split_optimizer``:
    make foreach/fused optimizers step on homogeneous param groups (default on).
    """

    topology: dict[str, int] | None = None
    reshard_checkpoints: bool = True
    split_optimizer: bool = True


class AdoptionError(ValueError):
    """A prepared object does not fit the adopted model's topology."""


@dataclass
class _Adoption:
    """Per-accelerator record of adopted models and the data-parallel layout they impose."""

    topologies: dict[int, Topology] = field(default_factory=dict)  # id(model) -> topology
    models: list[nn.Module] = field(default_factory=list)
    # For each data-parallel rank (in order), the lowest global rank that holds it: whose data gather_for_metrics
    # keeps.
    owners: list[int] | None = None

    @property
    def layout(self) -> Topology | None:
        return next(iter(self.topologies.values()), None)


def adoption_kwargs(accelerator: Any) -> AdoptionKwargs:
    return getattr(accelerator, _KWARGS_ATTR, None) or AdoptionKwargs()


def adopted(accelerator: Any) -> _Adoption | None:
    """The adoption record of ``accelerator``, or None when it adopted no sharded model."""
    state = getattr(accelerator, _STATE_ATTR, None)
    return state if state is not None and state.topologies else None


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded_model(model: Any, override: Mapping[str, int] | None = None) -> bool:
    """True for a module sharded at load time by transformers or by hand (DTensor parameters / FSDP2)."""
    if not isinstance(model, nn.Module):
        return False
    return topology(model, override).is_sharded


def adopt_model(accelerator: Any, model: nn.Module, prepare: Any = None) -> nn.Module:
    """Register the sharded ``model`` with ``accelerator`` without touching its parameters.

    ``prepare`` is upstream's ``prepare_model`` (bound); it is called with ``device_placement=False,
    evaluation_mode=True`` so that mixed precision, compile and bookkeeping happen as upstream does them, and no
    wrapping, moving or re-sharding. Dataloaders this accelerator prepared before are re-split by data-parallel
    rank.
    """
    kwargs = adoption_kwargs(accelerator)
    topo = topology(model, kwargs.topology)
    if "peft" in sys.modules:  # LoRA layers not laid out by shardadopt.adapters would train wrong: refuse them
        from shardadopt.adapters import check_adapters

        check_adapters(model)
    if accelerator.num_processes != topo.world_size:
        # accelerate on a machine without GPUs and without cpu=True treats each torchrun process as a job of its
        # own: every rank would see the whole dataset, write every checkpoint and log as rank 0.
        raise AdoptionError(
            f"the model is sharded over {topo.world_size} processes, but this Accelerator runs "
            f"{accelerator.num_processes} ({accelerator.distributed_type}). On a machine without GPUs pass "
            f"Accelerator(cpu=True) (Trainer: TrainingArguments(use_cpu=True)) so the torchrun processes join one job.")
    state = getattr(accelerator, _STATE_ATTR, None)
    if state is None:
        state = _Adoption()
        setattr(accelerator, _STATE_ATTR, state)
    previous = state.layout
    if previous is not None and (previous.dp_size, previous.dp_rank) != (topo.dp_size, topo.dp_rank):
        raise AdoptionError(
            f"this Accelerator already adopted a model laid out as {previous.describe()}; the new model is "
            f"{topo.describe()}. One Accelerator splits data one way: use models with the same data-parallel "
            f"layout, or one Accelerator per layout.")
    # transformers 5.15's TP keeps row-parallel shards as plain strided views, which torch's fused AdamW mis-updates
    # (shardadopt.torchprobe): own contiguous storage, same Parameter objects, so an optimizer built before
    # prepare() keeps stepping them.
    make_shards_contiguous(model)
    if prepare is not None:
        model = prepare(model, device_placement=False, evaluation_mode=True)
    elif model not in upstream.accelerator_models(accelerator):
        upstream.accelerator_models(accelerator).append(model)
    state.topologies[id(model)] = topo
    state.models.append(model)
    if state.owners is None:
        state.owners = _dp_owners(topo)
    for loader in upstream.accelerator_dataloaders(accelerator):
        shard_dataloader(loader, topo)
    return model


def _dp_owners(topo: Topology) -> list[int]:
    if topo.world_size == 1:
        return [0]
    dp_ranks = [None] * topo.world_size
    dist.all_gather_object(dp_ranks, topo.dp_rank)
    owners: dict[int, int] = {}
    for rank, dp_rank in enumerate(dp_ranks):
        owners.setdefault(dp_rank, rank)
    if sorted(owners) != list(range(topo.dp_size)):
        raise TopologyError(f"data-parallel ranks over the world are {dp_ranks}, expected each of "
                            f"0..{topo.dp_size - 1}; pass an explicit topology override")
    return [owners[d] for d in range(topo.dp_size)]


# -- data --------------------------------------------------------------------------------------------------------

def _shard_target(loader: Any) -> Any:
    """The object of an accelerate-prepared loader that decides which samples this process gets."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    for candidate in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                      getattr(loader, "dataset", None)):
        if isinstance(candidate, (BatchSamplerShard, IterableDatasetShard)):
            return candidate
    return None


def shard_dataloader(loader: Any, topo: Topology) -> Any:
    """Make an accelerate-prepared ``loader`` give this rank the batches of its data-parallel rank.

    accelerate splits by process (``num_processes``/``process_index``); an adopted model splits by data-parallel
    rank. A loader split another way is re-split in place; one that cannot be re-split raises
    :class:`AdoptionError` naming the fix.
    """
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(loader, DataLoaderDispatcher):
        if topo.dp_size == topo.world_size:  # one slice per process is one per data-parallel rank
            return loader
        raise AdoptionError(
            "this dataloader was prepared with dispatch_batches=True: rank 0 slices every batch over all processes, "
            "which cannot give the ranks of a tensor-parallel group the same batch. Create the Accelerator with "
            "dataloader_config=DataLoaderConfiguration(dispatch_batches=False).")
    target = _shard_target(loader)
    if target is None:
        if topo.world_size > 1 and topo.dp_size > 1 and upstream.is_accelerate_prepared(loader):
            raise AdoptionError(
                f"dataloader {type(loader).__name__} was prepared without a per-process split, but the model needs "
                f"{topo.dp_size} data-parallel ranks; prepare the torch DataLoader itself with this Accelerator.")
        return loader
    if (target.num_processes, target.process_index) != (topo.dp_size, topo.dp_rank):
        if getattr(target, "_shardadopt_split", None) not in (None, (topo.dp_size, topo.dp_rank)):
            raise AdoptionError(
                f"this dataloader is already split for {target._shardadopt_split[0]} data-parallel ranks by another "
                f"adopted model; the model being prepared needs {topo.dp_size}. Prepare a separate dataloader.")
        target.num_processes, target.process_index = topo.dp_size, topo.dp_rank
    target._shardadopt_split = (topo.dp_size, topo.dp_rank)
    return loader


# -- metrics -----------------------------------------------------------------------------------------------------

def _keep_owner_chunks(data: Any, owners: list[int], world: int) -> Any:
    def select(tensor: torch.Tensor) -> torch.Tensor:
        chunks = tensor.chunk(world) if tensor.dim() else [tensor]
        if len(chunks) != world:
            return tensor
        return torch.cat([chunks[r] for r in owners])

    from accelerate.utils import recursively_apply

    return recursively_apply(select, data)


def gather_for_metrics(accelerator: Any, input_data: Any, use_gather_object: bool = False) -> Any:
    """``Accelerator.gather_for_metrics`` that returns each sample once when several ranks share a batch (TP)."""
    from accelerate.utils import recursively_apply

    state = adopted(accelerator)
    world = accelerator.num_processes
    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    use_gather_object = use_gather_object or not all_tensors
    if use_gather_object:
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, input_data)
        data: Any = []
        for rank in state.owners:
            part = per_rank[rank]
            data.extend(part if isinstance(part, (list, tuple)) else [part])
    else:
        data = _keep_owner_chunks(accelerator.gather(input_data), state.owners, world)
    gradient_state = accelerator.gradient_state
    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        remainder = gradient_state.remainder
        return data[:remainder] if use_gather_object else recursively_apply(lambda t: t[:remainder], data)
    return data


# -- accumulation ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip FSDP2 gradient reduction (reduce-scatter and HSDP all-reduce) inside the block; gradients accumulate
    unsharded locally and the next synchronised backward reduces the sum."""
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


# -- clipping ----------------------------------------------------------------------------------------------------

def clip_grad_norm_(accelerator: Any, parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients of adopted models over every mesh at once (``shardadopt.gradnorm``), with plain tensors
    counted by how many ranks hold them (``Topology.plain_replication``)."""
    from shardadopt.gradnorm import clip_grad_norm_ as clip

    parameters = list(parameters)
    accelerator.unscale_gradients()
    state = adopted(accelerator)
    maps = [t.grad_replication(parameters) for t in state.topologies.values()] if state else []
    world = accelerator.num_processes

    def replication(grad: torch.Tensor) -> int:
        for counts in maps:
            found = counts(grad)
            if found != world:
                return found
        return world

    return clip(parameters, max_norm, norm_type, plain_replication=replication)
