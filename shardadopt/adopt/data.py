"""Data loaders follow the adopted model's data-parallel layout, not the process count.

accelerate splits a loader by process; the ranks of a tensor-parallel group must get identical batches, so loaders
prepared by the same accelerator (before or after the model) are split by data-parallel rank only
(:func:`shard_dataloader`), and loaders that dispatch from rank 0 (``dispatch_batches``, accelerate's default for
iterable datasets) dispatch per data-parallel group (:class:`DataParallelSource`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

from shardadopt import upstream
from shardadopt.adopt.record import AdoptionError
from shardadopt.parallel.topology import Topology, TopologyError


def world_dp_ranks(topo: Topology) -> list[int]:
    """The data-parallel rank of every global rank, in rank order (a collective)."""
    if topo.world_size == 1:
        return [0]
    dp_ranks = [None] * topo.world_size
    dist.all_gather_object(dp_ranks, topo.dp_rank)
    return dp_ranks


def dp_owners(topo: Topology, dp_ranks: list[int]) -> list[int]:
    """For each data-parallel rank (in order), the lowest global rank that holds it (``dp_ranks``: every global
    rank's data-parallel rank); raises ``TopologyError`` when the ranks do not cover 0..dp_size-1."""
    owners: dict[int, int] = {}
    for rank, dp_rank in enumerate(dp_ranks):
        owners.setdefault(dp_rank, rank)
    if sorted(owners) != list(range(topo.dp_size)):
        raise TopologyError(f"data-parallel ranks over the world are {dp_ranks}, expected each of "
                            f"0..{topo.dp_size - 1}; pass an explicit topology override")
    return [owners[d] for d in range(topo.dp_size)]


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
    rank. A loader split another way is re-split in place. A loader that dispatches from rank 0
    (``DataLoaderDispatcher``) gets a :class:`DataParallelSource`.

    Args:
        loader: a loader this accelerator prepared.
        topo: the adopted model's topology.
        dp_ranks: every global rank's data-parallel rank; gathered when not given, which makes the call collective.

    Returns:
        ``loader`` itself, re-split.

    Raises:
        AdoptionError: for a loader that cannot be re-split, naming the fix.
    """
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(loader, DataLoaderDispatcher):
        if topo.dp_size == topo.world_size or isinstance(loader.base_dataloader, DataParallelSource):
            return loader  # one slice per process is one per data-parallel rank
        if dp_ranks is None:
            dp_ranks = world_dp_ranks(topo)
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
    with 2 data-parallel ranks both train on the same batch and half the data is never seen (no error). Local: no
    collective.

    Args:
        loader: a loader the Accelerator prepared.
        mesh: the Accelerator's device mesh (``torch_device_mesh``; None or a mesh without ``tp``: nothing to do).

    Returns:
        ``loader``, its source replaced where needed; other loaders, and meshes without ``tp`` or without data
        parallelism, as they are.
    """
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
    the first samples of the epoch (as the dispatcher pads), and ``gather_for_metrics`` drops the padding.

    Everything else (``dataset``, ``batch_size``, ``isinstance(.., DataLoader)``) is the wrapped loader's.

    Args:
        loader: the dispatcher's own loader (``base_dataloader``).
        dp_ranks: every global rank's data-parallel rank, in rank order.
        split_batches: the dispatcher's ``split_batches``: one batch of ``loader`` is a global batch.
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
