"""Tensor parallelism: sum a replicated parameter's partial gradient over the TP group, once per backward.

transformers' TP style ``replicated_with_grad_allreduce`` keeps a parameter whole on every TP rank while its
gradient is partial: Qwen3's per-head ``q_norm``/``k_norm`` sit between a colwise and a rowwise projection and only
see this rank's heads. Upstream (5.15 .. 5.24 at least) all-reduces the parameter's *accumulated* ``.grad`` after
every backward, so with gradient accumulation every earlier micro-batch's gradient is summed over the group again
on each later backward (2 micro-batches on a tiny Qwen3: those gradients 58-110 % off).

:func:`install_replicated_grad_allreduce` reduces only what each backward adds: a hook on the gradient flowing
into the parameter (a tensor hook on the leaf runs once per backward, before accumulation), registered on the
first forward that records autograd, because loading replaces the parameters after TP is set up.
:func:`fix_tp_grad_accumulation` swaps upstream's hook for this one on a model that is already loaded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardadopt import upstream

__all__ = ["install_replicated_grad_allreduce", "fix_tp_grad_accumulation"]

# Upstream's installer lives on this class in every release since 5.15; its hooks are recognised by qualname.
_UPSTREAM_STYLE = "ReplicatedWithGradAllReduce."
_MARK = "_shardadopt_grad_allreduce"


def _group(mesh: Any) -> Any:
    """The process group of a 1-D device mesh, or ``mesh`` itself when it already is a group."""
    return mesh.get_group() if hasattr(mesh, "get_group") else mesh


def install_replicated_grad_allreduce(module: nn.Module, mesh: Any) -> nn.Module:
    """Sum the gradients of ``module``'s own parameters over ``mesh`` (a 1-D DeviceMesh or a ProcessGroup), each
    backward's contribution once, so that accumulating several backwards gives the sum of the full gradients.

    The hooks go on the parameters the module holds when it runs forward with autograd recording (loading or FSDP
    swap parameters in later), once per parameter object. Idempotent per module.
    """
    if getattr(module, _MARK, None) is not None:
        return module
    group = _group(mesh)
    if dist.get_world_size(group) == 1:
        return module  # a gradient summed over one rank is already whole
    hooked: dict[str, weakref.ref[torch.Tensor]] = {}  # name -> the parameter object that carries the hook

    def reduce_new_gradient(grad: torch.Tensor) -> torch.Tensor:
        # A fresh tensor: the incoming gradient may be shared with other autograd buffers.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=group)
        return grad

    def hook_parameters(mod: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for name, param in mod.named_parameters(recurse=False):
            ref = hooked.get(name)
            if param.requires_grad and (ref is None or ref() is not param):
                param.register_hook(reduce_new_gradient)
                hooked[name] = weakref.ref(param)

    setattr(module, _MARK, module.register_forward_pre_hook(hook_parameters))
    return module


def _closure(function: Callable[..., Any]) -> dict[str, Any]:
    code = getattr(function, "__code__", None)
    cells = getattr(function, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars if code else (), cells)}


def _is_upstream(function: Any) -> bool:
    return getattr(function, "__qualname__", "").startswith(_UPSTREAM_STYLE)


def _upstream_mesh(module: nn.Module, function: Callable[..., Any]) -> Any:
    """The TP mesh an upstream hook reduces over: a closure variable (5.16+), a default argument (5.15), or the
    mesh 5.15 records on the module."""
    closure = _closure(function)
    for inner in closure.values():  # 5.21+: the forward wrapper closes over the gradient hook, which has the mesh
        if _is_upstream(inner) and "mesh" in _closure(inner):
            return _closure(inner)["mesh"]
    if "mesh" in closure:
        return closure["mesh"]
    defaults = getattr(function, "__defaults__", None) or ()
    mesh = next((d for d in defaults if hasattr(d, "get_group")), None)
    return mesh if mesh is not None else upstream.module_hf_device_mesh(module)


def fix_tp_grad_accumulation(model: nn.Module) -> int:
    """Replace transformers' ``replicated_with_grad_allreduce`` gradient hooks on an already loaded model with
    :func:`install_replicated_grad_allreduce`; returns how many modules were repaired.

    For models loaded before ``shardadopt.enable()`` (or by users who do not monkeypatch). Call it on every rank
    before the first backward that accumulates. Modules already fixed, and models without such hooks (no tensor
    parallelism, or a transformers whose hook is right), are left alone.
    """
    repaired = 0
    for name, module in model.named_modules():
        if getattr(module, _MARK, None) is not None:
            continue
        meshes = []
        # 5.15 .. 5.20: a module full backward hook that reduces every parameter's accumulated .grad.
        for key, hook in list(upstream.module_backward_hooks(module).items()):
            if _is_upstream(hook):
                meshes.append(_upstream_mesh(module, hook))
                del upstream.module_backward_hooks(module)[key]
        # 5.21+: module.forward replaced by a wrapper that registers a post-accumulate-grad hook on first use.
        forward = module.__dict__.get("forward")
        if _is_upstream(forward):
            meshes.append(_upstream_mesh(module, forward))
            original = _closure(forward).get("original_forward")
            if getattr(original, "__func__", None) is type(module).forward and original.__self__ is module:
                del module.forward
            else:
                module.forward = original
            for param in module.parameters(recurse=False):
                hooks = upstream.post_accumulate_grad_hooks(param)
                for key in [k for k, h in hooks.items() if _is_upstream(h)]:
                    del hooks[key]
        if not meshes:
            continue
        if any(mesh is None for mesh in meshes):
            raise RuntimeError(f"{name}: found transformers' replicated_with_grad_allreduce hook but not the mesh it "
                               "reduces over; load the model after shardadopt.enable() instead")
        install_replicated_grad_allreduce(module, meshes[0])
        repaired += 1
    return repaired
