"""TRL GRPO (online RL: the trainer samples completions and scores them with a reward function) on a model that
transformers shards while loading.

    torchrun --standalone --nproc-per-node 2 examples/grpo.py --layout tp

TRL seeds every process differently so that data-parallel ranks sample different completions; the ranks of a
tensor-parallel group hold one model replica and must sample the same ones. ``shardadopt.enable()`` gives every rank
of a TP group its first rank's random state at each ``generate``, so GRPO trains one replica on one batch. After
training the script samples from the trained model the same way TRL does (a different seed per process) and checks
that the TP ranks got the same tokens.

``--layout``: ``tp`` (tensor parallel; transformers 5.17 or newer: TRL's fused LM head needs DTensor shards) or
``fsdp`` (FSDP2 over all ranks). ``--model`` and ``--tokenizer`` take a real checkpoint; without them a tiny random
Qwen3 and a word-level tokenizer are generated under ``runs/tiny-models``.
"""

from __future__ import annotations

import argparse
import os

import shardadopt

shardadopt.enable()  # first, before transformers is used

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=["fsdp", "tp"], default="tp")
    parser.add_argument("--model", help="checkpoint path or hub id (default: a generated tiny Qwen3)")
    parser.add_argument("--tokenizer", help="tokenizer path or hub id (default: the model's, or a generated one)")
    parser.add_argument("--output-dir", default="runs/grpo", help="trainer output")
    parser.add_argument("--max-steps", type=int, default=4)
    return parser.parse_args()


def tiny_defaults() -> tuple[str, str]:
    """A tiny random Qwen3 and a tokenizer for it, written once (atomically, so every rank may call this)."""
    from shardadopt.testing import tiny_checkpoints
    from shardadopt.testing.text import tiny_tokenizer

    return tiny_checkpoints("runs/tiny-models", ["qwen3"])["qwen3"], tiny_tokenizer("runs/tiny-models")


def prompts(size: int) -> Dataset:
    """Stand-in prompts: random word sequences (use your own dataset with a "prompt" column)."""
    from shardadopt.testing.text import sentences

    return Dataset.from_dict({"prompt": sentences(size, seed=0, max_words=6)})


def even_words(completions, **kwargs):
    """The reward: the share of a completion's words whose number is even (the tiny tokenizer's words are
    ``w0`` .. ``w508``); any python function of the completions works."""
    scores = []
    for completion in completions:
        words = [w for w in completion.split() if w[1:].isdigit()]
        scores.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
    return scores


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    model_path, tokenizer_path = (args.model, args.tokenizer or args.model) if args.model else tiny_defaults()
    sizes = {"fsdp_size": world} if args.layout == "fsdp" else {"tp_size": world}

    # Sharded while loading; every rank loads only its part.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(**sizes))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,  # x data-parallel ranks: whole groups of num_generations (tp_size=2: one rank)
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,  # TRL defaults to bf16=True, on CPU too
        use_cpu=not torch.cuda.is_available(),  # torchrun's processes join one gloo job on CPU-only machines
    )
    trainer = GRPOTrainer(model=model, reward_funcs=even_words, args=config, train_dataset=prompts(64),
                          processing_class=tokenizer)
    trainer.train()

    # Sample from the trained model with a different seed per process, as TRL does ...
    torch.manual_seed(config.seed + dist.get_rank())
    probe = tokenizer(["w1 w2 w3", "w4 w5 w6"], return_tensors="pt").to(trainer.model.device)
    with torch.no_grad():
        tokens = trainer.model.generate(**probe, do_sample=True, max_new_tokens=8).tolist()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tokens)
    # ... the ranks of a TP group (here: all of them) sampled the same tokens; FSDP ranks sample their own.
    if args.layout == "tp":
        assert all(t == everyone[0] for t in everyone), "the tensor-parallel ranks sampled different tokens"
    if dist.get_rank() == 0:
        rewards = [round(row["reward"], 3) for row in trainer.state.log_history if "reward" in row]
        print(f"rewards per step: {rewards}")
        if args.layout == "tp":
            print(f"the {world} tensor-parallel ranks sampled the same completions")
    dist.barrier()


if __name__ == "__main__":
    main()
