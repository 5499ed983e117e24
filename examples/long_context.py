"""Long sequences with context parallelism: an accelerate loop on a model that transformers shards while loading.

    torchrun --standalone --nproc-per-node 2 examples/long_context.py --seq-len 256 --steps 3

Every sequence is split over the ranks of the CP group (``ParallelismConfig(cp_size=N)``, here every rank; the
model is loaded with ``DistributedConfig(fsdp_size=N)``): each rank's forward runs on 1/N of the positions and
torch's ring attention passes the keys and values round the group, so activation memory per rank falls with N.
The loop is the one accelerate documents for ``maybe_context_parallel``: labels shifted before the split
(``shift_labels``), global position ids, every buffer split on its sequence dim. See docs/long-context.md.

``--model`` takes any causal-LM checkpoint whose attention runs through SDPA; without it a tiny random Llama is
generated under ``runs/tiny-models``. ``--seq-len`` must be divisible by 2 x the number of ranks.
"""

from __future__ import annotations

import argparse
import os

import shardadopt

shardadopt.enable()  # first, before transformers/accelerate are used

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator, ParallelismConfig  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint path or hub id (default: a generated tiny Llama)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step (the CP group shares them)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    return parser.parse_args()


def default_model() -> str:
    """A tiny random Llama, written once (atomically, so every rank may call this)."""
    from shardadopt.testing import tiny_checkpoints

    return tiny_checkpoints("runs/tiny-models", ["llama"])["llama"]


def main() -> None:
    args = parse_args()
    # One CP group of every rank torchrun started. cpu=True on machines without GPUs: gloo is accelerate's
    # distributed backend only for CPU runs.
    cp_size = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = Accelerator(parallelism_config=ParallelismConfig(cp_size=cp_size), cpu=not torch.cuda.is_available())
    torch.manual_seed(0)

    # Sharded while loading over the same ranks; ring attention needs SDPA.
    model = AutoModelForCausalLM.from_pretrained(args.model or default_model(), dtype=torch.float32,
                                                 attn_implementation="sdpa",
                                                 distributed_config=DistributedConfig(fsdp_size=cp_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # Stand-in data: random token sequences (use your tokenized long documents).
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, model.config.vocab_size, (args.seq_len,), generator=generator)
               for _ in range(args.steps * args.batch_size)]
    loader = torch.utils.data.DataLoader(samples, batch_size=args.batch_size)

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []  # the positions each forward ran on: 1/cp_size of the sequence
    model.register_forward_pre_hook(lambda module, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)

    model.train()
    for step, input_ids in enumerate(loader, start=1):
        labels = input_ids
        # shift before the split: the last token of one rank's chunk predicts the first token of the next chunk
        shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        # positions of the whole sequence (RoPE), split with the tokens
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids).contiguous()
        buffers = [input_ids, labels, shift_labels, position_ids]
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                                no_restore_buffers=set(buffers)):
            loss = model(input_ids=input_ids, labels=labels, shift_labels=shift_labels,
                         position_ids=position_ids).loss
            accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step} loss {accelerator.reduce(loss.detach(), 'mean').item():.4f} "
                          f"grad_norm {grad_norm.item():.4f}")
    accelerator.print(f"each rank's forward saw {seen[-1]} of {args.seq_len} positions (cp_size={cp_size})")
    accelerator.end_training()


if __name__ == "__main__":
    main()
