"""Tensor parallelism: sum a replicated parameter's partial gradient over the TP group, once per backward.

transformers' TP style ``replicated_with_grad_allreduce`` keeps a parameter whole on every TP rank while its
gradient is partial: Qwen3's per-head ``q_norm``/``k_norm`` sit between a colwise and a rowwise projection and only
see this rank's heads. Upstream (5.15 .. 5.25 at least) all-reduces the parameter's *accumulated* ``.grad`` after
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

__all__ = ["install_replicated_grad_allreduce", "fix_tp_grad_accumulation", "has_upstream_replicated_hooks",
           "install_partial_gradient_sums",
           "localize_padding_idx", "stash_rowwise_bias", "add_stashed_bias"]

# Upstream's installer lives on this class in every release since 5.15; its hooks are recognised by qualname.
_UPSTREAM_STYLE = "ReplicatedWithGradAllReduce."
_MARK = "_shardadopt_grad_allreduce"
_PARTIAL_MARK = "_shardadopt_partial_gradient_sums"
# A parameter's gradient copies on the TP ranks differ by more than this (relative to the largest element of their
# mean): partial. Copies of a whole gradient differ by reduction-order noise (~1e-7) or not at all; partial ones
# (each rank saw only its own heads or features) differ by order one.
PARTIAL_THRESHOLD = 1e-4


def _group(mesh: Any) -> Any:
    """The process group of a 1-D device mesh, or ``mesh`` itself when it already is a group."""
    return mesh.get_group() if hasattr(mesh, "get_group") else mesh


def install_replicated_grad_allreduce(module: nn.Module, mesh: Any) -> nn.Module:
    """Sum the gradients of ``module``'s own parameters over ``mesh`` (a 1-D DeviceMesh or a ProcessGroup), each
    backward's contribution once, so that accumulating several backwards gives the sum of the full gradients.

    The hooks go on the parameters the module holds when it runs forward with autograd recording (loading or FSDP
    swap parameters in later), once per parameter object. Idempotent per module.

    Args:
        module: the module whose own (non-recursive) parameters are replicated over ``mesh``.
        mesh: the tensor-parallel group: a 1-D ``DeviceMesh`` or a ``ProcessGroup``.

    Returns:
        ``module``, hooked.
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
    for inner in closure.values():  # 5.21+: the forward wrapper / pre-hook closes over the gradient hook (the mesh)
        if _is_upstream(inner) and "mesh" in _closure(inner):
            return _closure(inner)["mesh"]
    if "mesh" in closure:
        return closure["mesh"]
    defaults = getattr(function, "__defaults__", None) or ()
    mesh = next((d for d in defaults if hasattr(d, "get_group")), None)
    return mesh if mesh is not None else upstream.module_hf_device_mesh(module)


def _upstream_pre_hooks(module: nn.Module) -> list[int]:
    """Handle ids of transformers' forward pre-hooks (5.25+) that hook ``module``'s parameters on first use."""
    return [key for key, hook in upstream.module_forward_pre_hooks(module).items() if _is_upstream(hook)]


