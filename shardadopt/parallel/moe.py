"""Expert-parallel correctness for MoE models sharded at load time on transformers 5.15 / 5.16.

Two fixes that upstream made in transformers#48205 (released in 5.17), as plain functions:

- :func:`grouped_mm_experts_forward`: the ``grouped_mm`` experts forward with the sentinel-tail rows masked after
  *each* grouped GEMM. Under expert parallelism the slots routed to another rank's experts are sorted to the tail,
  beyond ``offsets[-1]``, and ``torch._grouped_mm`` leaves those output rows (forward output and backward
  ``d_input``) undefined: uninitialised memory, NaN/Inf on CUDA and now and then on CPU. 5.15/5.16 mask only the
  input and the weighted output, so NaN/Inf from those rows reaches the routing-weight gradient (``0 * NaN``) and,
  through the experts' gradient all-reduce, every rank's gradients.
- :func:`sum_router_score_grad`: under expert parallelism each rank zeroes the routing scores of experts it does not
  own, so in backward its score gradient covers only its own experts' slots. Summing the score gradient over the EP
  group *before* that mask gives every rank the full gradient (each slot has exactly one owning rank, so the sum is
  exact); without it the router gate and every parameter upstream of an MoE block get partial, rank-dependent
  gradients.

And one fix from transformers 5.23 (FSDP over the experts):

- :func:`fix_single_rank_expert_grad_divide`: transformers 5.19 .. 5.22 shard the dispatched experts over the
  ``efsdp`` mesh with ``set_gradient_divide_factor(fsdp_size)`` and ``set_force_sum_reduction_for_comms(True)``
  (5.19 / 5.20.1 only on non-NCCL backends). When ``efsdp_size == 1`` (``ep_size == fsdp_size``) FSDP2 does no
  reduce-scatter: its single-rank path already divides by the factor, and the forced sum divides by it again
  afterwards, so every expert gradient is ``1 / fsdp_size`` of the right value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardadopt import upstream

__all__ = ["fix_single_rank_expert_grad_divide", "grouped_mm_experts_forward", "is_expert_parallel",
           "sum_router_score_grad"]


def is_expert_parallel(experts: torch.nn.Module) -> bool:
    """Whether an experts module was sharded by expert at load time (its routing carries sentinel slots).

    Args:
        experts: an experts module of a MoE model.

    Returns:
        True when it holds this rank's experts of an expert-parallel load.
    """
    flag = upstream.experts_is_expert_parallel(experts)  # set by upstream from 5.18
    if flag is not None:
        return bool(flag)
    distributed = getattr(getattr(experts, "config", None), "distributed_config", None)
    return bool(getattr(distributed, "enable_expert_parallel", False)) and (getattr(distributed, "tp_size", 1) or 1) > 1


def grouped_mm_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor, *, grouped_linear: Callable[..., torch.Tensor] | None = None
                               ) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` with the sentinel-tail rows zeroed after each grouped GEMM.

    A faithful port of the transformers 5.17 function (transformers#48205). ``grouped_linear`` defaults to the
    installed ``transformers.integrations.moe._grouped_linear``, so the kernel choice stays upstream's.

    Args:
        self: the experts module (the function replaces its ``forward``).
        hidden_states: the tokens routed to this rank, ``(tokens, hidden)``.
        top_k_index: the expert index of each token's routing slots (sentinel slots included).
        top_k_weights: the routing weight of each slot.
        grouped_linear: the grouped GEMM to call (default: the installed transformers').

    Returns:
        The experts' weighted output per token, as upstream's function returns it.
    """
    if grouped_linear is None:
        grouped_linear = upstream.moe_grouped_linear()

    device = hidden_states.device
    num_top_k = top_k_index.size(-1)
    num_tokens = hidden_states.size(0)
    hidden_dim = hidden_states.size(-1)

    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)

    expert_ids_g, perm = torch.sort(expert_ids)
    selected_hidden_states_g = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]

    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)

    # Sentinel slots (experts owned by another rank) sort to the tail; the grouped GEMM skips those rows and leaves
    # them undefined in its output and in its backward d_input, so each GEMM's output is masked right away.
    sentinel_mask = (expert_ids_g >= self.num_experts).unsqueeze(-1)
    expert_ids_g.clamp_(max=self.num_experts - 1)

    if self.has_gate:
        selected_weights = self.gate_up_proj
        selected_biases = self.gate_up_proj_bias[expert_ids_g] if self.has_bias else None
    else:
        selected_weights = self.up_proj
        selected_biases = self.up_proj_bias[expert_ids_g] if self.has_bias else None

    # Pre-mask: its backward zeroes the undefined d_input rows of the up GEMM before they scatter into d_hidden.
    selected_hidden_states_g.masked_fill_(sentinel_mask, 0.0)

    proj_out = grouped_linear(selected_hidden_states_g, selected_weights, offsets, bias=selected_biases,
                              is_transposed=self.is_transposed)
    proj_out = proj_out.masked_fill(sentinel_mask, 0.0)

    proj_out = upstream.experts_apply_gate(self, proj_out) if self.has_gate else self.act_fn(proj_out)

    selected_biases = self.down_proj_bias[expert_ids_g] if self.has_bias else None
    proj_out = grouped_linear(proj_out, self.down_proj, offsets, bias=selected_biases,
                              is_transposed=self.is_transposed)
    proj_out = proj_out.masked_fill(sentinel_mask, 0.0)

    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)

    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=device)
    weighted_out = weighted_out[inv_perm]

    final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final_hidden_states.to(hidden_states.dtype)


class _SumOverGroupBackward(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over a process group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def sum_router_score_grad(router_scores: torch.Tensor, ep_mesh: Any) -> torch.Tensor:
    """``router_scores`` unchanged, whose gradient is summed over the EP group in backward.

    Apply it to the router's scores before the non-local mask. Only with autograd recording (inference pays no
    collective) and only for a group of more than one rank.

    Args:
        router_scores: the router's scores.
        ep_mesh: the expert-parallel mesh (1-D), whose group the gradient is summed over.

    Returns:
        ``router_scores`` itself when no sum is needed, else the same values with the summing backward.
    """
    if not (torch.is_grad_enabled() and router_scores.requires_grad) or ep_mesh.size() == 1:
        return router_scores
    return _SumOverGroupBackward.apply(router_scores, ep_mesh.get_group())


def fix_single_rank_expert_grad_divide(model: torch.nn.Module) -> list[str]:
    """Stop FSDP2 dividing twice the gradients of modules sharded over a one-rank mesh; returns their names.

    For every ``fully_shard``-ed submodule with a gradient divide factor, forced sum reduction, and a reduce-scatter
    group of one rank (no reduce-scatter happens), turn the forced sum off: FSDP2's single-rank copy divides by the
    factor once, and nothing else does (with a replicate all-reduce the reduce op is then a plain SUM). This is what
    transformers 5.23 does by setting the forced sum only when ``efsdp_size > 1``. Call it after the model is sharded
    and before its first backward; modules with a reduce-scatter over several ranks are left alone.

    Args:
        model: a model sharded with ``fully_shard`` (expert parallelism with FSDP).

    Returns:
        The names of the submodules whose forced sum reduction was turned off.
    """
    from torch.distributed.fsdp import FSDPModule

    fixed = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = upstream.fsdp_param_groups(module)
        if groups and all(group.force_sum_reduction_for_comms and group.gradient_divide_factor is not None
                          and getattr(group.mesh_info, "shard_mesh_size", None) == 1 for group in groups):
            module.set_force_sum_reduction_for_comms(False)
            fixed.append(name)
    return fixed
