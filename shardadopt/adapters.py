"""PEFT LoRA adapters on models sharded at load time: laid out like their base layers, trained like one process.

peft adds LoRA factors as plain tensors (and, on tensor-parallel loads, sizes them by the local shard); nothing
reduces their gradients over the data-parallel ranks, so each rank trains its own adapter (FSDP), or the first
forward crashes (TP, fsdp x tp, EP). :func:`lay_out_adapters` fixes an injected adapter so that the sharded model
trains exactly like one process on the same global batch:

- **shapes**: peft builds every factor on its base layer's *global* shape inside :func:`global_adapter_shapes`
  (peft's own initialiser, so the init scale does not depend on the TP size), and whole: the patch hides the TP
  plan from peft while it injects;
- **values**: each whole factor is broadcast from global rank 0, so the ranks agree whatever their RNG holds, and
  with rank 0 seeded like the one-process run the adapter equals the one-process adapter;
- **placements**: then the factor facing the sharded dim is sharded like its base layer with transformers' own TP
  style (what peft's DTensor TP, peft #3079, and torchtitan's ``components/lora.py`` do): colwise base (weight
  ``Shard(0)`` on the tp mesh) -> ``lora_A`` replicated, ``lora_B`` colwise; rowwise base (``Shard(1)``) ->
  ``lora_A`` rowwise (its partial output all-reduced), ``lora_B`` replicated. Bases that are not tensor parallel
  (FSDP only, HSDP, EP's attention) keep both factors whole;
- **gradients**: factors are replicated over the data-parallel ranks (they are small; DDP does the same) and their
  gradients averaged over exactly that group (the ranks with this rank's tp coordinate) after each backward.
  Averaging an accumulated gradient again would be exact too (the part every rank shares averages to itself), but
  under FSDP2 ``no_sync`` (accelerate's ``accumulate()``) the reduction waits for the synchronised backward, like
  FSDP's own. TP factors get their TP reductions from DTensor. Base weights stay frozen (peft's marking). Every
  adapter is hooked when laid out, an inactive one too (``set_adapter`` makes it trainable later, after
  ``prepare``); a factor is marked laid out on its module, so ``delete_adapter`` + ``add_adapter`` under the same
  name lays the new one out;
- **DoRA** (``use_dora=True``): the initial magnitude is the norm of the whole base weight (gathered once at
  injection) plus rank 0's B @ A, then broadcast from rank 0; on a colwise base the magnitude is sharded like the
  output features and the weight norm taken over this rank's rows, on a rowwise base it stays whole and the
  squared norm is summed over the TP group (:func:`_tensor_parallel_dora`; on fsdp x tp on FSDP's unsharded TP
  shard); on FSDP and HSDP peft's own forward runs inside FSDP's, on the unsharded weight. Its gradient is averaged
  over the data-parallel group (on fsdp x tp: the ranks with this rank's tp coordinate) like the factors';
- **modules_to_save**: peft's trainable copy of a sharded module is made whole and plain (:func:`whole_copy`: peft's
  deepcopy of FSDP/TP shards fails) and averaged over the data-parallel group, for modules inside a larger FSDP
  unit and modules that are not tensor parallel or gather their output (``lm_head``'s ``colwise_gather_output``);
- **refused**, naming the layer or option and the way out (:class:`AdapterLayoutError`), before peft touches a
  shard where possible (:func:`check_config`): initialisations computed from the base
  weight (PiSSA, OLoRA, LoftQ, EVA, CorDA, LoRA-GA), ``modules_to_save`` of an FSDP unit of its own (an untied
  ``lm_head``: the FSDP plan's norm-and-head unit) or of a module with another TP plan,
  ``target_parameters`` and target modules that match fused expert tensors, base layers on the expert mesh or with a
  TP plan other than colwise/rowwise, LoRA on sharded non-Linear layers, ``lora_bias`` on a rowwise base, adapters
  on the meta device, and tensor parallelism on transformers without DTensor TP (before 5.17).

Adapters are fixed when peft injects them (``get_peft_model``, ``PeftModel.from_pretrained``, ``add_adapter``,
``load_adapter``: the ``peft-sharded-adapters`` patch wraps peft's ``BaseTuner.inject_adapter``), so an optimizer
built from ``model.parameters()`` before ``accelerator.prepare`` holds the final parameters. ``accelerator.prepare``
(``shardadopt.adopt.adopt_model``) calls :func:`check_adapters`: a sharded model whose LoRA layers were not laid out
(added before ``shardadopt.enable()``) is refused, and factors made trainable after injection get their hooks.

Public API (``lay_out_adapters``, ``adapter_state_dict`` and ``full_adapter_tensors`` are collectives: call them on
every rank):

- ``lay_out_adapters(model) -> int``: lay out every LoRA adapter not laid out yet (returns how many (layer,
  adapter) pairs); without the patch: ``with global_adapter_shapes(): model = get_peft_model(...)``, then
  ``lay_out_adapters(model)`` (likewise around ``add_adapter`` / ``load_adapter``);
- ``global_adapter_shapes()``: the context manager in which peft sizes LoRA factors by the global shape;
- ``check_config(lora_config)`` / ``check_adapters(model)``: raise :class:`AdapterLayoutError` for what cannot be
  laid out / for LoRA layers that are not laid out;
- ``whole_copy(module)``, ``whole_weight(weight)``: what the patch gives peft's ``modules_to_save`` copy and DoRA's
  initial norm on a sharded base (collectives);
- ``adapter_state_dict(peft_model, adapter_name="default") -> dict``: the adapter's full tensors in PEFT's format
  (what ``save_pretrained`` writes), on every rank; ``full_adapter_tensors(peft_model)``: the model's state dict
  with the LoRA factors whole;
- ``adapter_parameters(model) -> set[int]``: the ids of every adapter's parameters, active or not (what an
  adapter checkpoint keeps; the rest of the frozen parameters is the base);
- ``refuse_weighted_adapter(model)``: ``add_weighted_adapter`` refused on TP loads (:data:`WEIGHTED_REFUSAL`);
- ``is_sharded_base(model)``, ``dtensor_tensor_parallel()``, ``MERGE_REFUSAL``, ``AdapterLayoutError`` (a
  ``ValueError``).

With the patch, ``PeftModel.save_pretrained(dir)`` on a sharded model writes full tensors once (global rank 0, under
a fence, then a barrier); ``merge_and_unload()``/``merge_adapter()`` on a sharded model are refused (export, then
merge in one process); ``add_weighted_adapter`` is refused on TP loads.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardadopt import upstream
from shardadopt.topology import Topology, topology

__all__ = ["AdapterLayoutError", "lay_out_adapters", "check_config", "check_adapters",
           "global_adapter_shapes", "adapter_state_dict", "full_adapter_tensors", "is_sharded_base",
           "dtensor_tensor_parallel", "whole_copy", "whole_weight", "MERGE_REFUSAL", "WEIGHTED_REFUSAL",
           "refuse_weighted_adapter", "adapter_parameters"]

# on an adapter's lora_A module (not its name on the layer: delete_adapter then add_adapter under the same name
# brings new factors, which must be laid out again)
_LAID_OUT = "_shardadopt_laid_out"
_HOOKED = "_shardadopt_dp_average"  # on a factor parameter: the dp-averaging hook handle
_DP = "_shardadopt_dp"  # on a LoRA layer: (dp group, dp size, FSDP modules telling whether gradients sync)
# init_lora_weights values whose result does not depend on the base weight
_WEIGHT_FREE_INITS = (True, False, "gaussian")
MERGE_REFUSAL = (
    "merging LoRA adapters into a model sharded at load time is not supported: the merged weights would be written "
    "into this rank's shard only. Export the adapter with model.save_pretrained(dir) (every rank), then merge in "
    "one process: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir).merge_and_unload().")


WEIGHTED_REFUSAL = (
    "add_weighted_adapter on a tensor-parallel load ({layout}) is not supported by shardadopt: peft combines the "
    "factors as whole tensors, and here they are sharded (the combination would crash or hold one rank's slice). "
    "Export the adapters with model.save_pretrained(dir) (every rank), combine them in one process "
    "(PeftModel.from_pretrained(base, dir), load_adapter, add_weighted_adapter, save_pretrained), and load the result "
    "onto the sharded model with load_adapter; on fsdp_size loads add_weighted_adapter works as in one process.")


def refuse_weighted_adapter(model: nn.Module) -> None:
    """Refuse ``add_weighted_adapter`` on a tensor-parallel load (:data:`WEIGHTED_REFUSAL`); data-parallel loads hold
    every factor whole and identical on every rank, where peft's combination runs as in one process."""
    topo = topology(_base_model(model))
    if topo.tp_size > 1:
        raise AdapterLayoutError(WEIGHTED_REFUSAL.format(layout=f"tp_size={topo.tp_size}"))


