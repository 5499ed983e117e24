"""Gradient norm and clipping over gradients on any mix of device meshes, with one collective per call.

Drop-in for ``torch.nn.utils.get_total_norm`` / ``clip_grads_with_norm_`` / ``clip_grad_norm_`` that accepts
FSDP2 shards, TP shards, EP experts on their own (sub-)mesh, ``_StridedShard``, uneven shards and plain replicated
tensors in one call. Each rank reduces its local pieces, weighted by how many ranks hold them (see
:mod:`shardadopt.gradnorm.core`), and a single all-reduce over the world (or ``group``) gives the norm; every rank
gets the same value and clips by the same coefficient.

Differences from torch, on purpose:

- the norm is returned in fp32 (fp64 if any gradient is fp64), not in the gradients' dtype: bf16 grads get an
  exact-to-fp32 norm and a clip coefficient that does not jump in bf16 steps;
- ``norm_type=0`` counts nonzero elements (the 0-"norm" of the concatenated gradients); torch's
  ``get_total_norm`` counts the tensors that have any nonzero element instead.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from shardadopt import upstream
from shardadopt.gradnorm import plan
from shardadopt.gradnorm.core import check_norm_type, finish, local_payload, poisoned_payload, reduce_op
from shardadopt.gradnorm.layout import Group, LayoutError, PlainReplication, to_pieces

__all__ = ["total_norm", "clip_grads_with_norm_", "clip_grad_norm_", "LayoutError"]

TensorOrTensors = Tensor | Iterable[Tensor]


# Process group -> its Group, for this rank (which does not change for a group); weakly, not keeping groups alive.
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group(group: dist.ProcessGroup | None) -> tuple[Group, dist.ProcessGroup | None]:
    """The reducing group, or a one-rank group (and no process group) when there is nothing to reduce over."""
    if not (dist.is_available() and dist.is_initialized()):
        return Group([0], 0), None
    group = group or dist.group.WORLD
    found = _GROUPS.get(group)
    if found is not None:
        return found, group
    ranks = dist.get_process_group_ranks(group)
    rank = dist.get_rank()
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the process group passed as group= (ranks {sorted(ranks)}); "
                         f"call total_norm/clip_grad_norm_ only on the ranks of that group.")
    found = _GROUPS[group] = Group(ranks, rank)
    return found, group


def _payload_device(first: torch.device | None, group: dist.ProcessGroup | None) -> torch.device:
    """Where the all-reduce can run: the grads' device if the backend supports it (gloo: CPU and CUDA, NCCL:
    CUDA only), else the backend's device (e.g. CPU-offloaded grads under NCCL)."""
    supported = upstream.backend_device_types(group)
    if first is not None and first.type in supported:
        return first
    kind = next((d for d in supported if d != "cpu"), supported[0]) if supported else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _result_dtype(tensors: list[Tensor]) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@torch.no_grad()
def total_norm(tensors: TensorOrTensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: bool | None = None, *, group: dist.ProcessGroup | None = None,
               plain_replication: PlainReplication | None = None) -> Tensor:
    """The ``norm_type``-norm of all ``tensors`` viewed as one vector, the same on every rank of ``group``.

    Call on every rank of ``group`` (default: the world) with that rank's tensors in the same order (DTensors
    as they are, plain tensors as they are). ``plain_replication(t)`` says how many ranks of the group hold an
    identical copy of the plain tensor ``t`` (default: all of them); old transformers keep TP/EP shards as plain
    tensors, and only the model's topology knows that.

    Exactly one all-reduce on ``group`` (none when torch.distributed is not initialised or the group has one
    rank), plus one redistribution per DTensor with a ``Partial`` placement. A gradient that cannot be counted
    raises :class:`LayoutError` on the ranks that found it, after the collective, while the other ranks get NaN;
    no rank hangs and none uses a wrong norm. The layout is worked out once and reused while the gradients keep
    it (:mod:`shardadopt.gradnorm.plan`).

    Args:
        tensors: this rank's tensors (usually gradients), DTensor or plain, in the same order on every rank.
        norm_type: the norm's order, ``inf`` included, as for ``torch.nn.utils.get_total_norm``.
        error_if_nonfinite: raise ``RuntimeError`` when the norm is NaN or infinite.
        foreach: use foreach kernels for the local norms (default: where torch would).
        group: the process group the tensors are spread over (default: the world).
        plain_replication: how many ranks of ``group`` hold an identical copy of a plain tensor.

    Returns:
        The total norm, a scalar tensor, equal on every rank.
    """
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    return _planned_norm(tensors, norm_type, error_if_nonfinite, foreach, group, plain_replication)[0]


