"""LoRA on the fused expert tensors of an expert-parallel MoE (peft's ``ParamWrapper``, ``target_parameters``).

peft sizes the factors of a 3-D expert tensor for all experts (``lora_A: (r*E, in)``, expert ``e`` owns the rows
``e*r .. e*r+r-1``; ``lora_B: (out, r*E)``, expert ``e`` owns the strided columns ``k*E + e``) and adds the delta with
a parametrization, which hides the tensor from the EP forward (it swaps the DTensor experts for their local shard) and
mixes DTensor and plain tensors. Here each factor, rank 0's whole value, becomes a DTensor on the experts' own mesh:
``lora_A`` ``Shard(0)`` and ``lora_B`` ``_StridedShard(1, split_factor=r)`` on ``ep`` (exactly this rank's experts'
rows / columns, so ``full_tensor()`` is peft's one-process layout for export and peft reshards it on load), replicated
on the other dims (``efsdp``). The forward adds ``scaling * lhs @ rhs`` of the local experts to the local expert
tensor, as the experts' forward reads it inside the EP forward. Gradients: each rank's experts already hold the
contributions of the whole EP group (the token all-to-all), so they are summed over the replicas of the same experts
(``efsdp``) and divided by the data-parallel size, never averaged over the EP group. DCP checkpoints see ``lora_B``
through a contiguous view (:func:`checkpoint_views`). Design: ``docs/expert-lora.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardadopt import upstream
from shardadopt.adapters.refusals import refusal

EXPERTS = "experts"  # the layout style check_layer returns for a LoRA layer on an expert tensor
_DELTAS = "_shardadopt_expert_deltas"  # on an experts module: parameter name -> [(lhs, rhs, scaling)] while active
_GRAD_SCALE = "_shardadopt_expert_grad_scale"  # on a laid-out ParamWrapper: replicas / data-parallel size
_PLAIN = "a plain tensor: transformers before 5.21 shards experts on the TP mesh"
_classes: dict[type, type] = {}
_groups: dict[tuple, Any] = {}


def is_expert_layer(layer: Any) -> bool:
    """Whether ``layer`` is peft's ``ParamWrapper`` (LoRA on a parameter: ``target_parameters``, or a
    ``target_modules`` name peft matched to a parameter, such as ``down_proj`` on Qwen3-MoE)."""
    from peft.tuners.lora.layer import ParamWrapper

    return isinstance(layer, ParamWrapper)


def linear_target_modules(model: nn.Module, config: Any) -> list[str] | None:
    """The ``target_modules`` that train ``config``'s Linear targets without the fused experts, as this peft reads
    names: peft maps a ``target_modules`` name to the experts' fused tensors (``down_proj`` -> ``experts.down_proj``,
    ``gate_proj``/``up_proj`` -> ``gate_up_proj``); peft 0.22 keeps it for the Linear layers of that name too
    (shared experts, dense layers: then their paths below the decoder layer, ``mlp.shared_expert.down_proj``, keep
    them and leave the experts out), peft 0.21 maps every name ending in it (then the name is left out).

    Args:
        model: the transformers model peft injected into.
        config: the adapter's ``LoraConfig``.

    Returns:
        The names, or None where the user gave no list of names (a regex, or ``target_parameters`` only).
    """
    targets = getattr(config, "target_modules", None)
    if not targets or isinstance(targets, str):
        return None
    layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A")]
    fused = {m.parameter_name for _, m in layers if is_expert_layer(m)}
    linear = [n.removesuffix(".base_layer") for n, m in layers if not is_expert_layer(m) and ".experts." not in n]

    def to_experts(leaf: str) -> bool:
        part = leaf.removesuffix("_proj")
        return leaf in fused or any(part in f.removesuffix("_proj").split("_") for f in fused)

    names: list[str] = []
    for target in sorted(targets):
        leaf = target.rsplit(".", 1)[-1]
        if not to_experts(leaf):
            names.append(target)
            continue
        for path in linear:  # the Linear layers peft kept for this name: their path below the decoder layer
            if path == target or path.endswith("." + target):
                parts = path.split(".")
                below = ".".join(parts[max(i for i, p in enumerate(parts) if p.isdigit()) + 1:]
                                 if any(p.isdigit() for p in parts) else parts)
                names.append(below)
    return list(dict.fromkeys(names))


def check_expert_layer(name: str, layer: Any, linear_targets: list[str] | None = None) -> str:
    """Refuse, by name, a ``ParamWrapper`` that cannot be laid out: a parameter that is not a fused 3-D expert tensor
    sharded by expert on an ``ep`` mesh (the router's 2-D weight, experts on the TP mesh or only FSDP-sharded), or
    experts whose forward does not run on this rank's experts.

    Args:
        name: the layer's name (for the message).
        layer: peft's ``ParamWrapper``.
        linear_targets: :func:`linear_target_modules` of the adapter's config (named in the refusal of experts not
            sharded by expert).

    Returns:
        :data:`EXPERTS`.

    Raises:
        AdapterLayoutError: naming the layer, what it is and the way out.
    """
    from torch.distributed.tensor import DTensor, Shard

    param = layer.get_param()
    where = f"{layer.parameter_name} of {type(layer.get_base_layer()).__name__}"
    if param.ndim != 3:
        raise refusal(
            name,
            f"LoRA on the {param.ndim}-D parameter {where} (target_parameters, or a target_modules "
            'name peft matched to a parameter, e.g. the router "gate" or "all-linear")',
            "Only fused 3-D expert tensors are laid out: leave the router out (list the projections "
            'instead of "all-linear", without "gate").',
        )
    names = tuple(getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ())
    if not isinstance(param, DTensor) or "ep" not in names:
        raise refusal(
            name,
            f"LoRA on the expert tensor {where} not sharded by expert on an ep mesh ("
            f"{'mesh ' + str(names) if names else _PLAIN})",
            "Load with DistributedConfig(ep_size=..., fsdp_size=...) on transformers 5.21 or newer, or "
            "leave the experts out of target_modules / target_parameters"
            + (f": target_modules={linear_targets!r}, without target_parameters (the Linear layers the names "
               "also matched, without the experts' fused tensors peft mapped them to)." if linear_targets else "."),
        )
    placement = param.placements[names.index("ep")]
    experts = layer.get_base_layer()
    local = getattr(experts, "num_experts", None)
    ep_size = param.device_mesh.size(names.index("ep"))
    if (
        placement != Shard(0)
        or local is None
        or local * ep_size != param.shape[0]
        or not upstream.experts_is_expert_parallel(experts)
    ):
        raise refusal(
            name,
            f"LoRA on the expert tensor {where} laid out as {placement} on ep with "
            f"num_experts={local} of {param.shape[0]} (an ep_implementation whose experts forward does not "
            "run this rank's slice of the experts)",
            "Use an ep_implementation that shards the experts "
            '("auto", "all_to_all"), or leave the experts out of target_modules / target_parameters.',
        )
    return EXPERTS


def lay_out_expert_factors(layer: Any, adapter: str, dp_size: int) -> None:
    """Make ``adapter``'s whole factors on ``layer`` (identical on every rank) DTensors holding this rank's experts
    on the experts' mesh, and route the forward through :func:`_expert_forward`. Local: no collective.

    Args:
        layer: peft's ``ParamWrapper`` on an expert tensor (checked by :func:`check_expert_layer`).
        adapter: the adapter's name.
        dp_size: the model's data-parallel size (the number of batches one optimizer step sees).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    param = layer.get_param()
    mesh = param.device_mesh
    names = mesh.mesh_dim_names
    strided = upstream.strided_shard_type()
    rank = layer.r[adapter]
    placements = {
        "lora_A": [Shard(0) if n == "ep" else Replicate() for n in names],
        "lora_B": [strided(1, split_factor=rank) if n == "ep" else Replicate() for n in names],
    }
    for kind, where in placements.items():
        factor = getattr(layer, kind)[adapter]
        weight = factor.weight
        factor.weight = nn.Parameter(
            distribute_tensor(weight.detach(), mesh, where, src_data_rank=None), requires_grad=weight.requires_grad
        )
    layer.__dict__[_GRAD_SCALE] = expert_replicas(layer) / dp_size
    if not isinstance(layer, _ExpertWrapper):
        layer.__class__ = _wrapper_class(type(layer))
    experts = layer.get_base_layer()
    if _DELTAS not in experts.__dict__:
        experts.__class__ = _experts_class(type(experts))
        experts.__dict__[_DELTAS] = {}