def fix_tp_grad_accumulation(model: nn.Module) -> int:
    """Replace transformers' ``replicated_with_grad_allreduce`` gradient hooks on an already loaded model with
    :func:`install_replicated_grad_allreduce`; returns how many modules were repaired.

    For models loaded before ``shardadopt.enable()`` (or by users who do not monkeypatch). Call it on every rank
    before the first backward that accumulates. Modules already fixed, and models without such hooks (no tensor
    parallelism, or a transformers whose hook is right), are left alone.

    Args:
        model: a model loaded with a ``DistributedConfig`` whose ``tp_size`` is above 1 (others are left alone).

    Returns:
        The number of modules whose upstream hooks were replaced.
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
        # 5.21 .. 5.24: module.forward replaced by a wrapper that registers a post-accumulate-grad hook on first use;
        # 5.25+: a forward pre-hook that does the same.
        hooked_on_first_use = False
        forward = module.__dict__.get("forward")
        if _is_upstream(forward):
            meshes.append(_upstream_mesh(module, forward))
            original = _closure(forward).get("original_forward")
            if getattr(original, "__func__", None) is type(module).forward and original.__self__ is module:
                del module.forward
            else:
                module.forward = original
            hooked_on_first_use = True
        for key in _upstream_pre_hooks(module):
            meshes.append(_upstream_mesh(module, upstream.module_forward_pre_hooks(module)[key]))
            del upstream.module_forward_pre_hooks(module)[key]
            hooked_on_first_use = True
        if hooked_on_first_use:
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


def _upstream_hooked(module: nn.Module) -> bool:
    """Whether transformers' own replicated_with_grad_allreduce hooks (any release: a full backward hook, a forward
    wrapper or a forward pre-hook) sit on ``module``."""
    return (_is_upstream(module.__dict__.get("forward")) or bool(_upstream_pre_hooks(module))
            or any(_is_upstream(hook) for hook in upstream.module_backward_hooks(module).values()))


def has_upstream_replicated_hooks(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries transformers' own ``replicated_with_grad_allreduce`` hooks (the ones
    :func:`fix_tp_grad_accumulation` replaces).

    Args:
        model: any module.

    Returns:
        True when at least one module is hooked by upstream's style.
    """
    return any(_upstream_hooked(module) for module in model.modules())


