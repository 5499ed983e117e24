"""An accelerate training loop on a model that transformers shards while loading.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --layout fsdp --stop-after 4
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --layout fsdp --resume

The loop is the one accelerate documents (``prepare``, ``accumulate``, ``clip_grad_norm_``, ``save_state`` /
``load_state``); shardadopt makes it correct for the sharded model: ``prepare`` adopts the model as loaded (no DDP
wrap, batches split by data-parallel rank), clipping sees every mesh, ``save_state`` writes a resumable sharded
checkpoint, and the consolidated export loads with a plain single-process ``from_pretrained``.

``--layout``: ``fsdp`` (FSDP2 over all ranks), ``tp`` (tensor parallel), ``ep`` (expert parallel; a MoE model),
``2d`` (fsdp_size=2 x tp_size=world/2: 4 ranks, transformers 5.18+). ``--model`` takes any causal-LM checkpoint;
without it a tiny random Qwen3 (Qwen3-MoE for ``ep``) is generated under ``runs/tiny-models``.
"""

from __future__ import annotations

import argparse
import os

import shardadopt

shardadopt.enable()  # first, before transformers/accelerate are used

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import shardadopt.checkpoint  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=["fsdp", "tp", "ep", "2d"], default="fsdp")
    parser.add_argument("--model", help="checkpoint path or hub id (default: a generated tiny model)")
    parser.add_argument("--output-dir", help="checkpoints and export (default: runs/accelerate-<layout>)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps in total")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel rank and micro-batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--save-every", type=int, default=2, help="save_state every N optimizer steps")
    parser.add_argument("--stop-after", type=int, help="exit after this step's checkpoint (a simulated interruption)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    return parser.parse_args()


def distributed_config(layout: str, world: int) -> DistributedConfig:
    """The ``DistributedConfig`` for a layout over ``world`` ranks."""
    if layout == "fsdp":
        return DistributedConfig(fsdp_size=world)
    if layout == "tp":
        return DistributedConfig(tp_size=world)
    if layout == "ep":
        if "ep_size" in DistributedConfig.__dataclass_fields__:  # transformers 5.21+: experts over ep, rest FSDP
            return DistributedConfig(ep_size=world, fsdp_size=world)
        return DistributedConfig(tp_size=world, enable_expert_parallel=True)  # older releases: EP on the TP mesh
    return DistributedConfig(fsdp_size=2, tp_size=world // 2)  # 2d


def default_model(layout: str) -> str:
    """A tiny random checkpoint, written once (atomically, so every rank may call this)."""
    from shardadopt.testing import tiny_checkpoints

    name = "qwen3moe" if layout == "ep" else "qwen3"
    return tiny_checkpoints("runs/tiny-models", [name])[name]


class Progress:
    """Optimizer steps done; registered for checkpointing, so ``save_state``/``load_state`` carry it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    args = parse_args()
    output_dir = args.output_dir or f"runs/accelerate-{args.layout}"
    checkpoints = os.path.join(output_dir, "checkpoints")
    # cpu=True on machines without GPUs: without it accelerate runs torchrun's processes as unrelated
    # single-process jobs (gloo is accelerate's distributed backend only for CPU runs).
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)

    # Sharded while loading; every rank loads only its part.
    model = AutoModelForCausalLM.from_pretrained(
        args.model or default_model(args.layout), dtype=torch.float32,
        distributed_config=distributed_config(args.layout, accelerator.num_processes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # Stand-in data: random token sequences (use your tokenized dataset). Every rank builds the same list;
    # prepare() hands each data-parallel rank its own batches (tensor-parallel ranks share theirs).
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, model.config.vocab_size, (args.seq_len,), generator=generator) for _ in range(512)]
    loader = torch.utils.data.DataLoader(samples, batch_size=args.batch_size)

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    if args.resume:
        # the newest complete checkpoint (a save killed halfway is never published): weights, optimizer, RNG,
        # and the progress object
        accelerator.load_state(shardadopt.checkpoint.latest(checkpoints))
        loader = accelerator.skip_first_batches(loader, progress.step * args.grad_accum)
        accelerator.print(f"resumed at step {progress.step}")

    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # the last micro-batch of this optimizer step
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()  # steps (and zero_grad clears) only on the last micro-batch
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        progress.step += 1
        accelerator.print(f"step {progress.step} loss {accelerator.reduce(loss.detach(), 'mean').item():.4f} "
                          f"grad_norm {grad_norm.item():.4f}")
        if progress.step % args.save_every == 0:
            # sharded, written through torch.distributed.checkpoint and published atomically
            accelerator.save_state(os.path.join(checkpoints, f"step-{progress.step}"))
        if progress.step == args.stop_after:
            accelerator.print(f"stopping after step {progress.step} (run again with --resume)")
            return
        if progress.step == args.steps:
            break

    # Full weights for plain from_pretrained, gathered one parameter at a time and written by rank 0.
    final = os.path.join(output_dir, "final")
    try:
        shardadopt.checkpoint.save_full(accelerator.unwrap_model(model), final)
    except shardadopt.checkpoint.CheckpointError:
        if args.layout != "tp":
            raise
        # transformers releases whose TP shards are plain tensors (not DTensors): their own gathering save
        accelerator.unwrap_model(model).save_pretrained(final)
    accelerator.print(f"exported {output_dir}/final")
    accelerator.end_training()


if __name__ == "__main__":
    main()