def expert_replicas(layer: Any) -> int:
    """How many ranks hold ``layer``'s experts (the size of :func:`expert_dp_group`)."""
    mesh = layer.get_param().device_mesh
    return mesh.size() // mesh.size(mesh.mesh_dim_names.index("ep"))


def expert_dp_group(layer: Any) -> Any:
    """The process group of the replicas of ``layer``'s experts (the experts mesh's dims other than ``ep``: ``efsdp``,
    and ``dp_replicate``), over which its factors' gradients are averaged; cached per layout. Collective the first
    time."""
    import torch.distributed as dist

    mesh = layer.get_param().device_mesh
    ranks, ep_dim = mesh.mesh, mesh.mesh_dim_names.index("ep")
    # per ep coordinate, the ranks holding those experts: every replica of the same experts
    groups = tuple(
        tuple(int(r) for r in ranks.select(ep_dim, e).flatten().tolist()) for e in range(ranks.shape[ep_dim])
    )
    key = (id(upstream.default_group()), groups)
    if key not in _groups:
        _groups[key] = dist.new_subgroups_by_enumeration([list(g) for g in groups])[0]
    return _groups[key]


def _scaled_local(layer: Any, weight: Any) -> torch.Tensor:
    """``weight``'s local shard; its gradient scaled by replicas / dp size. This rank's experts see the tokens of the
    whole EP group (the all-to-all), so their gradient sums those ranks' losses; averaged over the replicas after
    the backward, it is then the mean over every data-parallel batch, as one process computes it. Scaling here, not
    in the averaging, keeps that averaging repeatable (accumulated gradients are averaged again each micro-step)."""
    local = weight.to_local()
    scale = layer.__dict__[_GRAD_SCALE]
    if scale != 1 and local.requires_grad:
        local.register_hook(lambda grad: grad * scale)
    return local