def install_partial_gradient_sums(model: nn.Module, on_partial: Callable[[str], None] | None = None) -> nn.Module:
    """Sum over the TP group the gradients of parameters that every TP rank holds whole but that see only this
    rank's shard of the activations (a parameter inside a colwise -> rowwise region that the TP plan leaves out,
    e.g. Apertus' xIELU ``mlp.act_fn.alpha_p``/``alpha_n``).

    Which ones is found by comparing, not by name: at a parameter's first backward with a non-zero gradient, its
    gradient copies on the TP ranks (which see the same batch) are compared; copies that differ (by more than
    ``PARTIAL_THRESHOLD`` relative) are partial, and from then on each backward's gradient is summed over the group
    once (so gradient accumulation stays right). Whole copies are left alone. While every rank's copy is exactly
    zero (a zero-initialised ``down_proj`` behind the parameter, a gate not yet open) nothing tells the two apart
    and the sum of the copies is zero either way, so the parameter stays undecided and is compared again at its next
    backward. The decision is the same on every rank (a MAX all-reduce). DTensor parameters (TP shards and what a
    plan placed itself), plain shards of older releases and modules hooked by ``replicated_with_grad_allreduce``
    (transformers' or :func:`install_replicated_grad_allreduce`) are not considered. ``on_partial(name)`` is called
    once per parameter found partial. Call on every rank before the first forward; a model without tensor
    parallelism is left as it is. Idempotent.

    Args:
        model: the tensor-parallel model.
        on_partial: called with a parameter's name once it is found partial.

    Returns:
        ``model``, hooked.
    """
    if getattr(model, _PARTIAL_MARK, None) is not None:
        return model
    decisions: dict[str, bool] = {}  # qualified name -> partial?

    def first_forward(root: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        getattr(root, _PARTIAL_MARK).remove()
        setattr(root, _PARTIAL_MARK, False)
        from shardadopt.parallel.topology import topology

        layout = topology(root)
        if layout.tp_size == 1:
            return
        group = layout.tp_group()
        not_whole = {n for n, p in root.named_parameters() if layout.plain_replication(p) < layout.world_size}
        for module_name, module in root.named_modules():
            # modules the plan covers are the plan's: 5.15 records its mesh on them (their whole parameters, such
            # as a tied embedding, are reduced by upstream), later releases make their parameters DTensors
            if (getattr(module, _MARK, None) is not None or _upstream_hooked(module)
                    or upstream.module_hf_device_mesh(module) is not None):
                continue
            names = [f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters(recurse=False)]
            if names and not all(n in not_whole for n in names):
                module.register_forward_pre_hook(_hook_whole_parameters(module_name, not_whole, group, decisions,
                                                                        on_partial))

    setattr(model, _PARTIAL_MARK, model.register_forward_pre_hook(first_forward))
    return model


def _is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _hook_whole_parameters(module_name: str, not_whole: set[str], group: Any, decisions: dict[str, bool],
                           on_partial: Callable[[str], None] | None) -> Callable[[nn.Module, Any], None]:
    hooked: dict[str, weakref.ref[torch.Tensor]] = {}

    def sum_if_partial(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if name not in decisions:
                partial = _differs_across(grad, group)
                if partial is None:  # zero on every rank: summed or not, it is zero; decide at a later backward
                    return grad
                decisions[name] = partial
                if partial and on_partial is not None:
                    on_partial(name)
            if not decisions[name]:
                return grad
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, group=group)
            return grad

        return hook

    def hook_parameters(module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for local_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{local_name}" if module_name else local_name
            ref = hooked.get(local_name)
            if (param.requires_grad and name not in not_whole and not _is_dtensor(param)
                    and (ref is None or ref() is not param)):
                param.register_hook(sum_if_partial(name))
                hooked[local_name] = weakref.ref(param)

    return hook_parameters


def _differs_across(grad: torch.Tensor, group: Any) -> bool | None:
    """Whether the TP ranks' copies of ``grad`` differ, or None when every copy is exactly zero (no evidence either
    way); a collective on ``group``, the same answer everywhere."""
    local = grad.detach().float()
    mean = local.clone()
    dist.all_reduce(mean, group=group)
    mean /= dist.get_world_size(group)
    spread = torch.stack([(local - mean).abs().max(), mean.abs().max()]) if local.numel() else torch.zeros(2)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    if not spread.any():  # no deviation and a zero mean: every copy is zero (+x/-x copies deviate: partial)
        return None
    return bool(spread[0] > PARTIAL_THRESHOLD * spread[1])


_GLOBAL_PADDING = "_shardadopt_global_padding_idx"
_STASHED_BIAS = "_shardadopt_rowwise_bias"


def localize_padding_idx(embedding: nn.Module, rank: int) -> None:
    """Make a vocab-parallel embedding's ``padding_idx`` index this rank's shard of the table.

    A vocabulary shard of ``n`` rows holds global rows ``rank * n`` .. ``rank * n + n - 1`` at local rows 0 ..
    ``n - 1``. ``nn.Embedding`` zeroes the gradient of row ``padding_idx`` and ``F.embedding`` refuses one past the
    table, so the global id kept on every rank gives rank 1's first real token no gradient (the padding id being 0)
    or raises (a padding id beyond the shard). The global id is remembered on the module; ranks whose shard does not
    hold it get None. Idempotent.

    Args:
        embedding: a vocab-parallel embedding holding this rank's rows of the table.
        rank: this rank's index in the tensor-parallel group.
    """
    global_idx = embedding.__dict__.setdefault(_GLOBAL_PADDING, getattr(embedding, "padding_idx", None))
    if global_idx is None:
        return
    rows = embedding.weight.shape[0]
    start = rank * rows
    embedding.padding_idx = global_idx - start if start <= global_idx < start + rows else None


def stash_rowwise_bias(module: nn.Module) -> None:
    """Before a rowwise projection's forward: take its bias out of the matmul (it must be added once, after the
    all-reduce), without renaming the parameter (kept outside ``_parameters`` for this forward only).

    Args:
        module: the rowwise projection about to run forward.
    """
    bias = getattr(module, "bias", None)
    if isinstance(bias, nn.Parameter):
        module.__dict__[_STASHED_BIAS] = bias
        module.bias = None  # a registered parameter set to None stays registered under its name


def add_stashed_bias(module: nn.Module, outputs: torch.Tensor) -> torch.Tensor:
    """After the all-reduce of a rowwise projection: add the stashed bias once and put the parameter back.

    Args:
        module: the rowwise projection whose bias :func:`stash_rowwise_bias` stashed.
        outputs: its all-reduced output.

    Returns:
        ``outputs`` plus the bias (``outputs`` as they are when nothing was stashed).
    """
    bias = module.__dict__.pop(_STASHED_BIAS, None)
    if bias is None:
        return outputs
    module.bias = bias
    return outputs + bias
