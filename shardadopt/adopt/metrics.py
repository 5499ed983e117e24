"""Evaluation metrics count each sample once when several ranks share a batch (the ranks of a TP group).

``Accelerator.gather_for_metrics`` gathers every process's samples; with tensor parallelism the ranks of a group hold
the same batch, so only one rank per data-parallel rank (its *owner*) is kept, and the padding a
:class:`~shardadopt.adopt.data.DataParallelSource` added to a short last batch is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardadopt import upstream
from shardadopt.adopt.data import DataParallelSource, dp_owners, world_dp_ranks
from shardadopt.adopt.model import is_sharded_model
from shardadopt.adopt.record import adopted, adoption_kwargs
from shardadopt.parallel.topology import topology

# on an Accelerator: (ids of its prepared models, owners) last computed; a plain model's topology is not cached on
# it, and gather_for_metrics runs every evaluation batch
_METRIC_OWNERS_ATTR = "_shardadopt_metric_owners"


def _keep_owner_chunks(data: Any, owners: list[int], world: int) -> Any:
    def select(tensor: torch.Tensor) -> torch.Tensor:
        chunks = tensor.chunk(world) if tensor.dim() else [tensor]
        if len(chunks) != world:
            return tensor
        return torch.cat([chunks[r] for r in owners])

    from accelerate.utils import recursively_apply

    return recursively_apply(select, data)


def metric_owners(accelerator: Any) -> list[int] | None:
    """For each data-parallel rank, the global rank whose samples ``gather_for_metrics`` keeps. From the adoption
    record, else from the first sharded model ``accelerator`` prepared for evaluation only
    (``prepare_model(model, evaluation_mode=True)``: what ``Trainer.evaluate`` does, and Trainer 5.19+ for training
    too), whose TP ranks share a batch all the same. A collective the first time.

    Args:
        accelerator: the ``Accelerator``.

    Returns:
        The owners, or None when every rank holds a batch of its own.
    """
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
        owners = dp_owners(topo, world_dp_ranks(topo)) if topo.dp_size < topo.world_size else None
    setattr(accelerator, _METRIC_OWNERS_ATTR, (key, owners))
    return owners


def gather_for_metrics(accelerator: Any, input_data: Any, use_gather_object: bool = False,
                       owners: Sequence[int] | None = None) -> Any:
    """``Accelerator.gather_for_metrics`` that returns each sample once when several ranks share a batch (TP).
    Collective.

    Args:
        accelerator: the ``Accelerator``.
        input_data: this rank's tensors (nested containers too) or, with ``use_gather_object``, any objects.
        use_gather_object: gather Python objects (also used when ``input_data`` is not all tensors).
        owners: the global ranks whose samples are kept, one per data-parallel rank (default
            :func:`metric_owners`; every rank when that is None).

    Returns:
        The owners' samples in data-parallel order, without the padding of a short last batch.
    """
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
