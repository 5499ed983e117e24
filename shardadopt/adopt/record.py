"""What an Accelerator knows about the sharded models it adopted: its options and its adoption record.

Both live on the Accelerator itself (``AdoptionKwargs`` from ``Accelerator(kwargs_handlers=[...])``, the record of
adopted models and their data-parallel layout), so that every piece of ``shardadopt.adopt`` reads the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from accelerate.utils import KwargsHandler
from torch import nn

from shardadopt.parallel.topology import Topology

_STATE_ATTR = "_shardadopt_adoption"
KWARGS_ATTR = "_shardadopt_kwargs"


@dataclass
class AdoptionKwargs(KwargsHandler):
    """How ``Accelerator`` adopts sharded models: pass in ``Accelerator(kwargs_handlers=[AdoptionKwargs(...)])``.

    ``topology``: explicit sizes for layouts the model cannot tell (``{"dp_replicate": .., "dp_shard": ..,
    "tp": .., "ep": ..}``; see :func:`shardadopt.parallel.topology`). ``reshard_checkpoints``: whether
    ``load_state`` may
    load a checkpoint saved with another layout or world size, resharding weights and optimizer state through
    DCP (default on; off refuses it with ``shardadopt.checkpoint.CheckpointMismatchError``). ``split_optimizer``:
    make foreach/fused optimizers step on homogeneous param groups (default on). ``keep_frozen_units_gathered``:
    FSDP2 units whose parameters are all frozen (the base model under LoRA) are not resharded between forward and
    backward and across the micro-batches of a step, one all-gather per unit per optimizer step instead of two per
    micro-batch, at the cost of holding every such unit's unsharded weights from forward to backward (default off;
    :func:`shardadopt.adopt.keep_frozen_units_gathered`). ``keep_frozen_units_gathered_across_steps``: the same, kept
    from one step to the next too (implies the former): one all-gather per unit for the run, the same peak, held
    between steps too (default off).
    """

    topology: dict[str, int] | None = None
    reshard_checkpoints: bool = True
    split_optimizer: bool = True
    keep_frozen_units_gathered: bool = False
    keep_frozen_units_gathered_across_steps: bool = False


class AdoptionError(ValueError):
    """A prepared object does not fit the adopted model's topology."""


@dataclass
class Adoption:
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


def adoption_record(accelerator: Any) -> Adoption:
    """``accelerator``'s adoption record, created empty the first time."""
    state = getattr(accelerator, _STATE_ATTR, None)
    if state is None:
        state = Adoption()
        setattr(accelerator, _STATE_ATTR, state)
    return state


def forget_adopted(accelerator: Any) -> None:
    """Drop ``accelerator``'s record of the models it adopted (what ``Accelerator.free_memory``/``clear`` calls, so
    that the models they release are not kept alive by it: a search's earlier trials' models, say)."""
    if getattr(accelerator, _STATE_ATTR, None) is not None:
        setattr(accelerator, _STATE_ATTR, None)


def adoption_kwargs(accelerator: Any) -> AdoptionKwargs:
    """The :class:`AdoptionKwargs` given to ``accelerator`` (the defaults when none was).

    Args:
        accelerator: an ``Accelerator`` built after ``shardadopt.enable()`` (or any object: the defaults).

    Returns:
        Its options.
    """
    return getattr(accelerator, KWARGS_ATTR, None) or AdoptionKwargs()


def adopted(accelerator: Any) -> Adoption | None:
    """The adoption record of ``accelerator``.

    Args:
        accelerator: an ``Accelerator``.

    Returns:
        The record (models, their topologies, data-parallel owners and ranks), or None when it adopted no sharded
        model.
    """
    state = getattr(accelerator, _STATE_ATTR, None)
    return state if state is not None and state.topologies else None