def _local_factors(layer: Any, adapter: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(lhs, rhs, scaling)`` of this rank's experts, such that their delta is ``scaling * lhs @ rhs`` (peft's
    ``get_delta_factors`` on the local slice)."""
    weight_a = _scaled_local(layer, layer.lora_A[adapter].weight)  # (E_local * r, in): expert-major rows
    weight_b = _scaled_local(layer, layer.lora_B[adapter].weight)  # (out, r * E_local): expert index fastest
    rank = layer.r[adapter]
    local = weight_a.shape[0] // rank
    weight_a = weight_a.reshape(local, rank, weight_a.shape[-1])  # (experts, rank, in)
    weight_b = weight_b.reshape(weight_b.shape[0], rank, local).permute(2, 0, 1)  # (experts, out, rank)
    # peft swaps in/out for experts stored as (experts, out, in), unless the module says it is transposed
    if getattr(layer.get_base_layer(), "is_transposed", False):
        lhs, rhs = weight_a.transpose(-2, -1), weight_b.transpose(-2, -1)
    else:
        lhs, rhs = weight_b, weight_a
    return lhs.to(dtype), rhs.to(dtype), layer.scaling[adapter]


@contextlib.contextmanager
def _expert_deltas(layer: Any, adapters: list[str]) -> Iterator[None]:
    experts = layer.get_base_layer()
    dtype = layer.get_param().dtype
    deltas = experts.__dict__[_DELTAS]
    deltas[layer.parameter_name] = [_local_factors(layer, a, dtype) for a in adapters]
    try:
        yield
    finally:
        deltas.pop(layer.parameter_name, None)


def _expert_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's ``ParamWrapper.forward`` with the active adapters' local-expert deltas instead of a parametrization."""
    if kwargs.pop("adapter_names", None) is not None:
        raise ValueError(f"lora.{type(self).__name__} does not support mixed adapter batches.")
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    if self.disable_adapters or self.merged or not adapters:
        return self.base_layer(x, *args, **kwargs)
    with _expert_deltas(self, adapters):
        return self.base_layer(x, *args, **kwargs)


