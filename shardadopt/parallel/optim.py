"""Fused/foreach optimizers over parameters on several meshes, or a mix of DTensor and plain tensors.

A foreach/fused optimizer step runs one multi-tensor kernel per param group (per device and dtype); DTensor's
dispatch refuses a list that mixes DTensors with plain tensors ("got mixed torch.Tensor and DTensor") or DTensors
on different meshes ("All operands ... must have the same mesh"). A TP model (norm weights stay plain), an EP model
(experts on their own mesh) and a 2-D model are such mixes.

:func:`split_param_groups_by_mesh` makes every step see homogeneous groups — one per (DTensor or not, mesh,
placements, device, dtype) inside each user group — and still one multi-tensor kernel per group, never a
per-parameter fallback. The split is a view that exists only *during* ``step()`` (a step pre-hook swaps it in, a
post-hook swaps the user's groups back), so:

- ``optimizer.param_groups`` stays exactly what the user built: LR schedulers created before or after, per-group
  hyperparameters, ``add_param_group`` and ``state_dict()`` / ``load_state_dict()`` are unchanged (the state is
  keyed by parameter, and the saved ``param_groups`` are the user's);
- each step copies the user's current group hyperparameters into the view, so scheduler changes apply at once;
  values a step writes into a group are copied back.

:func:`split_param_groups` is the pure function underneath, for code that builds its optimizer itself (e.g.
``Trainer.create_optimizer``): passing its result to the optimizer's constructor gives the same homogeneous
groups permanently (then ``state_dict()`` has the split groups).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardadopt import upstream

__all__ = ["split_param_groups", "split_param_groups_by_mesh", "unsplit_param_groups_by_mesh", "group_key"]

_STATE_ATTR = "_shardadopt_split"


def group_key(param: torch.Tensor) -> tuple:
    """What a multi-tensor kernel needs to be equal across its list: DTensor-ness, mesh, placements, device,
    dtype.

    Args:
        param: a parameter, DTensor or plain.

    Returns:
        A hashable key; parameters with equal keys can share one foreach/fused kernel call.
    """
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return ("dtensor", tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names,
                tuple(param.placements), upstream.dtensor_local(param).device, param.dtype)
    return ("plain", (), (), None, (), param.device, param.dtype)


def _partition(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indexes of ``params`` per homogeneous subgroup, in first-seen order (order inside each kept)."""
    parts: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        parts.setdefault(group_key(p), []).append(i)
    return list(parts.values())


def split_param_groups(param_groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split into homogeneous groups with the same hyperparameters (groups already homogeneous are
    returned as they are). Accepts what an optimizer constructor accepts: dicts with ``params``.

    Args:
        param_groups: parameter groups as an optimizer constructor takes them (dicts with ``params``).

    Returns:
        The groups, each split into homogeneous groups that keep its other keys.
    """
    out = []
    for group in param_groups:
        params = list(group["params"])
        parts = _partition(params)
        if len(parts) <= 1:
            out.append(group)
            continue
        settings = {k: v for k, v in group.items() if k != "params"}
        out.extend({**settings, "params": [params[i] for i in idx]} for idx in parts)
    return out


class _Split:
    """The per-optimizer view: cached partitions, and the user's groups while a step runs."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, ...], list[list[int]]] = {}
        self.saved: list[dict[str, Any]] | None = None
        self.view: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (user group, view group)
        self.handles: list[Any] = []

    def parts(self, params: list[torch.Tensor]) -> list[list[int]]:
        key = tuple(id(p) for p in params)
        found = self.cache.get(key)
        if found is None:
            found = self.cache[key] = _partition(params)
        return found


def _restore(optimizer: torch.optim.Optimizer, split: _Split) -> None:
    if split.saved is None:
        return
    for user, view in split.view:
        for k, v in view.items():
            if k != "params" and user.get(k) is not v:
                user[k] = v
    optimizer.param_groups = split.saved
    split.saved, split.view = None, []


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    split: _Split = getattr(optimizer, _STATE_ATTR)
    _restore(optimizer, split)  # a previous step that raised left the view in place
    groups, view = [], []
    for group in optimizer.param_groups:
        params = group["params"]
        parts = split.parts(params)
        if len(parts) <= 1:
            groups.append(group)
            continue
        for idx in parts:
            sub = {**group, "params": [params[i] for i in idx]}
            groups.append(sub)
            view.append((group, sub))
    if view:
        split.saved, split.view = optimizer.param_groups, view
        optimizer.param_groups = groups


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _restore(optimizer, getattr(optimizer, _STATE_ATTR))


def split_param_groups_by_mesh(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` run on homogeneous param groups (see the module docstring); idempotent.

    Works for any ``torch.optim.Optimizer`` (foreach, fused or neither); returns the same optimizer. A wrapper
    such as accelerate's ``AcceleratedOptimizer`` is unwrapped to the optimizer it holds.

    Args:
        optimizer: the optimizer, or a wrapper holding one as ``.optimizer``.

    Returns:
        The same optimizer object, now splitting its groups around each ``step()``.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer (or a wrapper with .optimizer), got {type(optimizer)}")
    if getattr(inner, _STATE_ATTR, None) is None:
        split = _Split()
        setattr(inner, _STATE_ATTR, split)
        split.handles = [inner.register_step_pre_hook(_pre_step), inner.register_step_post_hook(_post_step)]
    return optimizer


def unsplit_param_groups_by_mesh(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`split_param_groups_by_mesh` (remove its hooks).

    Args:
        optimizer: an optimizer :func:`split_param_groups_by_mesh` was called on (others are left as they are).
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    split = getattr(inner, _STATE_ATTR, None)
    if split is not None:
        _restore(inner, split)
        for handle in split.handles:
            handle.remove()
        delattr(inner, _STATE_ATTR)
