"""Step time of the adopted accelerate loop vs upstream's own Trainer path, same FSDP model, side by side.

    python benchmarks/accelerate_step.py                 # 2 gloo ranks, a small llama, fsdp_size=2
    python benchmarks/accelerate_step.py --rounds 5 --steps 20 --hidden 512

Needs transformers >= 5.19 (the first whose ``Trainer`` trains a model sharded at load time by itself). Both sides
load the same checkpoint with ``DistributedConfig(fsdp_size=2)`` and train the same global batches with foreach
AdamW, gradient accumulation, clipping at 1.0 and a constant learning rate:

- accelerate: the user's loop (``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``, ``step``,
  ``zero_grad``) with ``shardadopt.enable()``;
- Trainer: ``Trainer.train()`` with shardadopt disabled (upstream alone), the same optimizer instance type.

A step is the time between two consecutive optimizer-step ends (data loading, forward/backward of every
micro-batch, clipping, step), the slowest rank's; the first ``--warmup`` steps of every run are dropped. The two
sides alternate ``--rounds`` times in one pool so that load on a shared machine hits both alike. It prints each
side's median step and the ratio accelerate / Trainer (target <= 1.05), and the ratio of 10th percentiles: on a
shared CPU machine other processes stretch random steps, and the fastest steps show the loop's own cost best. The
machine's load average is printed before and after every run; it exits 1 when the median ratio is above ``--goal``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _timing import timed_accelerate_loop, write_llama

LR = 1e-3
MAX_GRAD_NORM = 1.0


def _dataset(n: int, seq: int, vocab: int) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, vocab, (n, seq), generator=generator)]


def _load(path: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                distributed_config=DistributedConfig(fsdp_size=2))


def _fresh_state() -> None:
    from shardadopt import upstream

    upstream.reset_accelerate_state()


def accelerate_steps(path: str, steps: int, batch: int, accum: int, seq: int, vocab: int) -> list[float]:
    """Optimizer-step end times of the adopted accelerate loop."""
    import torch
    from accelerate import Accelerator

    import shardadopt

    shardadopt.enable()
    try:
        _fresh_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
        model = _load(path)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        loader = torch.utils.data.DataLoader(_dataset(steps * accum * batch * 2, seq, vocab), batch_size=batch)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        return timed_accelerate_loop(accelerator, model, optimizer, loader, MAX_GRAD_NORM, lambda data: data)[0]
    finally:
        shardadopt.disable()


def trainer_steps(path: str, steps: int, batch: int, accum: int, seq: int, vocab: int) -> list[float]:
    """Optimizer-step end times of upstream's Trainer on the same model (shardadopt disabled)."""
    import torch
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import shardadopt

    shardadopt.disable()
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    model = _load(path)
    _fresh_state()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    with tempfile.TemporaryDirectory(prefix="shardadopt-bench-") as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=steps,
            learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=MAX_GRAD_NORM, logging_steps=10**6,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, train_sampling_strategy="sequential",
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(steps * accum * batch * 2, seq, vocab),
                          optimizers=(optimizer, None), callbacks=[StepEnds()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return ends


def measure(side: str, *args) -> list[float]:
    """Per-step durations on this rank (warm-up dropped by the caller)."""
    import torch.distributed as dist

    dist.barrier()
    ends = (accelerate_steps if side == "accelerate" else trainer_steps)(*args)
    return [b - a for a, b in zip(ends, ends[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations accelerate/Trainer (default 3)")
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run (default 14)")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped per run (default 3)")
    parser.add_argument("--batch", type=int, default=4, help="per-rank micro-batch (default 4)")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps (default 2)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "shardadopt-bench-models"))
    parser.add_argument("--goal", type=float, default=1.05, help="largest accelerate / Trainer ratio (default 1.05)")
    args = parser.parse_args()

    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.19"):
        sys.exit(f"transformers {transformers.__version__}: its Trainer cannot train a model sharded at load time "
                 f"(needs >= 5.19 for the upstream side of this comparison)")
    from shardadopt.testing import RankPool

    path = write_llama(args.models, args.hidden, args.layers, args.vocab)
    shape = (path, args.steps, args.batch, args.accum, args.seq, args.vocab)
    times: dict[str, list[float]] = {"accelerate": [], "trainer": []}
    loads: dict[str, list[float]] = {"accelerate": [], "trainer": []}
    with RankPool(2) as pool:
        for _ in range(args.rounds):
            for side in times:
                loads[side].append(os.getloadavg()[0])
                per_rank = pool.run(measure, side, *shape, timeout=600)
                if any(len(r) != args.steps - 1 for r in per_rank):
                    raise SystemExit(f"{side}: expected {args.steps} optimizer steps, got "
                                     f"{[len(r) + 1 for r in per_rank]}")
                times[side] += [max(step) for step in zip(*per_rank)][args.warmup - 1:]
    medians = {side: statistics.median(values) for side, values in times.items()}
    print(f"llama hidden {args.hidden} x {args.layers} layers, seq {args.seq}, fsdp_size=2 on 2 gloo ranks, "
          f"per-rank batch {args.batch} x accumulation {args.accum}; transformers {transformers.__version__}")
    for side, values in times.items():
        print(f"{side:>10}: median step {medians[side] * 1e3:8.1f} ms over {len(values)} steps "
              f"(p10 {statistics.quantiles(values, n=10)[0] * 1e3:.1f}, "
              f"p90 {statistics.quantiles(values, n=10)[-1] * 1e3:.1f}); load average before its runs "
              f"{', '.join(f'{load:.2f}' for load in loads[side])} ({os.cpu_count()} cores)")
    ratio = medians["accelerate"] / medians["trainer"]
    p10 = [statistics.quantiles(times[side], n=10)[0] for side in ("accelerate", "trainer")]
    print(f"ratio accelerate / Trainer: median {ratio:.3f}x (target <= {args.goal}x: "
          f"{'OK' if ratio <= args.goal else 'OVER'}), p10 {p10[0] / p10[1]:.3f}x (least disturbed by other load on a "
          f"shared machine); load average {os.getloadavg()[0]:.2f} at the end")
    if ratio > args.goal:
        sys.exit(f"accelerate / Trainer {ratio:.3f}x is above {args.goal}x")


if __name__ == "__main__":
    main()
