"""The pure core of the grad norm: local pieces with replication counts, reduced to a one-collective payload.

Nothing here touches ``torch.distributed``: a "world" can be simulated in one process by calling
:func:`local_payload` once per virtual rank, combining the payloads as the all-reduce would (elementwise sum, or
max for :func:`reduce_op` ``"max"``) and calling :func:`finish`. The distributed entry points in
:mod:`shardadopt.gradnorm` do exactly that with a real all-reduce.

The maths. For a finite ``p > 0`` the global norm is ``(sum over distinct elements of |x|^p)^(1/p)``. A rank
knows only its local pieces; a piece that ``r`` ranks of the group hold identically (replicated mesh dims,
copies of a sub-mesh, plain replicated tensors) is weighted ``1/r``, so summing every rank's weighted local sum
counts each distinct element exactly once: one SUM all-reduce, which keeps NaN and inf. ``p = 0`` counts nonzeros
the same way (no root). ``p = inf`` is a MAX, where replicas do not matter; MAX reductions (gloo, NCCL) may drop
NaN, so there the payload is ``[value, nan_flag]`` and every rank still sees the same NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from shardadopt import upstream

__all__ = ["Piece", "Bucket", "check_norm_type", "reduce_op", "buckets", "local_payload", "bucket_payload",
           "poisoned_payload", "finish"]

# The payload and the cross-tensor accumulation are fp64: it is a handful of scalars, and it keeps the sum of
# p-th powers finite well beyond fp32's range (a fp32 norm of 1e20 has a square of 1e40).
PAYLOAD_DTYPE = torch.float64


class Piece(NamedTuple):
    """A tensor this rank holds and the number of ranks of the group that hold an identical copy of it.

    A NamedTuple, not a dataclass: one is built per gradient per step, and a frozen dataclass costs several times
    more to build. ``local_payload`` checks ``replicas``.
    """

    tensor: Tensor
    replicas: int


def check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p < 0:
        raise ValueError(f"norm_type must be >= 0 or inf, got {norm_type!r} (negative orders have no sharded form)")
    return p


def reduce_op(norm_type: float) -> str:
    """``"max"`` for p = inf, else ``"sum"``: the one all-reduce the payload needs."""
    return "max" if math.isinf(check_norm_type(norm_type)) else "sum"


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Per-tensor norms in fp32 at least (bf16/fp16 grads are upcast inside the kernel), fp64 grads stay fp64.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _use_foreach(tensors: list[Tensor], device: torch.device, foreach: bool | None) -> bool:
    if (foreach is None and upstream.has_foreach_support(tensors, device)) or (
            foreach and upstream.device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


class Bucket(NamedTuple):
    """Non-empty local tensors of one (device, dtype): what one fused local reduction covers, with the weights
    of their norms (1/replicas, a fp64 row on the payload's device) and whether the foreach kernel computes them."""

    device: torch.device
    dtype: torch.dtype
    tensors: list[Tensor]
    weights: Tensor
    foreach: bool


def buckets(pieces: Iterable[Piece], device: torch.device | str | None = None,
            foreach: bool | None = None) -> list[Bucket]:
    """``pieces`` grouped by (device, dtype) for a payload on ``device`` (default: the first piece's), empty ones
    left out (uneven shards leave empty pieces: torch's inf-norm refuses them (torchprobe); they add 0)."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[int]]] = {}
    for piece in pieces:
        t, replicas = piece
        if not (isinstance(replicas, int) and replicas >= 1):
            raise ValueError(f"replicas must be a positive int, got {replicas!r}")
        if t.numel():
            tensors, counts = groups.setdefault((t.device, t.dtype), ([], []))
            tensors.append(t)
            counts.append(replicas)
    if device is None:
        device = next(iter(groups))[0] if groups else torch.device("cpu")
    return [Bucket(dev, dtype, tensors,
                   torch.tensor([[1.0 / c for c in counts]], dtype=PAYLOAD_DTYPE, device=device),
                   _use_foreach(tensors, dev, foreach))
            for (dev, dtype), (tensors, counts) in groups.items()]


def local_payload(pieces: Iterable[Piece], norm_type: float, device: torch.device | str | None = None,
                  foreach: bool | None = None) -> Tensor:
    """This rank's contribution, a fp64 tensor on ``device`` (default: the first piece's) to all-reduce.

    p finite: ``[replica-weighted sum of local p-th powers]``; NaN and inf travel in the value, as a SUM keeps
    them. p = inf: ``[local max with NaN replaced by 0, NaN flag]``, as a MAX may drop NaN.
    """
    groups = buckets(pieces, device, foreach)
    return bucket_payload(groups, norm_type, groups[0].weights.device if groups else device)


def bucket_payload(groups: list[Bucket], norm_type: float, device: torch.device | str | None = None) -> Tensor:
    """:func:`local_payload` of pieces grouped by :func:`buckets` (on ``device``): one fused norm per bucket, one
    weighted sum."""
    p = check_norm_type(norm_type)
    if device is None:
        device = torch.device("cpu")
    parts = []
    for _, dtype, tensors, weights, foreach in groups:
        acc = _accumulation_dtype(dtype)
        upcast = {} if acc == dtype else {"dtype": acc}  # passing dtype= costs even when it changes nothing
        if foreach:
            norms = upstream.foreach_norm(tensors, p, **upcast)
        else:
            norms = [torch.linalg.vector_norm(t, p, **upcast) for t in tensors]
        norms = torch.stack(norms).to(device=device, dtype=PAYLOAD_DTYPE)
        if math.isinf(p):
            parts.append(norms.max().reshape(1))  # torch.max propagates NaN
        else:  # ord 0 gives counts, ord 1 sums: no power
            parts.append(weights @ (norms if p in (0.0, 1.0) else norms.pow(p)))
    if not parts:
        value = torch.zeros(1, dtype=PAYLOAD_DTYPE, device=device)
    elif len(parts) == 1:
        value = parts[0]
    else:
        value = torch.cat(parts)
        value = (value.max() if math.isinf(p) else value.sum()).reshape(1)
    if not math.isinf(p):
        return value
    nan = value.isnan()
    return torch.cat([value.nan_to_num(nan=0.0, posinf=math.inf), nan.to(PAYLOAD_DTYPE)])


def poisoned_payload(norm_type: float, device: torch.device | str) -> Tensor:
    """A payload that makes the combined result NaN: what a rank that cannot count its pieces contributes, so
    that its peers finish the collective (no hang) and none of them uses a silently wrong norm."""
    poison = [0.0, 1.0] if reduce_op(norm_type) == "max" else [math.nan]
    return torch.tensor(poison, dtype=PAYLOAD_DTYPE, device=device)


def finish(reduced: Tensor, norm_type: float) -> Tensor:
    """The global norm (fp64 scalar) from the all-reduced payload; the same on every rank."""
    p = check_norm_type(norm_type)
    if math.isinf(p):
        return torch.where(reduced[1] > 0, math.nan, reduced[0])
    return reduced[0] if p in (0.0, 1.0) else reduced[0].pow(1.0 / p)