class AdapterLayoutError(ValueError):
    """A PEFT adapter on a sharded model that shardadopt cannot make train like one process."""


_shapes = threading.local()


@contextlib.contextmanager
def global_adapter_shapes() -> Iterator[None]:
    """While active, peft sizes LoRA factors on a sharded base by its global shape (peft sizes TP bases by the
    local shard, which changes the init scale with the TP size and breaks row-parallel layers)."""
    depth = getattr(_shapes, "depth", 0)
    _shapes.depth = depth + 1
    try:
        yield
    finally:
        _shapes.depth = depth


def global_shape_requested() -> bool:
    return getattr(_shapes, "depth", 0) > 0


def global_in_out_features(base_layer: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a Linear whose weight is a DTensor, from the global shape; else None."""
    from torch.distributed.tensor import DTensor

    weight = getattr(base_layer, "weight", None)
    if isinstance(base_layer, nn.Linear) and isinstance(weight, DTensor) and weight.ndim == 2:
        out_features, in_features = weight.shape
        return in_features, out_features
    return None


def is_sharded_base(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers model, peft's tuner or PeftModel around one) is sharded."""
    return topology(_base_model(model)).is_sharded


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under peft's PeftModel / tuner wrappers."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    while isinstance(model, (PeftModel, BaseTuner)):
        model = model.base_model if isinstance(model, PeftModel) else model.model
    return model


# -- laying out ----------------------------------------------------------------------------------------------------

def _tp_style(weight: Any, topo: Topology) -> str:
    """How a base layer's weight is laid out over tensor parallelism: "none", "colwise", "rowwise", or a
    description of anything else."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if topo.tp_size == 1:
        return "none"
    if not isinstance(weight, DTensor):
        return "plain (not a DTensor: transformers before 5.17 keeps TP shards as plain tensors)"
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return "none" if not {"ep", "efsdp"} & set(names) else f"expert mesh {names}"
    placement = weight.placements[names.index("tp")]
    if isinstance(placement, Replicate):
        return "none"
    if isinstance(placement, Shard) and placement.dim == 0:
        return "colwise"
    if isinstance(placement, Shard) and placement.dim == 1:
        return "rowwise"
    return f"placement {placement} on the tp mesh"


def dtensor_tensor_parallel() -> bool:
    """Whether the installed transformers shards TP layers as DTensors with per-style forwards (5.17+: the module
    ``transformers.distributed.tensor_parallel``, its style registry and ``apply_tensor_parallelism``, what peft
    checks too), which adapters are laid out with."""
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism  # noqa: F401
    except ImportError:
        return False
    return True


def _placement_name(param: Any) -> str:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return "replicated"
    names = param.device_mesh.mesh_dim_names or ()
    if names != ("tp",) or len(param.placements) != 1 or not isinstance(param.placements[0], Shard):
        return f"{param.placements} on {names}"
    return "colwise" if param.placements[0].dim == 0 else "rowwise"


def _refusal(name: str | None, what: str, fix: str) -> AdapterLayoutError:
    """``name``: the LoRA layer, or None for a ``LoraConfig`` refused before peft injects anything."""
    subject = f"LoRA adapter on {name}" if name else "LoraConfig"
    return AdapterLayoutError(f"{subject}: {what} on a model sharded at load time is not supported by shardadopt "
                              f"(it would train wrong or crash). {fix}")


def check_config(config: Any) -> None:
    """Refuse, before peft injects anything, a ``LoraConfig`` whose options cannot be laid out on a sharded model
    (peft would run them on shards: weight-based initialisations read the whole base weight)."""
    init = getattr(config, "init_lora_weights", True)
    if init not in _WEIGHT_FREE_INITS:
        raise _refusal(None, f"init_lora_weights={init!r} (computed from the whole base weight)",
                       "Use init_lora_weights=True or \"gaussian\", or initialise in one process, save it, and load "
                       "it onto the sharded model with PeftModel.from_pretrained.")
    if getattr(config, "target_parameters", None):
        raise _refusal(None, f"target_parameters={config.target_parameters!r} (parameters such as fused "
                       "expert tensors; peft also lands here when a target_modules name matches an experts "
                       "module's parameter)", "Target projection modules only and leave the experts out, e.g. "
                       "target_modules=[\"q_proj\", \"v_proj\", \"o_proj\"] on a MoE model.")


def _plan(base_model: nn.Module, name: str) -> str | None:
    """The model's TP plan entry for module ``name`` (layer numbers as ``*``), as transformers applied it."""
    plan = getattr(base_model, "tp_plan", None) or {}
    return plan.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name))


