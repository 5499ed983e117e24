"""Per-layout plans: what a grad-norm call works out about its gradients, worked out once per layout.

Which ranks hold each gradient (:func:`~shardadopt.gradnorm.layout.to_pieces`), how the local tensors group into
fused reductions (:func:`~shardadopt.gradnorm.core.buckets`) and where the payload and result live depend only on
the layout, not on the values; a training loop asks the same question every step. A plan stores the answer and is
looked up by the call's *signature*: per gradient its DeviceMesh and placements (by identity: a model's gradients
reuse their parameters' spec objects step after step), or for a plain tensor its ``plain_replication`` count
(asked every call), and its local dtype, device and emptiness; plus the process group. A plan holds the objects
whose ids its key uses, so the ids cannot be reused by others while it is cached; at most :data:`MAX_PLANS` are.
Calls with ``Partial`` gradients (a redistribution per call) or layout errors are never planned.

Most calls never build the signature: :func:`match` checks the call's tensors against the plan last used for a
list of that length (same mesh and placements objects, local dtype, device and emptiness, plain replication
counts, in order), one identity comparison per field, and takes its local tensors in the same walk. Anything else
(a parameter added or removed, ``requires_grad`` flipped, a gradient that became None, a new dtype or placement)
fails the match and goes through the signature, which finds or builds the plan for the new layout.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from shardadopt import upstream
from shardadopt.gradnorm.core import Bucket, Piece, bucket_payload, buckets
from shardadopt.gradnorm.layout import Group, PlainReplication

__all__ = ["Plan", "MAX_PLANS", "signature", "lookup", "build", "match"]

MAX_PLANS = 16  # a few models (or parameter groups) per process; the oldest plan goes first


class Plan:
    """The layout of one call's gradients: its buckets by index into the call's local tensors, the devices, and
    what :func:`match` compares a later call's tensors with (``checks``, one entry per tensor)."""

    __slots__ = ("anchors", "group_ref", "buckets", "scale_groups", "payload_device", "result_device",
                 "result_dtype", "checks")

    def __init__(self, anchors: tuple, group: dist.ProcessGroup | None, pieces: list[Piece], foreach: bool | None,
                 payload_device: torch.device, result_device: torch.device | None, result_dtype: torch.dtype,
                 checks: tuple = ()):
        self.anchors = anchors
        self.group_ref = None if group is None else weakref.ref(group)
        self.checks = checks
        positions: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        scale: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, (local, _) in enumerate(pieces):
            scale.setdefault((local.device, local.dtype), []).append(i)
            if local.numel():  # what buckets() leaves out, in its order
                positions.setdefault((local.device, local.dtype), []).append(i)
        # Without the first call's tensors: a cached plan must not keep a step's gradients alive (one gradient
        # shard per plan, still held after zero_grad); payload() puts each call's own tensors in.
        self.buckets = [(_all_or(positions[(b.device, b.dtype)], len(pieces)),
                         Bucket(b.device, b.dtype, [], b.weights, b.foreach))
                        for b in buckets(pieces, payload_device, foreach)]
        # (device, indices or None, how to scale: "foreach", "loop" or an error message), decided once: the
        # local tensors' types, devices and dtypes are part of the plan's key.
        self.scale_groups = []
        for (device, _), indices in scale.items():
            tensors = [pieces[i].tensor for i in indices]
            if (foreach is None and upstream.has_foreach_support(tensors, device)) or (
                    foreach and upstream.device_has_foreach_support(device)):
                how = "foreach"
            elif foreach:
                how = f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            else:
                how = "loop"
            self.scale_groups.append((device, _all_or(indices, len(pieces)), how))
        self.payload_device = payload_device
        self.result_device = result_device
        self.result_dtype = result_dtype

    def payload(self, locals_: list[Tensor], norm_type: float) -> Tensor:
        """This rank's all-reduce payload for ``locals_`` (the call's local tensors, in order)."""
        groups = [Bucket(b.device, b.dtype, locals_ if indices is None else [locals_[i] for i in indices], b.weights,
                         b.foreach) for indices, b in self.buckets]
        return bucket_payload(groups, norm_type, self.payload_device)

    def scale(self, locals_: list[Tensor], coef: Tensor) -> None:
        """Multiply ``locals_`` (the call's local tensors, in order) by ``coef`` in place: one foreach call per
        (device, dtype)."""
        for device, indices, how in self.scale_groups:
            tensors = locals_ if indices is None else [locals_[i] for i in indices]
            device_coef = coef if coef.device == device else coef.to(device)
            if how == "foreach":
                upstream.foreach_mul_(tensors, device_coef)
            elif how == "loop":
                for t in tensors:
                    t.mul_(device_coef)
            else:
                raise RuntimeError(how)


