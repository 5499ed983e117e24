"""Checkpoint costs on 2 gloo ranks, measured side by side in one run.

1. Full export memory: peak resident memory per rank while ``shardadopt.checkpoint.save_full`` streams an
   FSDP-sharded model, against (the rank's shard size + the largest single parameter). Target <= 1.2x. For
   contrast, the same peak for a consolidated ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``.
2. Save/load time: ``shardadopt.checkpoint.save/load`` of the sharded model vs accelerate's own
   ``save_state``/``load_state`` of the same model unsharded (plain, where upstream works). Medians of N runs.

usage: python benchmarks/checkpoint_memory.py [--hidden 512] [--vocab 32000] [--layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's resident memory every millisecond; ``extra`` is the peak above the start."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.extra = self.peak - self.start


def make_model(root: str, hidden: int, vocab: int, layers: int) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = os.path.join(root, "bench-qwen3")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=hidden // 8, tie_word_embeddings=False)
        Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def rank_bench(path: str, root: str, repeats: int) -> dict:
    import gc

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from shardadopt import checkpoint
    from shardadopt.selftest.checkpoint import build, train_steps

    rank = dist.get_rank()
    model, optimizer, scheduler = build(path, {"fsdp_size": 2})
    train_steps(model, optimizer, scheduler, {"fsdp_size": 2}, 1)  # optimizer state exists
    params = list(model.parameters())
    shard = sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else p.numel() * p.element_size()
                for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    gc.collect()
    dist.barrier()
    with PeakRss() as streamed:
        checkpoint.save_full(model, os.path.join(root, "full"))
    gc.collect()
    dist.barrier()
    with PeakRss() as consolidated:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        del state
    save_s, load_s = [], []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        checkpoint.save(os.path.join(root, f"sharded-{i}"), model, optimizer, scheduler, step=i)
        save_s.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        checkpoint.load(os.path.join(root, f"sharded-{i}"), model, optimizer, scheduler)
        load_s.append(time.perf_counter() - start)
    return {"rank": rank, "shard": shard, "largest": largest, "streamed_extra": streamed.extra,
            "consolidated_extra": consolidated.extra, "save": statistics.median(save_s),
            "load": statistics.median(load_s)}


def rank_accelerate_plain(path: str, root: str, repeats: int) -> dict:
    """accelerate's own save_state/load_state where it works: the same model, plain (DDP), AdamW."""
    import torch
    import torch.distributed as dist

    from shardadopt.selftest.checkpoint import load_model
    from shardadopt.testing.accelerator import fresh_accelerator

    accelerator = fresh_accelerator(cpu=True)
    model = load_model(path, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 512, (2, 16))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    save_s, load_s = [], []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        accelerator.save_state(os.path.join(root, f"accelerate-{i}"))
        dist.barrier()
        save_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        accelerator.load_state(os.path.join(root, f"accelerate-{i}"))
        dist.barrier()
        load_s.append(time.perf_counter() - start)
    return {"save": statistics.median(save_s), "load": statistics.median(load_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from shardadopt.testing import RankPool

    quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as root:
        path = make_model(root, args.hidden, args.vocab, args.layers)
        with RankPool(2, env=quiet) as pool:
            sharded = pool.run(rank_bench, path, os.path.join(root, "out"), args.repeats, timeout=1200)
            plain = pool.run(rank_accelerate_plain, path, os.path.join(root, "out"), args.repeats, timeout=1200)
    mib = 2**20
    print(f"model: qwen3 hidden={args.hidden} vocab={args.vocab} layers={args.layers}, fsdp_size=2, 2 gloo ranks")
    print("full export peak memory per rank (MiB): shard + extra over the start, vs shard + largest parameter")
    for r in sharded:
        bound = r["shard"] + r["largest"]
        print(f"  rank {r['rank']}: shard {r['shard'] / mib:.1f}, largest param {r['largest'] / mib:.1f}; "
              f"save_full peak {(r['shard'] + r['streamed_extra']) / mib:.1f} "
              f"-> ratio {(r['shard'] + r['streamed_extra']) / bound:.2f}x (target <= 1.2x); "
              f"full_state_dict peak {(r['shard'] + r['consolidated_extra']) / mib:.1f} "
              f"-> {(r['shard'] + r['consolidated_extra']) / bound:.2f}x")
    save, load = max(r["save"] for r in sharded), max(r["load"] for r in sharded)
    print(f"save/load medians of {args.repeats} (s): shardadopt sharded {save:.3f}/{load:.3f}, accelerate plain "
          f"{plain[0]['save']:.3f}/{plain[0]['load']:.3f} -> ratio save {save / plain[0]['save']:.2f}x, "
          f"load {load / plain[0]['load']:.2f}x")


if __name__ == "__main__":
    main()