def _planned_norm(tensors: list[Tensor], norm_type: float, error_if_nonfinite: bool, foreach: bool | None,
                  group: dist.ProcessGroup | None, plain_replication: PlainReplication | None
                  ) -> tuple[Tensor, plan.Plan | None, list[Tensor]]:
    """:func:`total_norm`, and the plan and local tensors it used (no plan: the call could not be planned)."""
    p = check_norm_type(norm_type)
    grp, pg = _group(group)
    reducing = pg is not None and grp.size > 1
    matched = plan.match(tensors, grp, pg, plain_replication, foreach)
    if matched is None:
        signed = plan.signature(tensors, grp, pg, plain_replication, foreach)
        found = None if signed is None else plan.lookup(signed[0], pg)
        locals_ = [] if signed is None else signed[2]
    else:
        found, locals_ = matched
    if found is not None:
        payload = found.payload(locals_, p)
        if reducing:
            dist.all_reduce(payload, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=pg)
        result = finish(payload, p)
        result = result.to(device=found.result_device or payload.device, dtype=found.result_dtype)
    else:
        pieces, errors = to_pieces(tensors, grp, plain_replication)
        first = tensors[0].device if tensors else None
        device = _payload_device(first, pg) if reducing else first
        if not reducing and errors:
            raise errors[0]
        payload = poisoned_payload(p, device) if errors else local_payload(pieces, p, device, foreach)
        if reducing:
            dist.all_reduce(payload, op=dist.ReduceOp.MAX if reduce_op(p) == "max" else dist.ReduceOp.SUM, group=pg)
            if errors:
                more = f" ({len(errors) - 1} more such gradients)" if len(errors) > 1 else ""
                raise LayoutError(f"{errors[0]}{more}") from errors[0]
        result_dtype = _result_dtype(tensors)
        result = finish(payload, p).to(device=payload.device if first is None else first, dtype=result_dtype)
        if signed is not None:
            found = plan.build(signed[0], signed[1], pg, pieces, foreach, payload.device, first, result_dtype)
    if found is not None:
        plan.remember(found, pg, foreach)
    if error_if_nonfinite and not torch.isfinite(result):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            f"clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`")
    return result, found, locals_ if found is not None else []


def _grads(parameters: TensorOrTensors) -> list[Tensor]:
    parameters = [parameters] if isinstance(parameters, Tensor) else parameters
    return [p.grad for p in parameters if p.grad is not None]


def _coefficient(max_norm: float, total_norm: Tensor) -> Tensor:
    # Always multiply, even by 1: a `coef < 1` test would sync with the device. In place, the same values as
    # torch's `max_norm / (total_norm + 1e-6)` (Tensor.__rdiv__ is `reciprocal() * other`), fewer temporaries.
    return (total_norm + 1e-6).reciprocal_().mul_(float(max_norm)).clamp_(max=1.0)


def _scale(tensors: list[Tensor], device: torch.device, coef: Tensor, foreach: bool | None) -> None:
    """Multiply ``tensors`` (one device) by ``coef`` in place: one foreach call where the device has them."""
    if (foreach is None and upstream.has_foreach_support(tensors, device)) or (
            foreach and upstream.device_has_foreach_support(device)):
        upstream.foreach_mul_(tensors, coef.to(device))
    elif foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    else:
        device_coef = coef.to(device)
        for g in tensors:
            g.mul_(device_coef)


@torch.no_grad()
def clip_grads_with_norm_(parameters: TensorOrTensors, max_norm: float, total_norm: Tensor,
                          foreach: bool | None = None) -> None:
    """Scale every gradient in place by ``min(max_norm / (total_norm + 1e-6), 1)``, torch's formula.

    DTensor gradients are scaled through their local tensors (any placement, Partial included: scaling is
    linear), with foreach kernels per (device, dtype); no collective.

    Args:
        parameters: the parameters whose ``.grad`` is scaled (those without a gradient are skipped).
        max_norm: the norm the gradients are clipped to.
        total_norm: the total norm of the gradients, e.g. from :func:`total_norm`.
        foreach: use foreach kernels (default: where torch would).
    """
    grads = [upstream.dtensor_local(g) if isinstance(g, DTensor) else g for g in _grads(parameters)]
    if not grads:
        return
    coef = _coefficient(max_norm, total_norm)
    for (device, _), ([device_grads], _) in upstream.group_tensors_by_device_and_dtype([grads]).items():
        _scale(device_grads, device, coef, foreach)


@torch.no_grad()
def clip_grad_norm_(parameters: TensorOrTensors, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    group: dist.ProcessGroup | None = None,
                    plain_replication: PlainReplication | None = None) -> Tensor:
    """Clip the gradients of ``parameters`` to a total norm of ``max_norm``; returns the total norm before
    clipping (the same on every rank). :func:`total_norm` then :func:`clip_grads_with_norm_`, the latter with the
    norm's plan: one foreach multiply per (device, dtype).

    Args:
        parameters: the parameters whose ``.grad`` is clipped, in the same order on every rank.
        max_norm: the norm the gradients are clipped to.
        norm_type: the norm's order, ``inf`` included.
        error_if_nonfinite: raise ``RuntimeError`` when the norm is NaN or infinite.
        foreach: use foreach kernels (default: where torch would).
        group: the process group the gradients are spread over (default: the world).
        plain_replication: how many ranks of ``group`` hold an identical copy of a plain gradient, e.g.
            ``shardadopt.topology(model).grad_replication(model.parameters())``.

    Returns:
        The total norm before clipping, a scalar tensor, equal on every rank.
    """
    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    norm, used, locals_ = _planned_norm(_grads(parameters), norm_type, error_if_nonfinite, foreach, group,
                                        plain_replication)
    if used is None:
        clip_grads_with_norm_(parameters, max_norm, norm, foreach)
        return norm
    used.scale(locals_, _coefficient(max_norm, norm))
    return norm
