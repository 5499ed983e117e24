"""TRL supervised fine-tuning with LoRA on a model that transformers shards while loading, then the adapter exported
and reloaded in one process.

    torchrun --standalone --nproc-per-node 2 examples/lora_sft.py --layout tp

``SFTTrainer(peft_config=LoraConfig(...))`` adds the adapters to the sharded model (shardadopt lays each factor out
like its base layer, starts it from rank 0's values and averages its gradients over the data-parallel ranks),
trains, and ``save_pretrained`` on every rank writes an ordinary PEFT adapter (full tensors, written once). Rank 0
then loads the plain checkpoint in this one process, applies the adapter with ``PeftModel.from_pretrained`` and
checks that its outputs equal the sharded model's.

``--layout``: ``fsdp`` (FSDP2 over all ranks) or ``tp`` (tensor parallel; transformers 5.17 or newer). ``--model``
and ``--tokenizer`` take a real checkpoint; without them a tiny random Qwen3 and a word-level tokenizer are
generated under ``runs/tiny-models``.
"""

from __future__ import annotations

import argparse
import os

import shardadopt

shardadopt.enable()  # first, before transformers is used

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=["fsdp", "tp"], default="tp")
    parser.add_argument("--model", help="checkpoint path or hub id (default: a generated tiny Qwen3)")
    parser.add_argument("--tokenizer", help="tokenizer path or hub id (default: the model's, or a generated one)")
    parser.add_argument("--output-dir", default="runs/lora-sft", help="trainer output and the exported adapter")
    parser.add_argument("--max-steps", type=int, default=4)
    return parser.parse_args()


def tiny_defaults() -> tuple[str, str]:
    """A tiny random Qwen3 and a tokenizer for it, written once (atomically, so every rank may call this)."""
    from shardadopt.testing import tiny_checkpoints
    from shardadopt.testing.text import tiny_tokenizer

    return tiny_checkpoints("runs/tiny-models", ["qwen3"])["qwen3"], tiny_tokenizer("runs/tiny-models")


def training_text(size: int) -> Dataset:
    """Stand-in data: random word sequences (use your own dataset with a "text" column)."""
    from shardadopt.testing.text import sentences

    return Dataset.from_dict({"text": sentences(size, seed=0)})


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    model_path, tokenizer_path = (args.model, args.tokenizer or args.model) if args.model else tiny_defaults()
    sizes = {"fsdp_size": world} if args.layout == "fsdp" else {"tp_size": world}

    # Sharded while loading; every rank loads only its part.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(**sizes))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,  # TRL defaults to bf16=True, on CPU too
        max_length=64,
        use_cpu=not torch.cuda.is_available(),  # torchrun's processes join one gloo job on CPU-only machines
    )
    peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"],
                             task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=config, train_dataset=training_text(64), processing_class=tokenizer,
                         peft_config=peft_config)
    trainer.train()

    # An ordinary PEFT adapter: call on every rank, full tensors are written once.
    adapter_dir = os.path.join(args.output_dir, "adapter")
    trainer.model.save_pretrained(adapter_dir)

    # The sharded model's outputs on a probe batch (every rank takes part in the forward) ...
    probe = tokenizer(["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"], return_tensors="pt")
    trainer.model.eval()
    device = next(trainer.model.parameters()).device
    with torch.no_grad():
        sharded = trainer.model(**probe.to(device)).logits.float().cpu()
    dist.barrier()  # the adapter is on disk for rank 0
    if dist.get_rank() == 0:
        # ... equal those of the plain checkpoint with the exported adapter, in this one process.
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                                             adapter_dir).eval()
        with torch.no_grad():
            single = reloaded(**probe.to("cpu")).logits
        torch.testing.assert_close(sharded, single, rtol=1e-4, atol=1e-5)
        print(f"reloaded {adapter_dir} in one process: outputs equal the sharded model's "
              f"(max diff {float((sharded - single).abs().max()):.2e})")
    dist.barrier()


if __name__ == "__main__":
    main()
