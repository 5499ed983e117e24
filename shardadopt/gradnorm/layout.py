"""From gradients (DTensors on any mesh, plain tensors) to :class:`~shardadopt.gradnorm.core.Piece` lists.

A DTensor's local tensor is one of ``S`` disjoint pieces of the full tensor, where ``S`` is the product of the
mesh sizes along ``Shard``/``_StridedShard`` dims (uneven shards included: some pieces are smaller or empty).
Each piece is held by ``group_size / S`` ranks of the group: the ranks along ``Replicate`` dims and, when the mesh
is a sub-mesh (e.g. the ``fsdp`` mesh of a 2-D fsdp x tp model, or each replica's mesh in HSDP), the ranks
holding the same piece on the other copies of that sub-mesh. That assumes every rank of the group holds every
gradient, which is what load-time sharding does; a rank outside a gradient's mesh is reported as an error.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Shard

from shardadopt import upstream
from shardadopt.gradnorm.core import Piece

StridedShard = upstream.strided_shard_type()

__all__ = ["LayoutError", "Group", "count_shards", "to_pieces"]

PlainReplication = Callable[[Tensor], int]


class LayoutError(ValueError):
    """A gradient whose replication across the group cannot be counted."""


class Group:
    """The ranks that the all-reduce spans: their global ids, and this rank's global id."""

    def __init__(self, ranks: Sequence[int], rank: int):
        self.ranks = frozenset(ranks)
        self.size = len(self.ranks)
        self.rank = rank


# DeviceMesh -> its global ranks. ``mesh.mesh`` rebuilds a tensor from the mesh layout on every access (~50 us);
# meshes live as long as the model, so remember the answer (weakly, not keeping meshes alive).
_MESH_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mesh_ranks(mesh) -> frozenset[int]:
    ranks = _MESH_RANKS.get(mesh)
    if ranks is None:
        ranks = _MESH_RANKS[mesh] = frozenset(mesh.mesh.flatten().tolist())
    return ranks


def count_shards(mesh, placements, group: Group) -> int:
    """Number of distinct pieces the mesh splits the tensor into; raises LayoutError when the group cannot
    account for the mesh's replicas."""
    mesh_ranks = _mesh_ranks(mesh)
    if group.rank not in mesh_ranks:
        raise LayoutError(
            f"rank {group.rank} holds a DTensor gradient whose mesh {mesh} does not include it. The norm assumes "
            f"every rank of the group holds each gradient (as a shard, or on its own copy of a sub-mesh); pass "
            f"group= a process group whose ranks all hold these gradients.")
    if not group.ranks.issuperset(mesh_ranks):
        missing = sorted(mesh_ranks - group.ranks)
        raise LayoutError(
            f"a gradient lives on mesh {mesh}, but ranks {missing} of that mesh are not in the process group the "
            f"norm is reduced over ({group.size} ranks); its other shards would be missed. Pass group=None (the "
            f"world) or a group that contains every rank of every gradient's mesh.")
    if group.size % len(mesh_ranks):
        raise LayoutError(
            f"a gradient lives on mesh {mesh} of {len(mesh_ranks)} ranks, which does not divide the group of "
            f"{group.size} ranks, so how many ranks hold each shard cannot be counted. Pass group= the ranks "
            f"that hold copies of this mesh, or reduce such gradients in a separate call.")
    shards = 1
    for dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, StridedShard)):  # not a Shard in 2.13-2.15 (torchprobe)
            shards *= mesh.size(dim)
        elif not isinstance(placement, Replicate):
            raise LayoutError(f"unsupported placement {placement!r} on mesh dim {dim} of {mesh}; "
                              f"redistribute the gradient to Shard/Replicate placements first.")
    return shards


def _without_partial(grad: DTensor) -> DTensor:
    """A Partial gradient is a pending reduction, so its local values say nothing about its norm: reduce it
    (one collective on its mesh; the gradients transformers' FSDP/TP/EP layouts produce are never Partial)."""
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    try:
        return grad.redistribute(grad.device_mesh, placements)
    except Exception as exc:
        raise LayoutError(f"a gradient with Partial placements {grad.placements} could not be redistributed to "
                          f"{placements}: {exc}. Reduce it (e.g. grad.full_tensor()) before taking the norm.") from exc


def to_pieces(tensors: Sequence[Tensor], group: Group,
              plain_replication: PlainReplication | None) -> tuple[list[Piece], list[LayoutError]]:
    """The local pieces of ``tensors`` and the errors met, in order; one error does not stop the walk, so every
    rank issues the same Partial redistributions (collectives) whatever went wrong locally."""
    pieces: list[Piece] = []
    errors: list[LayoutError] = []
    # Per (mesh, placement types), which is all count_shards depends on: few keys per model. Keyed by types
    # because hashing the placements themselves runs Python code per placement (_StridedShard's __hash__).
    shards_of: dict[tuple, int | None] = {}
    for tensor in tensors:
        try:
            if isinstance(tensor, DTensor):
                mesh, placements = tensor.device_mesh, tensor.placements
                key = (id(mesh), *map(type, placements))
                if key not in shards_of:  # None: has a Partial placement
                    partial = any(p.is_partial() for p in placements)
                    shards_of[key] = None if partial else count_shards(mesh, placements, group)
                shards = shards_of[key]
                if shards is None:
                    tensor = _without_partial(tensor)
                    shards = count_shards(tensor.device_mesh, tensor.placements, group)
                pieces.append(Piece(upstream.dtensor_local(tensor), group.size // shards))
            else:
                try:
                    replicas = group.size if plain_replication is None else plain_replication(tensor)
                except Exception as exc:  # raised here it would leave the peers waiting in the collective
                    raise LayoutError(f"plain_replication raised {exc!r} for a plain tensor of shape "
                                      f"{tuple(tensor.shape)}") from exc
                if not isinstance(replicas, int) or not 1 <= replicas <= group.size:
                    raise LayoutError(f"plain_replication returned {replicas!r} for a plain tensor of shape "
                                      f"{tuple(tensor.shape)}; it must be an int from 1 to the group size "
                                      f"{group.size} (how many ranks hold an identical copy).")
                pieces.append(Piece(tensor, replicas))
        except LayoutError as exc:
            errors.append(exc)
    return pieces, errors