def _all_or(indices: list[int], total: int) -> list[int] | None:
    """None for "every tensor, in order" (no gather needed), else the indices."""
    return None if len(indices) == total else indices


_PLANS: dict[tuple, Plan] = {}
# (id of the process group, foreach, number of tensors) -> the plan last used for such a call, for match().
_RECENT: dict[tuple, Plan] = {}


def match(tensors: Sequence[Tensor], group: Group, group_pg: dist.ProcessGroup | None,
          plain_replication: PlainReplication | None, foreach: bool | None) -> tuple[Plan, list[Tensor]] | None:
    """``(plan, local tensors)`` when ``tensors`` have the layout of the plan last used for as many tensors (the
    same check as the signature's key, field by field, without building it), else None."""
    plan = _RECENT.get((id(group_pg), foreach, len(tensors)))
    if plan is None or (plan.group_ref is not None and plan.group_ref() is not group_pg):
        return None
    locals_: list[Tensor] = []
    for tensor, (mesh, placements, kind, dtype, device, empty) in zip(tensors, plan.checks):
        if mesh is None:  # a plain tensor: placements is its replication count
            if isinstance(tensor, DTensor):
                return None
            try:
                replicas = group.size if plain_replication is None else plain_replication(tensor)
            except Exception:
                return None
            if replicas != placements or type(replicas) is not int:
                return None
            local = tensor
        else:
            if not isinstance(tensor, DTensor) or tensor.device_mesh is not mesh or tensor.placements is not placements:
                return None
            local = upstream.dtensor_local(tensor)
        if type(local) is not kind or local.dtype is not dtype or local.device != device or (
                not local.numel()) is not empty:
            return None
        locals_.append(local)
    return plan, locals_


def remember(plan: Plan, group_pg: dist.ProcessGroup | None, foreach: bool | None) -> None:
    """Make ``plan`` the one :func:`match` tries first for calls with as many tensors."""
    key = (id(group_pg), foreach, len(plan.checks))
    if key not in _RECENT and len(_RECENT) >= MAX_PLANS:
        del _RECENT[next(iter(_RECENT))]
    _RECENT[key] = plan


def signature(tensors: Sequence[Tensor], group: Group, group_pg: dist.ProcessGroup | None,
              plain_replication: PlainReplication | None, foreach: bool | None
              ) -> tuple[tuple, tuple, list[Tensor]] | None:
    """``(key, anchors, local tensors)`` of a call, or None when it cannot be planned (a ``plain_replication``
    that fails or answers out of range: the unplanned path reports it)."""
    key: list = [id(group_pg), foreach]
    anchors: list = []
    locals_: list[Tensor] = []
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            mesh, placements = tensor.device_mesh, tensor.placements
            local = upstream.dtensor_local(tensor)
            key.append((id(mesh), id(placements), type(local), local.dtype, local.device, not local.numel()))
            anchors.append((mesh, placements))
        else:
            try:
                replicas = group.size if plain_replication is None else plain_replication(tensor)
            except Exception:
                return None
            if not isinstance(replicas, int) or not 1 <= replicas <= group.size:
                return None
            local = tensor
            key.append((replicas, type(local), local.dtype, local.device, not local.numel()))
        locals_.append(local)
    return tuple(key), tuple(anchors), locals_


def lookup(key: tuple, group_pg: dist.ProcessGroup | None) -> Plan | None:
    """The cached plan for ``key``, if its process group is still the one the key's id named."""
    plan = _PLANS.get(key)
    if plan is None or (plan.group_ref is not None and plan.group_ref() is not group_pg):
        return None
    return plan


def build(key: tuple, anchors: tuple, group_pg: dist.ProcessGroup | None, pieces: list[Piece],
          foreach: bool | None, payload_device: torch.device, result_device: torch.device | None,
          result_dtype: torch.dtype) -> Plan | None:
    """Plan a call whose ``pieces`` :func:`~shardadopt.gradnorm.layout.to_pieces` found without errors, and cache
    it; None (not cached) when a placement is Partial (its redistribution makes new tensors every call)."""
    if any(p.is_partial() for _, placements in anchors for p in placements):
        return None
    dtensors = iter(anchors)
    checks = tuple((*next(dtensors), *entry[2:]) if len(entry) == 6 else (None, *entry) for entry in key[2:])
    plan = Plan(anchors, group_pg, pieces, foreach, payload_device, result_device, result_dtype, checks)
    if len(_PLANS) >= MAX_PLANS:
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = plan
    return plan
