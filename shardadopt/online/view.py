"""TRL's online trainers (GRPO, RLOO, Distillation) gather, slice and count by data-parallel rank on a model whose
tensor-parallel ranks share batches: one copy of each row per model replica, as DDP's processes hold them.

TRL gathers rewards, completion lengths, token counts and clip ratios over every process (accelerate's ``gather`` /
``gather_object``, ``Accelerator.gather``/``reduce``), slices the advantages by ``accelerator.process_index`` and
divides by ``accelerator.num_processes``; DistillationTrainer sizes its sampler's blocks by ``num_processes``. The
ranks of a TP group contribute copies of the same rows, so a group of ``num_generations`` that spans processes was
built from copies, a standard deviation over the whole batch counted each row ``tp`` times, the token counts and
logged statistics were ``tp`` times DDP's, and the sampler's blocks held ``tp`` data-parallel windows.

While a trainer's own methods run (:func:`data_parallel_scope`, which the ``trl-*-data-parallel`` patches wrap
around them), its ``accelerator`` answers as DDP's process of this data-parallel rank
(:class:`DataParallelAccelerator`) and the module-level ``gather``/``gather_object`` of TRL's trainer modules keep
one copy per data-parallel rank (:func:`gather`, :func:`gather_object`); everything else (backward, clipping,
checkpoints, logging on the main process) sees the accelerator as it is.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the patch modules: nothing here imports torch before a trainer runs
    from shardadopt.parallel.topology import Topology

__all__ = ["VIEW_ATTR", "DataParallelAccelerator", "DataParallelView", "attach_view", "data_parallel_scope",
           "gather", "gather_object", "scoped"]

# On a trainer whose model's TP ranks share batches: its DataParallelView (attach_view, in the trainer's __init__).
VIEW_ATTR = "_shardadopt_data_parallel_view"
# The view of the trainer whose method runs now (data_parallel_scope), for TRL's module-level gathers.
_ACTIVE: contextvars.ContextVar[DataParallelView | None] = contextvars.ContextVar("shardadopt_online_view",
                                                                                   default=None)


@dataclass(frozen=True)
class DataParallelView:
    """One rank's data-parallel view of the world: its layout, and for each data-parallel rank the global rank
    whose rows are kept (the lowest rank of its TP group)."""

    layout: Topology
    owners: tuple[int, ...]

    def _keep_owners(self, tensor: Any) -> Any:
        if tensor.shape[0] == 0:  # every process gathered nothing (TRL checks for it, e.g. no entropies to rank)
            return tensor
        chunks = tensor.chunk(self.layout.world_size)
        if len(chunks) != self.layout.world_size:
            raise ValueError(f"a gathered tensor of shape {tuple(tensor.shape)} does not split into "
                             f"{self.layout.world_size} equal per-process parts")
        import torch

        return torch.cat([chunks[rank] for rank in self.owners])

    def gather(self, data: Any) -> Any:
        """accelerate's ``gather`` (each process's tensors, nested containers too, concatenated along dim 0; a
        0-d tensor counts as one row), keeping one copy per data-parallel rank, in data-parallel order.
        Collective."""
        from accelerate.utils import gather, recursively_apply

        return recursively_apply(self._keep_owners, gather(data))

    def gather_object(self, objects: list[Any]) -> list[Any]:
        """accelerate's ``gather_object`` (each process's list, concatenated), one copy per data-parallel rank.
        Collective."""
        import torch.distributed as dist

        per_rank: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(per_rank, objects)
        return [item for rank in self.owners for item in per_rank[rank]]

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``Accelerator.reduce`` of a tensor over the data-parallel ranks (``"sum"`` or ``"mean"``), one copy
        each. Collective."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction={reduction!r}: the data-parallel view reduces by 'sum' or 'mean'")
        stacked = self.gather(tensor.unsqueeze(0))
        reduced = stacked.sum(dim=0) if reduction == "sum" else stacked.mean(dim=0)
        return reduced * scale if scale != 1.0 else reduced


class DataParallelAccelerator:
    """An ``Accelerator`` as DDP's process of this data-parallel rank sees it: ``process_index`` and
    ``num_processes`` are the data-parallel rank and size, ``gather``/``reduce`` keep one copy per data-parallel
    rank; every other attribute is the wrapped accelerator's (reads and writes)."""

    def __init__(self, accelerator: Any, view: DataParallelView):
        object.__setattr__(self, "wrapped_accelerator", accelerator)
        object.__setattr__(self, "view", view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped_accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.wrapped_accelerator, name, value)

    @property
    def process_index(self) -> int:
        return self.view.layout.dp_rank

    @property
    def num_processes(self) -> int:
        return self.view.layout.dp_size

    def gather(self, tensor: Any) -> Any:
        return self.view.gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return self.view.reduce(tensor, reduction, scale)


def attach_view(trainer: Any, layout: Topology) -> None:
    """Give ``trainer`` (whose model's TP ranks share batches, ``layout``) its :class:`DataParallelView`. A
    collective (every rank's data-parallel rank is gathered): call it where every rank builds the trainer.

    Args:
        trainer: a GRPO/RLOO/Distillation trainer, initialised.
        layout: its model's topology (``shardadopt.online.trainers.online_layout``).
    """
    from shardadopt.adopt.data import dp_owners, world_dp_ranks

    setattr(trainer, VIEW_ATTR, DataParallelView(layout, tuple(dp_owners(layout, world_dp_ranks(layout)))))


@contextmanager
def data_parallel_scope(trainer: Any) -> Iterator[None]:
    """While the block runs, ``trainer.accelerator`` is a :class:`DataParallelAccelerator` and TRL's module-level
    gathers keep one copy per data-parallel rank; nothing changes for a trainer without a view (every rank its own
    data-parallel rank) or inside a block already scoped. Local.

    Args:
        trainer: the trainer whose method runs in the block.
    """
    view = getattr(trainer, VIEW_ATTR, None)
    accelerator = getattr(trainer, "accelerator", None)
    if view is None or accelerator is None or isinstance(accelerator, DataParallelAccelerator):
        yield
        return
    token = _ACTIVE.set(view)
    trainer.accelerator = DataParallelAccelerator(accelerator, view)
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        _ACTIVE.reset(token)


def scoped(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """A wrapt wrapper for a trainer method: runs it in :func:`data_parallel_scope`."""
    with data_parallel_scope(instance):
        return wrapped(*args, **kwargs)


def gather(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """A wrapt wrapper for accelerate's ``gather`` as a TRL trainer module imported it: one copy per data-parallel
    rank inside :func:`data_parallel_scope`, accelerate's own outside."""
    view = _ACTIVE.get()
    return wrapped(*args, **kwargs) if view is None else view.gather(*args, **kwargs)


def gather_object(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """A wrapt wrapper for accelerate's ``gather_object`` as a TRL trainer module imported it: one copy per
    data-parallel rank inside :func:`data_parallel_scope`, accelerate's own outside."""
    view = _ACTIVE.get()
    return wrapped(*args, **kwargs) if view is None else view.gather_object(*args, **kwargs)
