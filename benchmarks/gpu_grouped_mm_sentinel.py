"""F2 on a real GPU: the expert-parallel grouped_mm forward with and without the per-GEMM sentinel masks.

    python benchmarks/gpu_grouped_mm_sentinel.py [--steps 3] [--dtype bfloat16]

Needs one CUDA GPU (SM80+) and torch + transformers; no process group. One rank's view of expert parallelism over 2
ranks: a Qwen3-MoE experts module holding 2 local experts gets routing with sentinel slots (local id
``num_experts``, weight 0) for the experts of the other rank, exactly what transformers 5.15/5.16's router hook
produces. Before each step the CUDA caching allocator is filled with NaN and released, so memory that
``torch._grouped_mm`` leaves unwritten (the rows beyond ``offsets[-1]``) reads as NaN, as reused memory does from a
real run's second step on.

For each step it prints, for upstream's installed ``grouped_mm_experts_forward`` and for
``shardadopt.parallel.moe.grouped_mm_experts_forward`` (the 5.17 fix), whether the output, the hidden-state gradient,
the expert weight gradients and the routing-weight gradient are finite, and the max |difference| against a dense
per-expert reference on the local slots. Upstream 5.15/5.16 is expected to give a NaN routing-weight gradient at
the sentinel slots (which the experts' all-reduce then spreads to every rank); the fix gives zeros there.
"""

from __future__ import annotations

import argparse
import sys


def poison_allocator(nbytes: int) -> None:
    import torch

    junk = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del junk  # the block goes back to the caching allocator with NaN in it


def build_experts(dtype):
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from shardadopt import upstream

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=2, num_experts_per_tok=2,
                            experts_implementation="grouped_mm")
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(device="cuda", dtype=dtype)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.05)
    upstream.set_experts_expert_parallel(experts, True)  # read by transformers >= 5.18; 5.15/5.16 mask unconditionally
    return experts


def routing(num_tokens: int, num_local: int, dtype, seed: int):
    """Global top-2 over 4 experts on 2 ranks, seen by rank 0: experts 2-3 become the sentinel ``num_local``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    global_ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, 2, generator=generator), dim=-1)
    remote = global_ids >= num_local
    local_ids = global_ids.masked_fill(remote, num_local)
    return local_ids.cuda(), weights.masked_fill(remote, 0.0).to(device="cuda", dtype=dtype)


def dense_reference(experts, hidden, ids, weights):
    import torch

    out = torch.zeros_like(hidden, dtype=torch.float32)
    for expert in range(experts.num_experts):
        token, slot = torch.where(ids == expert)
        gate, up = (hidden[token].float() @ experts.gate_up_proj[expert].float().T).chunk(2, dim=-1)
        value = (experts.act_fn(gate) * up) @ experts.down_proj[expert].float().T
        out.index_add_(0, token, value * weights[token, slot, None].float())
    return out


def run_once(forward, experts, hidden, ids, weights):
    import torch

    for param in experts.parameters():
        param.grad = None
    hidden = hidden.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    out = forward(experts, hidden, ids, weights)
    out.float().square().sum().backward()
    sentinel = ids == experts.num_experts
    return {
        "output": out.detach(),
        "finite": {
            "output": bool(torch.isfinite(out).all()),
            "d_hidden": bool(torch.isfinite(hidden.grad).all()),
            "d_gate_up_proj": bool(torch.isfinite(experts.gate_up_proj.grad).all()),
            "d_down_proj": bool(torch.isfinite(experts.down_proj.grad).all()),
            "d_routing_weights": bool(torch.isfinite(weights.grad).all()),
        },
        "d_routing_weights_at_sentinels": weights.grad[sentinel].float().abs().max().item() if sentinel.any() else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers.integrations import moe as upstream_moe

    from shardadopt import upstream
    from shardadopt.parallel.moe import grouped_mm_experts_forward as fixed

    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the real CUDA grouped GEMM kernel", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    experts = build_experts(dtype)
    hidden = torch.randn(args.tokens, experts.gate_up_proj.shape[-1], device="cuda", dtype=dtype)
    ids, weights = routing(args.tokens, experts.num_experts, dtype, seed=0)
    offs = torch.tensor([args.tokens, args.tokens], dtype=torch.int32, device="cuda")
    real_kernel = upstream.moe_can_use_grouped_mm(hidden, experts.gate_up_proj, offs)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}, "
          f"{args.dtype}; upstream uses the real grouped_mm kernel: {real_kernel}")
    reference = dense_reference(experts, hidden, ids, weights)
    print(f"{ids.eq(experts.num_experts).sum().item()} of {ids.numel()} slots are sentinels (other rank's experts)")

    ok = True
    for step in range(1, args.steps + 1):
        for label, forward in (("upstream", upstream_moe.grouped_mm_experts_forward), ("shardadopt", fixed)):
            poison_allocator(256 * 1024 * 1024)
            result = run_once(forward, experts, hidden, ids, weights)
            diff = (result["output"].float() - reference).abs().max().item()
            bad = [name for name, finite in result["finite"].items() if not finite]
            print(f"step {step} {label:>10}: non-finite: {bad or 'none'}; max |out - dense| {diff:.3e}; "
                  f"max |d_routing_weight| at sentinel slots {result['d_routing_weights_at_sentinels']:.3e}")
            if label == "shardadopt":
                ok &= not bad and result["d_routing_weights_at_sentinels"] == 0.0
    print("fixed path clean on every step" if ok else "fixed path produced non-finite or leaking gradients")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