def _check_layer(name: str, layer: Any, adapter: str, topo: Topology, base_model: nn.Module) -> str:
    """The base layer's TP style ("none", "colwise", "rowwise"), after refusing what cannot be laid out."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper

    if isinstance(layer, ParamWrapper):
        raise _refusal(name, "adapters on parameters (fused expert tensors: target_modules matched a parameter "
                       "of an experts module)", "Leave expert projections out of target_modules (e.g. target "
                       "attention only: [\"q_proj\", \"v_proj\", \"o_proj\"]).")
    base = layer.get_base_layer()
    if topo.tp_size > 1 and not dtensor_tensor_parallel():
        raise _refusal(name, "tensor parallelism on transformers before 5.17 (TP shards are plain tensors there)",
                       "Upgrade transformers to 5.17 or newer, or load with fsdp_size instead of tp_size.")
    names = tuple(getattr(getattr(getattr(base, "weight", None), "device_mesh", None), "mesh_dim_names", None) or ())
    if {"ep", "efsdp"} & set(names):
        raise _refusal(name, f"a base layer held by the expert mesh {names}", "Leave expert modules out of "
                       "target_modules.")
    if not isinstance(layer, LoraLinear):
        if topo.tp_size == 1 and not any(getattr(p, "device_mesh", None) is not None for p in base.parameters()):
            return "none"
        raise _refusal(name, f"LoRA on a sharded {type(base).__name__} (only nn.Linear bases are laid out)",
                       "Target Linear projections only (target_modules=[\"q_proj\", ...]).")
    style = _tp_style(base.weight, topo)
    plan = _plan(base_model, name) if topo.tp_size > 1 else None
    if plan is not None and plan not in ("colwise", "rowwise"):
        raise _refusal(name, f"a base layer with tensor-parallel plan {plan!r}", "Only \"colwise\" and "
                       "\"rowwise\" plans are supported: leave this module out of target_modules, or load with "
                       "fsdp_size instead of tp_size.")
    if style not in ("none", "colwise", "rowwise") or (plan or "none") != style:
        raise _refusal(name, f"a tensor-parallel base layer laid out as {style} (plan {plan!r})",
                       "Only colwise and rowwise TP plans are supported: leave this module out of target_modules, "
                       "or load with fsdp_size instead of tp_size.")
    if style == "rowwise" and layer.lora_bias.get(adapter, False):
        raise _refusal(name, "lora_bias=True on a rowwise base", "Use lora_bias=False.")
    found = (_placement_name(layer.lora_A[adapter].weight), _placement_name(layer.lora_B[adapter].weight))
    whole = (layer.lora_A[adapter].weight.shape == (layer.r[adapter], layer.in_features)
             and layer.lora_B[adapter].weight.shape == (layer.out_features, layer.r[adapter])
             and (layer.in_features, layer.out_features) == (base.weight.shape[1], base.weight.shape[0]))
    if found != ("replicated", "replicated") or not whole:
        raise _refusal(name, f"factors peft already laid out (lora_A {found[0]}, lora_B {found[1]}, sized "
                       f"{layer.in_features}x{layer.out_features} for a {tuple(base.weight.shape)} base)",
                       "Add adapters after shardadopt.enable(), or inside shardadopt.adapters.global_adapter_shapes() "
                       "followed by lay_out_adapters(model).")
    return style


def _adapter_modules(layer: Any, adapter: str) -> list[nn.Module]:
    """The trainable modules of ``adapter`` on ``layer``: its LoRA factors and, with DoRA, its magnitude vector
    (one entry per output feature)."""
    modules = [layer.lora_A[adapter], layer.lora_B[adapter]]
    if adapter in layer.lora_magnitude_vector:
        modules.append(layer.lora_magnitude_vector[adapter])
    return modules


def _laid_out(layer: Any, adapter: str) -> bool:
    return bool(layer.lora_A[adapter].__dict__.get(_LAID_OUT))


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def _peft_configs(model: nn.Module) -> dict[str, Any]:
    """adapter name -> LoraConfig, from whichever peft wrapper holds them (empty for a bare transformers model)."""
    return dict(getattr(model, "peft_config", None) or {})


# TP plans under which a module computes what its plain copy computes from the same (replicated) input
_WHOLE_OUTPUT_PLANS = (None, "colwise_gather_output")


def whole_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` (peft's ``modules_to_save``) with every sharded parameter whole and plain (collective)
    and without transformers' TP forwards: a replicated trainable module, like the LoRA factors. peft's own
    ``copy.deepcopy`` cannot copy the shards (FSDP's and TP's DTensors), and a copied TP forward would still run
    the original module."""
    import copy

    memo: dict[int, Any] = {id(p): nn.Parameter(_full(p).clone(), requires_grad=p.requires_grad)
                            for p in module.parameters() if getattr(p, "device_mesh", None) is not None}
    whole = copy.deepcopy(module, memo)
    for sub in whole.modules():
        sub.__dict__.pop("forward", None)  # transformers installs TP forwards as instance attributes
    return whole