class _ExpertWrapper:
    """Marker base of the laid-out ``ParamWrapper`` classes."""


def _wrapper_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"EP{cls.__name__}", (cls, _ExpertWrapper), {"forward": _expert_forward})
    return _classes[cls]


def _experts_getattr(self: nn.Module, name: str) -> Any:
    value = nn.Module.__getattr__(self, name)
    found = self.__dict__[_DELTAS].get(name)
    if found:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            raise RuntimeError(
                f"{type(self).__name__}.{name} read as a DTensor while LoRA deltas of this rank's "
                "experts are active: the experts forward must run on local tensors (transformers' "
                "EP forward does); this experts forward is not supported with expert LoRA."
            )
        for lhs, rhs, scaling in found:
            value = torch.baddbmm(value, lhs, rhs, alpha=scaling)
    return value


def _experts_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(cls.__name__, (cls,), {"__getattr__": _experts_getattr})
    return _classes[cls]


@contextlib.contextmanager
def checkpoint_views(state: Any) -> Iterator[Any]:
    """Within the block, ``state`` (nested dicts / lists of a DCP state dict, changed in place) holds, instead of
    every expert ``lora_B`` DTensor (and its optimizer state: a lone ``_StridedShard(d, split_factor=s)``, replicated
    on the other mesh dims), a contiguous ``Shard(d + 1)`` view of its dim ``d`` split into ``(s, size / s)``, on the
    same local data; the originals are back after it. DCP cannot write a strided shard (its chunks would overlap);
    the view shares storage, so ``dcp.load`` into it loads the tensor itself, and what ``dcp.load`` puts in place of
    other entries (an optimizer's ``lr``) stays in ``state``. For ``lora_B`` ``(out, r * E)`` the saved tensor is
    ``(out, r, E)`` in peft's order, the same whatever the EP size, so such a checkpoint resumes on another EP size
    too. Local: no collective.

    Args:
        state: what ``get_state_dict`` returned, nested.

    Yields:
        ``state`` itself, those DTensors replaced by their views.
    """
    swapped: list[tuple[Any, Any, Any]] = []
    _swap_views(state, swapped)
    try:
        yield state
    finally:
        for container, key, original in reversed(swapped):
            container[key] = original


def _swap_views(state: Any, swapped: list[tuple[Any, Any, Any]]) -> None:
    from torch.distributed.tensor import DTensor

    keys = state.keys() if isinstance(state, dict) else range(len(state)) if isinstance(state, list) else ()
    for key in list(keys):
        value = state[key]
        if isinstance(value, DTensor):
            view = _contiguous_view(value)
            if view is not None:
                swapped.append((state, key, value))
                state[key] = view
        else:
            _swap_views(value, swapped)


def _contiguous_view(tensor: Any) -> Any:
    """``tensor`` (a DTensor) as a contiguous ``Shard`` view when it is a lone ``_StridedShard``, else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    strided = upstream.strided_shard_type()
    placements = tensor.placements
    if sum(isinstance(p, strided) for p in placements) != 1 or not all(
        isinstance(p, (strided, Replicate)) for p in placements
    ):
        return None
    split = next(p for p in placements if isinstance(p, strided))
    dim, factor = split.dim, split.split_factor
    local = upstream.dtensor_local(tensor)
    shape = (*tensor.shape[:dim], factor, tensor.shape[dim] // factor, *tensor.shape[dim + 1 :])
    view = local.view(*local.shape[:dim], factor, local.shape[dim] // factor, *local.shape[dim + 1 :])
    return DTensor.from_local(
        view,
        tensor.device_mesh,
        [Shard(dim + 1) if p is split else p for p in placements],
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )
