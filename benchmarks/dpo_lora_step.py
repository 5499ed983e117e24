"""DPO with LoRA (TRL's ``DPOTrainer(peft_config=...)``, the reference model being the adapter disabled) on an
``fsdp_size=2`` load, with and without ``keep_frozen_units_gathered``: step time and all-gathers per step.

    python benchmarks/dpo_lora_step.py                 # 2 gloo ranks, a small llama
    python benchmarks/dpo_lora_step.py --rounds 3 --steps 8

Each step runs the reference pass inside peft's ``disable_adapter()`` and the policy pass. From peft 0.22 on,
``disable_adapter`` (like ``set_adapter``, ``merge_adapter``, ``unmerge_adapter``, ``set_requires_grad``) calls
``reshard()`` on the FSDP2 units when a forward inside it replaced their registered parameters: the frozen units the
option keeps gathered are then resharded, and gathered again by the next pass. Run it with each peft installed and
compare the all-gathers per step (counted, independent of load) and the step-time ratio of the two sides (same run).

Sides, alternating ``--rounds`` times in one pool: ``dpo-lora`` (upstream's resharding), ``dpo-lora-gathered``
(``shardadopt.adopt.keep_frozen_units_gathered(trainer.model)`` after the trainer is built, as docs/adapters.md tells
Trainer users); ``dpo-ref-adapter`` and ``dpo-ref-adapter-gathered``: re-training an existing adapter
(``PeftModel.from_pretrained(..., is_trainable=True)``; TRL loads a frozen copy of it as adapter "ref", and its
reference pass is then ``set_adapter("ref")`` and back: an adapter switch). A step: the time between two
optimizer-step ends, the slowest rank's, the first ``--warmup`` steps dropped; the collectives of the run's last step
are counted (``CommDebugMode``'s kind of dispatch mode), that step not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _timing import write_llama

SIDES = ("dpo-lora", "dpo-lora-gathered", "dpo-ref-adapter", "dpo-ref-adapter-gathered")
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def run_side(side: str, path: str, tokenizer: str, steps: int, batch: int, accum: int) -> dict:
    """One DPO run on this rank: the end time of every step but the last, and the last step's collectives."""
    import contextlib

    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from transformers.distributed import DistributedConfig
    from trl import DPOConfig, DPOTrainer

    import shardadopt
    from shardadopt import upstream
    from shardadopt.adopt import keep_frozen_units_gathered
    from shardadopt.testing.collectives import counted_collectives
    from shardadopt.testing.trl import dataset

    ends: list[float] = []
    counted: list[dict[str, int]] = []

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.stack = contextlib.ExitStack()

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == steps - 1:
                counted.append(self.stack.enter_context(counted_collectives()))

        def on_step_end(self, args, state, control, **kwargs):
            self.stack.close()
            ends.append(time.perf_counter())

    shardadopt.enable()
    try:
        upstream.reset_accelerate_state()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(fsdp_size=2))
        torch.manual_seed(0)
        config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=TARGETS)
        extra = {"peft_config": config}
        with tempfile.TemporaryDirectory() as out:
            if side.startswith("dpo-ref-adapter"):
                import torch.distributed as dist
                from peft import PeftModel, get_peft_model

                adapter = os.path.join(out, "adapter") if dist.get_rank() == 0 else None
                shared = [adapter]
                dist.broadcast_object_list(shared)
                get_peft_model(model, config).save_pretrained(shared[0])  # every rank; rank 0 writes
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             distributed_config=DistributedConfig(fsdp_size=2))
                model = PeftModel.from_pretrained(model, shared[0], is_trainable=True)  # TRL loads it as "ref" too
                extra = {}
            args = DPOConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                             max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
                             max_length=64)
            trainer = DPOTrainer(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(tokenizer),
                                 train_dataset=dataset("dpo", steps * batch * accum * 2), callbacks=[Steps()],
                                 **extra)
            trainer.remove_callback(PrinterCallback)
            held = keep_frozen_units_gathered(trainer.model) if side.endswith("-gathered") else 0
            start = time.perf_counter()
            trainer.train()
        return {"steps": [b - a for a, b in zip([start, *ends], ends)][:-1], "collectives": counted[0],
                "held": held}
    finally:
        shardadopt.disable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the sides (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped per run (default 2)")
    parser.add_argument("--batch", type=int, default=2, help="pairs per rank and micro-batch (default 2)")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps (default 2)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "shardadopt-bench-models"))
    args = parser.parse_args()

    import peft
    import transformers

    from shardadopt.testing import RankPool
    from shardadopt.testing.models import VOCAB_SIZE
    from shardadopt.testing.text import tiny_tokenizer

    path = write_llama(args.models, args.hidden, args.layers, VOCAB_SIZE)
    tokenizer = tiny_tokenizer(args.models)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    counts: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    with RankPool(2) as pool:
        for _ in range(args.rounds):
            for side in SIDES:
                results = pool.run(run_side, side, path, tokenizer, args.steps, args.batch, args.accum, timeout=900)
                times[side] += [max(step) for step in zip(*(r["steps"] for r in results))][args.warmup:]
                counts[side] = [(r["collectives"], r["held"]) for r in results]
    load_after = os.getloadavg()
    print(f"peft {peft.__version__}, transformers {transformers.__version__}; llama hidden {args.hidden} x "
          f"{args.layers} layers; fsdp_size=2 on 2 gloo ranks; {args.batch} pairs per rank x accumulation "
          f"{args.accum}; {args.rounds} rounds x {args.steps - 1 - args.warmup} timed steps; load "
          f"{'/'.join(f'{x:.1f}' for x in load_before)} before, {'/'.join(f'{x:.1f}' for x in load_after)} after")
    median = {side: statistics.median(values) * 1e3 for side, values in times.items()}
    for side in SIDES:
        per_rank = "; ".join(f"rank {rank}: {c['all_gather']} all-gather, {c['reduce_scatter']} reduce-scatter, "
                             f"{c['all_reduce']} all-reduce, held {held / 2**20:.1f} MiB"
                             for rank, (c, held) in enumerate(counts[side]))
        base = "dpo-ref-adapter" if side.startswith("dpo-ref-adapter") else "dpo-lora"
        print(f"{side:24} median {median[side]:7.1f} ms ({median[side] / median[base]:.3f}x {base}); "
              f"last step: {per_rank}")


if __name__ == "__main__":
    main()