def refuse_fsdp_unit_copy(module: nn.Module) -> None:
    """Refuse ``modules_to_save`` of a module that is (or holds) an FSDP unit of its own: FSDP refuses to be copied,
    and the copy would have to leave FSDP."""
    from torch.distributed.fsdp import FSDPModule

    units = [n or type(module).__name__ for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    if units:
        raise _refusal(None, f"modules_to_save of a module that is an FSDP unit of its own ({units})", "Save only "
                       "modules inside a larger FSDP unit (lm_head, a score head), or target this module's Linear "
                       "layers with LoRA instead.")


def _modules_to_save(model: nn.Module, topo: Topology, base_model: nn.Module) -> list[nn.Module]:
    """The trainable copies of ``modules_to_save`` (their parameters averaged over the data-parallel ranks), after
    refusing those that are not whole copies or whose TP plan changes what the module outputs."""
    from peft.utils.other import ModulesToSaveWrapper

    copies = []
    for name, wrapper in base_model.named_modules():
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        for sub, _ in wrapper.original_module.named_modules():
            plan = _plan(base_model, f"{name}.{sub}".rstrip(".")) if topo.tp_size > 1 else None
            if plan not in _WHOLE_OUTPUT_PLANS:
                raise _refusal(name, f"modules_to_save of a module with tensor-parallel plan {plan!r} (its copy "
                               "would compute on whole weights what the model expects sharded)", "Save only "
                               "modules that are not tensor parallel or gather their output (lm_head, a score "
                               "head), or target this module's Linear layers with LoRA instead.")
        for adapter, copied in wrapper.modules_to_save.items():
            sharded = [n for n, p in copied.named_parameters() if getattr(p, "device_mesh", None) is not None]
            if sharded:
                raise _refusal(name, f"modules_to_save copy {adapter!r} holding shards ({sharded})", "Add "
                               "adapters after shardadopt.enable() (peft's copy of a sharded module is not whole).")
            copies.append(copied)
    return copies


def _full(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _set_from_rank0(param: nn.Parameter) -> None:
    """Make the whole (not yet sharded) ``param`` global rank 0's value on every rank."""
    with torch.no_grad():
        dist.broadcast(param.data, src=0)


def _tp_mesh(weight: Any) -> Any:
    mesh = weight.device_mesh
    return mesh["tp"] if mesh.ndim > 1 else mesh


def _shard_factor(factor: nn.Module, style: str, mesh: Any) -> None:
    """Shard the whole, identical-on-every-rank ``factor`` like its base layer and install transformers' own TP
    forward for ``style`` on it (what peft's DTensor TP does, on the global shape: each rank keeps its slice)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    tp_style = ALL_PARALLEL_STYLES[style]
    for name, _ in list(factor.named_parameters(recurse=False)):
        tp_style.shard_param(factor, name, mesh)
    tp_style.install_forward(factor, mesh)


def whole_weight(weight: Any) -> Any:
    """``weight`` whole (collective for a DTensor): what peft's DoRA computes the initial magnitude from."""
    return _full(weight) if getattr(weight, "device_mesh", None) is not None else weight


def _lay_out_dora(dora: nn.Module, style: str, mesh: Any) -> None:
    """DoRA on a tensor-parallel base: the magnitude (identical on every rank, one entry per output feature) is
    sharded like the output features on a colwise base and stays whole on a rowwise one; its forward computes the
    weight norm from the local shards (:func:`_tensor_parallel_dora`). On FSDP (and HSDP, EP's attention) nothing
    changes: peft's forward runs inside FSDP's, on the unsharded weight."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if style == "colwise":
        magnitude = dora.weight
        dora.weight = nn.Parameter(distribute_tensor(magnitude.data, mesh, [Shard(0)], src_data_rank=None),
                                   requires_grad=magnitude.requires_grad)
    dora.forward = functools.partial(_tensor_parallel_dora, dora, style, mesh.get_group())


def _local_tensor(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensor_parallel_dora(dora: nn.Module, style: str, tp_group: Any, x: torch.Tensor, *, lora_A: nn.Module,
                          lora_B: nn.Module, scaling: float, base_layer: nn.Module,
                          base_result: torch.Tensor | None = None, adapter_name: str = "default") -> torch.Tensor:
    """peft's ``DoraLinearLayer.forward`` on a TP base, on this rank's shards: the weight norm runs over the input
    dim of W + scaling * B @ A, whole rows on a colwise base (this rank's output features), partial sums of squares
    added over the TP group on a rowwise one; like peft, the norm is detached (DoRA paper, section 4.3)."""
    weight = _local_tensor(base_layer.weight).to(x.dtype)
    with torch.no_grad():
        combined = weight + scaling * (_local_tensor(lora_B.weight) @ _local_tensor(lora_A.weight)).to(x.dtype)
        if style == "colwise":
            norm = torch.linalg.norm(combined, dim=1)
        else:
            squares = combined.pow(2).sum(dim=1)
            dist.all_reduce(squares, group=tp_group)
            norm = squares.sqrt()
    scale = (_local_tensor(dora.weight) / norm).view(1, -1)
    if base_result is None:  # lora_dropout in training: peft passes the dropped-out input, the base reruns on it
        base_result = base_layer(x)
    bias = getattr(base_layer, "bias", None)
    if bias is not None:  # on this rank's output features (colwise) or all of them (rowwise: replicated)
        base_result = base_result - _local_tensor(bias)
    return (scale - 1) * base_result + scale * lora_B(lora_A(x)) * scaling


_groups: dict[tuple, Any] = {}


def _dp_group(topo: Topology) -> Any:
    """The process group of this rank's data-parallel peers (same tp rank), None for the whole world."""
    if topo.tp_size == 1:
        return None
    tp_ranks: list[int] = [0] * topo.world_size
    dist.all_gather_object(tp_ranks, topo.tp_rank)
    members = tuple(tuple(r for r, t in enumerate(tp_ranks) if t == tp) for tp in range(topo.tp_size))
    key = (id(upstream.default_group()), members)
    if key not in _groups:
        _groups[key] = dist.new_subgroups_by_enumeration([list(m) for m in members])[0]
    return _groups[key]


def _fsdp_syncing(fsdp_modules: list[nn.Module]) -> bool:
    """False inside FSDP2 ``no_sync`` (``set_requires_gradient_sync(False)``), where reductions wait."""
    for module in fsdp_modules:
        for group in upstream.fsdp_param_groups(module):
            return bool(group.reduce_grads)
    return True


def _average_over_dp(param: nn.Parameter, group: Any, dp_size: int, fsdp_modules: list[nn.Module]) -> None:
    from torch.distributed.tensor import DTensor

    if getattr(param, _HOOKED, None) is not None:
        return

    def average(p: torch.Tensor) -> None:
        if p.grad is None or not _fsdp_syncing(fsdp_modules):
            return
        grad = upstream.dtensor_local(p.grad) if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=group)
        grad.div_(dp_size)

    # Frozen factors too (an inactive adapter: set_adapter makes it trainable later, after prepare): torch hooks
    # only parameters that require grad, and the hook stays registered while the flag changes.
    frozen = not param.requires_grad
    param.requires_grad_(True)
    try:
        setattr(param, _HOOKED, param.register_post_accumulate_grad_hook(average))
    finally:
        param.requires_grad_(not frozen)


def lay_out_adapters(model: nn.Module) -> int:
    """Lay out every LoRA adapter of ``model`` (a PeftModel, peft tuner or transformers model holding LoRA layers)
    that is not laid out yet; returns the number of (layer, adapter) pairs laid out. Collective: every rank, in the
    same order. A model that is not sharded is left alone (returns 0). Raises :class:`AdapterLayoutError`."""
    from torch.distributed.fsdp import FSDPModule

    base = _base_model(model)
    topo = topology(base)
    if not topo.is_sharded:
        return 0
    copies = _modules_to_save(model, topo, base)
    for config in _peft_configs(model).values():
        check_config(config)
    group = _dp_group(topo) if topo.dp_size > 1 else None
    fsdp_modules = [m for m in base.modules() if isinstance(m, FSDPModule)][:1]
    done = 0
    for name, layer in _lora_layers(base):
        for adapter in [a for a in layer.lora_A if not _laid_out(layer, a)]:
            style = _check_layer(name, layer, adapter, topo, base)
            for factor in _adapter_modules(layer, adapter):
                for param in factor.parameters():
                    if param.is_meta:
                        raise _refusal(name, "adapters created on the meta device (low_cpu_mem_usage=True)",
                                       "Load the adapter with low_cpu_mem_usage=False.")
                    _set_from_rank0(param)
            if style != "none":
                _shard_factor(layer.lora_B[adapter] if style == "colwise" else layer.lora_A[adapter], style,
                              _tp_mesh(layer.get_base_layer().weight))
                if adapter in layer.lora_magnitude_vector:
                    _lay_out_dora(layer.lora_magnitude_vector[adapter], style, _tp_mesh(layer.get_base_layer().weight))
            layer.lora_A[adapter].__dict__[_LAID_OUT] = True
            done += 1
        if topo.dp_size > 1:
            layer.__dict__[_DP] = (group, topo.dp_size, fsdp_modules)
            _hook_trainable(layer)
    for copied in copies:
        if topo.dp_size > 1:
            copied.__dict__[_DP] = (group, topo.dp_size, fsdp_modules)
        _hook_copy(copied)
    return done


def _hook_copy(copied: nn.Module) -> None:
    """Average the gradients of a trainable ``modules_to_save`` copy over the data-parallel group."""
    dp = copied.__dict__.get(_DP)
    if dp is not None:
        for param in copied.parameters():
            _average_over_dp(param, *dp)


def _hook_trainable(layer: Any) -> None:
    """Average the gradients of ``layer``'s LoRA factors over the data-parallel group, frozen ones included (an
    inactive adapter that ``set_adapter`` makes trainable later; a hook fires only when a gradient arrives)."""
    dp = layer.__dict__.get(_DP)
    if dp is None:
        return
    for adapter in [a for a in layer.lora_A if _laid_out(layer, a)]:
        for factor in _adapter_modules(layer, adapter):
            for param in factor.parameters():
                _average_over_dp(param, *dp)


def check_adapters(model: nn.Module) -> None:
    """Refuse (:class:`AdapterLayoutError`) a sharded model holding LoRA adapters that were not laid out by
    :func:`lay_out_adapters`, or ``modules_to_save`` of sharded modules; hook the data-parallel averaging of factor
    parameters that have none (replaced after they were laid out). Local: no collective."""
    try:
        from peft.tuners.lora import LoraLayer  # noqa: F401
    except ImportError:
        return
    base = _base_model(model)
    topo = topology(base)
    if not topo.is_sharded:
        return
    for copied in _modules_to_save(model, topo, base):
        _hook_copy(copied)
    for name, layer in _lora_layers(base):
        missing = [a for a in layer.lora_A if not _laid_out(layer, a)]
        if missing:
            raise AdapterLayoutError(
                f"LoRA adapter(s) {missing} on {name} of a model sharded at load time were added without shardadopt "
                f"laying them out ({topo.describe()}): their gradients would not be reduced over the data-parallel "
                f"ranks, or the first forward would crash. Call shardadopt.enable() before get_peft_model / "
                f"PeftModel.from_pretrained / add_adapter, or call shardadopt.adapters.lay_out_adapters(model) on "
                f"every rank right after adding them.")
        _hook_trainable(layer)


def adapter_parameters(model: nn.Module) -> set[int]:
    """The ``id`` of every parameter peft holds per adapter in ``model``, active or not (LoRA factors, DoRA
    magnitudes, ``modules_to_save`` copies, trainable tokens): what an adapter run trains, at one time or another,
    as opposed to the frozen base. Empty without peft."""
    import sys

    if "peft" not in sys.modules:
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    found: set[int] = set()
    for module in model.modules():
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            for name in module.adapter_layer_names:  # dotted for trainable tokens: "token_adapter.<dict>"
                holder: Any = module
                for part in name.split("."):
                    holder = getattr(holder, part, None)
                if isinstance(holder, nn.Module):
                    found.update(id(p) for p in holder.parameters())
    return found


# -- export --------------------------------------------------------------------------------------------------------

def full_adapter_tensors(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with every LoRA factor as its full tensor (the sharded base weights as they are:
    nothing of them is gathered); what ``PeftModel.save_pretrained(state_dict=...)`` filters. Collective."""
    return {k: _full(v) if "lora_" in k else v for k, v in model.state_dict().items()}


def adapter_state_dict(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The full tensors of adapter ``adapter_name`` in PEFT's format (keys as ``save_pretrained`` writes them), on
    every rank. Collective for sharded models."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(
        model, state_dict=full_adapter_tensors(model), adapter_name=adapter_name).items()}
