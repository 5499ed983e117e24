"""LoRA step time on a model sharded at load time against DDP on the plain model, and memory per rank, side by side.

    python benchmarks/adapter_step.py                  # 2 gloo ranks, a small llama
    python benchmarks/adapter_step.py --layout tp --rounds 5 --hidden 512

Three sides train the same global batches with the ordinary accelerate loop (``prepare``, ``accumulate``,
``backward``, ``clip_grad_norm_``, foreach AdamW, constant learning rate), alternating ``--rounds`` times in one
pool so that load on a shared machine hits them alike:

- ``ddp-full``: the plain checkpoint under DDP, every weight trained (what the adapter run replaces);
- ``ddp-lora``: the plain checkpoint under DDP with the same LoRA adapters (``get_peft_model``);
- ``sharded-lora``: the checkpoint loaded with ``DistributedConfig(fsdp_size=2)`` (or ``tp_size=2``) and the same
  adapters, with ``shardadopt.enable()``.

A step is the time between two consecutive optimizer-step ends, the slowest rank's; the first ``--warmup`` steps of
every run are dropped. It prints each side's median (and p10) step, the ratios against ``ddp-full`` and
``ddp-lora``, and per rank: the bytes of the model's local parameters and of the trainable ones with their
gradients and AdamW state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from _timing import timed_accelerate_loop, write_llama

LR = 1e-3
MAX_GRAD_NORM = 1.0
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
SIDES = ("ddp-full", "ddp-lora", "sharded-lora")


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def run_side(side: str, path: str, layout: str, steps: int, batch: int, accum: int, seq: int, vocab: int,
             rank_r: int) -> dict:
    """Optimizer-step durations and memory of one side on this rank."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import shardadopt
    from shardadopt import upstream

    shardadopt.enable()
    try:
        upstream.reset_accelerate_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
        kwargs = {"dtype": torch.float32}
        dp = dist.get_world_size()
        if side == "sharded-lora":
            from transformers.distributed import DistributedConfig

            sizes = {"fsdp_size": dp} if layout == "fsdp" else {"tp_size": dp}
            dp = dp if layout == "fsdp" else 1
            kwargs["distributed_config"] = DistributedConfig(**sizes)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if side != "ddp-full":
            torch.manual_seed(0)
            model = get_peft_model(model, LoraConfig(r=rank_r, lora_alpha=2 * rank_r, target_modules=TARGETS))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=True)
        generator = torch.Generator().manual_seed(0)
        # the same global batch on every side: dp data-parallel ranks of `batch * world // dp` rows each
        rows = torch.randint(0, vocab, (steps * accum * batch * dist.get_world_size(), seq), generator=generator)
        per_rank = batch * dist.get_world_size() // dp
        loader = torch.utils.data.DataLoader(list(rows), batch_size=per_rank)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

        def memory() -> dict[str, int]:  # after the last update: gradients and AdamW state are there
            trainable = [p for p in model.parameters() if p.requires_grad]
            return {"model": sum(_local_bytes(p) for p in model.parameters()),
                    "trainable+grads+adam": sum(_local_bytes(p) + _local_bytes(p.grad) for p in trainable)
                    + sum(_local_bytes(v) for s in optimizer.optimizer.state.values()
                          for v in s.values() if torch.is_tensor(v) and v.dim() > 0)}

        dist.barrier()
        ends, measured = timed_accelerate_loop(accelerator, model, optimizer, loader, MAX_GRAD_NORM,
                                               lambda data: {"input_ids": data, "labels": data}, memory)
        return {"steps": [b - a for a, b in zip(ends, ends[1:])], "memory": measured}
    finally:
        shardadopt.disable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=["fsdp", "tp"], default="fsdp")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the three sides (default 3)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped per run (default 3)")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank under DDP (default 4)")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps (default 2)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "shardadopt-bench-models"))
    args = parser.parse_args()

    import transformers

    from shardadopt.testing import RankPool

    path = write_llama(args.models, args.hidden, args.layers, args.vocab)
    shape = (path, args.layout, args.steps, args.batch, args.accum, args.seq, args.vocab, args.lora_rank)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    memory: dict[str, list[dict]] = {}
    with RankPool(2) as pool:
        for _ in range(args.rounds):
            for side in SIDES:
                results = pool.run(run_side, side, *shape, timeout=900)
                times[side] += [max(step) for step in zip(*(r["steps"] for r in results))][args.warmup - 1:]
                memory[side] = [r["memory"] for r in results]
    medians = {side: statistics.median(values) for side, values in times.items()}
    p10 = {side: statistics.quantiles(values, n=10)[0] for side, values in times.items()}
    print(f"llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, seq {args.seq}, LoRA r="
          f"{args.lora_rank} on {', '.join(TARGETS)}; sharded side {args.layout}_size=2 on 2 gloo ranks; "
          f"global batch {args.batch * 2} x accumulation {args.accum}; transformers {transformers.__version__}")
    print(f"{'side':>13} {'median ms':>10} {'p10 ms':>8} {'/ddp-full':>10} {'/ddp-lora':>10} "
          f"{'model MiB/rank':>15} {'trainable+grads+adam MiB/rank':>30}")
    for side in SIDES:
        mem = memory[side]
        model_mib = "/".join(f"{m['model'] / 2**20:.2f}" for m in mem)
        train_mib = "/".join(f"{m['trainable+grads+adam'] / 2**20:.3f}" for m in mem)
        print(f"{side:>13} {medians[side] * 1e3:10.1f} {p10[side] * 1e3:8.1f} "
              f"{medians[side] / medians['ddp-full']:9.3f}x {medians[side] / medians['ddp-lora']:9.3f}x "
              f"{model_mib:>15} {train_mib:>30}")


if __name__ == "__main__":
    main()
