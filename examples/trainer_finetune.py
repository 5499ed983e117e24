"""A Trainer fine-tune of a model that transformers shards while loading, with resumable checkpoints.

    torchrun --standalone --nproc-per-node 2 examples/trainer_finetune.py --stop-after 4
    torchrun --standalone --nproc-per-node 2 examples/trainer_finetune.py --resume

The first command trains with a checkpoint every 2 steps and stops after checkpoint-4, as a job killed there
would; the second resumes from the newest complete checkpoint and ends with a consolidated ``save_model``.
shardadopt makes Trainer's checkpoints of the sharded model resumable (sharded through
``torch.distributed.checkpoint``, published atomically: a save killed halfway is never picked up) and gathers the
final ``save_model`` into files a plain ``from_pretrained`` loads.

``--layout``: ``fsdp`` (FSDP2 over all ranks), ``tp`` (tensor parallel) or ``ep`` (expert parallel; a MoE model).
``--model`` takes any causal-LM checkpoint; without it a tiny random Qwen3 (Qwen3-MoE for ``ep``) is generated
under ``runs/tiny-models``.
"""

from __future__ import annotations

import argparse
import os

import shardadopt

shardadopt.enable()  # first, before transformers is used

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=["fsdp", "tp", "ep"], default="fsdp")
    parser.add_argument("--model", help="checkpoint path or hub id (default: a generated tiny model)")
    parser.add_argument("--output-dir", default="runs/trainer-finetune", help="checkpoints and the final model")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--stop-after", type=int, help="stop after this step's checkpoint (a simulated interruption)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    return parser.parse_args()


def distributed_config(layout: str, world: int) -> DistributedConfig:
    """The ``DistributedConfig`` for a layout over ``world`` ranks."""
    if layout == "fsdp":
        return DistributedConfig(fsdp_size=world)
    if layout == "tp":
        return DistributedConfig(tp_size=world)
    if "ep_size" in DistributedConfig.__dataclass_fields__:  # transformers 5.21+: experts over ep, rest FSDP
        return DistributedConfig(ep_size=world, fsdp_size=world)
    return DistributedConfig(tp_size=world, enable_expert_parallel=True)  # older releases: EP on the TP mesh


def default_model(layout: str) -> str:
    """A tiny random checkpoint, written once (atomically, so every rank may call this)."""
    from shardadopt.testing import tiny_checkpoints

    name = "qwen3moe" if layout == "ep" else "qwen3"
    return tiny_checkpoints("runs/tiny-models", [name])[name]


class TokenDataset(torch.utils.data.Dataset):
    """Stand-in data: random token sequences, the same on every rank (use your tokenized dataset)."""

    def __init__(self, size: int, vocab_size: int, seq_len: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, vocab_size, (seq_len,), generator=generator) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class ReportStart(TrainerCallback):
    """Say where training starts: step 0, or the step of the checkpoint it resumed from."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"training from step {state.global_step} to {state.max_steps}")


class StopAfter(TrainerCallback):
    """Leave training once checkpoint-<step> is written, as a job killed right after it would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun

    # Sharded while loading; every rank loads only its part.
    model = AutoModelForCausalLM.from_pretrained(args.model or default_model(args.layout), dtype=torch.float32,
                                                 distributed_config=distributed_config(args.layout, world))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,  # rotation counts complete checkpoints only
        report_to=[],
        use_cpu=not torch.cuda.is_available(),  # torchrun's processes join one gloo job on CPU-only machines
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(256, model.config.vocab_size),
                      callbacks=[ReportStart()] + ([StopAfter(args.stop_after)] if args.stop_after else []))

    # resume_from_checkpoint=True: the newest complete checkpoint-N under output_dir
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.state.global_step < args.max_steps:
        if trainer.is_world_process_zero():
            print(f"stopped after step {trainer.state.global_step} (run again with --resume)")
        return

    # Consolidated weights for a plain from_pretrained (gathered one parameter at a time, written by rank 0).
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if trainer.is_world_process_zero():
        print(f"saved {args.output_dir}/final")


if __name__ == "__main__":
    main()
