"""LoRA step time on a model sharded at load time against DDP + LoRA on the plain model, with memory per rank and the
collectives of one step, side by side.

    python benchmarks/adapter_step.py                  # 2 gloo ranks, a small llama, fsdp_size=2
    python benchmarks/adapter_step.py --layout tp --rounds 5 --hidden 512
    python benchmarks/adapter_step.py --sides ddp-full,ddp-lora,sharded-lora,sharded-lora-gathered

The sides train the same global batches with the ordinary accelerate loop (``prepare``, ``accumulate``,
``backward``, ``clip_grad_norm_``, foreach AdamW, constant learning rate), alternating ``--rounds`` times in one
pool so that load on a shared machine hits them alike:

- ``ddp-full``: the plain checkpoint under DDP, every weight trained (what the adapter run replaces; off by default);
- ``ddp-lora``: the plain checkpoint under DDP with the same LoRA adapters (``get_peft_model``);
- ``sharded-lora``: the checkpoint loaded with ``DistributedConfig(fsdp_size=2)`` (or ``tp_size=2``) and the same
  adapters, with ``shardadopt.enable()``;
- ``sharded-lora-gathered``: the same with ``AdoptionKwargs(keep_frozen_units_gathered=True)`` (FSDP2 units whose
  weights are all frozen are not resharded between forward and backward nor between the micro-batches of a step:
  one all-gather per unit per step; nothing changes on a TP load);
- ``sharded-lora-across-steps``: with ``AdoptionKwargs(keep_frozen_units_gathered_across_steps=True)`` (kept from one
  step to the next too: no all-gather after the first step, so its gap to ``ddp-lora`` is the layout's cost
  without the base's all-gathers, measured).

A step is the time between two consecutive optimizer-step ends, the slowest rank's; the first ``--warmup`` steps of
every run are dropped. It prints each side's median (and p10) step and the ratios against ``ddp-lora`` (and
``ddp-full`` when run); per rank the bytes of the model's local parameters, of the trainable ones with their
gradients and AdamW state, the peak RSS growth (the resident set's high-water mark, sampled every millisecond
during the timed steps, above the RSS after ``malloc_trim`` just before the load: what the side added, allocator
caching included), and the unsharded frozen weights the option holds; and the collectives of one optimizer step
(run once more after the timed steps, recorded by a dispatch mode like ``CommDebugMode``), by kind, with their
bytes. The machine's load is printed before and after.

Whether the sharded sides' extra time is their collectives': every side replays the collectives its recorded step
issued (the same ops, groups and sizes, on zero buffers, each waited for before the next) alone, as many times as
it ran steps, timed the same way (the slowest rank, warmup dropped, median over the rounds, in the same pool run
right after its steps). Per sharded side it prints the step's gap to ``ddp-lora`` next to the replayed collectives'
gap to ``ddp-lora``'s replay (the share of the gap the layout's collectives explain, if they did not overlap with
compute), and the step minus its replay (what is not collective time, derived, not measured apart).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import threading
import time

from _timing import timed_accelerate_loop, write_llama

LR = 1e-3
MAX_GRAD_NORM = 1.0
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
SIDES = ("ddp-full", "ddp-lora", "sharded-lora", "sharded-lora-gathered", "sharded-lora-across-steps")
DEFAULT_SIDES = "ddp-lora,sharded-lora,sharded-lora-gathered,sharded-lora-across-steps"


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The RSS high-water mark while running, sampled every millisecond on a thread."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _trimmed_rss() -> int:
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss()


def run_side(side: str, path: str, layout: str, steps: int, batch: int, accum: int, seq: int, vocab: int,
             rank_r: int) -> dict:
    """Optimizer-step durations, memory and one step's collectives of one side on this rank."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import shardadopt
    from shardadopt import upstream
    from shardadopt.adopt import frozen_units, keep_frozen_units_gathered
    from shardadopt.testing.collectives import COLLECTIVE_KINDS, recorded_collectives, replay_collectives

    shardadopt.enable()
    try:
        baseline = _trimmed_rss()
        upstream.reset_accelerate_state()
        kept, across = side.endswith(("-gathered", "-across-steps")), side.endswith("-across-steps")
        handlers = [shardadopt.AdoptionKwargs(keep_frozen_units_gathered=kept,
                                              keep_frozen_units_gathered_across_steps=across)]
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum, kwargs_handlers=handlers)
        kwargs = {"dtype": torch.float32}
        dp = dist.get_world_size()
        if side.startswith("sharded"):
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
        rows = torch.randint(0, vocab, ((steps + 1) * accum * batch * dist.get_world_size(), seq),
                             generator=generator)
        per_rank = batch * dist.get_world_size() // dp
        split = steps * accum * batch * dist.get_world_size()
        loader = torch.utils.data.DataLoader(list(rows[:split]), batch_size=per_rank)
        counted = torch.utils.data.DataLoader(list(rows[split:]), batch_size=per_rank)
        model, optimizer, loader, counted = accelerator.prepare(model, optimizer, loader, counted)
        # what the option holds (asking again changes nothing): the units' unsharded weights, per rank
        held = keep_frozen_units_gathered(model, across_steps=across) if kept else 0
        units = len(frozen_units(model))

        def memory() -> dict[str, int]:  # after the last update: gradients and AdamW state are there
            trainable = [p for p in model.parameters() if p.requires_grad]
            return {"model": sum(_local_bytes(p) for p in model.parameters()),
                    "trainable+grads+adam": sum(_local_bytes(p) + _local_bytes(p.grad) for p in trainable)
                    + sum(_local_bytes(v) for s in optimizer.optimizer.state.values()
                          for v in s.values() if torch.is_tensor(v) and v.dim() > 0)}

        def batch_inputs(data):
            return {"input_ids": data, "labels": data}

        dist.barrier()
        with PeakRss() as rss:
            ends, measured = timed_accelerate_loop(accelerator, model, optimizer, loader, MAX_GRAD_NORM,
                                                   batch_inputs, memory)
        measured.update(peak_rss=rss.peak - baseline, held=held, frozen_units=units)
        dist.barrier()
        with recorded_collectives() as recorded:
            timed_accelerate_loop(accelerator, model, optimizer, counted, MAX_GRAD_NORM, batch_inputs)
        collectives = {kind: [c.nbytes for c in recorded if c.kind == kind] for kind in COLLECTIVE_KINDS}
        dist.barrier()
        replays = [time.perf_counter()]
        for _ in range(steps):
            replay_collectives(recorded)
            replays.append(time.perf_counter())
        return {"steps": [b - a for a, b in zip(ends, ends[1:])], "memory": measured, "collectives": collectives,
                "replays": [b - a for a, b in zip(replays, replays[1:])]}
    finally:
        shardadopt.disable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=["fsdp", "tp"], default="fsdp")
    parser.add_argument("--sides", default=DEFAULT_SIDES, help=f"comma-separated, of {', '.join(SIDES)} "
                        f"(default {DEFAULT_SIDES})")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the sides (default 3)")
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
    sides = [side for side in SIDES if side in args.sides.split(",")]
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown or "ddp-lora" not in sides:
        parser.error(f"--sides: unknown {sorted(unknown)}" if unknown else "--sides must include ddp-lora")

    import transformers

    from shardadopt.testing import RankPool
    from shardadopt.testing.collectives import COLLECTIVE_KINDS

    path = write_llama(args.models, args.hidden, args.layers, args.vocab)
    shape = (path, args.layout, args.steps, args.batch, args.accum, args.seq, args.vocab, args.lora_rank)
    times: dict[str, list[float]] = {side: [] for side in sides}
    replays: dict[str, list[float]] = {side: [] for side in sides}
    memory: dict[str, list[dict]] = {}
    collectives: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    with RankPool(2) as pool:
        for _ in range(args.rounds):
            for side in sides:
                results = pool.run(run_side, side, *shape, timeout=900)
                # per step the slowest rank; the steps before the warmup's end dropped, likewise for the replays
                times[side] += [max(step) for step in zip(*(r["steps"] for r in results))][args.warmup - 1:]
                replays[side] += [max(step) for step in zip(*(r["replays"] for r in results))][args.warmup:]
                memory[side] = [r["memory"] for r in results]
                collectives[side] = [r["collectives"] for r in results]
    load_after = os.getloadavg()
    step = {side: statistics.median(values) * 1e3 for side, values in times.items()}
    p10 = {side: statistics.quantiles(values, n=10)[0] * 1e3 for side, values in times.items()}
    replay = {side: statistics.median(values) * 1e3 for side, values in replays.items()}
    print(f"llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, seq {args.seq}, LoRA r="
          f"{args.lora_rank} on {', '.join(TARGETS)}; sharded sides {args.layout}_size=2 on 2 gloo ranks; "
          f"global batch {args.batch * 2} x accumulation {args.accum}; {args.rounds} rounds x "
          f"{args.steps - args.warmup} steps; transformers {transformers.__version__}")
    print(f"machine: {os.cpu_count()} cores, load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_before)} "
          f"before, {'/'.join(f'{x:.1f}' for x in load_after)} after")
    ratios = [f"/{base}" for base in ("ddp-full", "ddp-lora") if base in sides]
    print(f"{'side':>25} {'step ms':>8} {'p10 ms':>7} " + " ".join(f"{r:>9}" for r in ratios)
          + f" {'colls ms':>8} {'step gap':>8} {'colls gap':>9} {'explained':>9} {'rest ms':>7}"
          + f" {'model MiB':>11} {'train+grad+adam':>15} {'peak RSS +MiB':>13} {'held MiB':>9}"
          + "  collectives/step (count x MiB): " + ", ".join(COLLECTIVE_KINDS))
    for side in sides:
        mem = memory[side]

        def per_rank(key: str, digits: int, mem=mem) -> str:
            return "/".join(f"{m[key] / 2**20:.{digits}f}" for m in mem)

        gap, colls_gap = step[side] - step["ddp-lora"], replay[side] - replay["ddp-lora"]
        gaps = (f" {gap:8.1f} {colls_gap:9.1f} {colls_gap / gap:8.0%} " if side != "ddp-lora" and gap > 0
                else f" {'':8} {'':9} {'':9} ")
        # per kind: calls x MiB in all (rank 0; the other rank's when it differs)
        kinds = ["  ".join(f"{len(c[kind])}x{sum(c[kind]) / 2**20:.2f}" for kind in COLLECTIVE_KINDS)
                 for c in collectives[side]]
        print(f"{side:>25} {step[side]:8.1f} {p10[side]:7.1f} "
              + " ".join(f"{step[side] / step[r[1:]]:8.3f}x" for r in ratios)
              + f" {replay[side]:8.1f}" + gaps + f"{step[side] - replay[side]:7.1f}"
              + f" {per_rank('model', 2):>11} {per_rank('trainable+grads+adam', 3):>15} "
              f"{per_rank('peak_rss', 0):>13} {per_rank('held', 2):>9}  "
              + (kinds[0] if len(set(kinds)) == 1 else " | ".join(kinds)))
    print(f"(per-rank values rank0/rank1; frozen FSDP units per rank: "
          f"{max(m['frozen_units'] for m in memory[sides[-1]])}; collectives of one optimizer step = "
          f"{args.accum} micro-batches + clip + update, recorded after the timed steps; colls ms: those collectives "
          f"replayed alone on zero buffers, each waited for, median; step gap / colls gap: each minus ddp-lora's; "
          f"explained: colls gap / step gap; rest ms: step - colls ms)")


if __name__ == "__main__":
    main()
