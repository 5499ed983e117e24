"""accelerate adopts a model that is already sharded (at load time by transformers, or by hand).

``Accelerator.prepare`` knows how to shard a plain model (DDP, its FSDP plugin, its TP path); a model that arrives
sharded needs the opposite: leave it exactly as it is and make everything around it follow its topology.
:func:`adopt_model` does that and is what ``shardadopt.enable()`` routes ``prepare_model`` to; the other functions
here are the pieces, usable without any patching:

- the model: no DDP wrap, no re-sharding, no ``.to()``; each rank's parameters (EP experts included) keep their
  loaded values (strided plain TP shards get contiguous storage: fused AdamW mis-updates views). Mixed precision
  and ``torch.compile`` still apply (upstream's ``evaluation_mode`` path does exactly that);
- data: loaders prepared by the same accelerator, before or after the model, are split by data-parallel rank only
  (:func:`shard_dataloader`): the ranks of a TP group get identical batches; loaders that dispatch from rank 0
  (``dispatch_batches``, accelerate's default for iterable datasets) dispatch per data-parallel group
  (:class:`DataParallelSource`);
- metrics: :func:`gather_for_metrics` keeps one copy of each sample (one rank per data-parallel rank);
- accumulation: :func:`no_sync` skips FSDP2 gradient reduction on non-final micro-steps;
- clipping: :func:`clip_grad_norm_` over any mix of meshes, counting plain-tensor shards right;
- optimizers: :func:`shardadopt.optim.split_param_groups_by_mesh`.

Configuration: :class:`AdoptionKwargs` in ``Accelerator(kwargs_handlers=[...])``; defaults need none.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import KwargsHandler
from torch import nn

from shardadopt import upstream
from shardadopt.optimizer_ready import make_shards_contiguous
from shardadopt.topology import Topology, TopologyError, topology

__all__ = ["AdoptionKwargs", "AdoptionError", "DataParallelSource", "adopt_model", "adopted", "adoption_kwargs",
           "dispatch_per_mesh_dp_group", "is_sharded_model", "refuse_fused_lm_head_on_plain_shards",
           "refuse_unsupported_distributed_features",
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
    # The data-parallel rank of every global rank (in rank order): what a dispatching loader sends where.
    dp_ranks: list[int] | None = None

    @property
    def layout(self) -> Topology | None:
        return next(iter(self.topologies.values()), None)


def forget_adopted(accelerator: Any) -> None:
    """Drop ``accelerator``'s record of the models it adopted (what ``Accelerator.free_memory``/``clear`` calls, so
    that the models they release are not kept alive by it: a search's earlier trials' models, say)."""
    if getattr(accelerator, _STATE_ATTR, None) is not None:
        setattr(accelerator, _STATE_ATTR, None)


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
        state.dp_ranks = _world_dp_ranks(topo)
        state.owners = _dp_owners(topo, state.dp_ranks)
    for loader in upstream.accelerator_dataloaders(accelerator):
        shard_dataloader(loader, topo, state.dp_ranks)
    return model


# DistributedConfig flags adoption does not train like one process, and what to load instead.
_UNSUPPORTED_FEATURES = {
    "fsdp_cpu_offload": ("FSDP2 CPU offload is not supported (the optimizer, clipping and checkpoints assume the "
                         "parameters stay on the model's device); load without it and, to fit in memory, shard over "
                         "more ranks (a larger fsdp_size)"),
    "fsdp_mixed_precision": ("FSDP2's bf16 parameter policy is not supported (adoption keeps the loaded fp32 "
                             "parameters and trains in their precision); load without it and use "
                             "Accelerator(mixed_precision=\"bf16\") / TrainingArguments(bf16=True) instead"),
}


def refuse_unsupported_distributed_features(model: nn.Module) -> None:
    """Refuse (:class:`AdoptionError`) a model loaded with a ``DistributedConfig`` option adoption cannot train
    like one process: ``fsdp_cpu_offload=True``, ``fsdp_mixed_precision=True`` (``pp_size > 1``:
    :func:`shardadopt.topology` refuses it).

    Args:
        model: the model handed to ``prepare`` / the Trainer (a PEFT model reads its base model's config).
    """
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if config is None:
        return
    for name, why in _UNSUPPORTED_FEATURES.items():
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value:
            raise AdoptionError(f"DistributedConfig({name}={value!r}): {why}.")


def _fused_lm_head_forwards(model: nn.Module) -> Iterator[nn.Module]:
    """Modules of ``model`` whose forward TRL's ``add_fused_lm_head`` replaced.

    TRL sets an instance ``forward`` made with ``functools.wraps(type(model).forward)``, which copies the original's
    ``__module__`` and ``__qualname__``: only its code object, one of ``add_fused_lm_head``'s nested functions, says
    where it comes from."""
    try:
        from trl.trainer import add_fused_lm_head
    except ImportError:  # a TRL without the fused head
        return
    nested = {c for c in add_fused_lm_head.__code__.co_consts if isinstance(c, types.CodeType)}
    for module in model.modules():
        forward = vars(module).get("forward")
        if getattr(getattr(forward, "__func__", None), "__code__", None) in nested:
            yield module


def refuse_fused_lm_head_on_plain_shards(model: nn.Module) -> None:
    """Refuse (:class:`AdoptionError`) a model whose LM head is a plain local TP shard (transformers 5.15/5.16) when
    TRL's fused LM head reads it (SFTTrainer, DPOTrainer, KTO, GRPO, RLOO install it on the model they train).

    The fused head projects hidden states through ``lm_head.weight`` itself and gathers the weight only when it is
    a DTensor; a plain shard holds this rank's slice of the vocabulary, so every token would be scored against part
    of the vocabulary: wrong loss and gradients without an error. Local: no collective."""
    from torch.distributed.tensor import DTensor

    for module in _fused_lm_head_forwards(model):
        weight = getattr(module.get_output_embeddings(), "weight", None)
        vocab = getattr(module.config.get_text_config(), "vocab_size", None)
        if weight is None or isinstance(weight, DTensor) or vocab is None or weight.shape[0] >= vocab:
            continue
        import transformers

        raise AdoptionError(
            f"TRL's fused LM head (trl add_fused_lm_head, installed by SFTTrainer, DPOTrainer and the other TRL "
            f"trainers) reads lm_head.weight directly, and on this model it is a plain tensor-parallel shard of "
            f"{tuple(weight.shape)} rows of the {vocab}-token vocabulary (transformers {transformers.__version__} "
            f"keeps TP shards as plain tensors, 5.15 and 5.16): every rank would score tokens against its own slice "
            f"of the vocabulary and train silently wrong. Upgrade transformers to 5.17 or newer (TP shards are "
            f"DTensors there, which TRL gathers), or load the model with DistributedConfig(fsdp_size=...) instead "
            f"of tp_size. TRL has no option to turn its fused LM head off.")


def _world_dp_ranks(topo: Topology) -> list[int]:
    """The data-parallel rank of every global rank (a collective)."""
    if topo.world_size == 1:
        return [0]
    dp_ranks = [None] * topo.world_size
    dist.all_gather_object(dp_ranks, topo.dp_rank)
    return dp_ranks


def _dp_owners(topo: Topology, dp_ranks: list[int]) -> list[int]:
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


def shard_dataloader(loader: Any, topo: Topology, dp_ranks: Sequence[int] | None = None) -> Any:
    """Make an accelerate-prepared ``loader`` give this rank the batches of its data-parallel rank.

    accelerate splits by process (``num_processes``/``process_index``); an adopted model splits by data-parallel
    rank. A loader split another way is re-split in place; one that cannot be re-split raises
    :class:`AdoptionError` naming the fix. A loader that dispatches from rank 0 (``DataLoaderDispatcher``) gets a
    :class:`DataParallelSource`; ``dp_ranks`` (every global rank's data-parallel rank) is gathered when not given,
    which makes the call collective.
    """
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(loader, DataLoaderDispatcher):
        if topo.dp_size == topo.world_size or isinstance(loader.base_dataloader, DataParallelSource):
            return loader  # one slice per process is one per data-parallel rank
        if dp_ranks is None:
            dp_ranks = _world_dp_ranks(topo)
        loader.base_dataloader = DataParallelSource(loader.base_dataloader, dp_ranks, loader.split_batches)
        # accelerate's own TP dispatch (a "tp" dim in the Accelerator's device mesh, which Trainer builds for TP
        # models) sends rank 0's one batch to every process, data-parallel ranks included: the source decides.
        loader.submesh_tp = None
        return loader
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


def dispatch_per_mesh_dp_group(loader: Any, mesh: Any) -> Any:
    """Give a ``DataLoaderDispatcher`` prepared by an Accelerator whose device mesh has a ``tp`` dimension next to
    data-parallel ones (``dp_replicate``/``dp_shard``; Trainer builds that ``ParallelismConfig`` for TP models) a
    :class:`DataParallelSource` laid out by the mesh's data-parallel coordinates.

    Upstream's dispatcher has a path for a ``tp`` mesh only: it reads one batch and sends it to every process, so
    with 2 data-parallel ranks both train on the same batch and half the data is never seen (no error). Other
    loaders, and meshes without ``tp`` or without data parallelism, are returned as they are. Local: no collective.
    """
    import itertools

    from accelerate.data_loader import DataLoaderDispatcher

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if (not isinstance(loader, DataLoaderDispatcher) or "tp" not in names
            or isinstance(loader.base_dataloader, DataParallelSource)):
        return loader
    ranks = mesh.mesh
    dp_dims = [d for d, name in enumerate(names) if name in ("dp_replicate", "dp_shard")]
    if not dp_dims or math.prod(ranks.shape[d] for d in dp_dims) == 1 or ranks.numel() != dist.get_world_size():
        return loader
    dp_ranks = [0] * ranks.numel()
    for coords in itertools.product(*(range(n) for n in ranks.shape)):
        dp_rank = 0
        for d in dp_dims:
            dp_rank = dp_rank * ranks.shape[d] + coords[d]
        dp_ranks[int(ranks[coords])] = dp_rank
    loader.base_dataloader = DataParallelSource(loader.base_dataloader, dp_ranks, loader.split_batches)
    loader.submesh_tp = None
    return loader


class DataParallelSource:
    """What accelerate's ``DataLoaderDispatcher`` reads on rank 0 when the model's ranks are not all data parallel.

    The dispatcher reads one batch per process from its loader, concatenates them, broadcasts the result and gives
    process ``r`` the ``r``-th slice: the ranks of a tensor-parallel group would get different batches. This source
    reads a global batch (``dp_size`` batches of the wrapped loader, or one with ``split_batches``), cuts it into one
    piece per data-parallel rank and hands the dispatcher, for each process in rank order, the piece of that
    process's data-parallel rank: the ranks of a group get the same batch, the data-parallel ranks disjoint pieces
    of the global batch, as one process would see it. A short last global batch is cut into equal pieces padded with
    the first samples of the epoch (as the dispatcher pads), and :func:`gather_for_metrics` drops the padding.

    Everything else (``dataset``, ``batch_size``, ``isinstance(.., DataLoader)``) is the wrapped loader's.
    """

    def __init__(self, loader: Any, dp_ranks: Sequence[int], split_batches: bool):
        self.loader = loader
        self.dp_ranks = list(dp_ranks)
        self.dp_size = max(self.dp_ranks) + 1
        self.split_batches = split_batches
        self.last_global_size: int | None = None  # samples in the latest global batch (rank 0 only)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def __class__(self) -> type:  # type: ignore[override]
        return self.loader.__class__  # as accelerate's DataLoaderAdapter: still "a DataLoader" to isinstance

    def __len__(self) -> int:
        batches = len(self.loader)
        if self.split_batches:
            return batches
        cycles = batches // self.dp_size if self.loader.drop_last else math.ceil(batches / self.dp_size)
        return cycles * len(self.dp_ranks)

    def __iter__(self) -> Iterator[Any]:
        # Created on every process, as the dispatcher does (DataPipes share a seed when their iterator starts); only
        # rank 0 reads from it.
        return self._dispatch(iter(self.loader))

    def _dispatch(self, batches: Iterator[Any]) -> Iterator[Any]:
        from accelerate.utils import concatenate, find_batch_size, slice_tensors

        per_global = 1 if self.split_batches else self.dp_size
        first: Any = None
        while True:
            group = []
            for _ in range(per_global):
                try:
                    group.append(next(batches))
                except StopIteration:
                    break
            if not group:
                return
            if len(group) < per_global and self.loader.drop_last:
                return  # the dispatcher drops an incomplete set of batches too
            whole = concatenate(group, dim=0) if len(group) > 1 else group[0]
            size = find_batch_size(whole)
            self.last_global_size = size
            if first is None:
                first = whole
            piece = math.ceil(size / self.dp_size)
            if piece * self.dp_size > size:
                padding = [first] * math.ceil((piece * self.dp_size - size) / find_batch_size(first))
                whole = slice_tensors(concatenate([whole, *padding], dim=0), slice(0, piece * self.dp_size))
            pieces = [slice_tensors(whole, slice(d * piece, (d + 1) * piece)) for d in range(self.dp_size)]
            per_process = [pieces[d] for d in self.dp_ranks]
            if self.split_batches:
                yield concatenate(per_process, dim=0)
            else:
                yield from per_process


# -- metrics -----------------------------------------------------------------------------------------------------

def _keep_owner_chunks(data: Any, owners: list[int], world: int) -> Any:
    def select(tensor: torch.Tensor) -> torch.Tensor:
        chunks = tensor.chunk(world) if tensor.dim() else [tensor]
        if len(chunks) != world:
            return tensor
        return torch.cat([chunks[r] for r in owners])

    from accelerate.utils import recursively_apply

    return recursively_apply(select, data)


# on an Accelerator: (ids of its prepared models, owners) last computed; a plain model's topology is not cached on
# it, and gather_for_metrics runs every evaluation batch
_METRIC_OWNERS_ATTR = "_shardadopt_metric_owners"


def metric_owners(accelerator: Any) -> list[int] | None:
    """For each data-parallel rank, the global rank whose samples ``gather_for_metrics`` keeps; None when every rank
    holds a batch of its own. From the adoption record, else from the first sharded model ``accelerator`` prepared
    for evaluation only (``prepare_model(model, evaluation_mode=True)``: what ``Trainer.evaluate`` does, and
    Trainer 5.19+ for training too), whose TP ranks share a batch all the same. A collective the first time."""
    state = adopted(accelerator)
    if state is not None:
        return state.owners if state.layout.dp_size < accelerator.num_processes else None
    models = upstream.accelerator_models(accelerator)
    key = tuple(id(m) for m in models)
    cached = getattr(accelerator, _METRIC_OWNERS_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    override = adoption_kwargs(accelerator).topology
    model = next((m for m in models if is_sharded_model(m, override)), None)
    owners = None
    if model is not None:
        topo = topology(model, override)
        owners = _dp_owners(topo, _world_dp_ranks(topo)) if topo.dp_size < topo.world_size else None
    setattr(accelerator, _METRIC_OWNERS_ATTR, (key, owners))
    return owners


def gather_for_metrics(accelerator: Any, input_data: Any, use_gather_object: bool = False,
                       owners: Sequence[int] | None = None) -> Any:
    """``Accelerator.gather_for_metrics`` that returns each sample once when several ranks share a batch (TP):
    only the ``owners``' samples (default :func:`metric_owners`) are kept."""
    from accelerate.utils import recursively_apply

    owners = list(owners if owners is not None else metric_owners(accelerator) or range(accelerator.num_processes))
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
        for rank in owners:
            part = per_rank[rank]
            data.extend(part if isinstance(part, (list, tuple)) else [part])
    else:
        data = _keep_owner_chunks(accelerator.gather(input_data), owners, world)
    gradient_state = accelerator.gradient_state
    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        remainder = gradient_state.remainder
        source = getattr(gradient_state.active_dataloader, "base_dataloader", None)
        if isinstance(source, DataParallelSource):
            # the dispatcher counts the samples it sent to every process; only rank 0's source read the real
            # number of the last global batch (every rank is here: end_of_dataloader is broadcast)
            sizes = [source.last_global_size]
            dist.broadcast_object_list(sizes, src=0)
            remainder = sizes[0]
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
